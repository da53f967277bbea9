"""torchrun's Python entry points (``etcdrun.run``, raising as ``torch.distributed.run``'s do) and
``--signals-to-handle`` (the signal itself passed on to the workers), each beside torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import clean_env, etcdrun_bin, torchrun_bin, wait_for

import etcdrun.run as er
from etcdrun.agent.errors import ChildFailedError

FAIL = "import sys; sys.exit(3)\n"
OK = "print('fine')\n"
# Which launcher API raises what, run in a fresh interpreter (each installs signal handlers).
DRIVER = """
import json, sys
mod = __import__(sys.argv[1], fromlist=["main"])
try:
    out = {"returned": repr(mod.main(sys.argv[2:]))}
except BaseException as e:
    out = {"raised": type(e).__name__, "value_error": isinstance(e, ValueError)}
print("RESULT " + json.dumps(out))
"""


def drive(module: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, module, *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--standalone", "--nproc-per-node", "2", "{fail}"], "ChildFailedError"),
        (["--no-python", "-m", "{fail}"], "value_error"),  # torch: ValueError, ours: UsageError
    ],
)
def test_main_raises_as_torchs_does(tmp_path, torch_available, argv, expected):
    (tmp_path / "fail.py").write_text(FAIL)
    argv = [a.format(fail=tmp_path / "fail.py") for a in argv]
    theirs = drive("torch.distributed.run", *argv)
    ours = drive("etcdrun.run", *argv)
    if expected == "value_error":
        assert theirs["value_error"] and ours["value_error"], (theirs, ours)
    else:
        assert theirs["raised"] == ours["raised"] == expected, (theirs, ours)


def test_in_process_main_run_and_config_from_args(tmp_path):
    (tmp_path / "ok.py").write_text(OK)
    (tmp_path / "fail.py").write_text(FAIL)
    assert er.main(["--standalone", "--nproc-per-node", "2", str(tmp_path / "ok.py")]) == {
        0: None,
        1: None,
    }
    ns = er.parse_args(["--nproc", "1", str(tmp_path / "fail.py")])  # torch's shape: a Namespace
    config, cmd, cmd_args = er.config_from_args(ns)
    assert config.nproc_per_node == 1 and cmd == sys.executable and cmd_args[-1].endswith("fail.py")
    with pytest.raises(ChildFailedError) as err:
        er.run(ns)
    assert err.value.get_first_failure()[1].exitcode == 3
    with pytest.raises(ValueError, match="no such script"):
        er.main([str(tmp_path / "missing.py")])
    assert er.get_args_parser().prog == "etcdrun"


def test_python_m_etcdrun_run_keeps_the_commands_exit_codes(tmp_path):
    (tmp_path / "fail.py").write_text(FAIL)
    run = [sys.executable, "-m", "etcdrun.run"]
    proc = subprocess.run([*run, str(tmp_path / "fail.py")], capture_output=True, env=clean_env())
    assert proc.returncode == 1
    proc = subprocess.run([*run, "--nnodes", "3:2", "x.py"], capture_output=True, env=clean_env())
    assert (proc.returncode, proc.stderr) == (
        2,
        b"etcdrun: error: max_nodes (2) must be >= min_nodes (3)\n",
    )


# ---- --signals-to-handle ---------------------------------------------------------------------
CATCHER = """
import json, os, signal, sys, time
out = sys.argv[1]
got = []

def note(signum, frame):
    got.append(signal.Signals(signum).name)
    with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
        json.dump(got, f)
    if signum == signal.SIGUSR1:
        sys.exit(0)  # "checkpoint, then leave": what a Slurm pre-emption warning asks for

for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, note)
open(os.path.join(out, os.environ["RANK"] + ".ready"), "w").close()
for _ in range(600):
    time.sleep(0.05)
"""


def launch_and_signal(launcher: str, tmp: Path, sig: signal.Signals, *flags: str) -> tuple:
    out = tmp / launcher
    out.mkdir()
    script = tmp / "catcher.py"
    script.write_text(CATCHER)
    exe = etcdrun_bin() if launcher == "etcdrun" else torchrun_bin()
    argv = [exe, "--standalone", "--nproc-per-node", "2", *flags, str(script), str(out)]
    with open(tmp / f"{launcher}.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env())
    try:
        wait_for(lambda: len(list(out.glob("*.ready"))) == 2, 60, f"{launcher}'s workers")
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return code, got


def test_a_handled_signal_reaches_the_workers_as_itself(tmp_path, torch_available):
    """SIGUSR1 in --signals-to-handle: the workers get SIGUSR1 and nothing else (before, etcdrun
    sent SIGTERM right after it), under both launchers.
    """
    flags = ("--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout", "20")
    for launcher in ("torchrun", "etcdrun"):
        code, got = launch_and_signal(launcher, tmp_path, signal.SIGUSR1, *flags)
        assert got == {"0": ["SIGUSR1"], "1": ["SIGUSR1"]}, (launcher, got)
        expected = 128 + signal.SIGUSR1 if launcher == "etcdrun" else 1  # torchrun exits 1
        assert code == expected, (launcher, code, (tmp_path / f"{launcher}.log").read_text())


def test_sigint_reaches_the_workers_as_sigint(tmp_path, torch_available):
    for launcher in ("torchrun", "etcdrun"):
        code, got = launch_and_signal(launcher, tmp_path, signal.SIGINT, "--shutdown-timeout", "3")
        assert got == {"0": ["SIGINT"], "1": ["SIGINT"]}, (launcher, got)
        assert code == (130 if launcher == "etcdrun" else 1), (launcher, code)


def test_an_unhandled_signal_is_not_caught(tmp_path):
    """SIGUSR1 not in the list: the agent keeps the default disposition (it dies of it, as
    torchrun's does), and its workers die with it (their parent-death signal).
    """
    code, got = launch_and_signal("etcdrun", tmp_path, signal.SIGUSR1)
    assert code == -signal.SIGUSR1 and got == {}
    assert os.path.exists(tmp_path / "etcdrun")
