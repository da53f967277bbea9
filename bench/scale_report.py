"""bench/rendezvous_scale.py's report: the targets, the PASS/MISS table and each run's details.

Why apart: what a figure is judged against and how it is shown is pure logic over the results
dicts (tests/project/test_bench.py feeds it synthetic ones); rendezvous_scale.py runs the rounds.
Targets (issue 14): N=1000 in <= 3 s (both rounds, one member); the N=4096 join round in <= 2 s
on one etcd member and <= 4 s on three; writes <= 3N + 10 per round (the constant covers the
round's own start/freeze/run lease, not anything per node).
"""

from __future__ import annotations

from bench.scale_keepalive import GAP_INTERVALS, kept_up_text
from bench.scale_metrics import QUIET_BUSY

# (N, etcd members) -> (seconds, the rounds it applies to)
TIME_TARGETS = {
    (1000, 1): (3.0, ("round1", "round2")),
    (4096, 1): (2.0, ("round1",)),
    (4096, 3): (4.0, ("round1",)),
}
WRITES_PER_N, WRITES_CONST = 3, 10

HEADER = (
    "N",
    "etcd",
    "procs",
    "round",
    "time s",
    "writes/N",
    "ev/N",
    "MB sent",
    "etcd CPU s",
    "leader CPU s",
    "time",
    f"writes<={WRITES_PER_N}N+{WRITES_CONST}",
    "kept up",
)


def time_target(n: int, members: int, name: str) -> float | None:
    got = TIME_TARGETS.get((n, members))
    return got[0] if got and name in got[1] else None


def verdicts(r: dict, n: int, members: int = 1, name: str = "round1") -> tuple[str, str]:
    """(time verdict, writes verdict) of one round; "-" where no time target applies."""
    t, w = r.get("time"), r.get("writes")
    target = time_target(n, members, name)
    if t is None:
        tv = "MISS (no time)"
    elif target is not None:
        tv = f"PASS (<={target:g})" if t <= target else f"MISS (>{target:g})"
    else:
        tv = "-"
    wv = "PASS" if w is not None and w <= WRITES_PER_N * n + WRITES_CONST else "MISS"
    return tv, wv


def leader_cpu_text(r: dict) -> str:
    """ "thread / process": the leader's driver thread, and its whole process (which hosts
    other handlers and the shared watch thread too).
    """
    ld = r.get("leader") or {}
    th, pr = ld.get("thread_cpu"), ld.get("process_cpu")
    if th is None and pr is None:
        return "-"
    return f"{_f(th, 2)} / {_f(pr, 2)}"


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table_row(res: dict, name: str) -> tuple[tuple[str, ...], bool] | None:
    """One round's row and whether it passed; None for a round that cannot exist."""
    n, r, m = res["n"], res.get(name), res.get("members", 1)
    if r is None and n == 1 and name == "round2":
        return None  # nobody can leave a round of one
    head = (str(n), str(m), str(res["procs"]))
    if r is None:
        return (*head, name, *["-"] * 6, "MISS (not run)", "MISS", "-"), False
    w = res.get("arrive_over") or 0
    join = f"1: join over {w:g}s" if w else "1: all join"
    label = join if name == "round1" else f"2: {r['left']} left"
    tv, wv = verdicts(r, n, m, name)
    row = (
        *head,
        label,
        _f(r.get("time")),
        f"{r['writes'] / n:.3f}",
        f"{r['watch_events'] / n:.2f}",
        _mb(r.get("sent_bytes")),
        _f(r.get("etcd_cpu"), 2),
        leader_cpu_text(r),
        tv,
        wv,
        kept_up_text(r.get("keepalive")),
    )
    valid = r.get("keepalive", {}).get("kept_up", True)  # older results have no figures
    return row, "MISS" not in tv and wv == "PASS" and valid


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def table(results: list[dict]) -> tuple[str, bool]:
    rows = [HEADER]
    ok = True
    for res in results:
        for name in ("round1", "round2"):
            got = table_row(res, name)
            if got is not None:
                rows.append(got[0])
                ok &= got[1]
        ok &= not res["problems"] and not res.get("round2", {}).get("problems")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines), ok


OPS = (
    "writes {writes}, revisions {revisions}, puts {puts}, deletes {deletes}, ranges {ranges}, "
    "watch events {watch_events} (by member {watch_events_by_member}), watch msgs {watch_msgs}, "
    "etcd sent {sent_bytes} B, slow applies {slow_applies}, leases expired {leases_expired}"
    "\n    CPU s: etcd {etcd_cpu} (by member {etcd_cpu_by_member}), workers {workers_cpu}, "
    "keep-alive relays {relay_cpu}, grpc-proxy {proxy_cpu} (events coalesced {proxy_coalesced}), "
    "other programs {other_cpu} in {t} s wall; GC pauses {gc_s} s ({gc2} "
    "gen-2); sessions opened {opened}, lost {lost} {lost_why}"
)


def _ops(r: dict) -> str:
    # results from before lost_why (or the slow applies) have none
    older = {"lost_why": "", "slow_applies": "?", "leases_expired": "?", "relay_cpu": "?"}
    older |= {"proxy_cpu": "?", "proxy_coalesced": "?"}
    return OPS.format(**{**older, **r})


def _keepalive_line(r: dict) -> str:
    ka = r.get("keepalive")
    if not ka:
        return "    keep-alives: no figures"
    return (
        f"    keep-alives over {ka['window_s']} s: due {ka['due']} ({ka['due_per_s']}/s), sent "
        f"{ka['sent']} ({ka['sent_per_s']}/s) in {ka['ticks']} ticks, answered {ka['acked']} "
        f"({ka['acked_per_s']}/s), etcd renewed {r.get('renewals', '?')} in the round; latest "
        f"tick {ka['late_max']} s late, longest gap {ka['gap_max']} intervals, "
        f"{ka.get('lapsed', 0)} lapsed: kept up "
        f"{kept_up_text(ka)}"
    )


def _leader_line(r: dict) -> str:
    ld = r.get("leader") or {}
    if not ld:
        return "    leader: unknown"
    return (
        f"    leader {ld.get('node')} in worker {ld.get('worker')} ({ld.get('handlers')} "
        f"handlers): driver thread {_f(ld.get('thread_cpu'), 2)} s, that process's watch "
        f"thread {_f(ld.get('watch_thread_cpu'), 2)} s, process {_f(ld.get('process_cpu'), 2)} s"
        f" CPU; other workers' mean {_f(ld.get('others_mean_cpu'), 2)} s"
    )


def details(res: dict) -> str:
    r1, r2 = res.get("round1", {}), res.get("round2", {})
    out = [f"N={res['n']} on {res.get('members', 1)} etcd member(s), {res['procs']} processes"]
    out[0] += f", keep-alives {res.get('keepalive', 'in-process')}"
    out[0] += ", through an etcd grpc-proxy" if res.get("grpc_proxy") else ""
    if res.get("shard_at") is not None:
        out[0] += f", shard_at {res['shard_at']}"
    if res.get("arrive_over"):
        out[0] += f", arrivals spread over {res['arrive_over']:g} s"
    if "busy_before" in res:
        out[0] += f"; machine {res['busy_before']:g} CPUs busy after {res['quiet_wait_s']:g} s"
    if res.get("etcd_leader") is not None:
        out.append(
            f"  clients prefer member {res.get('preferred', 0)}; raft leader member "
            f"{res['etcd_leader']}"
        )
    if r1:
        out += [
            f"  round 1: go->all registered {_f(r1['go_to_registered'])}s, go->last join "
            f"{_f(r1['go_to_last_join'])}s, last join->frozen {_f(r1['join_to_frozen'])}s, "
            f"go->all accepted {_f(r1['go_to_all'])}s",
            f"    frozen->last accepted, per process: {r1['fanout']} s; " + _ops(r1),
            _keepalive_line(r1),
            _leader_line(r1),
        ]
    if r2:
        out += [
            f"  round 2 ({r2['left']} left): shutdown() {_f(r2['shutdown_s'])}s, "
            f"leave->round started {_f(r2['leave_to_started'])}s, ->last join "
            f"{_f(r2['leave_to_last_join'])}s, ->frozen {_f(r2['leave_to_frozen'])}s",
            f"    frozen->last accepted, per process: {r2['fanout']} s; " + _ops(r2),
            _keepalive_line(r2),
            _leader_line(r2),
        ]
    if res.get("round_bytes") and r1.get("sent_bytes") is not None:
        n, v = res["n"], res["round_bytes"]
        out.append(
            f"  round key value {v} B (the last frozen round); etcd sent per participant: "
            f"round 1 {r1['sent_bytes'] / n:.0f} B, round 2 {r2.get('sent_bytes', 0) / n:.0f} B; "
            f"N x value {n * v / 1e6:.1f} MB"
        )
        if res.get("shards"):
            b = res["shard_bytes"]
            out.append(
                f"  sharded into {res['shards']} keys of {b:.0f} B on average, each watched by "
                f"the nodes hashing to it: about N x (value + shard) {n * (v + b) / 1e6:.1f} MB"
            )
    for p in res["problems"] + r2.get("problems", []):
        out.append(f"  PROBLEM: {p}")
    for w, info in res.get("warnings", {}).items():
        out.append(f"  {w}: {info['count']} warning(s), first: {info['first'][0]}")
    if res.get("leftover_threads"):
        out.append(f"  leftover: {res['leftover_threads'][:5]}")
    return "\n".join(out)


def busy_notes(results: list[dict]) -> list[str]:
    """Rounds during which other programs took more than a tenth of the 2-core budget."""
    notes = []
    for r in results:
        if r.get("busy_before", 0.0) >= QUIET_BUSY:
            notes.append(
                f"note: N={r['n']} on {r.get('members', 1)} member(s) started on a busy machine "
                f"({r['busy_before']:g} CPUs busy after waiting {r['quiet_wait_s']:g} s)"
            )
        for name in ("round1", "round2"):
            other, wall = (r[name]["other_cpu"], r[name]["t"]) if name in r else (0.0, 0.0)
            if wall > 0 and other >= 0.2 and other / (2 * wall) > 0.1:
                notes.append(
                    f"note: N={r['n']} on {r.get('members', 1)} member(s) {name}: other "
                    f"programs used {other:.2f} CPU-s in {wall:.2f} s of the 2-core budget; "
                    f"its time is pessimistic"
                )
    return notes


def target_lines() -> list[str]:
    out = []
    for (n, m), (s, rounds) in TIME_TARGETS.items():
        which = "both rounds" if len(rounds) == 2 else "join round"
        out.append(f"N={n} on {m} member(s): {which} <= {s:g} s")
    return [
        "time targets: " + "; ".join(out) + " (round 1: last join -> all accepted; round 2: "
        "leave -> all survivors accepted). writes: raft proposals. leader CPU: its driver "
        "thread / its whole process.",
        "kept up (a row counts only then; shown: keep-alives answered/due, the longest gap in "
        f"intervals): over the round and at least two keep-alive intervals, no lease over "
        f"{GAP_INTERVALS:g} intervals without an answer, none given up.",
    ]
