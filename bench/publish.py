"""The documents bench/compare.py writes from a run: bench/results.md and the plot.

Why apart from report.py: report.py decides (tables, verdicts); this module only lays those
tables out with the run's metadata and the definitions a reader needs, and writes the files.

results.md holds this run and nothing else, rewritten whole by each published run. Every other
benchmark's figures are on that benchmark's own page, bench/results/<bench>.md, which compare.py
never touches: a page keeps its benchmark's latest run under stable headings, and the history of
every page lives in git.
"""

from __future__ import annotations

from pathlib import Path

from bench.report import (
    COLS,
    RATIO,
    READY,
    RUNNING,
    TARGET,
    VERDICT,
    WHY,
    fmt_num,
    markdown_table,
    rows,
)


def _idle_detail(res: dict) -> list[str]:
    out = []
    for r in res["runs"]:
        if r["scenario"] != "8":
            continue
        for i, t in enumerate(r["trials"], 1):
            ex = t.get("extra") or {}
            if "by_method" in ex:
                out.append(
                    f"- {r['label']} trial {i}: {t['value']:.2f} req/s per agent over "
                    f"{ex['window_s']:.1f} s; by method (whole job): "
                    + ", ".join(f"{k} {v}" for k, v in ex["by_method"].items())
                )
            else:
                out.append(f"- {r['label']} trial {i}: {t['outcome']}: {t['note']}")
    return out


def _trials_detail(res: dict) -> list[str]:
    out = []
    for r in res["runs"]:
        items = []
        for t in r["trials"]:
            if t["value"] is None:
                items.append(f"{t['outcome']} ({t['note']})")
            elif t.get("spawn") is not None:
                items.append(f"running {t['spawn']:.2f} s, ready {t['value']:.2f} s")
            else:
                items.append(fmt_num(t["value"], r["unit"]))
            cpu = (t.get("extra") or {}).get("agent_cpu_s")
            if cpu is not None:
                items[-1] += f", agent CPU {cpu:.2f} s"
            if "load1" in t:
                items[-1] += f" (load {t['load1']})"
        out.append(f"- {r['scenario']} {r['setting']}, {r['label']}: " + "; ".join(items))
    return out


def _run_line(m: dict) -> str:
    return (
        f"Run {m['date']}, {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']} (CPU), "
        f"etcdrun {m['etcdrun']}; N = {m['n']} local agents (scenario 1: {m['n_first']}), one "
        f"worker each; {m['trials']} trials per launcher ({m['slow_trials']} for torchrun "
        f"with default settings, 1 where torchrun is expected never to recover); "
        f"1-min load {m['load_before']} before, {m.get('load_after')} after; "
        f"{m.get('duration_s')} s in all."
    )


def _load_note(m: dict) -> str:
    if m.get("load_waited_ok", True):
        return ""
    return (
        f"\n**The machine was busy:** the 1-minute load average was "
        f"{m['load_before']} (>= {m['load_limit']}) when the run started, after "
        f"waiting for it to drop; the figures are slower than on an idle machine, "
        f"for both launchers alike.\n"
    )


def _how_measured(m: dict) -> list[str]:
    return [
        "- Same worker script for both launchers (`bench/compare_worker.py`), same interpreter "
        "and torch (the bench venv, where this checkout is installed as a user would install "
        "it: a regular, byte-compiled install), `--nproc-per-node 1 --max-restarts 10 "
        "--monitor-interval 0.1`, each agent a separate process group on 127.0.0.1.",
        '- "Running": the launcher has started every worker with the new world\'s '
        "environment (torchrun's `WorkerState.RUNNING`), timed by the worker's first line "
        "(`BENCH_START`, before `import torch`) of the worker that went on to print "
        "`BENCH_READY` with the expected WORLD_SIZE (a worker that started and failed does not "
        'count). "Ready": that `BENCH_READY`, printed once `init_process_group("gloo")` '
        "returned. Times are the workers' own `time.time()` minus the harness's action (last "
        "agent start, kill, newcomer start); the newest node counts.",
        "- Scenario 1 starts all agents at once: on this machine that is N Python agents "
        "starting on its CPUs together, which a cluster (one agent per node) never sees. 1s "
        "starts N-1 agents, waits until they sit idle in the rendezvous (their CPU use, not "
        "their logs, for both launchers alike), then starts the last one.",
        "- A node dies as a machine would: its agent and every process below it get SIGKILL at "
        "once. all_reduce workers call a one-element gloo all_reduce every 0.2 s. A kill or a "
        "newcomer comes once the job is in its steady state: 1 s of collectives, then the "
        "whole group CPU-quiet (for every launcher alike), as a node fails or arrives while "
        "a job trains.",
        "- etcd: a fresh single member per trial (fast raft timings, `--enable-v2` for "
        "torchrun's etcd-v2); c10d needs none. Scenario 8 reads etcd's `/metrics` "
        "(`grpc_server_msg_received_total` per method; `etcd_http_received_total` for v2) "
        "before and after an idle window.",
        "- After every trial every process carrying the run's environment tag is killed "
        f"(SIGKILL) and checked gone; leftovers swept at the end: "
        f"{m.get('leftover_processes')}.",
        '- "load" in the trial list: the 1-minute load average right after the trial '
        "(it includes the trial's own processes).",
    ]


NOTES = [
    "- Tuned torchrun runs set `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. With the default "
    "(the workers use the agents' rendezvous store, which outlives a restart), the "
    'restarted workers\' gloo init failed within ~2 s with "Connection refused", restart '
    "after restart (agent logs under `bench/out/`); our reading: they found the previous "
    "attempt's addresses in that store. With the sharing off, torchrun recovers (the tuned "
    "rows). The issue asks for it where the default deadlocks; we use it in every tuned "
    'run so that "tuned" is torchrun\'s best here.',
    '- torchrun\'s `TORCHELASTIC_RESTART_COUNT` is per node: a "never" note lists each '
    "survivor's newest worker (WORLD_SIZE, restart count); differing counts mean the nodes "
    "restarted a different number of times.",
    "- etcdrun learns of a kill -9 only when the dead agent's lease expires: between 2/3 "
    "of `lease_ttl` and `lease_ttl` after the kill (keep-alives every TTL/3), plus up to "
    '0.5 s for etcd\'s expiry sweep. The rest of the "running" figure is the new '
    "round and the workers' spawn; `lease_ttl` is the knob (default 5 s; the tuned rows "
    "use 2 s).",
]


def results_md(res: dict) -> str:
    m = res["meta"]
    return "\n".join(
        [
            "# etcdrun vs torchrun (`python -m bench.compare` writes this page)",
            "",
            _run_line(m),
            _load_note(m),
            CELLS_NOTE,
            "",
            "## To workers ready (what users wait for: every worker past `init_process_group`)",
            "",
            ready_note(res),
            "",
            markdown_table(res, READY),
            "",
            "## To workers running (the same trials, to every worker started: the launcher's part)",
            "",
            markdown_table(res, RUNNING),
            "",
            "![recovery and scale-up times](recovery.png)",
            "",
            "## How it is measured",
            "",
            *_how_measured(m),
            "",
            "## Notes",
            "",
            *NOTES,
            "",
            "## Scenario 8 detail",
            "",
            *_idle_detail(res),
            "",
            "## Every trial",
            "",
            *_trials_detail(res),
            "",
        ]
    )


CELLS_NOTE = (
    'Cells: median (min–max) ×trials. "never (timeout X s)": no recovery within the '
    'bound; "job died": every agent exited. Ratio: torchrun\'s best median / '
    "etcdrun's, over torchrun's own backends; \"torchrun + etcd-v3\" is plain torchrun on "
    "etcdrun's rendezvous (its plugin), shown beside them."
)


def ready_note(res: dict) -> str:
    """What lies between "running" and "ready", with its range taken from this run's trials."""
    gaps = [
        t["value"] - t["spawn"]
        for r in res["runs"]
        if r["unit"] == "s"
        for t in r["trials"]
        if t["value"] is not None and t.get("spawn") is not None
    ]
    rng = f" ({min(gaps):.1f}-{max(gaps):.1f} s in this run)" if gaps else ""
    return (
        'The difference from "running" is the workers\' own start-up: Python, '
        f"`import torch` and the gloo init{rng}, longer when several workers start on the "
        "same CPUs. etcdrun's standby workers (`--prewarm`, on by default) do the Python and "
        "`import torch` part ahead of need; torchrun starts every worker cold."
    )


def publish(res: dict, md: Path, png: Path) -> None:
    """Write results.md (the whole file: nothing in it is kept from an earlier run) and the plot.
    README does not repeat the tables: a figure lives once, and the docs link to results.md.
    """
    md.write_text(results_md(res))
    from bench import plot

    plot.recovery_plot(res, png)


def console(res: dict) -> str:
    out = []
    for which in (READY, RUNNING):
        out.append(f"== to workers {which} ==")
        for r in rows(res, which):
            out.append(f"{r[0]}  [{r[1]}]")
            for (_, name), c in zip(COLS, r[2:RATIO], strict=True):
                out.append(f"    {name:<18} {c}")
            out.append(
                f"    torchrun/etcdrun {r[RATIO]}"
                + (
                    f"; target {r[TARGET]}: {r[VERDICT]}" + (f" — {r[WHY]}" if r[WHY] else "")
                    if r[TARGET] != "—"
                    else ""
                )
            )
    m = res["meta"]
    out.append(
        f"load average (1 min): {m['load_before']} before, {m.get('load_after')} after; "
        f"{m.get('duration_s')} s; leftover processes swept at the end: "
        f"{m.get('leftover_processes')}"
    )
    return "\n".join(out)
