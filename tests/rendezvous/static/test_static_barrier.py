"""The static backend's meeting on the master's port (rendezvous/static/barrier.py): the nodes
of a static job meet before any worker starts and wait for each other at the end, as under
torchrun's static rendezvous; mistakes are one line, and nothing waits for a node that left.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import threading
import time
from typing import Any

import pytest
from agent_helpers import clean_env, etcdrun_bin, wait_for

from etcdrun.rendezvous.api import RendezvousParameters
from etcdrun.rendezvous.errors import RendezvousError, RendezvousTimeoutError
from etcdrun.rendezvous.free_port import reserve_free_port
from etcdrun.rendezvous.registry import create_handler


class Node(threading.Thread):
    """One node's next_rendezvous() in a thread; ``result`` is its info or its exception."""

    def __init__(self, port: int, rank: int, nodes: int = 2, **kw: Any) -> None:
        super().__init__(name=f"static-node{rank}", daemon=True)
        conf = {"rank": rank, **kw.pop("config", {})}
        base = dict(run_id="sb", max_nodes=nodes, local_world_size=1)
        base.update(kw)
        self.h = create_handler(
            RendezvousParameters(
                backend="static", endpoint=f"127.0.0.1:{port}", config=conf, **base
            )
        )
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.h.next_rendezvous()
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.result = e

    def finish(self, timeout: float = 30) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} is still waiting: {self.h.report().status()}"
        return self.result


@pytest.fixture
def nodes():
    made: list[Node] = []
    port = reserve_free_port()

    def make(rank: int, **kw: Any) -> Node:
        n = Node(kw.pop("port", port), rank, **kw)
        made.append(n)
        return n

    make.port = port  # type: ignore[attr-defined]
    yield make
    for n in made:
        n.h.shutdown()
        n.join(5)


def test_a_node_waits_for_node_0_then_both_go(nodes):
    late, early = nodes(0), nodes(1)
    early.start()
    wait_for(lambda: "waits for node 0" in early.h.report().status(), 10, "node 1 retrying node 0")
    assert early.is_alive()  # no worker may start before node 0 is there
    late.start()
    a, b = late.finish(), early.finish()
    assert (a.node_rank, b.node_rank, a.world_size, b.world_size) == (0, 1, 2, 2)
    assert early.h.report().status() == "" and late.h.report().status() == ""
    # a restart (the static backend re-runs its one round) meets nobody again
    assert early.h.next_rendezvous().node_rank == 1


def test_node_0_waits_for_every_rank_and_says_which(nodes):
    n0, n2 = nodes(0, nodes=3), nodes(2, nodes=3)
    n0.start()
    n2.start()
    wait_for(lambda: "node rank(s) 1 (2 of 3 here)" in n0.h.report().status(), 10, "node 2 counted")
    assert n0.is_alive() and n2.is_alive()
    n1 = nodes(1, nodes=3)
    n1.start()
    assert [n.finish().node_rank for n in (n0, n1, n2)] == [0, 1, 2]


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(run_id="other"), "node 0 runs job 'sb', not 'other'"),
        (dict(nodes=3), "node 0 has --nnodes 2, node 1 has 3"),
        (dict(local_world_size=2), "node 0 has --nproc-per-node 1, node 1 has 2"),
    ],
)
def test_a_node_of_another_job_is_refused_and_node_0_waits_on(nodes, kw, why):
    n0 = nodes(0)
    n0.start()
    stranger = nodes(1, **kw)
    stranger.start()
    err = stranger.finish()
    assert isinstance(err, RendezvousError) and why in str(err), err
    assert "refused us" in str(err)
    assert n0.is_alive()  # still waiting for its own node 1
    right = nodes(1)
    right.start()
    assert (n0.finish().node_rank, right.finish().node_rank) == (0, 1)


def test_the_same_rank_twice_is_refused(nodes):
    n0 = nodes(0, nodes=3)
    first = nodes(1, nodes=3)
    n0.start()
    first.start()
    wait_for(lambda: "(2 of 3 here)" in n0.h.report().status(), 10, "node 1 at node 0")
    twin = nodes(1, nodes=3)
    twin.start()
    err = twin.finish()
    assert isinstance(err, RendezvousError) and "node rank 1 is already here" in str(err)
    last = nodes(2, nodes=3)
    last.start()
    assert [n.finish().node_rank for n in (n0, first, last)] == [0, 1, 2]


def test_timeouts_name_who_is_missing(nodes):
    lone = nodes(1, config={"timeout": "0.5"})  # torchrun's key, read as join_timeout
    lone.start()
    err = lone.finish()
    assert isinstance(err, RendezvousTimeoutError)
    assert f"node 0 did not answer at 127.0.0.1:{nodes.port} within 0.5 s" in str(err)
    host = nodes(0, nodes=3, config={"join_timeout": "0.5"})
    host.start()
    err = host.finish()
    assert isinstance(err, RendezvousTimeoutError)
    assert "node rank(s) 1, 2 did not arrive" in str(err)


def test_a_busy_port_on_node_0_is_one_line(nodes):
    with socket.create_server(("", 0)) as busy:
        n0 = nodes(0, port=busy.getsockname()[1])
        n0.start()
        err = n0.finish()
    assert isinstance(err, RendezvousError)
    assert "cannot listen on MASTER_PORT" in str(err) and "another --master-port" in str(err)


def test_another_program_on_the_port_is_never_spoken_to(nodes):
    """A TCPStore (or anything) on MASTER_PORT: node 1 waits for our banner, sends nothing."""
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as other:

        def serve() -> None:
            conn, _ = other.accept()
            with conn:
                conn.settimeout(10)
                got.append(conn.recv(100))  # b"" when node 1 gives up without a word

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        n1 = nodes(1, port=other.getsockname()[1])
        n1.start()
        err = n1.finish()
        t.join(10)
    assert isinstance(err, RendezvousError) and "answers, but not as node 0" in str(err)
    assert got == [b""]


def test_exit_barrier_waits_for_all_and_not_for_one_that_left(nodes):
    n = [nodes(r, nodes=3) for r in range(3)]
    for x in n:
        x.start()
    for x in n:
        x.finish()
    done: dict[int, bool] = {}
    t0 = threading.Thread(target=lambda: done.__setitem__(0, n[0].h.exit_barrier(30)))
    t1 = threading.Thread(target=lambda: done.__setitem__(1, n[1].h.exit_barrier(30)))
    t0.start()
    t1.start()
    wait_for(lambda: not t1.is_alive() or t0.is_alive(), 5, "both waiting")
    assert t0.is_alive() and t1.is_alive()  # node 2 has not finished
    start = time.monotonic()
    n[2].h.shutdown()  # node 2 failed for good: its agent leaves without the barrier
    t0.join(10)
    t1.join(10)
    left_after = time.monotonic() - start
    assert done == {0: False, 1: False} and left_after < 5, (done, left_after)

    port = reserve_free_port()
    m = [nodes(r, port=port, nodes=2, run_id="sb2") for r in range(2)]
    for x in m:
        x.start()
    for x in m:
        x.finish()
    result: dict[int, bool] = {}
    ts = [
        threading.Thread(target=lambda r=r: result.__setitem__(r, m[r].h.exit_barrier(30)))
        for r in range(2)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert result == {0: True, 1: True}


def test_the_workers_store_binds_master_port_while_the_meeting_holds_it(nodes, torch_available):
    """What makes MASTER_PORT usable for both: torch's TCPStore (libuv and classic) binds with
    SO_REUSEADDR, so the meeting's open connections on that port do not stop it.
    """
    from torch.distributed import TCPStore

    n0, n1 = nodes(0), nodes(1)
    n0.start()
    n1.start()
    n0.finish(), n1.finish()
    for libuv in (True, False):
        store = TCPStore(
            "127.0.0.1",
            nodes.port,
            1,
            True,
            datetime.timedelta(seconds=10),
            use_libuv=libuv,
        )
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store


# ---- the command line: torchrun's static multi-node command, unchanged -----------------------
WORKER = """
import os, sys, time
time.sleep(float(sys.argv[1]))
print("node", os.environ["GROUP_RANK"], "rank", os.environ["RANK"], "done", time.time(), flush=True)
"""


def test_two_static_nodes_meet_before_and_after_their_workers(tmp_path):
    """``--nnodes 2 --node-rank R --master-addr --master-port``: node 1 started alone starts no
    worker (it used to, in 0.21 s); node 0, whose worker ends first, leaves only after node 1's
    worker ended (the "waiting for the other nodes" line is true now).
    """
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    port = reserve_free_port()
    procs: list[subprocess.Popen[str]] = []

    def start(rank: int, sleep: float) -> subprocess.Popen[str]:
        argv = [etcdrun_bin(), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"]
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(sleep)]
        log = open(tmp_path / f"node{rank}.log", "w")  # noqa: SIM115 - closed below
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), text=True)
        log.close()
        procs.append(p)
        return p

    def text(rank: int) -> str:
        return (tmp_path / f"node{rank}.log").read_text()

    try:
        n1 = start(1, 1.5)
        wait_for(
            lambda: "waiting for a round" in text(1) or "waits for node 0" in text(1),
            20,
            "node 1 waiting",
        )
        assert "done" not in text(1) and n1.poll() is None
        t0 = time.time()
        n0 = start(0, 0.0)
        assert n0.wait(60) == 0 and n1.wait(60) == 0, text(0) + text(1)
        t_end0 = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done1 = float(text(1).split("done")[1].split()[0])
    assert done1 > t0  # node 1's worker ran only once node 0 was there
    assert "waiting for the other nodes" in text(0) and t_end0 >= done1, text(0)
    print(f"[static] node 1's worker done {done1 - t0:.2f} s after node 0 started")
