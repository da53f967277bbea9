"""The two ways a rank re-forms its gloo group: ``Fresh`` (etcdrun's) and ``Reconf`` (torch's).

``fresh`` is etcdrun's own: ``etcdrun.elastic.group.Group`` (release, drop, form, check_round),
a new TCPStore and a new ``init_process_group`` every round, as bench/release_stress_worker.py
drives it. ``reconf`` (torch 2.14's ``enable_reconfigure``) lives only here: one
``init_process_group(enable_reconfigure=True)`` on a ``SwapStore``, then per round a TCPStore
that the round's rank 0 serves on the round's own port (the SwapStore is pointed at it), the
handles exchanged through it with set/get, and ``dist._reconfigure(uuid=round)``. Its release
is the same as etcdrun's: shut this process's ends of the sockets that appeared during the
round's form (``etcdrun.elastic.sockets``) and end ``InFlight``'s futures. ``reconf-plain``
inits on the first round's TCPStore itself (no swap); ``reconf-alone`` releases with
``_reconfigure`` only (bench/reform/worker.py's ``case_stop``). Both paths run the same first
collective after a form (an all_gather of the round, as ``check_round``), so "re-formed" means
the same thing for both. Each form records how long its parts took (``parts``), for the page.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from etcdrun.agent.standby.boot import await_listener
from etcdrun.elastic import sockets
from etcdrun.elastic.group import Group
from etcdrun.elastic.inflight import InFlight

HOST = "127.0.0.1"
STORE_S = 10.0  # a reconf round store's get of a key nobody writes raises after this
STORE_TRY = 1.0  # one try to reach a round's store (Group's STORE_TRY)
RECONF_S = 10.0  # _reconfigure's own timeout
Ended = Callable[[], bool]


def _never() -> bool:
    return False


class SwapStore(dist.Store):
    """A Python store that hands every call to ``inner``, the current round's TCPStore: gloo
    keeps the store given at init for every reconfigure, so that store must outlive the
    process that served the first round's (REPORT Q1). gloo calls set/get/wait/compare_set.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inner: Any = None

    def set(self, key, value):  # type: ignore[no-untyped-def]
        return self.inner.set(key, value)

    def get(self, key):  # type: ignore[no-untyped-def]
        return self.inner.get(key)

    def add(self, key, value):  # type: ignore[no-untyped-def]
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.check(keys)

    def delete_key(self, key):  # type: ignore[no-untyped-def]
        return self.inner.delete_key(key)

    def num_keys(self):  # type: ignore[no-untyped-def]
        return self.inner.num_keys()


def round_store(rank: int, world: int, port: int, stop: Callable[[], bool]) -> Any:
    """The round's TCPStore, as Group._store builds it: rank 0 serves it without waiting for
    the others, who try STORE_TRY at a time until ``stop()``.
    """
    while True:
        if rank != 0:
            await_listener(HOST, port, STORE_TRY)
        try:
            store = dist.TCPStore(
                HOST,
                port,
                world,
                rank == 0,
                timeout=timedelta(seconds=STORE_S if rank == 0 else STORE_TRY),
                wait_for_workers=False,
            )
        except RuntimeError:
            if rank == 0 or stop():
                raise
            continue
        store.set_timeout(timedelta(seconds=STORE_S))
        return store


def check(k: int, inflight: InFlight) -> None:
    """The first collective of a round's group (``Group.check_round``'s all_gather)."""
    mine = torch.tensor([k], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    inflight.wait(dist.all_gather(every, mine, async_op=True))
    if {int(t) for t in every} != {k}:
        raise RuntimeError(f"ranks of rounds {sorted({int(t) for t in every})} met")


class Fresh:
    """etcdrun's path: Group.drop + Group.form + Group.check_round; Group.release."""

    def __init__(self) -> None:
        self.group = Group()
        self.inflight = self.group.inflight
        self.parts: dict[str, float] = {}  # seconds in each part of the last form

    def form(self, k: int, rank: int, world: int, port: int, ended: Ended = _never) -> None:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port), ETCDRUN_ROUND=str(k)
        )
        t0, held = time.monotonic(), self.group.held.collectives
        self.group.drop()
        if self.group.held.collectives > held:  # counted by Group (Held), said here for stress.py
            kept = self.group.held.collectives - held
            print(f"{kept} collective(s) of the round before are still inside gloo", flush=True)
        t1 = time.monotonic()
        self.group.form("gloo", ended)
        t2 = time.monotonic()
        self.group.check_round()
        self.parts = {"drop": t1 - t0, "form": t2 - t1, "check": time.monotonic() - t2}

    def release(self) -> None:
        self.group.release()


class Reconf:
    """torch's path: one enable_reconfigure group, a ``_reconfigure`` per round; released by
    shutting the sockets that appeared during the round's form, as Group.release does.
    """

    def __init__(self, swap: bool = True) -> None:
        self.swap = SwapStore() if swap else None
        self.inflight = InFlight()
        self._lock = threading.Lock()
        self._before: dict[int, sockets.Sock] | None = None  # census at a form in progress
        self._fds: dict[int, int] = {}
        self._released = False
        self._store: Any = None  # the round's store (rank 0 serves it while referenced)
        self.parts: dict[str, float] = {}  # seconds in each part of the last form
        self.stage = ""  # the part of the form running: where an error of the form arose

    def form(self, k: int, rank: int, world: int, port: int, ended: Ended = _never) -> None:
        with self._lock:
            self._before, self._fds, self._released = sockets.census(), {}, False
        running = len(self.inflight.running())
        if running:  # Group.drop's "still inside gloo": here the same group goes on with it
            print(f"{running} collective(s) of the round before are still inside gloo", flush=True)
        self.inflight.restart()
        t0, self.stage = time.monotonic(), "store"
        store = round_store(rank, world, port, lambda: self._released or ended())
        self._store = store
        t1, self.stage = time.monotonic(), "init"
        if self._released or ended():
            raise ConnectionAbortedError("the round ended while its group was formed")
        if not dist.is_initialized():
            init = self.swap if self.swap is not None else store
            if self.swap is not None:
                self.swap.inner = store
            dist.init_process_group(
                "gloo", store=init, rank=rank, world_size=world, enable_reconfigure=True
            )
        elif self.swap is not None:
            self.swap.inner = store
        t2, self.stage = time.monotonic(), "handles"
        store.set(f"h/{k}/{rank}", dist._get_reconfigure_handle())
        handles = [store.get(f"h/{k}/{r}").decode() for r in range(world)]
        t3, self.stage = time.monotonic(), "_reconfigure"
        dist._reconfigure(k, handles, timeout=timedelta(seconds=RECONF_S)).wait()
        t4, self.stage = time.monotonic(), "check"
        with self._lock:
            new = sockets.new_since(self._before, sockets.census())
            self._fds, self._before = _connected(new), None
            if self._released:
                sockets.shut(self._fds)
        check(k, self.inflight)
        self.parts = {
            "store": t1 - t0,
            "init": t2 - t1,
            "handles": t3 - t2,
            "reconfigure": t4 - t3,
            "check": time.monotonic() - t4,
        }

    def release(self) -> None:
        with self._lock:
            self._released = True
            if self._before is not None:  # a form in progress: what it has opened so far
                fds = _connected(sockets.new_since(self._before, sockets.census()))
            else:
                fds = dict(self._fds)
        sockets.shut(fds)
        self.inflight.end()


def _connected(new: dict[int, sockets.Sock]) -> dict[int, int]:
    """The connected sockets among ``new`` (never a listener: gloo's accept thread dies on
    a shut one): the round store's and gloo's pairs.
    """
    return {fd: s.inode for fd, s in new.items() if not s.listening and s.peer_port is not None}


def make_path(name: str) -> Fresh | Reconf:
    if name == "fresh":
        return Fresh()
    return Reconf(swap=name != "reconf-plain")
