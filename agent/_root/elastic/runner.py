"""``elastic.run``: call the training function, and through every membership change, again.

Why the order of a re-form (restore, new group, re-wrap, sync, callbacks): the last commit is
the only state every survivor shares; the new group must exist before anything is exchanged;
DDP must point at it before the sync broadcasts parameters; the callbacks see the synced state
and the new world (a data loader sharded by the new rank, a learning rate scaled by it).

Why an exception is a membership change only when the agent said so: a failure of the script's
own (a bad batch, an assertion) must stay a failure, charged to the job's restart budget as
without this module. A collective that fails because its group was released, or a
``commit()`` that raises ``MembershipChanged``, comes after the agent's notice, and only those
are taken in place. One case comes before it: a peer that was killed closes its sockets at
once, and the survivors' collectives fail while etcd still waits for its lease to expire. So a
failure of the transport (torch's ``DistError``, gloo's and NCCL's connection errors) waits up
to ``ETCDRUN_PEER_WAIT`` seconds (the agent sets it from its lease) for the agent's word; any
other exception is the script's own at once.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from etcdrun.agent.worker.control import PEER_WAIT_VAR
from etcdrun.elastic import interrupt
from etcdrun.elastic.group import Group
from etcdrun.elastic.inflight import FAILED
from etcdrun.elastic.interrupt import MembershipChanged
from etcdrun.elastic.link import AgentLink
from etcdrun.elastic.state import State

T = TypeVar("T")
log = logging.getLogger("etcdrun.elastic")


def run(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``fn(state, *args, **kwargs)``; see the package docstring."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        group = Group()
        link = AgentLink.open(group.release)
        if link is None:  # no etcdrun agent: its launcher restarts workers (torchrun)
            return fn(state, *args, **kwargs)
        interrupt.watch(link)
        try:
            return _rounds(fn, state, group, link, args, kwargs)
        finally:
            interrupt.watch(None)
            link.close()

    return wrapper


def _rounds(
    fn: Callable[..., T],
    state: State,
    group: Group,
    link: AgentLink,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else _default_backend()
    if dist.is_initialized():
        group.adopt()
        state.attach(group.inflight)
    link.hello()
    if dist.is_initialized():
        group.check_round()
        state.sync()
    while True:
        try:
            return fn(state, *args, **kwargs)
        except Exception as exc:
            failed_at = time.monotonic()
            if not _round_over(link, exc):
                raise  # the script's own failure
            link.paused_since(failed_at)
        _reform(state, group, link, backend)


def _reform(state: State, group: Group, link: AgentLink, backend: str) -> None:
    """Back to the last commit, then the next round's group; again while rounds keep ending
    before one is formed. A form that fails on its transport waits for the agent's word as a
    collective does: a peer killed while the group forms (chaos seed 2222: the rank-0 node)
    breaks the form before etcd has seen its lease expire, and the round then ends.
    """
    state.restore()
    while True:
        link.wait_round()
        group.drop()
        started = time.monotonic()
        try:
            group.form(backend, link.interrupted)
            state.rewrap()
            state.attach(group.inflight)
            group.check_round()
            sync_bytes = state.sync()
        except Exception as exc:
            if not _round_over(link, exc):
                raise
            continue  # that round ended too: wait for the next
        if state.commits == 0:
            _never_committed(link.round)
        state.reset()
        link.resumed(sync_bytes=sync_bytes, form_s=round(time.monotonic() - started, 4))
        return


def _never_committed(round_: int) -> None:
    """Say why the training went back to its start: without a commit, a restore has nothing
    else to go back to, and a script that forgot ``commit()`` would lose all its work at every
    membership change without a word.
    """
    log.warning(
        "etcdrun.elastic: run %s, round %d, rank %s: no rank has called state.commit(), so every "
        "rank goes back to the state it started with (commit at each safe point)",
        os.environ.get("TORCHELASTIC_RUN_ID", "?"),
        round_,
        os.environ.get("RANK", "?"),
    )


def _round_over(link: AgentLink, exc: Exception) -> bool:
    """Whether ``exc`` is the end of the round, not the script's: the agent said so, or the
    transport failed and the agent says so within the peer wait.
    """
    return link.interrupted() or _transport(exc) and link.await_abort(_peer_wait())


_TRANSPORT_WORDS = ("Connection closed by peer", "Connection reset", "NCCL", "Broken pipe", FAILED)


def _transport(exc: BaseException) -> bool:
    """A failure of the group's transport, which a lost peer causes, rather than the script's."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in _TRANSPORT_WORDS)


def _peer_wait() -> float:
    return float(os.environ.get(PEER_WAIT_VAR, "30"))


def _default_backend() -> str:
    return "nccl" if os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, "") else "gloo"


__all__ = ["MembershipChanged", "run"]
