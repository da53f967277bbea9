"""A kept worker forming the next round's group is released when that round ends too, also while
the round's store is being built (etcdrun.elastic.group, design.md §4a).

Why: chaos seed 92 (tests/chaos/chaos_inplace.py) froze two nodes past their TTL and sent a
newcomer; rounds followed one another while the fenced nodes' fresh workers were still starting,
and the survivors stayed in torch's TCPStore constructor — rank 0 waiting for every rank to
connect, the others retrying their connect — which no release reached, for 30 minutes; and a
survivor whose round ended before it began to form it tried that round's store forever. Here one
rank forms a world of two whose other rank never comes, and is released 0.5 s later, or was told
before it began that the round is over.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from agent_helpers import clean_env, unused_port

FORM = """
import os, sys, threading, time
import torch.distributed  # imported before any timer starts: form() must be under way
from etcdrun.elastic.group import Group

# nobody serves rank 1's store, rank 0 serves its own; the last: the round ended before the form
for rank, port, early in zip((1, 0, 1), sys.argv[1:], (False, False, True), strict=True):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    group = Group()
    if not early:
        threading.Timer(0.5, group.release).start()
    began = time.monotonic()
    try:
        group.form("gloo", ended=lambda: early)
    except Exception as e:
        print(f"rank {rank} released after {time.monotonic() - began:.2f} s: {type(e).__name__}")
    else:
        print(f"rank {rank} formed")
"""


def test_a_release_ends_a_group_whose_store_is_being_built(torch_available):
    out = subprocess.run(
        [sys.executable, "-c", FORM, *(unused_port() for _ in range(3))],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 3 and all("released after" in ln for ln in lines), out.stderr[-2000:]
    for line in lines:  # the release at 0.5 s and one STORE_TRY; never FORM_TIMEOUT
        assert float(line.split("released after ")[1].split()[0]) < 5.0, line


MEET = """
import sys
import torch.distributed as dist
from etcdrun.elastic.group import Group

if sys.argv[1] == "fresh":
    dist.init_process_group("gloo")  # env://: its rank 0 store waits for every rank's count
else:
    if sys.argv[1] == "kept-after-a-cut":  # a form cut short inside init_process_group
        from datetime import timedelta

        s = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        try:  # its other rank never comes: gloo gives up after 1 s, and no group is made
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("default_pg", s),
                rank=0,
                world_size=2,
                timeout=timedelta(seconds=1),
            )
        except Exception:
            pass
        assert not dist.is_initialized()
    Group().form("gloo")
dist.barrier()
print("formed")
"""


@pytest.mark.parametrize("kept", ["kept", "kept-after-a-cut"])
def test_a_kept_rank_meets_a_fresh_rank_0_formed_through_env(torch_available, kept):
    """A survivor's store client counts itself in, as a fresh rank 0's env:// store waits
    for every rank to (chaos seed 1010 hung there when it did not). And after a form cut short
    inside ``init_process_group`` its group has the name a fresh rank's has: torch names the
    default group by a counter that only a destroyed WORLD resets, and groups of different
    names never meet in the store (chaos seeds 1081 and 92 hung there).
    """
    port = unused_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MEET, how],
            env=clean_env(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how, rank in (("fresh", "0"), (kept, "1"))
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for out, err in outs:
        assert "formed" in out, err[-2000:]


LATE = """
import sys
import torch.distributed as dist
from etcdrun.elastic.group import Group

print("forming", flush=True)
Group().form("gloo")
dist.barrier()
print("formed", flush=True)
"""


def test_a_kept_rank_dials_the_store_once_rank_0_listens(torch_available):
    """Rank 0 may still be releasing its old group when the other kept ranks are handed the
    round. A torch store client that is refused dials again only ~0.5 s later, and the whole
    re-form waits for it (bench/results/in_place_compare.md, 'The kept ranks' redial'), so a kept
    rank waits for the listener before it dials: torch never logs a refused try.
    """
    port = unused_port()

    def start(rank: str) -> subprocess.Popen:
        env = clean_env(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        return subprocess.Popen(
            [sys.executable, "-c", LATE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    kept = start("1")
    try:
        assert kept.stdout.readline().strip() == "forming"  # it dials before rank 0 exists
        rank0 = start("0")
        outs = [p.communicate(timeout=60) for p in (kept, rank0)]
    finally:
        kept.kill()
    for out, err in outs:
        assert "formed" in out, err[-2000:]
    # A refused try is what costs the redial; a try that timed out on a loaded machine (its
    # SYN unanswered within torch's 1 s) says nothing of when the kept rank dialled.
    refused = [
        line
        for line in outs[0][1].splitlines()
        if "failed to connect" in line and "timed out" not in line
    ]
    assert not refused, outs[0][1][-2000:]


ENDS_IN_THE_MESH = """
import os, sys, threading, time
import torch.distributed as dist
from etcdrun.elastic.group import Group

rank, lag, delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ports = sys.argv[4:]
group = Group()
for trial in range(len(ports) // 2):
    time.sleep(lag)  # comes to the round late: a peer released before it dials this rank
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=ports[2 * trial]
    )
    over = threading.Event()

    def end_round():
        over.set()
        group.release()

    timer = threading.Timer(delay, end_round)
    timer.start()
    began = time.monotonic()
    try:
        group.form("gloo", ended=over.is_set)
    except ConnectionAbortedError as e:
        print(f"trial {trial}: released after {time.monotonic() - began:.2f} s: {e}", flush=True)
    except Exception:  # a form the release cut inside torch: its store gone
        print(f"trial {trial}: released after {time.monotonic() - began:.2f} s", flush=True)
    timer.join()
    group.drop()
    os.environ["MASTER_PORT"] = ports[2 * trial + 1]
    group.form("gloo")
    dist.barrier()
    group.drop()
    print(f"trial {trial}: next round formed", flush=True)
"""


def test_a_round_that_ends_inside_gloos_mesh_does_not_hold_the_next(torch_available):
    """Once the group's addresses are exchanged, gloo's mesh waits for the peers that are to
    dial this rank, and neither a shut store nor a signal ends that wait. Here rank 2 comes to
    each round after rank 1 was released from it; where rank 1 was the one to dial (about one
    pair in two, by gloo's order of addresses), rank 2 waits for a dial that never comes, and
    its own release must still let it form the next round with the others, which wait for it
    in that round's store.
    """
    trials = 6
    ports = [unused_port() for _ in range(2 * trials)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENDS_IN_THE_MESH, str(rank), lag, delay, *ports],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, (lag, delay) in enumerate((("0", "1.0"), ("0", "0.1"), ("0.3", "0.4")))
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        formed = [ln for ln in out.splitlines() if ln.endswith("next round formed")]
        assert len(formed) == trials and proc.returncode == 0, f"rank {rank}:\n{out}{err[-3000:]}"


REUSED = """
import os, socket
from etcdrun.elastic import sockets

server = socket.create_server(("127.0.0.1", 0))
before = sockets.census()
peer = socket.create_connection(server.getsockname())
accepted, _ = server.accept()
new = sockets.new_since(before, sockets.census())
port = server.getsockname()[1]
owned = sockets.the_groups(new, port, set())  # both ends: the store's port is at one end of each
assert set(owned) == {peer.fileno(), accepted.fileno()}, (owned, peer.fileno(), accepted.fileno())
fd = peer.fileno()
peer.close()  # gone with the group it served (torch's store closes its ends the same way)
listener = socket.create_server(("127.0.0.1", 0))  # takes the lowest free descriptor: peer's
assert listener.fileno() == fd, (listener.fileno(), fd)
sockets.shut(owned)
listener.settimeout(5)
dial = socket.create_connection(listener.getsockname())
listener.accept()
print("the listener still accepts")
"""


def test_a_release_never_shuts_a_socket_that_took_a_closed_ones_descriptor():
    """A descriptor that the group's socket had is reused by the next socket the process makes,
    gloo's listener among them, and a shut listener kills the process (gloo's "accept:
    Invalid argument"). So a release shuts a socket only while its descriptor still names it.
    """
    out = subprocess.run(
        [sys.executable, "-c", REUSED], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert "the listener still accepts" in out.stdout, out.stderr[-2000:]


FOREIGN = """
import os, socket, sys, threading, time
import torch, torch.distributed as dist
from etcdrun.elastic.group import Group

rank = int(os.environ["RANK"])
echo = ("127.0.0.1", int(sys.argv[1]))
early = socket.create_connection(echo)  # the script's, from before the group
late = []
if rank == 0:  # the script's too, opened by a thread of its own while etcdrun forms the group
    threading.Timer(0.3, lambda: late.append(socket.create_connection(echo))).start()
else:
    time.sleep(1.0)  # rank 0 waits for this rank inside the form meanwhile
group = Group()
group.form("gloo")
group.check_round()
assert rank == 1 or late, "the thread's connection was not opened during the form"
dist.all_reduce(torch.ones(1))
if rank == 1:
    time.sleep(30)  # alive and silent: rank 0's next collective blocks on it
    sys.exit(0)
threading.Timer(0.5, group.release).start()
began = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError:
    print(f"released after {time.monotonic() - began:.2f} s", flush=True)
for name, conn in (("early", early), ("late", late[0])):
    conn.sendall(name.encode() + b"\\n")
    print(name, conn.makefile().readline().strip() == name, flush=True)
os._exit(0)
"""


def test_a_release_shuts_the_groups_sockets_and_none_of_the_scripts(torch_available):
    """A release shut every connected socket of the process but the store's, a tracker's or a
    database's too. Now it shuts only what etcdrun's form made (sockets.py): rank 0's blocked
    collective is released, and its own connections, one from before the group and one a
    thread opened while the group formed, still carry a line to an echo server and back.
    """
    import socketserver

    class Echo(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(line)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    serving = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    serving.start()
    port = unused_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FOREIGN, str(server.server_address[1])],
            env=clean_env(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ("0", "1")
    ]
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        server.shutdown()
        server.server_close()
        serving.join(5)
    assert "released after" in out, err[-2000:]
    assert float(out.split("released after ")[1].split()[0]) < 10, out  # not gloo's 30 min
    assert "early True" in out and "late True" in out, out + err[-2000:]
