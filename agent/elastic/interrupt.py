"""Whether the round this worker runs in is over, for the safe points to ask.

Why a module of its own: ``commit()`` (state.py) asks and ``elastic.run`` (runner.py) answers,
and neither should hold the other. A worker runs one ``elastic.run`` at a time, so one link per
process is all there is.
"""

from __future__ import annotations

from typing import Protocol


class MembershipChanged(Exception):
    """The round this worker ran in is over; ``elastic.run`` re-forms and calls again."""


class _Interruptible(Protocol):
    def interrupted(self) -> bool: ...


_link: _Interruptible | None = None


def watch(link: _Interruptible | None) -> None:
    global _link
    _link = link


def pending() -> bool:
    return _link is not None and _link.interrupted()


def check() -> None:
    """Raise ``MembershipChanged`` at a safe point once the agent said the round is over."""
    if pending():
        raise MembershipChanged("the round changed: re-forming the process group in place")


__all__ = ["MembershipChanged", "check", "pending", "watch"]
