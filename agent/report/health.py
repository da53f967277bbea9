"""The agent's HTTP port: ``/healthz``, ``/livez`` and ``/metrics`` (``--metrics-port``).

Why the agent serves its own health: torchrun's health-check server is an empty stub, and a
Kubernetes probe can only ask a port. What each answers:

- ``/healthz`` (readiness): 200 while this node's lease is alive and its workers run, 503
  otherwise, with a small JSON body either way: ``{"healthy", "why", "node", "round",
  "node_rank", "phase", "workers": {local rank: state}, "lease_time_left_s"}``. A node that
  waits for a round (a hot spare, the first round gathering, a recovery) is not ready.
- ``/livez`` (liveness): 200 while the agent runs and answers. Why not ``/healthz`` for
  liveness: a hot spare waits, by design, as long as the job runs, and a first round may gather
  for minutes; a liveness probe failing there would have Kubernetes kill healthy agents. A
  frozen agent (SIGSTOP, a deadlock of the process) answers nothing, and the probe times out.
- ``/metrics``: the Prometheus exposition (agent/report/metrics.py), when that handler is on.

One daemon thread (``ThreadingHTTPServer`` serves each request on a short-lived thread of its
own); ``close()`` shuts it down and joins it. Every answer is built from snapshots the agent
publishes (``state()``): a scrape never waits for the agent's loop, nor takes its locks.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("etcdrun.agent")
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PATHS = ("/healthz", "/livez", "/metrics")


class HealthServer:
    """Serves ``state()`` (a dict: see the module docstring) and ``metrics()`` (bytes or None)."""

    def __init__(
        self,
        addr: str,
        port: int,
        state: Callable[[], dict[str, Any]],
        metrics: Callable[[], bytes | None],
    ) -> None:
        self._state, self._metrics = state, metrics
        owner = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner._answer(self)

            def log_message(self, fmt: str, *args: Any) -> None:  # no access log on stderr
                return

        self._server = ThreadingHTTPServer((addr, port), _Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._addr = "127.0.0.1" if addr in ("", "0.0.0.0") else addr
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="etcdrun-health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def _serve(self) -> None:
        """Sleep in accept until a request comes. Why not ``serve_forever``: it wakes every
        0.5 s to look for a shutdown, and its shutdown waits for that wake-up — up to half a
        second added to every agent's exit (bench/results/figures.md).
        """
        while not self._stopping:
            self._server.handle_request()

    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        try:
            if path == "/healthz":
                body = self._state()
                self._send(req, 200 if body["healthy"] else 503, json.dumps(body).encode())
            elif path == "/livez":
                self._send(req, 200, b'{"alive": true}')
            elif path == "/metrics":
                text = self._metrics()
                if text is None:
                    self._send(
                        req,
                        404,
                        b"no metrics here: the agent runs without the "
                        b"prometheus handler (pip install 'etcdrun[prometheus]')\n",
                        "text/plain",
                    )
                else:
                    self._send(req, 200, text, PROMETHEUS_TYPE)
            else:
                self._send(req, 404, json.dumps({"paths": PATHS}).encode())
        except Exception as e:  # a bug here must not kill the server thread: say it
            log.exception("health server: %s failed", path)
            self._send(req, 500, json.dumps({"error": str(e)}).encode())

    @staticmethod
    def _send(
        req: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str = "application/json"
    ) -> None:
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def close(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            try:  # wake the accept: a connection that says nothing
                socket.create_connection((self._addr, self.port), timeout=1).close()
            except OSError:
                pass
            self._thread.join(timeout=5)
        self._server.server_close()


__all__ = ["PATHS", "HealthServer"]
