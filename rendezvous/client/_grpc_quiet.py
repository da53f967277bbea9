"""gRPC's C core, quiet on the agent's stderr, and the workers' environment left as the user's.

Why: gRPC's C core logs at INFO in some builds (e.g. "Handshake failed ..." on stderr); an
agent's stderr carries one clear line per problem, ours. ``GRPC_VERBOSITY`` is read once, when
grpc is imported, so it is set for that import only (a user's own setting wins) and then goes
again: the workers inherit the agent's environment, and torchrun's workers have no such
variable (tests/pytorch/test_torchrun_parity.py compares them).
"""

import os

_USER_SETTING = os.environ.get("GRPC_VERBOSITY")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import grpc  # noqa: E402, F401 - reads GRPC_VERBOSITY now, once

if _USER_SETTING is None:
    os.environ.pop("GRPC_VERBOSITY", None)
