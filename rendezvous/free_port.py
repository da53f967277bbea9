"""A free TCP port for the job's master (MASTER_PORT), shared by every backend.

Why its own module: each backend stands alone (the etcd backend must not import the static one),
and the launcher reserves a port for a static job without an endpoint the same way.
"""

from __future__ import annotations

import socket


def reserve_free_port() -> int:
    """A TCP port free on every local interface right now (the OS picks it).

    The socket is closed before returning: rank 0's workers must be able to bind it. The window
    in which another process could take it is the same one torchrun and the reference accept.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
