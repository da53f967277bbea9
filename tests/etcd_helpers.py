"""Helpers for tests that run against a real etcd (imported by conftest and by tests).

Why raw generated stubs here and not our client: these helpers judge the client (leases left
behind, processes left running), so they must not depend on it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto.etcd_stubs import bind
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.localetcd import EtcdMember, LocalEtcd, TlsConfig, grpc_channel

# Every LocalEtcd started through owned_local_etcd(), whatever the fixture's scope: the leak
# check does not count their processes as leaked by the test that happens to be running.
OWNED: list[LocalEtcd] = []


@dataclass
class ExternalEtcd:
    """An etcd we did not start (``ETCDRUN_TEST_ENDPOINTS``): nothing to kill or restart."""

    endpoints: str
    tls: TlsConfig | None = None
    members: list[EtcdMember] = field(default_factory=list)

    @property
    def endpoint_list(self) -> list[str]:
        return [e.strip() for e in self.endpoints.split(",") if e.strip()]


def require_local(etcd: LocalEtcd | ExternalEtcd) -> LocalEtcd:
    """Skip a test that kills/restarts/pauses members when the etcd under test is external."""
    if not isinstance(etcd, LocalEtcd):
        pytest.skip(
            "needs a local etcd it can kill or restart; ETCDRUN_TEST_ENDPOINTS "
            f"points at an external one ({etcd.endpoints})"
        )
    return etcd


PF_EXITING = 0x4  # include/linux/sched.h: set as a process starts to exit


def proc_state(pid: int) -> str:
    """``pid``'s state letter from /proc; "X" when gone, and "Z" from the moment it exits: a
    SIGKILLed process runs none of its own code again, but shows state R while the kernel frees
    its memory (a 3 GB process: 0.26 s here; a worker with torch imported ~0.1-0.2 s).
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "X"
    return "Z" if int(fields[6]) & PF_EXITING else fields[0]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (proc_state)."""
    return proc_state(pid) not in ("Z", "X")


def owned_pids() -> set[int]:
    return {pid for e in OWNED for pid in e.pids}


@contextlib.contextmanager
def owned_local_etcd(**kwargs: object) -> Iterator[LocalEtcd]:
    """Start a LocalEtcd for a fixture; on exit stop it and *check* that it is really gone.

    Why check: stop() is what every test relies on to leave no etcd and no 64 MB data dir behind;
    a regression there would otherwise only show as a full disk much later.
    """
    etcd = LocalEtcd(**kwargs)  # type: ignore[arg-type]
    OWNED.append(etcd)
    root = None
    try:
        etcd.start()
        root = etcd.root
        yield etcd
    finally:
        procs = [m.proc for m in etcd.members if m.proc is not None]
        etcd.stop()
        OWNED.remove(etcd)
    alive = [p.pid for p in procs if pid_alive(p.pid)]
    if alive:
        pytest.fail(f"etcd processes {alive} still alive after LocalEtcd.stop()", pytrace=False)
    if root is not None and os.path.exists(root):
        pytest.fail(f"etcd data dir {root} still exists after LocalEtcd.stop()", pytrace=False)


def _split(endpoints: str | Sequence[str]) -> list[str]:
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    return [e.strip() for e in endpoints if e.strip()]


def list_leases(
    endpoints: str | Sequence[str],
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
    timeout: float = 2.0,
) -> dict[int, list[bytes]]:
    """Every lease in etcd with the keys attached to it (first endpoint that answers)."""
    metadata = (("token", token),) if token else None
    last: grpc.RpcError | None = None
    for ep in _split(endpoints):
        with grpc_channel(ep, tls) as ch:
            try:
                resp = bind(ch, "LeaseLeases")(
                    pb.LeaseLeasesRequest(), timeout=timeout, metadata=metadata
                )
                ttl = bind(ch, "LeaseTimeToLive")
                return {
                    lease.ID: list(
                        ttl(
                            pb.LeaseTimeToLiveRequest(ID=lease.ID, keys=True),
                            timeout=timeout,
                            metadata=metadata,
                        ).keys
                    )
                    for lease in resp.leases
                }
            except grpc.RpcError as err:
                last = err
    raise RuntimeError(f"no etcd endpoint of {endpoints!r} answered LeaseLeases: {last}")


def assert_no_leases(
    endpoints: str | Sequence[str],
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
    within: float = 0.0,
) -> None:
    """Fail if etcd still holds leases (after waiting up to ``within`` s for them to go).

    Why ``within``: a lease revoked on close is gone at once, but one that only expires (an agent
    killed with -9) takes its TTL; the test says how long that may legitimately take.
    """
    deadline = time.monotonic() + within
    while True:
        leases = list_leases(endpoints, tls=tls, token=token)
        if not leases:
            return
        if time.monotonic() >= deadline:
            shown = ", ".join(f"{lid:x} keys={keys[:5]}" for lid, keys in list(leases.items())[:10])
            pytest.fail(f"{len(leases)} lease(s) left in etcd: {shown}", pytrace=False)
        time.sleep(0.05)


def assert_only_the_closed_record(
    endpoints: str | Sequence[str], run_id: str, outcome: str, *, within: float = 0.0
) -> None:
    """Every lease gone but the closed run's record (its round key, under the ``closed_ttl``
    lease of its own, saying ``outcome``): a record people and schedulers read, which expires
    by itself, not a leak. Waits up to ``within`` s, as assert_no_leases does.
    """
    from etcdrun.proto import etcdrun_state_pb2 as st
    from etcdrun.rendezvous.etcd.core import codec

    key = f"/etcdrun/{run_id}/round".encode()
    deadline = time.monotonic() + within
    while True:
        leases = list_leases(endpoints)
        others = {lid: keys for lid, keys in leases.items() if keys != [key]}
        if not others and len(leases) == 1:
            break
        if time.monotonic() >= deadline:
            shown = ", ".join(f"{lid:x} keys={keys[:5]}" for lid, keys in list(leases.items())[:10])
            pytest.fail(f"expected only {key!r} under a lease; left: {shown}", pytrace=False)
        time.sleep(0.05)
    with grpc_channel(_split(endpoints)[0]) as ch:
        kv = bind(ch, "Range")(pb.RangeRequest(key=key), timeout=2).kvs[0]
    msg = codec.round_message(kv.value, key.decode(), run_id)
    assert st.Outcome.Name(msg.outcome) == outcome, msg


def enable_auth(endpoints: str, **tls) -> None:
    """root + a user ``alice`` whose role covers only /jobs/42/ (the auth tests' setup)."""
    admin = EtcdClient(endpoints, **tls)
    try:
        admin.user_add("root", "rootpw")
        admin.user_grant_role("root", "root")
        admin.role_add("job42")
        admin.role_grant_prefix("job42", "/jobs/42/")
        admin.user_add("alice", "alicepw")
        admin.user_grant_role("alice", "job42")
        admin.auth_enable()
    finally:
        admin.close()
