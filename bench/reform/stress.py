"""Case 1, the driver's side: the release stress, seed by seed, for both paths.

Three ranks train a small DDP model and are released at drawn moments, ``--rounds`` times per
seed (bench/release_stress.py's stress; the ranks' side is ``worker.case_stress``), once with
InFlight's hook on the all-reduce and once with DDP's own. The driver only watches the logs:
a seed ends when every rank has ended, when one crashed, or when one is hung (silent
``HANG_S`` after an event of its round, or no first form within ``FIRST_S``; the seed as a
whole is bounded by ``FIRST_S`` + 3 s a round). A hung seed's stacks are taken, and the next
seed runs. The re-form time is read from the logs afterwards: from each rank's own release,
and from the last rank's release, to the next round's first collective returning.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.reform.harness import FIRST_S, HANG_S, PATHS, Launch, Run


def case_stress(run: Run, a: argparse.Namespace, out: dict[str, Any]) -> None:
    for hook in (True, False):
        for path in PATHS:
            rows = []
            for seed in range(a.first, a.first + a.seeds):
                r = stress_seed(run, path, hook, seed, a.rounds)
                rows.append(r)
                state = "ok" if r["ok"] else ("HUNG " + r["hung"] if r["hung"] else "CRASHED")
                print(
                    f"[1] {path:6} {'hook' if hook else 'ddp ':4} seed {seed}: {state}, "
                    f"{r['left']} rounds",
                    *r["where"],
                    r["crashed"],
                    flush=True,
                )
            out.setdefault("stress", []).append({"path": path, "hook": hook, "seeds": rows})


def stress_seed(run: Run, path: str, hook: bool, seed: int, rounds: int) -> dict[str, Any]:
    tag = "hook" if hook else "ddp"
    L = run.launch(f"stress-{path}-{tag}-{seed}")
    ranks = [f"r{r}" for r in range(3)]
    ports = run.ports(rounds)
    for r in range(3):
        L.start(
            ranks[r],
            case="stress",
            path=path,
            rank=r,
            world=3,
            seed=seed,
            rounds=rounds,
            hook=hook,
            ports=ports,
        )
    hung, crashed = watch(L, ranks, L.began + FIRST_S + 3 * rounds)
    where = []
    if hung:
        L.stop(dump=True)
        for w in ranks:
            last = [e for e in L.events(w) if e["ev"] not in ("start",)]
            if last and last[-1]["ev"] == "rel":
                where.append(f"{w} round {last[-1]['k']}: {L.where(w)}")
    else:
        L.stop()
    return summary(L, ranks, hung, crashed, where)


def watch(L: Launch, ranks: list[str], cap: float) -> tuple[str, str]:
    """Until every rank ended, one crashed, or one is hung: (where the seed hung, or "";
    the rank that crashed, or "").
    """
    hung, crashed = "", ""
    while True:
        time.sleep(0.1)
        evs = {w: L.events(w) for w in ranks}
        if all(L.ended(w) for w in ranks):
            break
        now = time.monotonic()
        for w in ranks:  # the log read after the end: "done" is written before the exit
            if L.ended(w) and not L.first(w, "done"):
                crashed = crashed or w
        if crashed:
            break
        stuck = []
        for w in ranks:
            if L.ended(w):
                continue
            last = [e for e in evs[w] if e["ev"] != "start"]
            if not last and now - L.began > FIRST_S:
                stuck.append((w, "first form"))
            elif last and now - last[-1]["t"] > HANG_S:
                stuck.append((w, last[-1]["ev"]))
        if stuck or now > cap:
            live = [w for w in ranks if not L.ended(w)]
            lasts = [[e for e in evs[w] if e["ev"] != "start"][-1:] for w in live]
            inside = any(last and last[0]["ev"] == "rel" for last in lasts)
            hung = "in its round" if inside else "form or barrier"
            break
    return hung, crashed


def summary(
    L: Launch, ranks: list[str], hung: str, crashed: str, where: list[str]
) -> dict[str, Any]:
    """What a stopped seed's logs say: rounds left, re-form times and parts, how ranks left."""
    evs = {w: L.events(w) for w in ranks}
    text = "".join((L.dir / f"{w}.log").read_text(errors="replace") for w in ranks)
    left = min(sum(e["ev"] == "left" for e in evs[w]) for w in ranks)
    rels: dict[int, dict[str, float]] = {}
    formed: dict[int, dict[str, float]] = {}
    hows: dict[str, int] = {}
    parts = []
    for w in ranks:
        for e in evs[w]:
            if e["ev"] == "rel":
                rels.setdefault(e["k"], {})[w] = e["t"]
            elif e["ev"] == "formed":
                formed.setdefault(e["k"], {})[w] = e["t"]
                if e["k"] > 0:
                    parts.append(e["parts"])
            elif e["ev"] == "left":
                hows[e["how"]] = hows.get(e["how"], 0) + 1
    own, last_rel = [], []
    for k, f in formed.items():
        r = rels.get(k - 1, {})
        if k == 0 or len(r) < 3:
            continue
        for w, t in f.items():
            own.append(t - r[w])
            last_rel.append(t - max(r.values()))
    crash_msg = ""
    if crashed:
        c = [e for e in evs[crashed] if e["ev"] == "crash"]
        crash_msg = f"{crashed}: {c[0]['type']}: {c[0]['msg']}" if c else f"{crashed}: died"
    return {
        "ok": not hung and not crashed,
        "hung": hung,
        "crashed": crash_msg,
        "left": left,
        "own": own,
        "last": last_rel,
        "parts": parts,
        "hows": hows,
        "kept": text.count("still inside gloo"),
        "behind": text.count("left behind"),
        "where": where,
    }
