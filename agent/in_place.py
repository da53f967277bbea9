"""The agent's side of in-place rounds (design.md §4a): which workers opted in, and telling them.

Why apart from elastic_agent.py: the driver performs the loop's actions; this object is what
the ``Regroup`` and ``HandOver`` actions need of the control channel (agent/worker/control.py)
and of the worker group, and what the agent tells a kept worker about its lease. It owns the
control server; it borrows the group and the liveness port it is handed per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from etcdrun.agent.grace import DEFAULT_RESTART_GRACE
from etcdrun.agent.worker import beat, control
from etcdrun.agent.worker.control import PEER_WAIT_VAR, ControlServer
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import LivenessPort, RendezvousInfo

log = logging.getLogger(__name__)
Resumed = Callable[[int, dict[str, Any]], None]
# How often a drain reads the workers' progress pages while it waits for their commit: a page
# read is a few microseconds, and 10 ms is small against any training step.
COMMIT_POLL_S = 0.01


class InPlace:
    """One per agent: ``start()`` → (``ready``, ``abort``, ``hand_over``)* → ``close()``.
    ``on_resumed(local_rank, msg)`` runs on the channel's thread when a kept worker trains
    again (it must return at once).
    """

    def __init__(self, tag: str, on_resumed: Resumed) -> None:
        self._on_resumed = on_resumed
        self._server = ControlServer(tag, self._on_message)
        self._lock = threading.Lock()
        self._handed: int | None = None  # the last round handed over, and who resumed in it
        self._resumed: set[int] = set()
        self._finished: set[int] = set()  # pids whose training function returned

    @property
    def env(self) -> dict[str, str]:
        """What every worker's environment carries to find the channel."""
        return self._server.env

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()

    def ready(self, group: WorkerGroup, local_world_size: int) -> bool:
        """Every local worker runs and opted in (``etcdrun.elastic``) in the current round."""
        info, pids = group.info, group.pids()
        if info is None or len(pids) != local_world_size or group.poll() is not None:
            return False
        return self._server.opted_in(pids, info.round) == set(range(local_world_size))

    def abort(self, round_number: int, local_world_size: int) -> None:
        """Tell every kept worker at once that its round is over: it releases its collectives
        and waits for the next round.
        """
        for local_rank in range(local_world_size):
            self._server.send(local_rank, control.ABORT, round=round_number)

    def hand_over(self, group: WorkerGroup, info: RendezvousInfo) -> bool:
        """The kept workers go on in ``info``'s round; False when one could not be told."""
        with self._lock:
            self._handed, self._resumed = info.round, set()
        envs = group.regroup(info)
        sent = [
            self._server.send(r, control.ROUND, round=info.round, env=env)
            for r, env in envs.items()
        ]
        return all(sent)

    def finished_before(self, round_number: int) -> bool:
        """True when the workers were handed ``round_number`` and none of them resumed in it:
        having exited 0 since, they ended the training in the round before (their function
        returned), so that round's newcomers can never sync from them.
        """
        with self._lock:
            return self._handed == round_number and not self._resumed

    @staticmethod
    def peer_wait(liveness: LivenessPort) -> dict[str, str]:
        """How long a kept worker whose collective failed waits for the round's end before it
        takes the failure for its own: a lost peer is seen when its lease expires, so one lease
        and a margin; 30 s without a lease.
        """
        lease = liveness.read()
        if lease.ttl is None:
            return {PEER_WAIT_VAR: "30"}
        return {PEER_WAIT_VAR: f"{max(5.0, lease.ttl + lease.margin + 2.0):.1f}"}

    def stop_at_commit(
        self,
        group: WorkerGroup,
        local_world_size: int,
        grace: float,
        superseded: Callable[[], bool],
    ) -> float:
        """A drain's stop: when the workers run in place, first wait for their next commit.
        Returns the grace left for the stop itself. One budget for the wait and the stop: a
        platform that grants ``--stop-grace`` and a margin after SIGTERM must not see the two
        add up. The workers still get a short SIGTERM grace after a commit that never came.

        ``superseded``: the round is over (its other nodes left, or the run closed, as in a
        job-wide teardown where the first node signalled drains and the rest stop): no commit
        can come then, and the workers, left waiting in a broken collective, are stopped at
        once rather than failing on their own with a traceback.
        """
        if not self.ready(group, local_world_size):
            return grace
        t0 = time.monotonic()
        committed = self.await_commit(group, grace, superseded)
        log.info(
            "drain: %s",
            "stopping after the workers' commit"
            if committed
            else "no commit came: stopping the workers now",
        )
        return max(min(DEFAULT_RESTART_GRACE, grace), grace - (time.monotonic() - t0))

    @staticmethod
    def await_commit(
        group: WorkerGroup, timeout: float, superseded: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait until every local worker made its next commit, for a drain (docs/drain.md).

        Why: a node that leaves mid-step breaks its peers' collective, and every survivor then
        goes back to its last commit: with a commit every K steps, up to K steps of the whole
        job's work are lost. Stopped just after a commit, the survivors lose only the step they
        had begun. The commit is read from the workers' progress pages, a local read and no
        message, so a worker needs no new call. False, and no wait, when the workers have no
        pages; False after ``timeout``, once a worker ended, or once ``superseded()``.
        """
        start = {f.progress: beat.read(f.progress) for f in group.log_paths.values()}
        if not start or None in start.values():
            return False  # no pages, or a worker that never committed: nothing to wait for
        paths = list(start)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and group.poll() is None and not superseded():
            now = {p: beat.read(p) for p in paths}
            if all(now[p] is not None and now[p].beats > start[p].beats for p in paths):
                return True
            time.sleep(COMMIT_POLL_S)
        return False

    def done_early(self, group: WorkerGroup, changed: bool) -> bool:
        """The workers succeeded in a round another one came after: they were handed it and
        never resumed (``finished_before``), or they had finished as it came (``changed``).
        The run then closes as succeeded at once: the new round's nodes wait for no one.
        """
        info = group.info
        if info is None:
            return False
        return (changed and self.finished(group)) or self.finished_before(info.round)

    def finished(self, group: WorkerGroup) -> bool:
        """Every local worker's training function returned: they exit next, and a round
        change meanwhile is no reason to stop them (the job's work is done; the agent waits for
        their exit, and the run closes as succeeded, its newcomers told so).
        """
        pids = set(group.pids().values())
        with self._lock:
            return bool(pids) and pids <= self._finished

    def _on_message(self, local_rank: int, msg: dict[str, Any]) -> None:
        if msg["op"] == control.FINISHED:
            with self._lock:
                self._finished.add(int(msg["pid"]))
            return
        if msg["op"] == control.RESUMED:
            with self._lock:
                if msg.get("round") == self._handed:
                    self._resumed.add(local_rank)
            self._on_resumed(local_rank, msg)


__all__ = ["InPlace"]
