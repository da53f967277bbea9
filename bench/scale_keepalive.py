"""The scale bench's keep-alives: a relay process that sends them, and the rule that says
whether the simulation kept up.

Why a relay: the N simulated nodes of a worker process share one client, so one keeper and one
keep-alive stream per batch; but each keep-alive is several hand-offs of the GIL between gRPC's
threads and the keeper, and while the process's handler threads compute they starve those
hand-offs. Measured (bench/results/rendezvous_scale.md, 'Simulation that keeps up'): 1024 leases in
one process beside two busy threads got under 20 of their 614 keep-alives a second answered, and
lost every lease. With ``--keepalive relay`` (the default) each worker has a relay process of its
own; the keeper hands it a batch of lease ids and gets the answers back, two pipe messages a batch,
through the client's ``keepalive_relay`` port. The rendezvous code is the real one; the keeper
still decides each lease's fate (in doubt, lost) in the worker.

Why a rule: a row measured while the simulated nodes renewed their leases late measures Python,
not etcd and the protocol. A round's row is valid only when, over its window (the round, and at
least two keep-alive intervals), no lease went more than ``GAP_INTERVALS`` of its keep-alive
intervals between two answered keep-alives, none had gone that long at the window's end, and none
was given up for want of an answer. At lease_ttl 5 that is 2.5 s, where a lease is in doubt at
4 s. Printed beside it, the rate: keep-alives due (one per lease every interval, integrated over
the leases alive), sent, answered (a starved process "sends" requests that its gRPC threads never
get out), and etcd's own renewal count, so a row that fails says which side fell behind. Why the
gap and not the rate decides: over a window of a few intervals the rate is lumpy (leases granted
together come due together), while a gap is exact for every lease.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import threading
import time

GAP_INTERVALS = 1.5  # the longest a lease may go between answers, in keep-alive intervals


# ---- the relay process ---------------------------------------------------------------------------
def relay_main(conn: mpc.Connection, endpoints: str) -> None:
    """Serve ``(seq, lease ids, timeout)`` requests with ``(seq, {id: TTL})`` answers, one
    keep-alive stream each, until the pipe closes or ``None`` comes.
    """
    import grpc

    from etcdrun.rendezvous.client.config import ClientConfig
    from etcdrun.rendezvous.client.keeper import send_keepalives
    from etcdrun.rendezvous.client.transport import Transport

    t = Transport(ClientConfig.create(endpoints))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            seq, ids, timeout = msg
            acked: dict[int, int] = {}
            idx = t.preferred()
            try:
                send_keepalives(t, ids, idx, timeout, acked)
            except grpc.RpcError as e:
                if len(acked) < len(ids):
                    t.on_stream_error(e, idx)
            conn.send((seq, acked))
    finally:
        t.close()


class RelayPort:
    """The worker's end: ``port(ids, timeout)`` is a ``KeepAliveRelay`` for its clients. The
    relay's stream gets most of ``timeout``; an answer that comes later (a tick already given
    up) is dropped by its sequence number.
    """

    def __init__(self, conn: mpc.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._seq = 0

    def __call__(self, ids: list[int], timeout: float) -> dict[int, int]:
        with self._lock:
            self._seq += 1
            end = time.monotonic() + timeout
            self._conn.send((self._seq, ids, 0.8 * timeout))
            while (left := end - time.monotonic()) > 0 and self._conn.poll(left):
                seq, acked = self._conn.recv()
                if seq == self._seq:
                    return acked
            return {}

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._conn.close()


# ---- what the keepers did, and whether they kept up ---------------------------------------------
class LeaseClock:
    """Integrates the leases a worker keeps over time (lease-seconds), sampled every
    ``period``: the keep-alives due in a window are its lease-seconds over the interval.
    """

    def __init__(self, clients: list, period: float = 0.1) -> None:
        self._clients = clients
        self._period = period
        self._lock = threading.Lock()
        self._t, self._n = time.monotonic(), 0
        self.lease_seconds = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="bench-lease-clock", daemon=True).start()

    def _sample(self) -> None:
        n = sum(c.keepalive_stats().leases for c in self._clients)
        with self._lock:
            now = time.monotonic()
            self.lease_seconds += (now - self._t) * (self._n + n) / 2
            self._t, self._n = now, n

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def reading(self) -> dict:
        """Now: leases, lease-seconds, and the clients' summed counters (``late_max`` of the
        window since the last reading, which starts a new one).
        """
        self._sample()
        stats = [c.keepalive_stats(reset=True) for c in self._clients]
        return {
            "t": time.monotonic(),
            "lease_seconds": self.lease_seconds,
            "leases": sum(s.leases for s in stats),
            "sent": sum(s.sent for s in stats),
            "acked": sum(s.acked for s in stats),
            "ticks": sum(s.ticks for s in stats),
            "late_max": max((s.late_max for s in stats), default=0.0),
            "gap_max": max((s.gap_max for s in stats), default=0.0),
            "stale_max": max((s.stale_max for s in stats), default=0.0),
            "lapsed": sum(s.lapsed for s in stats),
        }

    def stop(self) -> None:
        self._stop.set()


def combine(readings: list[dict]) -> dict:
    """The workers' readings as one (sums; the latest time, the worst lateness)."""
    sums = ("lease_seconds", "leases", "sent", "acked", "ticks", "lapsed")
    out = {k: sum(r[k] for r in readings) for k in sums}
    out["t"] = max(r["t"] for r in readings)
    for k in ("late_max", "gap_max", "stale_max"):
        out[k] = max(r[k] for r in readings)
    return out


def keep_up(a: dict, b: dict, interval: float) -> dict:
    """Between two combined readings: keep-alives due, sent and answered (and per second),
    the worst lateness, and the verdict ``kept_up``.
    """
    window = max(b["t"] - a["t"], 1e-9)
    due = (b["lease_seconds"] - a["lease_seconds"]) / interval
    sent, acked = b["sent"] - a["sent"], b["acked"] - a["acked"]
    out = {
        "window_s": round(window, 2),
        "interval_s": round(interval, 3),
        "due": round(due),
        "sent": sent,
        "acked": acked,
        "ticks": b["ticks"] - a["ticks"],
        "lapsed": b["lapsed"] - a["lapsed"],
        "due_per_s": round(due / window, 1),
        "sent_per_s": round(sent / window, 1),
        "acked_per_s": round(acked / window, 1),
        "late_max": round(b["late_max"], 3),
        "gap_max": round(max(b["gap_max"], b["stale_max"]), 3),
    }
    out["kept_up"] = kept_up(out)
    return out


def kept_up(ka: dict) -> bool:
    """The validity rule (the module's docstring): no lease too long without an answer."""
    return ka["gap_max"] <= GAP_INTERVALS and ka["lapsed"] == 0


def kept_up_text(ka: dict | None) -> str:
    """ "yes 0.98/1.0" (answered / due, the longest gap in intervals), "NO ...", or "-"; a
    lapsed lease shows as "NO ... lapsed K".
    """
    if not ka:
        return "-"
    ratio = f"{ka['acked'] / ka['due']:.2f}" if ka["due"] > 0 else "-"
    text = f"{'yes' if ka['kept_up'] else 'NO'} {ratio}/{ka['gap_max']:.1f}"
    return text + (f" lapsed {ka['lapsed']}" if ka["lapsed"] else "")
