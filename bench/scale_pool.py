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


def worker(conn: mpc.Connection, cfg: dict) -> None:
    """Host ``cfg['count']`` handlers sharing one client; obey the main process's commands."""
    tally = _LogTally()
    logging.basicConfig(level=logging.WARNING, handlers=[tally])
    gc_time = {"s": 0.0, "n": 0, "t0": 0.0}  # collector pauses of this process, per round

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time["t0"] = time.perf_counter()
        elif gc_time["t0"]:
            gc_time["s"] += time.perf_counter() - gc_time["t0"]
            gc_time["n"] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    from etcdrun.rendezvous.api import RendezvousParameters
    from etcdrun.rendezvous.client import EtcdClient
    from etcdrun.rendezvous.etcd_rendezvous import EtcdRendezvousHandler

    send_lock = threading.Lock()

    def send(*msg: object) -> None:
        with send_lock:
            conn.send(msg)

    seen: list[dict] = []

    def keep(e: dict) -> None:
        if e.get("event") in EVENTS:
            seen.append(e)

    client = EtcdClient(cfg["endpoints"])
    client.status()  # open the channel before any clock starts, as a running agent has
    params = RendezvousParameters(
        "etcd",
        cfg["endpoints"],
        cfg["run_id"],
        cfg["min_nodes"],
        cfg["max_nodes"],
        local_world_size=1,
        config=cfg["conf"],
    )
    hs = [EtcdRendezvousHandler(params, client=client) for _ in range(cfg["count"])]
    for h in hs:
        h.events.subscribe(keep)
    cancel = threading.Event()

    def run_round(tag: str, todo: list, wait_change: bool) -> None:
        out: list = [None] * len(todo)
        gc_time.update(s=0.0, n=0)

        def one(i: int) -> None:
            h = todo[i]
            try:
                if wait_change:
                    while not h.membership_changed.wait(1.0):
                        if cancel.is_set():
                            out[i] = "cancelled"
                            return
                info = h.next_rendezvous()
                out[i] = (
                    info.node_id,
                    info.round,
                    info.node_rank,
                    info.node_count,
                    info.master_addr,
                    info.master_port,
                )
            except Exception as e:  # reported to the main process
                out[i] = f"{type(e).__name__}: {e}"

        ths = [
            threading.Thread(target=one, args=(i,), name=f"bench-{tag}-{i}")
            for i in range(len(todo))
        ]
        for th in ths:
            th.start()
        send("armed", tag)
        for th in ths:
            th.join()
        send("done", tag, out, gc_time["s"], gc_time["n"])

    try:
        send("ready", os.getpid())
        while True:
            cmd, *arg = conn.recv()
            if cmd == "round1":
                threading.Thread(target=run_round, args=("1", hs, False), daemon=True).start()
            elif cmd == "arm":  # survivors wait for the membership change, then rejoin
                todo = [h for h in hs if h.node_id != arg[0]]
                threading.Thread(target=run_round, args=("2", todo, True), daemon=True).start()
            elif cmd == "leave":
                h = next(h for h in hs if h.node_id == arg[0])
                t0 = time.time()
                ok = h.shutdown()
                send("left", t0, time.time(), ok)
            elif cmd == "events":
                send("events", list(seen), tally.count, tally.first)
            elif cmd == "close":
                hs[0].set_closed()
                send("closed")
            elif cmd == "stop":
                cancel.set()
                for h in hs:
                    h.shutdown()
                client.close()
                end = time.monotonic() + 3.0  # the rendezvous' and client's threads must end
                while True:
                    extra = [
                        t.name
                        for t in threading.enumerate()
                        if t is not threading.current_thread() and t is not threading.main_thread()
                    ]
                    if not extra or time.monotonic() > end:
                        break
                    time.sleep(0.05)
                send("stopped", extra)
                return
    except (EOFError, KeyboardInterrupt):
        pass


class Pool:
    """P worker processes, talked to over pipes; every wait is bounded."""

    def __init__(self, counts: list[int], cfg: dict) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold a gRPC channel
        self.conns, self.procs = [], []
        for c in counts:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(child, {**cfg, "count": c}), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs]
        self.inbox: list[list[tuple]] = [[] for _ in self.procs]

    def send(self, i: int, *msg: object) -> None:
        self.conns[i].send(msg)

    def expect(
        self, kind: str, which: list[int], timeout: float, partial: bool = False
    ) -> dict[int, tuple]:
        """The next message of ``kind`` from each worker in ``which``. Other messages wait in
        the worker's inbox: a worker may finish one thing before it answers another. On a
        timeout, raise — or with ``partial``, return what came."""
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
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        return extra
