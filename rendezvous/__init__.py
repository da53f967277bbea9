"""etcdrun's rendezvous: where the nodes of a job meet and agree on rounds.

The names match torch.distributed.elastic.rendezvous where the concept is the same. Importing this
package is cheap: the etcd backend (gRPC, protobuf) loads only when ``create_handler`` builds it.
"""

from etcdrun.rendezvous.api import (
    FailureInfo,
    Participant,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from etcdrun.rendezvous.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
    RendezvousTooManyNodesError,
)
from etcdrun.rendezvous.registry import create_handler, register_backend

__all__ = [
    "FailureInfo",
    "Participant",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RendezvousTooManyNodesError",
    "create_handler",
    "register_backend",
]
