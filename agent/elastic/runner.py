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
once, and the survivors' collectives fail while etcd still waits for its lease to expire. So an
exception that arose in the group's transport (origin.py: known by where it came from, never by
its text) waits up to ``ETCDRUN_PEER_WAIT`` seconds (the agent sets it from its lease) for the
agent's word; any other exception is the script's own at once.

Why the round check comes where it does: survivors and newcomers must run the same collectives
in the same order. A newcomer whose script calls ``elastic.init_process_group`` checks the
round inside it, before building its DDP model; one whose script calls
``dist.init_process_group`` builds its model first and checks in ``elastic.run``. Every rank
runs the same script, so a survivor re-forms in the order its own start took.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from etcdrun.agent.worker.control import PEER_WAIT_VAR
from etcdrun.elastic import interrupt, process_group
from etcdrun.elastic.group import Group
from etcdrun.elastic.interrupt import MembershipChanged
from etcdrun.elastic.link import AgentLink
from etcdrun.elastic.state import State

T = TypeVar("T")
log = logging.getLogger("etcdrun.elastic")


def run(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``fn(state, *args, **kwargs)``; see the package docstring."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not process_group.under_agent():  # its launcher restarts workers (torchrun)
            return fn(state, *args, **kwargs)
        if not process_group.supported():
            _too_old()
            return fn(state, *args, **kwargs)
        group, backend = process_group.group_for_run()
        link = AgentLink.open(group.release)
        if link is None:
            return fn(state, *args, **kwargs)
        interrupt.watch(link)
        try:
            result = _rounds(fn, state, group, link, backend, args, kwargs)
            link.finished()
            return result
        finally:
            interrupt.watch(None)
            link.close()

    return wrapper


def _rounds(
    fn: Callable[..., T],
    state: State,
    group: Group,
    link: AgentLink,
    backend: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    import torch.distributed as dist

    check_first = group.owned  # the script formed its group with elastic.init_process_group
    if dist.is_initialized():
        state.attach(group.inflight)
    link.hello()
    if dist.is_initialized():
        if not check_first:
            group.check_round()
        state.sync()
    while True:
        try:
            return fn(state, *args, **kwargs)
        except Exception as exc:
            failed_at = time.monotonic()
            if not _round_over(link, group, exc):
                raise  # the script's own failure
            link.paused_since(failed_at)
        _reform(state, group, link, backend, check_first)


def _reform(state: State, group: Group, link: AgentLink, backend: str, check_first: bool) -> None:
    """Back to the last commit, then the next round's group; again while rounds keep ending
    before one is formed. A form that fails waits for the agent's word as a collective does: a
    peer killed while the group forms (chaos seed 2222: the rank-0 node) breaks the form before
    etcd has seen its lease expire, and the round then ends. Every error of the form is the
    form's own (etcdrun's code, on the round's store and gloo's mesh), so it waits; what comes
    after is judged by its origin.
    """
    state.restore()
    while True:
        link.wait_round()
        group.drop()
        started = time.monotonic()
        try:
            group.form(backend, link.interrupted)
        except Exception:
            if not (link.interrupted() or link.await_abort(_peer_wait())):
                raise
            continue  # that round ended too: wait for the next
        try:
            if check_first:
                group.check_round()
            state.rewrap()
            state.attach(group.inflight)
            if not check_first:
                group.check_round()
            sync_bytes = state.sync()
        except Exception as exc:
            if not _round_over(link, group, exc):
                raise
            continue
        if state.commits == 0:
            _never_committed(link.round)
        state.reset()
        link.resumed(
            sync_bytes=sync_bytes,
            form_s=round(time.monotonic() - started, 4),
            held_collectives=group.held.collectives,
            forms_left_in_mesh=group.held.left_in_mesh,
        )
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


def _too_old() -> None:
    """One line, once per process: in place needs a newer torch; the job still runs."""
    import torch

    log.warning(
        "etcdrun.elastic: torch %s is older than %d.%d: this worker is restarted at each "
        "membership change instead of kept in place",
        torch.__version__,
        *process_group.NEEDS,
    )


def _round_over(link: AgentLink, group: Group, exc: Exception) -> bool:
    """Whether ``exc`` is the end of the round, not the script's: the agent said so, or it
    arose in the group's transport and the agent says so within the peer wait.
    """
    if link.interrupted():
        return True
    return group.failures.transport(exc) and link.await_abort(_peer_wait())


def _peer_wait() -> float:
    return float(os.environ.get(PEER_WAIT_VAR, "30"))


__all__ = ["MembershipChanged", "run"]
