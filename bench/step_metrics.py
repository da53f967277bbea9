"""Pause, work lost and recovery from the toy job's step log (bench/toy_job.py): pure functions,
so tests/project/test_bench.py checks them on made-up logs.

The definitions (issue 29), over the surviving nodes (a node is an agent, or a torchft replica
group; its worker may be a new process after a restart):

- **recovery**: the event (kill, SIGSTOP, the newcomer's start) to the first step completed in
  the new world, on the slowest survivor (every survivor trains again);
- **pause**: the last step completed in the old world to that same first new-world step, both
  on the slowest survivor. After a kill it starts before the event; in a scale-up the
  survivors train on while the newcomer starts, and the pause is only the stall at the join;
- **work lost**: steps completed in the old world and completed again in the new one (a restart
  goes back to its checkpoint, and a scale-up's survivors' steps while the newcomer starts are
  lost with it). The step in flight at the change never completed: it is in no column's count.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Recovery:
    recovery_s: float
    pause_s: float
    work_lost: int
    loaded_checkpoint: bool  # a survivor's new process read ckpt.pt
    sync_bytes: int = 0  # state received in place after the event (largest transfer)
    sync_s: float = 0.0

    @property
    def sync_mb_s(self) -> float | None:
        return self.sync_bytes / self.sync_s / 1e6 if self.sync_bytes and self.sync_s else None

    def to_json(self) -> dict:
        return {
            "recovery_s": round(self.recovery_s, 3),
            "pause_s": round(self.pause_s, 3),
            "work_lost": self.work_lost,
            "loaded_checkpoint": self.loaded_checkpoint,
            "sync_bytes": self.sync_bytes,
            "sync_s": round(self.sync_s, 4),
        }


def read_log(out: Path) -> list[dict]:
    """Every record of every ``steps_<pid>.jsonl`` under ``out``, in time order (a line cut
    short by a kill is skipped).
    """
    recs = []
    for path in sorted(out.glob("steps_*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return sorted(recs, key=lambda r: r["t"])


def steps(recs: Iterable[dict], node: str) -> list[dict]:
    return [r for r in recs if r["k"] == "step" and r["node"] == node]


def first_new(recs: list[dict], node: str, t_event: float, world: int) -> dict | None:
    """``node``'s first step completed after ``t_event`` in a world of ``world``."""
    return next((r for r in steps(recs, node) if r["t"] > t_event and r["w"] == world), None)


def resumed(recs: list[dict], nodes: Iterable[str], t_event: float, world: int) -> bool:
    """Every one of ``nodes`` has completed a step in the new world."""
    return all(first_new(recs, n, t_event, world) is not None for n in nodes)


def measure(recs: list[dict], survivors: list[str], t_event: float, world: int) -> Recovery:
    """The figures of one event; raises ValueError if a survivor never resumed or never
    completed a step before it.
    """
    new, old = {}, {}
    for node in survivors:
        first = first_new(recs, node, t_event, world)
        if first is None:
            raise ValueError(f"{node} completed no step with world {world} after the event")
        before = [r for r in steps(recs, node) if r["t"] < first["t"] and r["w"] != world]
        if not before:
            raise ValueError(f"{node} completed no step before the event")
        new[node], old[node] = first, before[-1]
    t_new = max(r["t"] for r in new.values())
    t_old = max(r["t"] for r in old.values())
    lost = max(max(0, old[n]["s"] - (new[n]["s"] - 1)) for n in survivors)
    loaded = any(
        r["k"] == "load" and r["node"] in survivors and r["t"] > t_event and r["s"] > 0
        for r in recs
    )
    syncs = [r for r in recs if r["k"] == "sync" and r["t"] > t_event and r["bytes"] > 0]
    big = max(syncs, key=lambda r: r["bytes"], default=None)
    return Recovery(
        recovery_s=t_new - t_event,
        pause_s=t_new - t_old,
        work_lost=lost,
        loaded_checkpoint=loaded,
        sync_bytes=0 if big is None else int(big["bytes"]),
        sync_s=0.0 if big is None else float(big["secs"]),
    )


def newcomer_start(recs: list[dict], node: str, t_event: float, t_stall: float) -> dict:
    """Where a scale-up's stall goes: the newcomer's script started (``start``: its standby was
    handed the round, or its cold start) ``newcomer_start_s`` after the survivors' last
    old-world step; then, from that start, its process group was up (``group``), its DDP
    wrapper built (``wrapped``) and the state received (``sync``).
    """

    def first(kind: str) -> dict | None:
        return next(
            (r for r in recs if r["k"] == kind and r["node"] == node and r["t"] > t_event), None
        )

    start = first("start")
    out = {"newcomer_start_s": None if start is None else round(start["t"] - t_stall, 3)}
    for kind in ("group", "wrapped", "sync"):
        rec = first(kind)
        ok = start is not None and rec is not None
        out[f"newcomer_to_{kind}_s"] = round(rec["t"] - start["t"], 3) if ok else None
    return out


def agent_figures(events: list[dict], t_event: float) -> dict:
    """From etcdrun's events.jsonl (the survivors' agents): when the first agent learned of the
    change (``round_superseded``) after the event, and the longest re-form a kept worker
    reported (``worker_resumed``'s ``form_s``: new group, DDP re-wrap, state transfer).
    """
    seen = [e["time"] for e in events if e["event"] == "round_superseded" and e["time"] > t_event]
    forms = [e["form_s"] for e in events if e["event"] == "worker_resumed" and e.get("form_s")]
    return {
        "notice_s": round(min(seen) - t_event, 3) if seen else None,
        "form_s": max(forms) if forms else None,
    }


def last_ranks(recs: list[dict]) -> dict[str, int]:
    """Each node's rank in its newest step (who is rank 0 now)."""
    out = {}
    for r in recs:
        if r["k"] == "step" and r.get("r") is not None:
            out[r["node"]] = r["r"]
    return out


def newest_step(recs: list[dict]) -> int:
    return max((r["s"] for r in recs if r["k"] == "step"), default=0)
