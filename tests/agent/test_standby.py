"""Standby workers (issue 14): a worker started from a standby is the same worker, and no
standby outlives its agent.

Each comparison runs the same real ``etcdrun`` twice, ``--prewarm none`` (a spawn per worker, as
before) and ``--prewarm json`` (a standby per slot that imported json: a module the probe does
not import before it looks, so ``json_at_start`` proves which path ran), and compares what the
script can see: argv, ``__main__``, ``__file__``, sys.path, os.environ, /proc/self/environ, open
fds, the error file and the exit code. Standbys are found from outside by the room their start
environment reserves (``ETCDRUN_STANDBY_ROOM``, gone from /proc once the hand-over rewrote it).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, WORKER, Agent, Job, clean_env, etcdrun_bin, wait_for
from etcd_helpers import pid_alive

from etcdrun.agent.standby.pool import ROOM_VAR

PROBE = str(SCRIPTS / "standby_probe.py")
# ETCDRUN_CONTROL names the agent's control socket after its node tag: one per agent run.
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "ETCDRUN_NODE_TAG", "ETCDRUN_CONTROL")


def standbys_of(agent_pid: int) -> list[int]:
    """Live waiting standbys whose parent is ``agent_pid``."""
    needle = f"{ROOM_VAR}=".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != agent_pid or stat[0] in ("Z", "X"):
                continue
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if any(kv.startswith(needle) for kv in env.split(b"\0")):
            found.append(int(name))
    return found


def alive(pid: int) -> bool:
    return pid_alive(pid)  # an exiting process (PF_EXITING) counts as gone: etcd_helpers


def run_standalone(
    tmp: Path, prewarm: str, entry: tuple[str, ...], mode: str, *flags: str, **env: str
):
    """One ``etcdrun --standalone`` of the probe (the user's PYTHONPATH holds its folder, so
    ``-m standby_probe`` finds it, and the path's hand-over is checked too); (agent, out dir).
    """
    out, logs = tmp / f"out-{prewarm}", tmp / f"logs-{prewarm}"
    out.mkdir()
    argv = [
        etcdrun_bin(),
        "--standalone",
        "--prewarm",
        prewarm,
        "--log-dir",
        str(logs),
        *flags,
        *entry,
        str(out),
        mode,
    ]
    return Agent(argv, tmp, prewarm, clean_env(PYTHONPATH=str(SCRIPTS), **env)), out


def normalised(info: dict, tmp: Path, prewarm: str) -> dict:
    """A probe's dump without what differs between any two runs (ports, ids, the log dir)."""
    text = json.dumps(info).replace(str(tmp / f"logs-{prewarm}"), "LOGS")
    text = text.replace(info["env"]["TORCHELASTIC_RUN_ID"], "RUN")
    text = text.replace(str(tmp / f"out-{prewarm}"), "OUT")
    info = json.loads(text)
    for var in PER_RUN:
        info["env"].pop(var, None)
    info["proc_env"] = [kv for kv in info["proc_env"] if kv.split("=", 1)[0] not in PER_RUN]
    info.pop("pid")
    info.pop("json_at_start")
    info.pop("gc_frozen_at_start")
    info.pop("torch_at_start")
    return info


@pytest.mark.parametrize("entry", [(PROBE,), ("-m", "standby_probe")], ids=["script", "module"])
def test_a_script_sees_the_same_start_from_a_standby(tmp_path, entry):
    dumps = {}
    for prewarm in ("none", "json"):
        agent, out = run_standalone(tmp_path, prewarm, entry, "ok", "--nproc-per-node", "2")
        assert agent.wait(60) == 0, agent.stderr[-2000:]
        dumps[prewarm] = {r: json.loads((out / f"probe_{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        spawned, warm = dumps["none"][rank], dumps["json"][rank]
        assert (spawned["json_at_start"], warm["json_at_start"]) == (False, True), rank
        assert (spawned["gc_frozen_at_start"], warm["gc_frozen_at_start"]) == (False, True)
        assert normalised(spawned, tmp_path, "none") == normalised(warm, tmp_path, "json")
        assert not any(kv.startswith(ROOM_VAR) for kv in warm["proc_env"])
        assert warm["env"]["RANK"] == str(rank) and f"RANK={rank}" in warm["proc_env"]


def test_auto_imports_torch_but_not_dynamo(tmp_path, torch_available):
    """``--prewarm auto`` takes torch only: torch._dynamo imported before DDP is built makes
    gloo DDP scripts hang at exit in torch 2.13 (docs/standby.md).
    """
    agent, out = run_standalone(tmp_path, "auto", (PROBE,), "ok")
    assert agent.wait(90) == 0, agent.stderr[-2000:]
    info = json.loads((out / "probe_0.json").read_text())
    assert info["torch_at_start"] == ["torch"]


def _root_cause(agent: Agent) -> list[str]:
    """The agent's root-cause lines, without what differs between runs (pids, times, paths)."""
    keep = ("exit code", "ValueError", "probe failure", "error_file", "SIGINT")
    lines = [ln for ln in agent.stderr.splitlines() if any(k in ln for k in keep)]
    return [ln.split("]", 1)[-1] for ln in lines if "pid" not in ln and "/" not in ln]


@pytest.mark.parametrize("mode", ["exit3", "raise", "interrupt"])
def test_error_files_exit_codes_and_output_are_the_same(tmp_path, mode):
    seen = {}
    for prewarm in ("none", "json"):
        agent, out = run_standalone(tmp_path, prewarm, (PROBE,), mode, "--nproc-per-node", "1")
        code = agent.wait(60)
        probe = json.loads((out / "probe_0.json").read_text())
        error_files = list((tmp_path / f"logs-{prewarm}").glob("*/attempt_*/0/error.json"))
        error = json.loads(error_files[0].read_text())["message"] if error_files else None
        if error is not None:
            error = {"message": error["message"], "frames": error["extraInfo"]["py_callstack"]}
            error["frames"] = error["frames"].replace(str(os.getpid()), "PID")
        worker_lines = [
            ln
            for ln in agent.stdout.splitlines() + agent.stderr.splitlines()
            if ln.startswith("[0]:")
        ]
        seen[prewarm] = (probe["json_at_start"], code, error, worker_lines, _root_cause(agent))
    assert seen["none"][0] is False and seen["json"][0] is True, "which path ran"
    assert seen["none"][1:] == seen["json"][1:]
    assert seen["none"][1] == 1  # the agent fails for a worker that failed
    if mode == "raise":
        assert "probe failure on rank 0" in seen["json"][2]["message"]
        assert any("standby_probe.py" in ln for ln in seen["json"][3])  # the traceback
        assert not any("_standby_boot" in ln for ln in seen["json"][3])  # without our frames
    elif mode == "exit3":
        assert seen["json"][2] is None  # sys.exit(3): no error file, exit code 3 reported
        assert any("exit code 3" in ln for ln in seen["json"][4])
    else:
        assert any("killed by SIGINT" in ln for ln in seen["json"][4])


def test_standbys_wait_beside_the_workers_and_none_outlives_the_agent(tmp_path):
    """At start, and again right after the hand-over, one standby per slot; none after a
    normal exit.
    """
    agent, out = run_standalone(tmp_path, "json", (PROBE,), "sleep", "--nproc-per-node", "2")
    try:
        wait_for(lambda: len(list(out.glob("probe_*.json"))) == 2, 60, "both workers running")
        workers = {json.loads(p.read_text())["pid"] for p in out.glob("probe_*.json")}
        waiting = wait_for(
            lambda: len(standbys_of(agent.pid)) == 2 and standbys_of(agent.pid),
            30,
            "two new standbys beside the two workers",
        )
        assert not set(waiting) & workers
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 143
        assert not any(alive(p) for p in [*waiting, *workers])
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


def test_kill_9_of_the_agent_leaves_no_standby(tmp_path):
    agent, out = run_standalone(tmp_path, "json", (PROBE,), "sleep", "--nproc-per-node", "2")
    try:
        wait_for(lambda: len(list(out.glob("probe_*.json"))) == 2, 60, "both workers running")
        waiting = wait_for(
            lambda: len(standbys_of(agent.pid)) == 2 and standbys_of(agent.pid), 30, "two standbys"
        )
        workers = [json.loads(p.read_text())["pid"] for p in out.glob("probe_*.json")]
        agent.proc.kill()
        agent.proc.wait()
        wait_for(lambda: not any(alive(p) for p in [*waiting, *workers]), 5, "all of them gone")
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


def test_a_failed_run_leaves_no_standby(etcd, tmp_path):
    """Workers fail with the budget spent: the agent exits 1 and takes its standbys along."""
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1",
        nproc=2,
        conf="lease_ttl=2",
        extra=("--prewarm", "json", "--max-restarts", "1"),
    )
    try:
        agent = job.start(PROBE, str(job.out), "exit3")
        seen: set[int] = set()

        def exited() -> bool:
            seen.update(standbys_of(agent.pid))
            return agent.proc.poll() is not None

        wait_for(exited, 60, "the agent to give up")
        assert agent.proc.returncode == 1
        assert seen, "no standby was ever seen"
        assert not any(alive(p) for p in seen)
    finally:
        job.close()


def test_prewarm_none_spawns_as_before(tmp_path):
    agent, out = run_standalone(tmp_path, "none", (PROBE,), "sleep", "--nproc-per-node", "2")
    try:
        wait_for(lambda: len(list(out.glob("probe_*.json"))) == 2, 60, "both workers running")
        assert standbys_of(agent.pid) == []
        for p in out.glob("probe_*.json"):
            pid = json.loads(p.read_text())["pid"]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3]
            assert cmdline[1:] == [b"-u", PROBE.encode()], cmdline  # exec'd: no standby's -c
    finally:
        agent.proc.send_signal(signal.SIGTERM)
        agent.wait(60)


def test_a_standby_run_worker_is_fenced_by_the_warden(etcd, tmp_path):
    """The agent frozen (SIGSTOP) past its lease: the warden kills the standby-run worker, as
    it kills a spawned one (its pidfd reached the warden at the hand-over).
    """
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1",
        nproc=1,
        conf="lease_ttl=2",
        extra=("--prewarm", "json"),
    )
    agent = job.start(PROBE, str(job.out), "sleep")
    try:
        probe = job.out / "probe_0.json"
        wait_for(probe.exists, 60, "the worker running")
        info = json.loads(probe.read_text())
        assert info["json_at_start"], "the worker did not start from a standby"
        waiting = wait_for(lambda: standbys_of(agent.pid), 30, "the next standby")
        os.kill(agent.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: not alive(info["pid"]), 10, "the warden to kill the worker")
        took = time.monotonic() - t0
        assert took < 2.0, f"the worker outlived the lease's presumed loss by {took:.2f} s"
        # The warden's sweep takes the waiting standby too (tagged); the agent starts another.
        wait_for(lambda: not any(alive(p) for p in waiting), 5, "the swept standby gone")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
        job.close()


def test_a_newcomer_joins_once_its_standbys_are_warm(etcd, tmp_path):
    """Scale-up: the running job keeps its workers while a newcomer's standby imports (here a
    3 s import), and the round that takes the newcomer in starts only after that import. Had
    the newcomer joined at once, the survivors' workers would be stopped at once and the job
    would wait for the import (the fix measured in bench/results/standby_bench.md, 'Recovery and
    scale-up').
    """
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1:2",
        nproc=1,
        conf="last_call_timeout=0",
        extra=("--prewarm", "slow_warm"),
    )
    try:
        job.start()
        first = wait_for(job.starts, 60, "the first round")
        mark = tmp_path / "warm_mark"
        t_new = time.time()
        job.start(env=clean_env(SLOW_WARM_S="3", SLOW_WARM_MARK=str(mark)))

        def later() -> list:
            found = [s for s in job.starts() if s.round > first[0].round]
            return found if len(found) == 2 else []

        second = wait_for(later, 60, "the round of two")
        warm_at = float(mark.read_text())
        assert warm_at - t_new >= 3.0
        assert min(s.t for s in second) > warm_at, (second, warm_at)
        assert first[0].pid not in {s.pid for s in second}
    finally:
        job.close()


def test_a_forming_job_does_not_wait_for_the_standbys(etcd, tmp_path):
    """No round runs yet: the node joins at once (its round would wait for the same import
    after the freeze anyway), so the join comes before the 3 s import ends.
    """
    job = Job(etcd.endpoints, tmp_path, nnodes="1", nproc=1, extra=("--prewarm", "slow_warm"))
    mark, logs = tmp_path / "warm_mark", tmp_path / "logs"
    try:
        env = clean_env(SLOW_WARM_S="3", SLOW_WARM_MARK=str(mark))
        job.start(env=env, extra=("--log-dir", str(logs)))
        wait_for(job.starts, 60, "the first round")
        events = [json.loads(ln) for ln in (logs / "events.jsonl").read_text().splitlines()]
        joined = next(e["time"] for e in events if e["event"] == "node_joined")
        assert joined < float(mark.read_text()), (joined, mark.read_text())
    finally:
        job.close()


def test_a_round_handed_to_a_standby_still_importing_runs_once_it_is_warm(etcd, tmp_path):
    """A restart right after a round: the slot's new standby is still in its (2 s) import when
    the round is handed to it, and the agent has closed its end by the time the standby says
    it is warm. The worker must run all the same (it once exited 0 there, unrun).
    """
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1",
        nproc=1,
        conf="lease_ttl=2",
        extra=("--prewarm", "slow_warm", "--max-restarts", "1"),
    )
    try:
        agent = job.start(WORKER, str(job.out), "fail", "0", env=clean_env(SLOW_WARM_S="2"))
        assert agent.wait(90) == 1, agent.stderr
        restarts = sorted(int(s.env["TORCHELASTIC_RESTART_COUNT"]) for s in job.starts())
        assert restarts == [0, 1], restarts
    finally:
        job.close()


def test_bad_prewarm_values_are_one_line(tmp_path):
    for value, words in (("no_such_module_xyz", "no module named"), ("a b", "expected none")):
        (tmp_path / value.replace(" ", "_")).mkdir()
        agent, _ = run_standalone(tmp_path / value.replace(" ", "_"), value, (PROBE,), "ok")
        assert agent.wait(60) != 0
        errors = [ln for ln in agent.stderr.splitlines() if ln.startswith("etcdrun: error: ")]
        assert len(errors) == 1 and words in errors[0], agent.stderr
        assert "Traceback" not in agent.stderr


def test_wait_warm_counts_only_standbys_that_said_warm(monkeypatch, tmp_path):
    """A slot whose standby could not start, or died in its imports, is cold: the agent's one
    line must say so (here none of 3, the third still importing) rather than count it warm.
    """
    from etcdrun.agent.api import WorkerSpec
    from etcdrun.agent.standby import pool as sb

    monkeypatch.setenv("PYTHONPATH", str(SCRIPTS))
    monkeypatch.setenv("SLOW_WARM_S", "30")
    spec = WorkerSpec(
        local_world_size=3, entrypoint=PROBE, args=(str(tmp_path),), prewarm="slow_warm"
    )
    pool = sb.for_agent(spec, {})
    assert pool is not None
    real_popen, calls = sb.subprocess.Popen, []

    def popen(argv, **kw):  # the third start fails, as a fork would without memory
        calls.append(argv)
        if len(calls) == 3:
            raise OSError("no memory")
        return real_popen(argv, **kw)

    monkeypatch.setattr(sb.subprocess, "Popen", popen)
    pool.start()
    try:
        wait_for(lambda: len(calls) == 3, 30, "three starts")
        with pool.waiting() as pids:  # the failed start has left no pending slot
            slow, dying = sorted(pids)
        os.kill(dying, signal.SIGKILL)
        t0 = time.monotonic()
        assert pool.wait_warm(1.5) == (0, 3)  # the slow one still imports: cold
        assert time.monotonic() - t0 >= 1.4
    finally:
        pool.close()
    assert not alive(slow)


def hold_turns(name: str, n: int) -> list[socket.socket]:
    """Take ``n`` warm-up turns of this user (``name``: _standby_boot.TURN_NAME's form), as
    ``n`` refills importing would. A turn that another etcdrun of this user holds (the turns
    are machine-wide: a soak or a second test run beside this one) is waited for: its holder
    frees it once its import is done.
    """
    held = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        wait_for(lambda s=s, i=i: _bound(s, name.format(uid=os.getuid(), i=i)), 60, f"turn {i}")
        held.append(s)
    return held


def _bound(s: socket.socket, name: str) -> bool:
    try:
        s.bind(name)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        return False
    return True


def test_a_refill_waits_for_a_turn_unless_a_round_comes_first(monkeypatch, tmp_path):
    """_take_turn: none asked, none waited for; every turn taken, it waits until one is freed
    (and holds that one); a hand-over arriving first ends the wait, unread.
    """
    from etcdrun.agent.standby import boot

    monkeypatch.setattr(boot, "TURN_NAME", "\0etcdrun-test-" + tmp_path.name + "-{uid}-{i}")
    mine, theirs = socket.socketpair()
    assert boot._take_turn(theirs, 0) is None
    for ends in ("freed", "hand-over"):
        held, got = hold_turns(boot.TURN_NAME, 2), []
        waiter = threading.Thread(target=lambda out=got: out.append(boot._take_turn(theirs, 2)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), f"it took a turn while both were held ({ends})"
        if ends == "freed":
            held[1].close()
        else:
            mine.send(b"r")
        waiter.join(5)
        assert not waiter.is_alive()
        if ends == "freed":
            assert got[0].getsockname() == boot.TURN_NAME.format(uid=os.getuid(), i=1).encode()
            got[0].close()
        else:
            assert got == [None] and theirs.recv(1) == b"r"
        for s in held:
            s.close()


def test_refills_import_in_turn_and_first_standbys_do_not_wait(tmp_path):
    """Every turn of this user held: the agent's first standby still imports (its worker
    runs), but the refill started at the hand-over waits, and imports once a turn is freed.
    """
    from etcdrun.agent.standby import boot
    from etcdrun.agent.standby.pool import warmup_turns

    marks = tmp_path / "marks"
    marks.mkdir()
    held = hold_turns(boot.TURN_NAME, warmup_turns())
    agent, out = run_standalone(
        tmp_path, "slow_warm", (PROBE,), "sleep", SLOW_WARM_MARK=str(marks / "{pid}")
    )
    try:
        wait_for((out / "probe_0.json").exists, 60, "the worker running")
        worker = json.loads((out / "probe_0.json").read_text())["pid"]
        assert (marks / str(worker)).exists(), "the worker did not come from a warm standby"
        refill = wait_for(lambda: standbys_of(agent.pid), 30, "the refill")[0]
        time.sleep(1.0)  # its import takes ~10 ms once it may: 1 s shows it waits
        assert not (marks / str(refill)).exists(), "the refill imported while no turn was free"
        held.pop().close()
        wait_for((marks / str(refill)).exists, 10, "the refill's import, its turn freed")
    finally:
        for s in held:
            s.close()
        agent.proc.send_signal(signal.SIGTERM)
        agent.wait(60)


@pytest.mark.parametrize(
    "prewarm, env, served",
    [("torch", {}, True), ("torch", {"ETCDRUN_EARLY_STORE": "0"}, False), ("none", {}, False)],
    ids=["standby", "opted-out", "spawned"],
)
def test_rank_0s_standby_serves_master_port_before_the_script_runs(tmp_path, prewarm, env, served):
    """The rank-0 standby's store is up before the script's first line, and the script's own
    init_process_group shares it (a real gloo all_reduce over it); opted out, or spawned,
    MASTER_PORT is free until the script's own init.
    """
    script = (str(SCRIPTS / "early_store.py"),)
    agent, out = run_standalone(tmp_path, prewarm, script, "-", "--nproc-per-node", "2", **env)
    assert agent.wait(120) == 0, agent.stderr[-2000:]
    seen = {r: json.loads((out / f"store_{r}.json").read_text()) for r in (0, 1)}
    assert seen[0]["listening_at_start"] is served
    assert [seen[r]["sum"] for r in (0, 1)] == [2.0, 2.0]


def test_a_rank_waits_for_rank_0s_store_until_it_listens(monkeypatch):
    """_early_store on a rank > 0: it returns only once MASTER_PORT accepts (one connection,
    closed), and gives up after STORE_WAIT when nothing ever listens there.
    """
    from etcdrun.agent.standby import boot

    monkeypatch.setitem(__import__("sys").modules, "torch.distributed", object())
    monkeypatch.setattr(boot, "STORE_WAIT", 30.0)  # a slow machine must not see it give up
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port, events = server.getsockname()[1], []
    env = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    waiter = threading.Thread(target=lambda: events.append(("returned", boot._early_store(env))))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "it ran on while nothing listened"
    server.listen()
    events.append(("listening", None))
    waiter.join(5)
    assert events == [("listening", None), ("returned", None)]
    conn, _ = server.accept()
    assert conn.recv(1) == b""  # its probe, closed without a byte
    conn.close()
    server.close()
    monkeypatch.setattr(boot, "STORE_WAIT", 0.05)
    gone = threading.Thread(target=boot._early_store, args=(env,))
    gone.start()
    gone.join(5)
    assert not gone.is_alive(), "it waited past STORE_WAIT for a port nobody serves"


def test_standbys_start_before_the_rendezvous_handler_and_die_with_its_failure(monkeypatch):
    """launch_agent starts the standbys first (their import runs beside the agent's gRPC
    import and handler), and a handler that then fails leaves none of them alive.
    """
    from etcdrun.agent import launcher
    from etcdrun.agent.config import LaunchConfig

    seen: list[int] = []

    def both() -> list[int] | None:  # the second may start a moment after the first
        found = standbys_of(os.getpid())
        return found if len(found) == 2 else None

    def failing_handler(config):
        seen.extend(wait_for(both, 30, "both standbys before the handler"))
        raise ValueError("the handler failed")

    monkeypatch.setattr(launcher, "_make_rdzv_handler", failing_handler)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="etcd",
        rdzv_endpoint="127.0.0.1:1",
        run_id="early",
        prewarm="json",
    )
    with pytest.raises(ValueError, match="the handler failed"):
        launcher.launch_agent(config, PROBE, ["-", "ok"])
    assert len(seen) == 2, seen
    assert not any(alive(p) for p in seen), "a standby outlived the failed start"


def test_the_cli_forks_its_standbys_before_the_launchers_imports(tmp_path):
    """The console script's standbys start before etcdrun.agent.launcher (and so the rendezvous
    registry, metrics, gRPC) is imported: their ``import torch`` is a node's critical path.
    """
    code = (
        "import sys\n"
        "from etcdrun.agent import cli\n"
        "from etcdrun.agent.standby import pool as standby\n"
        "def early(spec):\n"
        "    print(sorted(m for m in ('etcdrun.agent.launcher', 'multiprocessing', 'grpc')\n"
        "                 if m in sys.modules))\n"
        "    raise SystemExit(7)\n"
        "standby.early = early\n"
        f"cli.main(['--standalone', '--prewarm', 'json', {PROBE!r}, '-', 'ok'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert done.returncode == 7, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_bad_metrics_setting_closes_the_callers_standbys():
    """The CLI starts the standbys before launch_agent checks its settings: a refused one
    (an unknown metrics handler) leaves none of them alive, in a program that goes on.
    """
    from etcdrun.agent import launcher
    from etcdrun.agent.config import LaunchConfig
    from etcdrun.agent.standby import pool as standby

    config = LaunchConfig(
        nproc_per_node=2, run_id="early", prewarm="json", metrics_cfg={"handler": "bogus"}
    )
    early = standby.early(config.worker_spec(None, PROBE, ["-", "ok"]))
    started = wait_for(
        lambda: (lambda f: f if len(f) == 2 else None)(standbys_of(os.getpid())),
        30,
        "both standbys",
    )
    with pytest.raises(ValueError, match="bogus"):
        launcher.launch_agent(config, PROBE, ["-", "ok"], early=early)
    wait_for(lambda: not any(alive(p) for p in started), 10, "the standbys to end")
