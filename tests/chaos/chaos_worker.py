"""A chaos trial's worker; argv: <out dir> <seconds>. Short and real: it runs ``seconds``, then
leaves ``done_<round>_<rank>_<pid>`` and exits 0, so a round whose workers all finish ends the
job, and a trial fits in ~10 s.

It behaves as a collective job would, without torch's start-up (1.3-5.9 s here): it waits until
every rank of its round has started (init_process_group), exits 1 when a peer of its round died
before finishing (a broken all_reduce), and finishes only once every peer has (a last barrier:
a frozen peer holds everyone, as in a real collective). Without that, a survivor's workers would
finish alone after a peer's node died or froze, and "the job completed" would mean nothing.

The work starts once the trial has seen a round with every agent (it writes ``go``): agents
started seconds apart under load would otherwise let the first two finish the job alone before
the others came (seeds 1002, 1334 counted the late ones' rightful "already ran" as crashes).

Every start leaves ``start_<round>_<rank>_<pid>.json`` (environment, pid, parent pid, wall
time), written atomically like tests/agent_scripts/worker.py's: the trial reads recovery times
and the rounds from them, never from the launcher's logs.
"""

import json
import os
import sys
import time


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + ".tmp", path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _peers_done(out: str, peers: dict[str, int]) -> bool:
    """True once every peer finished; exit 1 when one died before finishing."""
    done = True
    for peer, pid in peers.items():
        if os.path.exists(os.path.join(out, f"done_{peer}.json")):
            continue
        done = False
        if not _alive(pid):
            print(f"peer {peer} died: the collective is broken", file=sys.stderr)
            sys.exit(1)
    return done


def _meet(out: str, rnd: str, world: int, timeout: float = 30.0) -> dict[str, int]:
    """Every rank of this round's start file, by ``<round>_<rank>_<pid>``."""
    deadline = time.monotonic() + timeout
    while True:
        peers = {}
        for name in os.listdir(out):
            if name.startswith(f"start_{rnd}_") and name.endswith(".json"):
                peer = name[len("start_") : -len(".json")]
                peers[peer] = int(peer.rsplit("_", 1)[1])
        if len({p.split("_")[1] for p in peers}) >= world:
            return peers
        if time.monotonic() > deadline:
            print(f"round {rnd}: only {len(peers)} of {world} ranks came", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.02)


if __name__ == "__main__":
    out, seconds = sys.argv[1], float(sys.argv[2])
    name = f"{os.environ['ETCDRUN_ROUND']}_{os.environ['RANK']}_{os.getpid()}"
    env = dict(os.environ)
    _write(
        os.path.join(out, f"start_{name}.json"),
        {"env": env, "pid": os.getpid(), "ppid": os.getppid(), "t": time.time()},
    )
    peers = _meet(out, os.environ["ETCDRUN_ROUND"], int(os.environ["WORLD_SIZE"]))
    while not os.path.exists(os.path.join(out, "go")):  # the trial's start: every agent is in
        time.sleep(0.05)
        _peers_done(out, peers)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
        _peers_done(out, peers)
    _write(os.path.join(out, f"done_{name}.json"), {"t": time.time()})
    limit = time.monotonic() + 60
    while not _peers_done(out, peers):  # the last barrier
        if time.monotonic() > limit:
            print("the last barrier timed out", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.05)
