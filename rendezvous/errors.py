"""The rendezvous' errors: one root, few leaves, each naming run id, round and node.

Why the names: they are torch.distributed.elastic's, so a user who knows torchrun maps them one to
one. Why the context fields: an error from a 64-node job is useless unless it says which run,
which round and which node saw it.
"""

from __future__ import annotations


class RendezvousError(Exception):
    """Root of every rendezvous error."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        round: int | None = None,
        node: str | None = None,
    ) -> None:
        self.message = message
        self.run_id = run_id
        self.round = round
        self.node = node
        super().__init__(self._format())

    def _format(self) -> str:
        ctx = []
        if self.run_id is not None:
            ctx.append(f"run {self.run_id}")
        if self.round is not None:
            ctx.append(f"round {self.round}")
        if self.node is not None:
            ctx.append(f"node {self.node}")
        return f"{self.message} ({', '.join(ctx)})" if ctx else self.message


class RendezvousClosedError(RendezvousError):
    """The run is closed (finished or failed for good): joiners must not wait.

    ``succeeded`` is True when the run this node was part of closed as SUCCEEDED: a node that
    had nothing (left) to do — a hot spare, a node rejoining while the others finished — exits
    cleanly then, not as a failure.
    """

    def __init__(self, message: str, *, succeeded: bool = False, **context) -> None:
        self.succeeded = succeeded
        super().__init__(message, **context)


class RendezvousTimeoutError(RendezvousError):
    """A round did not complete within join_timeout."""


class RendezvousConnectionError(RendezvousError):
    """etcd could not be reached (or refused us: auth, permission) within the retry budget."""

    @classmethod
    def of(
        cls,
        text: str,
        refused_at: str | None,
        run_id: str | None,
        round: int | None,
        node: str | None,
    ) -> RendezvousConnectionError:
        """From an etcd error's text; ``refused_at``: the prefix etcd refused us access to."""
        text = text.removeprefix("etcd: ")
        message = f"etcd refused access to {refused_at}: {text}" if refused_at else text
        if not message.startswith("etcd"):
            message = f"etcd: {message}"
        return cls(message, run_id=run_id, round=round, node=node)


class RendezvousStateError(RendezvousError):
    """A value in etcd is corrupt, foreign, or from an unknown schema version."""


class RendezvousTooManyNodesError(RendezvousError):
    """The static backend was given a node rank outside the job."""


__all__ = [
    "RendezvousError",
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousTooManyNodesError",
]
