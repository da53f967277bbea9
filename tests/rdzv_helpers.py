"""Helpers for rendezvous tests: N in-process participants on a real etcd."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

from etcdrun.rendezvous.api import RendezvousInfo, RendezvousParameters
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core import shard_reads
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler
from etcdrun.rendezvous.tools import checker


def new_run_id() -> str:
    return "t-" + uuid.uuid4().hex[:8]


def handler(
    endpoints: str, run_id: str, min_nodes: int, max_nodes: int, *, lws: int = 1, **conf
) -> EtcdRendezvousHandler:
    conf.setdefault("last_call_timeout", 0.5)
    conf.setdefault("join_timeout", 30)
    return EtcdRendezvousHandler(
        RendezvousParameters(
            "etcd", endpoints, run_id, min_nodes, max_nodes, local_world_size=lws, config=conf
        )
    )


def rendezvous(
    handlers: Sequence[EtcdRendezvousHandler], timeout: float = 30
) -> list[RendezvousInfo]:
    """next_rendezvous() on every handler at once; re-raise the first error."""
    out: list = [None] * len(handlers)

    def go(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except BaseException as e:  # reported below
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(handlers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    for th, o in zip(threads, out, strict=True):
        if th.is_alive():
            raise TimeoutError("next_rendezvous did not return")
        if isinstance(o, BaseException):
            raise o
    return out


def settle(handlers: Sequence[EtcdRendezvousHandler], timeout: float = 30) -> list[RendezvousInfo]:
    """Every handler as an agent runs them: next_rendezvous(), and again whenever the round it
    accepted is superseded, until each has accepted one round and that round is still the one
    every handler's round view holds. What each accepted last.

    Why: a carried round (design.md §3a) is frozen at once, so a node can accept a round that a
    second change (a departure right after another, a newcomer) supersedes before its peers
    catch up; an agent then simply joins again, and so must a test that waits for one round.
    """
    latest: list = [None] * len(handlers)
    errors: list[BaseException] = []
    stop = threading.Event()

    def agent(k: int) -> None:
        h = handlers[k]
        try:
            while not stop.is_set():
                latest[k] = h.next_rendezvous()
                while not stop.is_set() and not h.membership_changed.wait(0.05):
                    pass
        except BaseException as e:  # reported below; where every handler stood, in the output
            where = "; ".join(f"{x.node_id}: {x.report().status()}" for x in handlers)
            print(f"settle: handler {k} failed ({e!r}); the handlers then: {where}")
            errors.append(e)

    def settled() -> bool:
        if any(i is None for i in latest) or len({i.round for i in latest}) != 1:
            return False
        views = [h.view.current() for h in handlers]
        return all(v is not None and v.number == latest[0].round for v in views)

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(len(handlers))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    try:
        while not errors and not settled():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the handlers never settled in one round: {latest}")
            handlers[0].view.wait(
                handlers[0].view.current(), time.monotonic() + 0.05, errors.__len__
            )
    finally:
        stop.set()
        for th in threads:
            th.join(timeout)
    if errors:
        raise errors[0]
    return latest


def exit_barriers(handlers: Sequence[EtcdRendezvousHandler], timeout: float = 30) -> list:
    """exit_barrier(timeout) on every handler at once, as finished agents do; their answers."""
    done: list = [None] * len(handlers)

    def go(i: int) -> None:
        done[i] = handlers[i].exit_barrier(timeout)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(handlers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 10)
    return done


def crash(h: EtcdRendezvousHandler) -> None:
    """What kill -9 does to an agent: no revoke, no goodbye; its lease expires after the TTL."""
    if h.session is not None:
        h.session.orphan()
    h.shutdown()


@contextlib.contextmanager
def accepted_events(handlers: Sequence[EtcdRendezvousHandler]) -> Iterator[list[dict]]:
    """The ``round_accepted`` events of these handlers, for the invariant checker."""
    got: list[dict] = []
    unsubscribes = [
        h.events.subscribe(lambda e: got.append(e) if e["event"] == "round_accepted" else None)
        for h in handlers
    ]
    try:
        yield got
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()


def violations(
    endpoints: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    accepted: Sequence[dict] = (),
    prefix: str = "/etcdrun",
) -> list[str]:
    """The invariant checker's findings over ``run_id``'s history. A run with no history at
    all is a finding too: a test that names the wrong run would otherwise pass unchecked.
    """
    keys = RunKeys(prefix, run_id)
    with EtcdClient(endpoints) as c:
        history = checker.round_history(c, keys)
    if not history:
        return [f"no history of run {run_id} in etcd: nothing to check"]
    return checker.check(
        history, min_nodes, max_nodes, [e for e in accepted if e["run_id"] == run_id]
    )


def shutdown_all(handlers: Sequence[EtcdRendezvousHandler]) -> None:
    for h in handlers:
        h.shutdown()


def shard_reads_recorded(monkeypatch) -> list[int]:
    """Record the round number of every node's read of its own shard (shard_reads.own): with
    the shard watch placed there is none.
    """
    calls: list[int] = []
    real = shard_reads.own

    def own(*a, **kw):
        calls.append(a[2].number)
        return real(*a, **kw)

    monkeypatch.setattr(shard_reads, "own", own)
    return calls
