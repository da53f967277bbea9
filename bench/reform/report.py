"""The page, bench/results/reform.md, rendered from a run's results (or a saved ``--json``).

Why rendering is apart from running: the page is a function of the raw results and the run's
meta alone, so ``--from-json`` re-renders a past run after the page's wording changes, and its
numbers stay those of the run. One table per case, each only where the run has the case
(``--only``); the last section, what the numbers say, is bench/reform/verdict.py's. Times are
printed in ms, p50 / max unless a column says otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.reform.harness import FIRST_S
from bench.reform.verdict import verdict


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def p50p99(xs: list[float]) -> str:
    """p50 / p99 in ms of seconds."""
    return f"{1000 * pct(xs, 0.5):.0f} / {1000 * pct(xs, 0.99):.0f}" if xs else "–"


def ms(xs: list[float]) -> str:
    """p50 / max in ms of seconds."""
    if not xs:
        return "–"
    return f"{1000 * statistics.median(xs):.0f} / {1000 * max(xs):.0f}"


def parts(ps: list[dict[str, float]]) -> str:
    """The p50 of each part of the forms, in ms, in the order the parts ran."""
    names: list[str] = []
    for p in ps:
        names += [n for n in p if n not in names]
    if not names:
        return "–"
    return ", ".join(
        f"{n} {1000 * statistics.median([p[n] for p in ps if n in p]):.0f}" for n in names
    )


MEASURES = """\
Two ways to re-form the default gloo group after a release, on 3 local processes (a 4th as a
newcomer), without agents or etcd (`bench/reform/`):

- **fresh** is what etcdrun runs: `etcdrun.elastic.group.Group`. `release()` shuts this
  process's ends of the group's sockets and ends InFlight's futures; `drop()` and `form()`
  make a new TCPStore at the round's MASTER_PORT (its rank 0 serves it) and a new
  `init_process_group` on a thread of its own; `check_round()` is the first collective.
- **reconf** is torch 2.14's: one `init_process_group("gloo", enable_reconfigure=True)` on a
  swappable Python store (`SwapStore`, a `dist.Store` handing every call to the current
  round's TCPStore, which the round's rank 0 serves on a new port), then per round the
  handles set/get through that store and `dist._reconfigure(uuid=round, handles)`. Its
  release is the same as fresh's: shut the connected sockets that appeared during the round's
  form (`etcdrun.elastic.sockets`: census/new_since/shut), and end InFlight's futures.
  `reconf-plain` inits on the first round's TCPStore itself; `reconf-alone` releases with
  `_reconfigure` alone (REPORT Q5 a).

Both paths run the same first collective after a form (an all_gather of the round, as
`check_round`). The cases:

1. **Release stress** (bench/release_stress.py's): a small DDP model trains, each rank is
   released at a drawn moment (0.3-0.7 s into the round, ranks up to 60 ms apart), every rank
   meets at a file barrier, the group is re-formed, `--rounds` times per seed; with InFlight's
   hook and with DDP's own all-reduce. A seed is hung when a rank is silent 10 s after an event
   of its round (after its release: it did not leave its round); its Python stacks are taken
   and the next seed runs. Re-form time: from a release to the first collective of the next
   group returning, per rank, from its own release and from the last rank's release.
2. **The first store's host dies**: the three train; round 0's rank 0 (it serves round 0's
   store, the one a reconfigure group was given at init) is SIGKILLed; the two others are
   told, release and re-form as ranks 0 and 1 (old rank 1 serves the new store). Time from the
   notice to the first collective of the new group; then three DDP steps.
3. **A newcomer**: round 0 has three ranks, rank 2 leaves (round 1: two survivors), and a
   newcomer started ahead joins round 2: fresh's newcomer with a script's own
   `dist.init_process_group("gloo")` (env://) on the round's store, adopted by a `Group`;
   reconf's with `init_process_group(enable_reconfigure=True)` and `_reconfigure`. Times
   from the notice to the first collective of round 2, then three DDP steps.
4. **A synchronous `dist.all_reduce` of the script's own, blocked on a SIGSTOPped peer**:
   ranks 0 and 1 release 1 s after they blocked. Released in how long (from the first rank's
   release), and re-formed as two in how long (from its own release)?
5. **A round superseded while it forms**: after round k-1 ends, one rank (rank i mod 3 at
   the i-th time, the store's host among them) is told that round k is over before it
   reaches round k's form and goes on to round k+1; the other two begin round k's form and are
   released 0-200 ms later (drawn). Does every rank reach round k+1, and how long after the
   release of round k?"""


HOW_TO_RUN = [
    "## How to run",
    "",
    "```",
    "python -m bench.reform            # 10-15 min on 2 cores; writes this page",
    "python -m bench.reform --quick    # < 90 s, prints only (--out PATH to write)",
    "python -m bench.reform --seeds 20 --rounds 10 --reps 5 --only 1,4",
    "python -m bench.reform --json run.json   # also the raw results",
    "python -m bench.reform --from-json run.json --out page.md   # render only",
    "```",
    "",
    "Every process is forked from one forkserver (torch imported once) and killed at the end "
    "of its seed; a seed is bounded by 10 s of silence after a release and by "
    f"{FIRST_S:.0f} s + 3 s per round. Logs: `--keep` keeps the temporary directory.",
    "",
]


def render(out: dict[str, Any], meta: dict[str, Any]) -> str:
    L: list[str] = ["# Re-forming the gloo group: a fresh group vs torch's `_reconfigure`", ""]
    L += ["## What it measures", "", MEASURES, "", "## Results", ""]
    L += [
        f"`{meta['cmd']}` on {meta['date']}: torch {meta['torch']}, {meta['cpus']} CPUs, "
        f"{meta['wall_s']:.0f} s. Load (1-minute average, sampled every 5 s): {meta['load']}; "
        "other benchmarks shared the machine. Times in ms, p50 / max unless said.",
        "",
    ]
    if out.get("stress"):
        L += stress_table(out["stress"], meta["rounds"])
    if out.get("kill0"):
        L += kill0_table(out["kill0"])
    if out.get("join"):
        L += join_table(out["join"])
    if out.get("stop"):
        L += stop_table(out["stop"])
    if out.get("supersede"):
        L += supersede_table(out["supersede"])
    L += ["## What etcdrun runs, and why", "", *verdict(out), ""]
    L += HOW_TO_RUN
    return "\n".join(L)


def stress_table(st: list[dict[str, Any]], rounds: int) -> list[str]:
    n = len(st[0]["seeds"])
    L = [
        f"### 1. Release stress ({n} seeds × {rounds} rounds)",
        "",
        "| path | all-reduce | seeds hung | crashed | rounds left by every rank | "
        "re-form from own release p50 / p99 | from the last release p50 / p99 | "
        "parts of a form, p50 | how ranks left their rounds | "
        "forms with a released collective still inside gloo |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in st:
        ss = row["seeds"]
        own = [x for s in ss for x in s["own"]]
        last = [x for s in ss for x in s["last"]]
        hows: dict[str, int] = {}
        for s in ss:
            for k, v in s["hows"].items():
                hows[k] = hows.get(k, 0) + v
        hung = [i for i, s in enumerate(ss) if s["hung"]]
        L.append(
            f"| {row['path']} | {'InFlight' if row['hook'] else 'DDP own'} | "
            f"{len(hung)} of {len(ss)} | {sum(bool(s['crashed']) for s in ss)} | "
            f"{sum(s['left'] for s in ss)} | "
            f"{p50p99(own)} | {p50p99(last)} | "
            f"{parts([p for s in ss for p in s['parts']])} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(hows.items()))
            + f" | {sum(s['kept'] for s in ss)} |"
        )
    notes = stress_notes(st)
    if notes:
        L += ["", "Hung and crashed seeds (the main thread's innermost frames):", "", *notes]
    return L + [""]


def stress_notes(st: list[dict[str, Any]]) -> list[str]:
    """A line per hung or crashed seed (where its ranks were), and per form left behind."""
    notes = []
    for row in st:
        for i, s in enumerate(row["seeds"]):
            tag = f"{row['path']}, {'InFlight' if row['hook'] else 'DDP own'}, seed {i}"
            if s["hung"]:
                notes.append(f"- {tag}: hung {s['hung']}" + "".join(f"; {w}" for w in s["where"]))
            if s["crashed"]:
                notes.append(f"- {tag}: crashed, {s['crashed']}")
            if s["behind"]:
                notes.append(f"- {tag}: {s['behind']} form(s) left behind inside gloo")
    return notes


def kill0_table(rows: list[dict[str, Any]]) -> list[str]:
    L = [
        "### 2. The first store's host SIGKILLed: the two survivors re-form",
        "",
        "| path | reps | survivors re-formed | re-form (from the notice) | "
        "parts of the form, p50 | error |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        sv = [s for r in row["reps"] for s in r.get("survivors", {}).values()]
        errs = sorted({s["error"] for s in sv if "error" in s})
        after = [s["error_after_s"] for s in sv if "error_after_s" in s]
        e = "; ".join(f"`{x}`" for x in errs) or "–"
        if after:
            e += f" (raised {ms(after)} ms after the notice)"
        L.append(
            f"| {row['path']} | {len(row['reps'])} | {sum(s['ok'] for s in sv)} of "
            f"{len(sv)} | {ms([s['reform_s'] for s in sv if 'reform_s' in s])} | "
            f"{parts([s['parts'] for s in sv if 'parts' in s])} | {e} |"
        )
    return L + [""]


def join_table(rows: list[dict[str, Any]]) -> list[str]:
    L = [
        "### 3. A newcomer joins the two survivors",
        "",
        "| path | newcomer dials | reps | joined | 3 → 2 re-form (survivors) | "
        "join: survivors | join: newcomer | parts: survivors, p50 | parts: newcomer, p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rs = row["reps"]
        shrink = [x for r in rs for x in r.get("shrink_s", [])]
        surv = [v for r in rs for w, v in r.get("join_s", {}).items() if w != "new"]
        new = [v for r in rs for w, v in r.get("join_s", {}).items() if w == "new"]
        sp = [v for r in rs for w, v in r.get("parts", {}).items() if w != "new"]
        np_ = [v for r in rs for w, v in r.get("parts", {}).items() if w == "new"]
        why = sorted({r["why"] for r in rs if "why" in r})
        L.append(
            f"| {row['path']} | {'at once' if row['early'] else 'once the store listens'} | "
            f"{len(rs)} | {sum(bool(r['joined']) for r in rs)} of "
            f"{len(rs)}{' (' + '; '.join(why) + ')' if why else ''} | {ms(shrink)} | "
            f"{ms(surv)} | {ms(new)} | {parts(sp)} | {parts(np_)} |"
        )
    return L + [
        "",
        "The newcomer is started ahead and told with the survivors; by default it dials once "
        "the round's store listens, as a script that imports torch first would. fresh's "
        "newcomer is a plain `init_process_group` (env://): dialling at once, a refused "
        "torch client retries only after a pause.",
        "",
    ]


def stop_table(rows: list[dict[str, Any]]) -> list[str]:
    L = [
        "### 4. A synchronous all_reduce blocked on a SIGSTOPped peer",
        "",
        "| path | release | ranks released | released after | exception | "
        "release call returned after | re-formed as two after | parts of the form, p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    how = {
        "fresh": "Group.release (shut + InFlight)",
        "reconf": "shut + InFlight",
        "reconf-alone": "`_reconfigure` to the two, no shut",
    }
    for row in rows:
        sv = [s for r in row["reps"] for s in r["ranks"].values()]
        rel = [s["after_s"] for s in sv if "after_s" in s]
        exc = sorted({s["error"] for s in sv if "error" in s})
        act = [s["act_s"] for s in sv if "act_s" in s]
        watched = [s["watched_s"] for s in sv if "watched_s" in s]
        nrel = sum(s["released"] for s in sv)
        reln = ms(rel)
        if watched:
            reln += f"; {len(watched)} still blocked {min(watched):.0f} s after the release"
        L.append(
            f"| {row['path']} | {how[row['path']]} | {nrel} of {len(sv)} | {reln} | "
            f"{', '.join(exc) or '–'} | {ms(act)} | "
            f"{ms([s['reform_s'] for s in sv if 'reform_s' in s])} | "
            f"{parts([s['parts'] for s in sv if 'parts' in s])} |"
        )
    return L + [""]


def supersede_table(rows: list[dict[str, Any]]) -> list[str]:
    L = [
        "### 5. A round superseded while it forms",
        "",
        "| path | superseded rounds | every rank reached the next round | time, the store's "
        "host told early | time, another rank told early | how the superseded forms ended |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        rs = row["reps"]
        hows = sorted({h for r in rs for h in r["how"]})
        stuck = [r for r in rs if not r["reached"]]
        reached = f"{sum(r['reached'] for r in rs)} of {row['n']}"
        if stuck:
            where = [f"{w}: {x}" for r in stuck for w, x in r.get("where", {}).items()]
            reached += " (stuck: " + "; ".join(where) + ")"
        host = [r["time_s"] for r in rs if "time_s" in r and r["skip"] == "r0"]
        other = [r["time_s"] for r in rs if "time_s" in r and r["skip"] != "r0"]
        L.append(
            f"| {row['path']} | {row['n']} | {reached} | {ms(host)} | {ms(other)} | "
            f"{', '.join(hows)} |"
        )
    return L + [
        "",
        "Times from the release of the superseded round to the last rank's first collective "
        "of the next.",
        "",
    ]
