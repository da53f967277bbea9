"""bench/in_place_compare.py's report: per scenario a table of the four columns (medians and
ranges over the trials), then the issue's targets, PASS or MISS with the measured figures.

Pure functions over the run's JSON, so ``--report run.json`` rebuilds it and
tests/project/test_bench.py checks the verdicts.
"""

from __future__ import annotations

import statistics

SCENARIOS = {
    "kill": "kill -9 of a node (not rank 0), 4 -> 3",
    "sigstop": "SIGSTOP of a node past the TTL, 4 -> 3",
    "scale": "scale-up 3 -> 4 (a newcomer starts)",
    "rank0": "kill -9 of the rank-0 node, 4 -> 3",
}
SETTINGS = {
    "default": "defaults",
    "tuned": "tuned",
    "tuned-hb": "tuned, torchft's join timeout at its default",
}
TARGET_RECOVERY_S = 2.3  # in place, kill -9 at lease_ttl 2: the lease's expiry + 0.3 s
TARGET_WORK_LOST = 1
TARGET_SCALE_PAUSE_S = 0.3  # plus the state transfer


def ok_trials(series: dict) -> list[dict]:
    return [t for t in series["trials"] if t["outcome"] == "ok"]


def median(series: dict, key: str) -> float | None:
    vals = [t[key] for t in ok_trials(series) if t.get(key) is not None]
    return statistics.median(vals) if vals else None


def cell(series: dict, key: str, fmt: str = "{:.2f}") -> str:
    vals = [t[key] for t in ok_trials(series) if t.get(key) is not None]
    if not vals:
        return "—"
    mid = fmt.format(statistics.median(vals))
    return mid if len(vals) == 1 else f"{mid} ({fmt.format(min(vals))}–{fmt.format(max(vals))})"


def failures(series: dict) -> str:
    bad = [t for t in series["trials"] if t["outcome"] != "ok"]
    return "; ".join(f"{t['outcome']}: {t['note']}" for t in bad)


def find(res: dict, scenario: str, setting: str, column: str) -> dict | None:
    return next(
        (
            s
            for s in res["series"]
            if (s["scenario"], s["setting"], s["column"]) == (scenario, setting, column)
        ),
        None,
    )


def table(res: dict, scenario: str, setting: str) -> list[str]:
    rows = [s for s in res["series"] if (s["scenario"], s["setting"]) == (scenario, setting)]
    if not rows:
        return []
    out = [
        f"#### {SCENARIOS[scenario]}, {SETTINGS[setting]}",
        "",
        "| column | recovery (s) | pause (s) | work lost (steps) | checkpoint read | ok | "
        "other trials |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        ok = ok_trials(s)
        read = sum(1 for t in ok if t.get("loaded_checkpoint"))
        out.append(
            f"| {s['label']} | {cell(s, 'recovery_s')} | {cell(s, 'pause_s')} | "
            f"{cell(s, 'work_lost', '{:.0f}')} | {read}/{len(ok)} | {len(ok)}/{len(s['trials'])} "
            f"| {failures(s) or '—'} |"
        )
    return [*out, ""]


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("PASS" if ok else "MISS")


def targets(res: dict) -> list[tuple[str, str, str]]:
    """(target, verdict, measured) for each of the issue's targets."""
    rows = []
    s = find(res, "kill", "tuned", "etcdrun-inplace")
    if s is not None:
        rec, lost = median(s, "recovery_s"), median(s, "work_lost")
        ok = None if rec is None else rec <= TARGET_RECOVERY_S and lost <= TARGET_WORK_LOST
        rows.append(
            (
                f"in place, kill -9 at lease_ttl 2: recovery ≤ {TARGET_RECOVERY_S} s, "
                f"work lost ≤ {TARGET_WORK_LOST}",
                _verdict(ok),
                f"recovery {cell(s, 'recovery_s')} s, work lost {cell(s, 'work_lost', '{:.0f}')}"
                + (
                    f"; of it, the agents learned of the loss (lease expired) after "
                    f"{cell(s, 'notice_s')} s, and the kept workers' re-form (group, DDP, state) "
                    f"took {cell(s, 'form_s')} s"
                    if median(s, "notice_s") is not None
                    else ""
                ),
            )
        )
    s = find(res, "scale", "tuned", "etcdrun-inplace")
    if s is not None:
        rows.append(_scale_target(s))
    for setting, ft_setting in (("default", "default"), ("tuned", "tuned"), ("tuned", "tuned-hb")):
        ours = find(res, "kill", setting, "etcdrun-inplace")
        ft = find(res, "kill", ft_setting, "torchft")
        if ours is None or ft is None:
            continue
        a, b = median(ours, "recovery_s"), median(ft, "recovery_s")
        ok = None if a is None else (b is None or a < b)
        rows.append(
            (
                f"ahead of torchft on recovery, kill -9: etcdrun {SETTINGS[setting]}, "
                f"torchft {SETTINGS[ft_setting]}",
                _verdict(ok),
                f"in place {cell(ours, 'recovery_s')} s, torchft {cell(ft, 'recovery_s')} s"
                + (f" ({failures(ft)})" if b is None else ""),
            )
        )
    return rows


def _scale_target(s: dict) -> tuple[str, str, str]:
    pause = median(s, "pause_s")
    sync_s = median(s, "sync_s") or 0.0
    mb = [t["sync_bytes"] / t["sync_s"] / 1e6 for t in ok_trials(s) if t.get("sync_s")]
    rate = f"{statistics.median(mb):.1f} MB/s" if mb else "no transfer seen"
    size = median(s, "sync_bytes")
    ok = None if pause is None else pause <= TARGET_SCALE_PAUSE_S + sync_s
    why = ""
    if median(s, "newcomer_to_sync_s") is not None:
        steps = [
            f"{what} {cell(s, f'newcomer_to_{key}_s')} s"
            for key, what in (("group", "process group up"), ("wrapped", "DDP built"))
            if median(s, f"newcomer_to_{key}_s") is not None
        ]
        why = (
            f"; in the stall, the newcomer's script started after "
            f"{cell(s, 'newcomer_start_s')} s; from there: "
            + ", ".join([*steps, f"state received {cell(s, 'newcomer_to_sync_s')} s"])
        )
    return (
        f"scale-up pause ≤ {TARGET_SCALE_PAUSE_S} s + the state transfer",
        _verdict(ok),
        f"pause {cell(s, 'pause_s')} s; transfer {sync_s:.3f} s of "
        f"{(size or 0) / 1e6:.2f} MB, {rate}{why}",
    )


def markdown(res: dict) -> str:
    meta = res["meta"]
    out = [
        f"Load average (1 min): {meta['load_before']} before, {meta.get('load_after')} after, "
        f"{meta['cpus']} CPUs; {meta.get('duration_s')} s. Settings: "
        + "; ".join(f"{k}: {v}" for k, v in meta["settings"].items()),
        "",
    ]
    for scenario in SCENARIOS:
        for setting in SETTINGS:
            out += table(res, scenario, setting)
    out += ["#### Targets", "", "| target | verdict | measured |", "|---|---|---|"]
    out += [f"| {t} | {v} | {m} |" for t, v, m in targets(res)]
    return "\n".join(out) + "\n"
