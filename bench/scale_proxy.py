"""``--grpc-proxy``: etcd's own gRPC proxy between the simulated nodes and the members.

Why: every participant watches the round key, so etcd sends each frozen round N times. The
proxy (``etcd grpc-proxy start``, in the etcd binary) coalesces identical watches: etcd sends
one copy to it and it fans the copies out, which is what the etcd docs advise for many
watchers. With it, the members' bytes sent are what etcd itself pays. (The proxy's own /metrics
page repeats its upstream member's counters, so what it sent its clients is not read from it;
its coalescing counters are.)

Keep-alives pass it by: etcd 3.4's proxy answered none of the keepers' short keep-alive streams
(50 leases, 0 answers in 8 s, in-process or relayed; bench/results/rendezvous_scale.md, 'Through
etcd's grpc-proxy'), so the relays talk to the members directly and ``--grpc-proxy`` needs
``--keepalive relay``. A deployment behind the proxy must do the same, or keep a long-lived stream.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request


class GrpcProxy:
    """One ``etcd grpc-proxy`` in front of ``endpoints`` on free local ports; a context
    manager. ``endpoint`` is what the clients use, ``metrics_url`` its /metrics.
    """

    def __init__(self, endpoints: list[str], log_path: str | None = None) -> None:
        from etcdrun.rendezvous.free_port import reserve_free_port
        from etcdrun.rendezvous.localetcd import find_etcd

        port, mport = reserve_free_port(), reserve_free_port()
        self.endpoint = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        cmd = [
            find_etcd() or "etcd",
            "grpc-proxy",
            "start",
            "--endpoints=" + ",".join(endpoints),
            f"--listen-addr={self.endpoint}",
            f"--metrics-addr=http://127.0.0.1:{mport}",
        ]
        self._log = open(log_path or "/dev/null", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the proxy answers a Status through to etcd (bounded; raises on a dead proxy)."""
        from etcdrun.rendezvous.client import EtcdClient, EtcdError

        end = time.monotonic() + timeout
        with EtcdClient(self.endpoint, request_timeout=1.0, retry_timeout=1.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd grpc-proxy exited with {self.proc.returncode}")
                try:
                    c.status()
                    return
                except EtcdError:
                    if time.monotonic() > end:
                        raise TimeoutError(f"etcd grpc-proxy not ready in {timeout:g}s") from None
                    time.sleep(0.1)

    def coalesced(self) -> float:
        """Watch events the proxy coalesced so far (served to several watchers from one)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("etcd_grpc_proxy_events_coalescing_total "):
                    return float(line.split()[1])
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> GrpcProxy:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
