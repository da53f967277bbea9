"""The etcdrun command line: torchrun's flags and meanings, one-line errors, a light start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from etcdrun.agent.api import Std
from etcdrun.agent.cli import UsageError, main, parse_args

PY = sys.executable


def etcdrun_bin() -> str:
    """The installed console script (next to this interpreter; not a pyenv shim)."""
    beside = Path(PY).parent / "etcdrun"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcdrun")
    assert found, "the etcdrun console script is not installed (pip install -e '.[test]')"
    return found


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    full_env.update(env or {})
    return subprocess.run(
        [etcdrun_bin(), *args], capture_output=True, text=True, env=full_env, timeout=60
    )


@pytest.fixture(autouse=True)
def no_pet_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("PYTHON_EXEC", raising=False)


# --- defaults and meanings --------------------------------------------------------------------
def test_defaults_are_torchruns():
    c, entrypoint, args = parse_args(["train.py"])
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (1, 1, 1)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("static", "127.0.0.1:29500", "none")
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 29500)
    assert c.rdzv_configs == {"rank": 0}
    assert (c.role, c.max_restarts, c.monitor_interval, c.start_method) == (
        "default",
        0,
        0.1,
        "spawn",
    )
    assert (c.redirects, c.tee, c.log_dir, c.local_ranks_filter) == (None, None, None, None)
    assert c.stop_grace is None and c.entrypoint_kind == "executable"
    assert entrypoint == PY and args == ["-u", "train.py"]


def test_all_flags():
    c, entrypoint, args = parse_args(
        [
            "--nnodes",
            "2:4",
            "--nproc-per-node",
            "3",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "e1,https://e2:2380",
            "--rdzv-id",
            "job7",
            "--rdzv-conf",
            "lease_ttl=2, join_timeout = 60",
            "--max-restarts",
            "5",
            "--monitor-interval",
            "0.5",
            "--start-method",
            "fork",
            "--role",
            "trainer",
            "--log-dir",
            "/tmp/l",
            "-r",
            "3",
            "-t",
            "0:1,1:2",
            "--local-ranks-filter",
            "0,2",
            "--node-rank",
            "1",
            "--local-addr",
            "10.0.0.5",
            "--stop-grace",
            "7.5",
            "train.py",
            "a",
        ]
    )
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 4, 3)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == (
        "etcd",
        "e1:2379,https://e2:2380",
        "job7",
    )
    assert c.rdzv_configs == {"lease_ttl": "2", "join_timeout": "60"}
    assert (c.max_restarts, c.monitor_interval, c.start_method, c.role) == (
        5,
        0.5,
        "fork",
        "trainer",
    )
    assert c.log_dir == "/tmp/l" and c.redirects == Std.ALL
    assert c.tee == {0: Std.OUT, 1: Std.ERR}
    assert c.local_ranks_filter == {0, 2} and c.node_rank == 1 and c.local_addr == "10.0.0.5"
    assert c.stop_grace == 7.5
    assert (c.master_addr, c.master_port) == (None, None)  # static-only settings
    assert (entrypoint, args) == (PY, ["-u", "train.py", "a"])


@pytest.mark.parametrize(
    "flag",
    [
        "--nproc_per_node",
        "--rdzv_backend",
        "--rdzv_endpoint",
        "--rdzv_id",
        "--rdzv_conf",
        "--max_restarts",
        "--monitor_interval",
        "--start_method",
        "--no_python",
        "--run_path",
        "--log_dir",
        "--local_ranks_filter",
        "--node_rank",
        "--master_addr",
        "--master_port",
        "--local_addr",
        "--stop_grace",
        "--restart_grace",
    ],
)
def test_underscore_spellings_are_accepted(flag):
    values = {
        "--nproc_per_node": "2",
        "--rdzv_backend": "static",
        "--rdzv_endpoint": "h:1",
        "--rdzv_id": "x",
        "--rdzv_conf": "join_timeout=1",
        "--max_restarts": "1",
        "--monitor_interval": "1",
        "--start_method": "fork",
        "--log_dir": "/tmp",
        "--local_ranks_filter": "0",
        "--node_rank": "0",
        "--master_addr": "h",
        "--master_port": "1",
        "--local_addr": "h",
        "--stop_grace": "1",
        "--restart_grace": "2",
    }
    argv = [flag, values[flag]] if flag in values else [flag]
    dashed = ["--" + argv[0][2:].replace("_", "-"), *argv[1:]]
    assert parse_args([*argv, "train.py"]) == parse_args([*dashed, "train.py"])


def test_script_args_pass_through_untouched():
    tail = ["--epochs", "10", "--nnodes", "3", "-m", "--help", "--", "-x", "--version"]
    _, _, args = parse_args(["--nproc-per-node", "2", "train.py", *tail])
    assert args == ["-u", "train.py", *tail]
    _, _, args = parse_args(["train.py", "--", "a"])  # argparse alone would drop this "--"
    assert args == ["-u", "train.py", "--", "a"]
    _, _, args = parse_args(["--", "train.py", "b"])  # a "--" before the script is ours
    assert args == ["-u", "train.py", "b"]


def test_module_no_python_run_path():
    c, e, a = parse_args(["-m", "pkg.train", "--lr", "1"])
    assert (e, a, c.entrypoint_kind) == (PY, ["-u", "-m", "pkg.train", "--lr", "1"], "executable")
    c, e, a = parse_args(["--no-python", "/bin/echo", "hi"])
    assert (e, a, c.entrypoint_kind) == ("/bin/echo", ["hi"], "executable")
    c, e, a = parse_args(["--run-path", "--no-python", "/abs/t.py", "x"])
    assert (e, a, c.entrypoint_kind) == ("/abs/t.py", ["x"], "run_path")


def test_python_exec_env(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python")
    assert parse_args(["t.py"])[1] == "/opt/py/bin/python"


def test_nproc_per_node_words():
    cpus = len(os.sched_getaffinity(0))
    assert parse_args(["--nproc-per-node", "cpu", "t.py"])[0].nproc_per_node == cpus
    from etcdrun.agent.accelerators import gpu_count, xpu_count

    gpus = gpu_count() or xpu_count()
    assert parse_args(["--nproc-per-node", "auto", "t.py"])[0].nproc_per_node == (gpus or cpus)
    if gpus == 0:
        with pytest.raises(UsageError, match="no GPU"):
            parse_args(["--nproc-per-node", "gpu", "t.py"])


def test_static_endpoint_from_master_flags():
    c = parse_args(["--master-addr", "10.0.0.1", "--master-port", "1234", "t.py"])[0]
    assert (c.rdzv_endpoint, c.master_addr, c.master_port) == ("10.0.0.1:1234", "10.0.0.1", 1234)
    c = parse_args(["--master-addr", "::1", "t.py"])[0]
    assert (c.rdzv_endpoint, c.master_addr, c.master_port) == ("[::1]:29500", "::1", 29500)
    c = parse_args(["--rdzv-endpoint", "h:99", "--master-port", "1", "t.py"])[0]
    assert (c.rdzv_endpoint, c.master_port) == ("h:99", 99)  # the endpoint wins, like torchrun


def test_node_rank_goes_to_static_config():
    c = parse_args(["--nnodes", "3", "--node-rank", "2", "--rdzv-conf", "rank=0", "t.py"])[0]
    assert c.node_rank == 2 and c.rdzv_configs == {"rank": 2}


def test_standalone():
    c1 = parse_args(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "x:1",
            "--rdzv-id",
            "ignored",
            "t.py",
        ]
    )[0]
    c2 = parse_args(["--standalone", "t.py"])[0]
    assert (c1.rdzv_backend, c1.rdzv_endpoint, c1.master_addr, c1.master_port) == (
        "static",
        "",
        None,
        None,
    )  # the launcher reserves a free local port
    assert c1.run_id not in ("ignored", "none") and len(c1.run_id) == 36
    assert c1.run_id != c2.run_id
    assert (c1.min_nodes, c1.max_nodes, c1.nproc_per_node) == (1, 1, 2)


# --- PET_ environment --------------------------------------------------------------------------
def test_pet_env(monkeypatch):
    for k, v in {
        "PET_NNODES": "2:3",
        "PET_NPROC_PER_NODE": "4",
        "PET_MAX_RESTARTS": "2",
        "PET_RDZV_BACKEND": "etcd",
        "PET_RDZV_ENDPOINT": "e:1",
        "PET_RDZV_ID": "j",
        "PET_MODULE": "1",
        "PET_MONITOR_INTERVAL": "0.25",
        "PET_ROLE": "r",
        "PET_START_METHOD": "forkserver",
        "PET_LOCAL_RANKS_FILTER": "1",
    }.items():
        monkeypatch.setenv(k, v)
    c, e, a = parse_args(["mod"])
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.max_restarts) == (2, 3, 4, 2)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("etcd", "e:1", "j")
    assert (c.monitor_interval, c.role, c.start_method) == (0.25, "r", "forkserver")
    assert c.local_ranks_filter == {1} and a == ["-u", "-m", "mod"]


def test_command_line_wins_over_pet_env(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_NNODES", "2")
    c = parse_args(["--nproc_per_node", "2", "--nnodes", "1", "t.py"])[0]
    assert (c.nproc_per_node, c.max_nodes) == (2, 1)


def test_pet_flags(monkeypatch):
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert parse_args(["t.py"])[0].run_id != "none"
    monkeypatch.setenv("PET_STANDALONE", "0")
    assert parse_args(["t.py"])[0].run_id == "none"


def test_torch_213_flags():
    c, _, _ = parse_args(
        [
            "--event-log-handler",
            "console",
            "--duplicate-stdout-filters",
            "loss,,step,acc",
            "--duplicate-stderr-filters",
            "Error",
            "--numa-binding",
            "socket",
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--shutdown-timeout",
            "12",
            "--virtual-local-rank",
            "train.py",
        ]
    )
    assert c.event_log_handler == "console" and c.numa_options == "socket"
    assert c.duplicate_stdout_filters == ["loss,step", "acc"]  # ",," is a comma (torch's rule)
    assert c.duplicate_stderr_filters == ["Error"]
    assert c.signals_to_handle == "SIGTERM,SIGUSR1" and c.virtual_local_rank
    assert (c.shutdown_timeout, c.stop_grace, c.grace()) == (12, None, 12)
    d, _, _ = parse_args(["train.py"])
    assert (d.event_log_handler, d.numa_options, d.logs_specs) == ("null", None, None)
    assert (d.duplicate_stdout_filters, d.duplicate_stderr_filters) == (None, None)
    assert d.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT" and not d.virtual_local_rank
    assert d.grace() is None and d.log_line_prefix_template is None


def test_shutdown_timeout_and_stop_grace_are_one_setting(monkeypatch):
    assert parse_args(["--stop-grace", "4", "t.py"])[0].grace() == 4
    assert parse_args(["--shutdown-timeout", "4", "--stop-grace", "4", "t.py"])[0].grace() == 4
    with pytest.raises(UsageError, match=r"shutdown_timeout \(4.0\) and stop_grace \(5.0\)"):
        parse_args(["--shutdown-timeout", "4", "--stop-grace", "5", "t.py"])
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")  # torch's variable
    assert parse_args(["t.py"])[0].grace() == 9
    assert parse_args(["--stop-grace", "2", "t.py"])[0].grace() == 2  # a flag wins
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "3")
    assert parse_args(["t.py"])[0].grace() == 3
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"):
        parse_args(["t.py"])
    assert parse_args(["--stop-grace", "1", "t.py"])[0].grace() == 1  # unread, as by torch


def test_torch_213_flags_from_pet_env_and_the_template(monkeypatch):
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGUSR2")
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")
    monkeypatch.setenv("PET_EVENT_LOG_HANDLER", "dynamic_rendezvous")
    monkeypatch.setenv("PET_DUPLICATE_STDOUT_FILTERS", "a,b")
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:")
    c, _, _ = parse_args(["t.py"])
    assert (c.signals_to_handle, c.virtual_local_rank, c.event_log_handler) == (
        "SIGUSR2",
        True,
        "dynamic_rendezvous",
    )
    assert c.duplicate_stdout_filters == ["a", "b"]
    assert c.log_line_prefix_template == "[${rank}]:"  # torchrun's config_from_args reads it


@pytest.mark.parametrize(
    "short, full",
    [
        (["--redirect=3"], ["--redirects", "3"]),  # torchrun's argparse accepts prefixes
        (["--nnode", "2:3"], ["--nnodes", "2:3"]),
        (["--nproc", "2"], ["--nproc-per-node", "2"]),  # torchrun's calls it ambiguous (twins)
        (["--nproc_per", "2"], ["--nproc-per-node", "2"]),
        (["--stand"], ["--standalone"]),
        (["--rdzv-e=h:1", "--rdzv-i", "j"], ["--rdzv-endpoint", "h:1", "--rdzv-id", "j"]),
        (["--max-r", "1", "--mon", "2"], ["--max-restarts", "1", "--monitor-interval", "2"]),
        (["--local-ranks", "0"], ["--local-ranks-filter", "0"]),
        (["--stop", "3"], ["--stop-grace", "3"]),
    ],
)
def test_unambiguous_prefixes_work_as_under_torchrun(short, full):
    (a, *rest_a), (b, *rest_b) = parse_args([*short, "train.py"]), parse_args([*full, "train.py"])
    if a.rdzv_backend == "static" and "--standalone" in full:  # a fresh run id each time
        a.run_id = b.run_id
    assert (a, rest_a) == (b, rest_b)


def test_a_prefix_our_own_options_make_ambiguous_means_torchruns():
    assert parse_args(["--v", "t.py"])[0].virtual_local_rank  # not --version
    with pytest.raises(SystemExit):
        parse_args(["--vers", "t.py"])


def test_prefixes_never_touch_the_scripts_arguments():
    # torchrun's argparse reads every word: "train.py --ma 1" fails there as ambiguous
    _, _, args = parse_args(["--nproc", "2", "train.py", "--ma", "1", "--nproc", "3", "--r"])
    assert args == ["-u", "train.py", "--ma", "1", "--nproc", "3", "--r"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--master", "h"], "--master-addr, --master-port"),
        (["--rdzv", "x"], "--rdzv-backend, --rdzv-conf, --rdzv-endpoint, --rdzv-id"),
        (
            ["--lo", "x"],
            "--local-addr, --local-ranks-filter, --log-dir, --log-line-prefix-template, "
            "--logs-specs",
        ),
        (
            ["--s", "x"],
            "--shutdown-timeout, --signals-to-handle, --standalone, --start-method, --stop-grace",
        ),
    ],
)
def test_an_ambiguous_prefix_is_one_line_naming_the_options(argv, names):
    with pytest.raises(UsageError) as err:
        parse_args([*argv, "train.py"])
    assert str(err.value) == f"ambiguous option: {argv[0]} could match {names}"


# --- errors ----------------------------------------------------------------------------------
BAD = [
    (["--nnodes", "2:1", "t.py"], "max_nodes (1) must be >= min_nodes (2)"),
    (["--nnodes", "0", "t.py"], "min_nodes (0) must be positive"),
    (["--nnodes", "1:2:3", "t.py"], "--nnodes '1:2:3'"),
    (["--nnodes", "x", "t.py"], "--nnodes 'x'"),
    (["--nproc-per-node", "0", "t.py"], "nproc_per_node (0) must be positive"),
    (["--nproc-per-node", "many", "t.py"], "--nproc-per-node 'many'"),
    (["--rdzv-backend", "nope", "t.py"], "unknown rendezvous backend 'nope'"),
    (
        ["--rdzv-backend", "c10d", "t.py"],
        "under etcdrun an elastic job's rendezvous is --rdzv-backend etcd",
    ),
    (["--rdzv-backend", "etcd", "t.py"], "--rdzv-endpoint is required"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1:2", "t.py"], "malformed etcd endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "ftp://h", "t.py"], "malformed etcd endpoint"),
    (["--rdzv-endpoint", "h:port", "t.py"], "malformed static rendezvous endpoint"),
    (["--master-port", "70000", "t.py"], "malformed static rendezvous endpoint"),
    (["--rdzv-conf", "lease_ttl", "t.py"], "--rdzv-conf: 'lease_ttl' is not key=value"),
    (["--rdzv-conf", "a=1,=2", "t.py"], "--rdzv-conf: '=2' is not key=value"),
    (["--max-restarts", "-1", "t.py"], "max_restarts (-1) must be non-negative"),
    (["--max-restarts", "x", "t.py"], "invalid int value"),
    (["--start-method", "thread", "t.py"], "invalid choice"),
    (["--node-rank", "1", "t.py"], "node_rank (1) must be smaller than max_nodes (1)"),
    (["--no-python", "-m", "t"], "--no-python and --module cannot be used together"),
    (["--standalone", "--nnodes", "2", "t.py"], "--standalone runs a single node"),
    (["-r", "5", "t.py"], "--redirects: invalid redirects/tee value '5'"),
    (["--local-ranks-filter", "a,b", "t.py"], "--local-ranks-filter 'a,b'"),
    (["--stop-grace", "-1", "t.py"], "stop_grace (-1.0) must be non-negative"),
    (["--bogus", "t.py"], "unrecognized arguments: --bogus"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE", "t.py"], "'SIGNOPE' is not a signal the agent"),
    (["--signals-to-handle", "SIGKILL", "t.py"], "'SIGKILL' is not a signal the agent can catch"),
    (["--event-log-handler", "file", "t.py"], "invalid choice: 'file'"),
    (["--numa-binding", "all", "t.py"], "invalid choice: 'all'"),
    (["--shutdown-timeout", "-1", "t.py"], "shutdown_timeout must be non-negative, got -1"),
    (
        ["--logs-specs", "nope", "t.py"],
        "could not find entrypoint under 'torchrun.logs_specs[nope]'",
    ),
    ([], "no script to run"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_parse_errors(argv, message):
    with pytest.raises(UsageError) as err:
        parse_args(argv)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PET_MAX_RESTARTS": "x"}, "PET_MAX_RESTARTS='x': invalid int value"),
        ({"PET_START_METHOD": "thread"}, "PET_START_METHOD='thread': must be one of"),
        ({"PET_STANDALONE": "yes"}, "PET_STANDALONE='yes': expected 0 or 1"),
    ],
)
def test_pet_env_errors_name_the_variable(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError) as err:
        parse_args(["t.py"])
    assert message in str(err.value)


def test_main_reports_one_line_and_returns_2(capsys):
    assert main(["--nnodes", "3:2", "t.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "etcdrun: error: max_nodes (2) must be >= min_nodes (3)\n"


CLI_ERRORS = [argv for argv, _ in BAD] + [
    # found by the static backend when the launcher builds it, not by the parser
    ["--rdzv-conf", "lease_ttl=2", "t.py"],
    # ... and by the etcd backend (its key validation runs before any connection)
    ["--rdzv-backend", "etcd", "--rdzv-endpoint", "localhost:1", "--rdzv-conf", "bogus=1", "t.py"],
]


@pytest.mark.parametrize("argv", CLI_ERRORS, ids=lambda a: " ".join(a) or "<none>")
def test_real_command_one_line_exit_2(argv):
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("etcdrun: error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_real_command_pet_error():
    proc = run_cli("t.py", env={"PET_NPROC_PER_NODE": "lots"})
    assert proc.returncode == 2
    assert (
        proc.stderr == "etcdrun: error: --nproc-per-node 'lots': expected an integer, "
        "cpu, gpu, xpu or auto (another accelerator's name is not known here: give a number)\n"
    )


def test_help_and_version():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--standalone",
        "--local-ranks-filter",
        "PET_",
        "etcdrun status",  # the subcommands are found from the main help
        "etcdrun drain NODE",
    ):
        assert flag in proc.stdout
    assert "--nproc_per_node" not in proc.stdout  # accepted, but not cluttering the help
    proc = run_cli("--version")
    assert (proc.returncode, proc.stdout) == (0, f"etcdrun {version('etcdrun')}\n")


HEAVY_PREFIXES = (
    "grpc",
    "google.protobuf",
    "tenacity",
    "torch",
    "etcdrun.rendezvous.client",
    "etcdrun.proto",
    "etcdrun.agent.launcher",
    "etcdrun.rendezvous.etcd",
    "prometheus_client",
    "http.server",
)


def _modules_after(code: str) -> set[str]:
    script = (
        "import sys, json, io, contextlib\n"
        "import etcdrun.agent.cli as cli\n"
        f"{code}\n"
        "sys.__stdout__.write(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_help_imports_nothing_heavy():
    mods = _modules_after(
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        cli.parse_args(['--help'])\n"
        "    except SystemExit:\n        pass"
    )
    assert "argparse" in mods and "etcdrun.agent.cli" in mods
    assert not {m for m in mods if m.startswith(HEAVY_PREFIXES)}
    # No config and no backend: the help lists the backends from the registry, which is plain
    # data (its package, the interface, the listeners its ports share, and the errors), and
    # loads none of them.
    assert "etcdrun.agent.config" not in mods
    assert {m for m in mods if m.startswith("etcdrun.rendezvous")} == {
        "etcdrun.rendezvous",
        "etcdrun.rendezvous.api",
        "etcdrun.rendezvous.errors",
        "etcdrun.rendezvous.listeners",
        "etcdrun.rendezvous.registry",
    }


def test_static_parse_imports_nothing_heavy():
    mods = _modules_after("cli.parse_args(['--nproc-per-node', '2', 'train.py'])")
    assert "etcdrun.agent.config" in mods
    assert not {m for m in mods if m.startswith(HEAVY_PREFIXES)}


def test_etcd_parse_normalises_the_endpoints_without_grpc():
    """The etcd command line's endpoints are normalised while it parses, from the client's
    config module alone: gRPC and protobuf load with the handler, after the standbys start.
    """
    mods = _modules_after(
        "c = cli.parse_args(['--rdzv-backend', 'etcd', '--rdzv-endpoint', 'e1,e2:2', "
        "'--nnodes', '2', 't.py'])[0]\nassert c.rdzv_endpoint == 'e1:2379,e2:2', c.rdzv_endpoint"
    )
    assert "etcdrun.rendezvous.client.config" in mods
    assert not {m for m in mods if m.startswith(("grpc", "google.protobuf", "etcdrun.proto"))}


def test_restart_grace_is_its_own_setting_beside_the_stop_grace():
    c = parse_args(["--restart-grace", "1.5", "--stop-grace", "20", "t.py"])[0]
    assert (c.restart_grace, c.grace()) == (1.5, 20)
    assert parse_args(["t.py"])[0].restart_grace is None  # agent/grace.py's default: 3 s
    with pytest.raises(UsageError, match=r"restart_grace \(-1.0\) must be non-negative"):
        parse_args(["--restart-grace", "-1", "t.py"])


def test_evict_stragglers_is_off_by_default_and_on_by_flag_or_pet_variable(monkeypatch):
    """docs/hangs.md, "Stragglers": the leader evicts only when asked."""
    assert parse_args(["t.py"])[0].evict_stragglers is False
    assert parse_args(["--evict-stragglers", "t.py"])[0].evict_stragglers is True
    monkeypatch.setenv("PET_EVICT_STRAGGLERS", "1")
    assert parse_args(["t.py"])[0].evict_stragglers is True


def test_print_completion_needs_shtab_as_under_torchrun(tmp_path):
    """torch 2.14's --print-completion: shtab is optional for both launchers. Without it,
    torchrun's line and exit 1; with it (a stand-in here: shtab is not a declared dependency),
    the script is made from etcdrun's own parser, so every option completes.
    """
    proc = run_cli("--print-completion", "bash", env={"PYTHONPATH": ""})
    assert proc.returncode == 1, proc
    assert (
        proc.stderr
        == "etcdrun: --print-completion requires the 'shtab' package: pip install shtab\n"
    )
    (tmp_path / "shtab.py").write_text(
        "def complete(parser, shell):\n"
        "    names = ' '.join(sorted(parser._option_string_actions))\n"
        "    return shell + ' ' + parser.prog + ' ' + names\n"
    )
    proc = run_cli("--print-completion", "zsh", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc
    assert proc.stdout.startswith("zsh etcdrun ") and "--rdzv-endpoint" in proc.stdout


def test_log_line_prefix_template_flag_wins_over_the_variable(monkeypatch):
    """torch 2.14's --log-line-prefix-template; TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is its
    fallback, as in torchrun's config_from_args.
    """
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[env]")
    c, _, _ = parse_args(["--log-line-prefix-template", "${hostname}:${rank}: ", "t.py"])
    assert c.log_line_prefix_template == "${hostname}:${rank}: "
    assert parse_args(["t.py"])[0].log_line_prefix_template == "[env]"
