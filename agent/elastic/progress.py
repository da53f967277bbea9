"""``progress(step)``: tell the agent that this worker moves (design.md §4b, §4d).

Why a call of its own: ``state.commit()`` already reports progress, but a script that does not
opt in to in-place rounds has no commit. One line in its step loop gives it the same watchdog.

The cost is one write to a page the agent mapped for this worker (agent/worker/beat.py): no
system call, no etcd write, nothing at all when the agent has no use for it (no
``--hang-timeout``, and a backend that shares no pace: the etcd one does, for the straggler
report) or when no etcdrun agent started this process (plain torchrun, a bare ``python``).
"""

from __future__ import annotations

from etcdrun.agent.worker import beat

_UNSET = object()
_writer: beat.Writer | None | object = _UNSET


def progress(step: int | None = None) -> None:
    """This worker made progress: ``step``, when given, is shown by the agent's hang line and
    by ``etcdrun status``.
    """
    global _writer
    if _writer is _UNSET:
        _writer = beat.Writer.from_env()
    if _writer is not None:
        _writer.beat(step)  # type: ignore[union-attr]


__all__ = ["progress"]
