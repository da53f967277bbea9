"""The job of bench/in_place_nccl.py: its worker (argv: OUT_DIR DEVICE BACKEND STEP_S [STEPS])
and how its step log is read.

Why a worker of its own and not bench/in_place_worker.py: this one must put its model on the
GPU its agent gives it (``LOCAL_RANK`` inside the agent's ``CUDA_VISIBLE_DEVICES``), form its
group with ``elastic.init_process_group(BACKEND)`` ("nccl" on a GPU machine, "gloo" here), and
log each step's loss. Every rank trains on the same batch (as tests/agent_scripts/
elastic_train.py does), so DDP's averaged gradient is one process's and the loss at every step
must equal ``reference()``'s, computed by the harness in one process without a group.

Each completed step appends a ``step`` record to OUT_DIR/steps_<pid>.jsonl (bench/toy_job.py's
``StepLog``: node, pid, time): ``s`` the steps completed, ``w``/``r`` world size and rank,
``loss`` the loss of step ``s - 1``. ``sync`` and ``rewrap`` records say what a re-form cost.
With STEPS > 0 the training ends after that many steps; else it runs until the harness ends it.

The job's other half lives here too, so that what a step logs and how it is judged stay in one
place: ``reference()``, and the pure functions that turn the records (and the agents'
events.jsonl) into a scenario's figures, its verdict and the run's table (``figures``,
``loss_check``, ``verdict``, ``markdown``).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

IN, HIDDEN, BATCH = 64, 256, 32
LR, MOMENTUM = 0.01, 0.9
TOL = 1e-4  # a step's loss against one process's


def build(device):
    """The model and optimizer, the same initial weights in every process."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    ).to(device)
    return net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


def batch(step: int, device):
    """Step ``step``'s batch: the same on every rank, whatever the world size."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
    return x.to(device), y.to(device)


def train_step(model, opt, step: int, device) -> float:
    x, y = batch(step, device)
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def reference(steps: int, device: str = "cpu") -> list[float]:
    """One process, no group: the loss of each of the first ``steps`` steps."""
    net, opt = build(device)
    return [train_step(net, opt, s, device) for s in range(steps)]


# ---- what the step log says (the harness's side: pure functions of the records) -------------


def figures(
    recs: list[dict], events: list[dict], nodes: list[str], t: float, world: int, new: str | None
) -> dict:
    """One membership change's figures: bench/step_metrics.py's recovery, pause and steps lost
    over the survivors ``nodes``, whether they kept their processes, their step time before the
    event, each kept worker's ``worker_resumed`` event, each state transfer, and, with a
    newcomer ``new``, its first step against the survivors' first step in the new world.
    """
    from bench.step_metrics import measure, newcomer_start

    m = measure(recs, nodes, t, world)
    out = {"t_event": t, "world_after": world, **m.to_json()}
    out["kept"] = kept_pids(recs, nodes, t)
    out["step_s"] = step_interval(recs, nodes, t)
    out["resumed_events"] = resumed_events(events, t)
    syncs = [r for r in recs if r["k"] == "sync" and r["t"] > t]
    out["syncs"] = [{"node": r["node"], "bytes": r["bytes"], "secs": r["secs"]} for r in syncs]
    if new is not None:
        mine = [r for r in recs if r["k"] == "step" and r["node"] == new]
        theirs = [r for r in recs if r["k"] == "step" and r["t"] > t and r["w"] == world]
        firsts = {r["node"]: r["s"] for r in reversed(theirs) if r["node"] in nodes}
        out["newcomer"] = {
            "first_step": mine[0]["s"] if mine else None,
            "first_step_after_s": round(mine[0]["t"] - t, 3) if mine else None,
            "survivors_first_step": sorted(set(firsts.values())),
            **newcomer_start(recs, new, t, t + m.recovery_s - m.pause_s),
        }
    return out


def kept_pids(recs: list[dict], nodes: list[str], t_event: float) -> dict[str, bool]:
    """Each survivor's steps after the event came from the process that stepped before it."""
    out = {}
    for n in nodes:
        before = {
            r["pid"] for r in recs if r["k"] == "step" and r["node"] == n and r["t"] < t_event
        }
        after = {r["pid"] for r in recs if r["k"] == "step" and r["node"] == n and r["t"] > t_event}
        out[n] = len(before) == 1 and after == before
    return out


def step_interval(recs: list[dict], nodes: list[str], t_event: float) -> float | None:
    """The median time between two steps of a survivor before the event (for scale)."""
    gaps = []
    for n in nodes:
        ts = [r["t"] for r in recs if r["k"] == "step" and r["node"] == n and r["t"] < t_event]
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return round(statistics.median(gaps), 4) if gaps else None


def resumed_events(events: list[dict], t_event: float) -> list[dict]:
    keep = ("local_rank", "pause_s", "form_s", "sync_bytes")
    return [
        {"node": e["_node"], **{k: e.get(k) for k in keep}}
        for e in events
        if e.get("event") == "worker_resumed" and e.get("time", 0) > t_event
    ]


def loss_check(recs: list[dict], ref: list[float]) -> dict:
    """Every logged step's loss against one process's (``ref[s - 1]``)."""
    worst, bad, n = 0.0, None, 0
    for r in recs:
        if r["k"] != "step" or "loss" not in r:
            continue
        err = abs(r["loss"] - ref[r["s"] - 1])
        n += 1
        if err > worst:
            worst = err
        if err > TOL and bad is None:
            bad = {"node": r["node"], "step": r["s"], "loss": r["loss"], "ref": ref[r["s"] - 1]}
    return {"loss_steps_checked": n, "loss_max_err": worst, "loss_first_bad": bad}


def verdict(scenario: str, res: dict) -> tuple[bool, str]:
    """PASS or FAIL (processes kept, at most one step lost, every loss one process's, the
    newcomer in step with the others), with the reasons.
    """
    if res.get("outcome") != "ok":
        return False, res.get("note", "")
    why = []
    if res["loss_max_err"] > TOL:
        why.append(f"loss off by {res['loss_max_err']:.3g} at {res['loss_first_bad']}")
    if scenario == "solo":
        return not why, "; ".join(why)
    if not all(res["kept"].values()):
        why.append(f"survivors' processes not kept: {res['kept']}")
    if res["work_lost"] > 1:
        why.append(f"{res['work_lost']} steps lost")
    nc = res.get("newcomer")
    if nc and nc["survivors_first_step"] != [nc["first_step"]]:
        why.append(
            f"newcomer's first step {nc['first_step']}, the others' {nc['survivors_first_step']}"
        )
    return not why, "; ".join(why)


def markdown(res: dict) -> str:
    """The run's table: one row a scenario (summary.md)."""
    meta = res["meta"]
    lines = [
        f"# In place: kill -9 and newcomer (`bench/in_place_nccl.py`, --backend {meta['backend']})",
        "",
        f"{meta['machine']}; torch {meta['torch']}; {meta['duration_s']} s in all.",
        "",
        "| scenario | result | kept PIDs | steps lost | pause s | recovery s | step s "
        "| loss max err (steps) | newcomer first step | resumed: pause / form s, bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["scenarios"]:
        if s["outcome"] != "ok":
            verdict_ = {"miss": "MISS", "skipped": "SKIPPED"}.get(s["outcome"], "FAIL")
            note = s["note"].replace("|", "\\|")
            lines.append(f"| {s['label']} | {verdict_}: {note} |" + " |" * 8)
            continue
        ev = "; ".join(
            f"{e['node']} {e['pause_s']} / {e['form_s']}, {e['sync_bytes']}"
            for e in s.get("resumed_events", [])
        )
        nc = s.get("newcomer")
        first = f"{nc['first_step']} (others {nc['survivors_first_step']})" if nc else "-"
        kept = "yes" if all(s.get("kept", {}).values()) else f"no {s.get('kept')}"
        if s["scenario"] == "solo":
            kept, ev = "-", f"{s['steps']} steps, exit {s['exit']}"
        result = "PASS" if s["pass"] else "FAIL: " + s["why"].replace("|", "\\|")
        lines.append(
            f"| {s['label']} | {result} | {kept} "
            f"| {s.get('work_lost', '-')} | {s.get('pause_s', '-')} | {s.get('recovery_s', '-')} "
            f"| {s.get('step_s', '-')} | {s['loss_max_err']:.2g} ({s['loss_steps_checked']}) "
            f"| {first} | {ev or '-'} |"
        )
    return "\n".join(lines) + "\n"


# ---- the worker ------------------------------------------------------------------------------


def main() -> None:
    t0 = time.time()
    out, device_kind, backend, step_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    from toy_job import StepLog  # beside this file: the script's folder is on sys.path

    log = StepLog(out)
    log.write("start", t=t0)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from etcdrun import elastic

    if device_kind == "cuda":  # the agent's GPU: LOCAL_RANK within its CUDA_VISIBLE_DEVICES
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, ids = torch.device("cuda", local), [local]
    else:
        device, ids = torch.device("cpu"), None
    elastic.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    log.write("group", gpu=os.environ.get("CUDA_VISIBLE_DEVICES"), backend=dist.get_backend())
    net, opt = build(device)
    ddp = DistributedDataParallel(net, device_ids=ids)
    log.write("wrapped")

    class TimedState(elastic.TorchState):
        """Logs each state transfer and each DDP re-wrap (bytes, seconds)."""

        def rewrap(self) -> None:
            t = time.perf_counter()
            super().rewrap()
            log.write("rewrap", secs=time.perf_counter() - t)

        def sync(self) -> int:
            t = time.perf_counter()
            n = super().sync()
            log.write("sync", bytes=n, secs=time.perf_counter() - t)
            return n

    state = TimedState(model=ddp, optimizer=opt, step=0)
    deadline = time.monotonic() + 600  # never outlive a forgotten harness for long

    @elastic.run
    def train(state) -> None:
        while time.monotonic() < deadline and (steps <= 0 or state.step < steps):
            loss = train_step(ddp, opt, state.step, device)
            state.step += 1
            log.write("step", s=state.step, w=dist.get_world_size(), r=dist.get_rank(), loss=loss)
            state.commit()
            time.sleep(step_s)

    train(state)
    log.write("done", s=state.step)


if __name__ == "__main__":
    main()
