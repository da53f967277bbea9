"""The worker side of bench/rendezvous_scale.py: P processes hosting N real rendezvous handlers.

Why apart: this is what runs in each spawned process (handlers sharing one EtcdClient, a caller
thread per handler, commands over a pipe) and the main process's handle on them (``Pool``, every
wait bounded); rendezvous_scale.py drives the rounds, reads etcd's metrics and reports.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time

from bench.scale_keepalive import LeaseClock, RelayPort, relay_main
from bench.scale_metrics import thread_cpu

EVENTS = (
    "session_opened",
    "leader_elected",
    "node_joined",
    "round_started",
    "round_frozen",
    "round_accepted",
    "session_lost",
    "node_left",
)


class _LogTally(logging.Handler):
    """Count warnings in a worker instead of printing 1000 lines; keep the first few."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 3:
            self.first.append(f"{record.name}: {record.getMessage()}"[:300])


class _GcClock:
    """Collector pauses of this process since the last ``reset()`` (total seconds, gen-2 runs)."""

    def __init__(self) -> None:
        self.seconds, self.gen2, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.seconds, self.gen2 = 0.0, 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0:
            self.seconds += time.perf_counter() - self._t0
            self.gen2 += info["generation"] == 2


def _info_tuple(info) -> tuple:
    return (
        info.node_id,
        info.round,
        info.node_rank,
        info.node_count,
        info.master_addr,
        info.master_port,
    )


class _Host:
    """One worker process: ``count`` handlers sharing one client (or one per ``per_client``),
    obeying commands. With a ``relay`` pipe, the clients' keep-alives go through the worker's
    relay process (scale_keepalive.py says why).
    """

    def __init__(self, conn: mpc.Connection, cfg: dict, relay: mpc.Connection | None) -> None:
        from etcdrun.rendezvous.api import RendezvousParameters
        from etcdrun.rendezvous.client import EtcdClient
        from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler

        self.conn, self.cfg = conn, cfg
        self.tally = _LogTally()
        logging.basicConfig(level=logging.WARNING, handlers=[self.tally])
        self.gc = _GcClock()
        self.send_lock = threading.Lock()
        self.cancel = threading.Event()
        self.seen: list[dict] = []
        # one client per ``per_client`` handlers (0: one for all): each client is one gRPC
        # channel with one watch stream, and etcd gives a watch stream one 128-slot buffer
        # whatever its watcher count (a real agent has 2-3 watches on its stream)
        per = cfg.get("per_client") or cfg["count"]
        self.relay = RelayPort(relay) if relay is not None else None
        self.clients = [
            EtcdClient(cfg["endpoints"], keepalive_relay=self.relay)
            for _ in range(-(-cfg["count"] // per))
        ]
        for c in self.clients:
            c.status()  # open the channel before any clock starts, as a running agent has
        self.clock = LeaseClock(self.clients)
        params = RendezvousParameters(
            "etcd",
            cfg["endpoints"],
            cfg["run_id"],
            cfg["min_nodes"],
            cfg["max_nodes"],
            local_world_size=1,
            config=cfg["conf"],
        )
        self.hs = [
            EtcdRendezvousHandler(params, client=self.clients[i // per])
            for i in range(cfg["count"])
        ]
        for h in self.hs:  # each handler's own event log (there is no process-wide one)
            h.events.subscribe(self._on_event)

    def _on_event(self, e: dict) -> None:
        if e.get("event") in EVENTS and e.get("run_id") == self.cfg["run_id"]:
            self.seen.append(e)

    def send(self, *msg: object) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _join_one(self, h, wait_change: bool) -> object:
        """One participant's part of a round: its RendezvousInfo as a tuple, or what failed."""
        try:
            if wait_change:
                while not h.membership_changed.wait(1.0):
                    if self.cancel.is_set():
                        return "cancelled"
            return _info_tuple(h.next_rendezvous())
        except Exception as e:  # reported to the main process
            return f"{type(e).__name__}: {e}"

    def run_round(self, tag: str, todo: list, wait_change: bool) -> None:
        """A caller thread per participant, as an agent would have; report when all are done."""
        out: list = [None] * len(todo)
        self.gc.reset()

        def one(i: int) -> None:
            if tag == "1" and self.cancel.wait(self.arrival(i, len(todo))):
                out[i] = "cancelled"
                return
            out[i] = self._join_one(todo[i], wait_change)

        ths = [
            threading.Thread(target=one, args=(i,), name=f"bench-{tag}-{i}")
            for i in range(len(todo))
        ]
        for th in ths:
            th.start()
        self.send("armed", tag)
        for th in ths:
            th.join()
        self.send("done", tag, out, self.gc.seconds, self.gc.gen2)

    def arrival(self, i: int, count: int) -> float:
        """When handler ``i`` of ``count`` starts round 1 (seconds after the go): spread evenly
        over ``arrive_over``, the processes interleaved by their phase; 0 when all at once.
        """
        return self.cfg.get("arrive_over", 0.0) * (i + self.cfg.get("phase", 0.0)) / count

    def _round(self, tag: str, todo: list, wait_change: bool) -> None:
        threading.Thread(target=self.run_round, args=(tag, todo, wait_change), daemon=True).start()

    def leave(self, node_id: str) -> None:
        h = next(h for h in self.hs if h.node_id == node_id)
        t0 = time.time()
        ok = h.shutdown()
        self.send("left", t0, time.time(), ok)

    def stop(self) -> None:
        """Leave, close the client, and wait (bounded) for the rendezvous' threads to end."""
        self.cancel.set()
        for h in self.hs:
            h.shutdown()
        for c in self.clients:
            c.close()
        self.clock.stop()
        if self.relay is not None:
            self.relay.close()
        end = time.monotonic() + 3.0
        while True:
            extra = [
                t.name
                for t in threading.enumerate()
                if t is not threading.current_thread() and t is not threading.main_thread()
            ]
            if not extra or time.monotonic() > end:
                break
            time.sleep(0.05)
        self.send("stopped", extra)

    def obey(self, cmd: str, arg: list) -> bool:
        """Carry out one command; False once told to stop."""
        if cmd == "round1":
            self._round("1", self.hs, False)
        elif cmd == "arm":  # survivors wait for the membership change, then rejoin
            self._round("2", [h for h in self.hs if h.node_id != arg[0]], True)
        elif cmd == "leave":
            self.leave(arg[0])
        elif cmd == "threads":
            self.send("threads", thread_cpu())
        elif cmd == "keepalive":
            self.send("keepalive", self.clock.reading())
        elif cmd == "events":
            self.send("events", list(self.seen), self.tally.count, self.tally.first)
        elif cmd == "close":
            self.hs[0].set_closed()
            self.send("closed")
        elif cmd == "stop":
            self.stop()
            return False
        return True


def worker(conn: mpc.Connection, cfg: dict, relay: mpc.Connection | None = None) -> None:
    """Host ``cfg['count']`` handlers sharing one client; obey the main process's commands."""
    if cfg.get("worker_cpus"):  # before any thread starts: they inherit it
        os.sched_setaffinity(0, cfg["worker_cpus"])
    host = _Host(conn, cfg, relay)
    try:
        host.send("ready", os.getpid())
        while True:
            cmd, *arg = conn.recv()
            if not host.obey(cmd, arg):
                return
    except (EOFError, KeyboardInterrupt):
        pass


class Pool:
    """P worker processes, talked to over pipes; every wait is bounded."""

    def __init__(self, counts: list[int], cfg: dict) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold a gRPC channel
        self.conns, self.procs, self.relays = [], [], []
        for i, c in enumerate(counts):
            parent, child = ctx.Pipe()
            mine = {**cfg, "count": c, "phase": i / len(counts)}
            relay = self._relay(ctx, cfg) if cfg.get("keepalive") == "relay" else None
            p = ctx.Process(target=worker, args=(child, mine, relay), daemon=True)
            p.start()
            child.close()
            if relay is not None:
                relay.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs]
        self.relay_pids = [p.pid for p in self.relays]
        self.inbox: list[list[tuple]] = [[] for _ in self.procs]

    def _relay(self, ctx, cfg: dict) -> mpc.Connection:
        """Start a worker's keep-alive relay (pinned with the workers); its pipe's worker end."""
        worker_end, relay_end = ctx.Pipe()
        p = ctx.Process(target=relay_main, args=(relay_end, cfg["relay_endpoints"]), daemon=True)
        p.start()
        relay_end.close()
        if cfg.get("worker_cpus"):
            os.sched_setaffinity(p.pid, cfg["worker_cpus"])
        self.relays.append(p)
        return worker_end

    def send(self, i: int, *msg: object) -> None:
        self.conns[i].send(msg)

    def expect(
        self, kind: str, which: list[int], timeout: float, partial: bool = False
    ) -> dict[int, tuple]:
        """The next message of ``kind`` from each worker in ``which``. Other messages wait in
        the worker's inbox: a worker may finish one thing before it answers another. On a
        timeout, raise — or with ``partial``, return what came.
        """
        got: dict[int, tuple] = {}
        for i in which:
            msg = next((m for m in self.inbox[i] if m[0] == kind), None)
            if msg is not None:
                self.inbox[i].remove(msg)
                got[i] = msg[1:]
        end = time.monotonic() + timeout
        while len(got) < len(which):
            left = end - time.monotonic()
            ready = mpc.wait([self.conns[i] for i in which if i not in got], max(0.0, left))
            if not ready:
                if partial:
                    return got
                raise TimeoutError(
                    f"no '{kind}' from {len(which) - len(got)} worker(s) within {timeout:g}s"
                )
            for c in ready:
                i = self.conns.index(c)
                try:
                    msg = c.recv()
                except EOFError:
                    raise RuntimeError(f"worker {i} (pid {self.pids[i]}) died") from None
                if msg[0] == kind:
                    got[i] = msg[1:]
                else:
                    self.inbox[i].append(msg)
        return got

    def stop(self, timeout: float) -> list[str]:
        """Graceful stop, then kill what is left; return leftover non-daemon threads."""
        extra: list[str] = []
        live = [i for i, p in enumerate(self.procs) if p.is_alive()]
        try:
            for i in live:
                self.send(i, "stop")
            for i, (names,) in self.expect("stopped", live, timeout).items():
                extra += [f"worker {i}: {n}" for n in names]
        except (TimeoutError, RuntimeError, OSError) as e:
            extra.append(f"stop: {e}")
        for p in self.procs + self.relays:  # a relay ends when its worker closes the pipe
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        return extra
