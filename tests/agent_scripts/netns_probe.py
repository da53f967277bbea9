"""Looks at an etcd from inside its network namespace; argv: <command> <endpoint> [...].

Why a script: the test process sits in the machine's own namespace and cannot reach an etcd
listening inside one (tests/netns_helpers.py runs this with ``ip netns exec``). Every answer is
one JSON document on stdout.

Commands:
  ready <endpoint> <timeout>                 wait until etcd answers Status with a leader
  check <endpoint> <run_id> <min> <max>      the checker's violations (round_accepted events,
                                             a JSON list, on stdin)
  leases <endpoint>                          keys attached to any lease
  outcome <endpoint> <run_id>                a closed run's outcome (CANCELLED, ...), or null
"""

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

# A hang shows where: every thread's stack on stderr, then exit (tests/netns_helpers.py sets it
# a little under its own timeout). Each step's time goes to stderr too, shown on a failure.
faulthandler.dump_traceback_later(float(os.environ.get("PROBE_STACKS_AFTER", "25")), exit=True)
T0 = time.monotonic()


def step(what: str) -> None:
    print(f"probe: {what} after {time.monotonic() - T0:.2f} s", file=sys.stderr, flush=True)


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared helpers

import grpc  # noqa: E402
from etcd_helpers import list_leases  # noqa: E402
from rdzv_helpers import violations  # noqa: E402

from etcdrun.proto import etcd_api_pb2 as pb  # noqa: E402
from etcdrun.proto.etcd_stubs import bind  # noqa: E402
from etcdrun.rendezvous.localetcd import grpc_channel  # noqa: E402


def ready(endpoint: str, timeout: str) -> bool:
    deadline = time.monotonic() + float(timeout)
    last = ""
    while time.monotonic() < deadline:
        with grpc_channel(endpoint) as ch:
            try:
                if bind(ch, "Status")(pb.StatusRequest(), timeout=0.2).leader:
                    return True
            except grpc.RpcError as e:
                last = str(e.code())
        time.sleep(0.01)
    sys.exit(f"etcd at {endpoint} not ready after {timeout} s ({last})")


def outcome(endpoint: str, run_id: str) -> str | None:
    from etcdrun.proto import etcdrun_state_pb2 as st
    from etcdrun.rendezvous.etcd.core import codec

    key = f"/etcdrun/{run_id}/round"
    with grpc_channel(endpoint) as ch:
        kvs = bind(ch, "Range")(pb.RangeRequest(key=key.encode()), timeout=5).kvs
    if not kvs:
        return None
    msg = codec.round_message(kvs[0].value, key, run_id)
    return st.Outcome.Name(msg.outcome) if msg.outcome else None


def main() -> None:
    cmd, endpoint, *rest = sys.argv[1:]
    step("imports")
    if cmd == "ready":
        out = ready(endpoint, *rest)
    elif cmd == "check":
        run_id, lo, hi = rest
        accepted = json.load(sys.stdin)
        step(f"{len(accepted)} round_accepted events read")
        out = violations(endpoint, run_id, int(lo), int(hi), accepted)
    elif cmd == "leases":
        out = sorted(k.decode() for keys in list_leases(endpoint).values() for k in keys)
    elif cmd == "outcome":
        out = outcome(endpoint, *rest)
    else:
        sys.exit(f"unknown command {cmd!r}")
    step(cmd)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
