"""LaunchConfig parity with the reference launcher (shared/seed/000_1956a0ba1b82183c.txt)."""

from __future__ import annotations

import dataclasses

import pytest

from etcdrun.agent import flags
from etcdrun.agent.config import LaunchConfig

# The reference's fields, in its order, with its defaults ("factory" = an empty dict per instance).
SEED_FIELDS = [
    ("min_nodes", 1),
    ("max_nodes", 1),
    ("nproc_per_node", 1),
    ("run_id", ""),
    ("role", "default_role"),
    ("rdzv_endpoint", ""),
    ("rdzv_backend", "static"),
    ("rdzv_configs", "factory"),
    ("rdzv_timeout", -1),
    ("max_restarts", 0),
    ("monitor_interval", 0.1),
    ("start_method", "spawn"),
    ("log_dir", None),
    ("redirects", None),
    ("tee", None),
    ("metrics_cfg", "factory"),
    ("local_addr", None),
    ("node_rank", 0),
    ("master_addr", None),
    ("master_port", None),
]
EXTRA_FIELDS = [
    ("local_ranks_filter", None),
    ("stop_grace", None),
    ("entrypoint_kind", "auto"),
    ("prewarm", flags.DEFAULT_PREWARM),  # a factory: the test suite's switch may change it
    ("restart_grace", None),
]
# torch 2.13's newer LaunchConfig fields, with torch's defaults, after ours.
TORCH_213_FIELDS = [
    ("logs_specs", None),
    ("log_line_prefix_template", None),
    ("event_log_handler", "null"),
    ("numa_options", None),
    ("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
    ("duplicate_stdout_filters", None),
    ("duplicate_stderr_filters", None),
    ("virtual_local_rank", False),
    ("shutdown_timeout", None),
]
# Ours again, added after torch's newer fields so that positional construction keeps working.
LATER_FIELDS = [
    ("hang_timeout", None),
    ("on_sigterm", "drain"),  # docs/drain.md
    ("evict_stragglers", False),  # docs/hangs.md, "Stragglers"
]


def test_fields_order_and_declared_defaults_match_the_reference():
    fields = dataclasses.fields(LaunchConfig)
    assert [f.name for f in fields] == [
        n for n, _ in SEED_FIELDS + EXTRA_FIELDS + TORCH_213_FIELDS + LATER_FIELDS
    ]
    for f, (name, default) in zip(
        fields, SEED_FIELDS + EXTRA_FIELDS + TORCH_213_FIELDS + LATER_FIELDS, strict=True
    ):
        if default == "factory":
            assert f.default_factory() == {}, name
        elif name == "prewarm":
            assert f.default_factory() == default, name
        else:
            assert f.default == default, name


def test_instance_defaults():
    c = LaunchConfig()
    expected = dict(SEED_FIELDS + EXTRA_FIELDS + TORCH_213_FIELDS + LATER_FIELDS)
    expected.update(run_id="none", rdzv_configs={}, metrics_cfg={})  # run_id "" becomes "none"
    assert dataclasses.asdict(c) == expected


def test_mutable_defaults_are_not_shared():
    a, b = LaunchConfig(), LaunchConfig()
    a.rdzv_configs["x"] = 1
    a.metrics_cfg["y"] = "z"
    assert b.rdzv_configs == {} and b.metrics_cfg == {}


def test_positional_construction_follows_the_reference_order():
    c = LaunchConfig(2, 4, 8, "job")
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.run_id) == (2, 4, 8, "job")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_nodes=3, max_nodes=2), "max_nodes (2) must be >= min_nodes (3)"),
        (dict(nproc_per_node=0), "nproc_per_node (0) must be positive"),
        (dict(nproc_per_node=-2), "nproc_per_node (-2) must be positive"),
        (dict(min_nodes=0, max_nodes=0), "min_nodes (0) must be positive"),
        (dict(min_nodes=-1, max_nodes=1), "min_nodes (-1) must be positive"),
        (dict(max_restarts=-1), "max_restarts (-1) must be non-negative"),
        (dict(monitor_interval=-0.5), "monitor_interval must be non-negative"),
        (dict(node_rank=-1), "node_rank (-1) must be non-negative"),
        (dict(node_rank=1), "node_rank (1) must be smaller than max_nodes (1)"),
        (dict(max_nodes=3, node_rank=3), "node_rank (3) must be smaller than max_nodes (3)"),
        # ours
        (dict(stop_grace=-1.0), "stop_grace (-1.0) must be non-negative"),
        (dict(restart_grace=-0.5), "restart_grace (-0.5) must be non-negative"),
        (dict(local_ranks_filter={0, -1}), "local_ranks_filter ([-1, 0]) must hold non-negative"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as err:
        LaunchConfig(**kwargs)
    assert str(err.value).startswith(message)


def test_check_order_is_the_reference_order():
    # Several problems at once: the reference reports max < min before anything else.
    with pytest.raises(ValueError, match=r"^max_nodes \(0\) must be >= min_nodes \(1\)$"):
        LaunchConfig(max_nodes=0, nproc_per_node=0, max_restarts=-1)
    with pytest.raises(ValueError, match=r"^nproc_per_node \(0\) must be positive$"):
        LaunchConfig(nproc_per_node=0, max_restarts=-1, node_rank=-1)


def test_valid_boundaries_pass():
    c = LaunchConfig(
        min_nodes=1,
        max_nodes=4,
        node_rank=3,
        monitor_interval=0,
        max_restarts=0,
        run_id="job-1",
        stop_grace=0.0,
        local_ranks_filter={0},
    )
    assert c.node_rank == 3 and c.run_id == "job-1" and c.stop_grace == 0.0


# ---- torch 2.13's newer fields ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shutdown_timeout=-1), "shutdown_timeout must be non-negative, got -1"),  # torch's
        (dict(shutdown_timeout=3, stop_grace=4), "shutdown_timeout (3) and stop_grace (4) are one"),
        (dict(signals_to_handle="SIGTERM,BOGUS"), "signals_to_handle: 'BOGUS' is not a signal"),
        (dict(event_log_handler="file"), "event_log_handler 'file' is not one of null, console"),
        (dict(numa_options="all"), "numa_options 'all' is not one of node, socket, exclusive"),
        (dict(duplicate_stdout_filters="abc"), "duplicate_stdout_filters must be a list of str"),
    ],
)
def test_torch_213_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        LaunchConfig(**kwargs)
    assert str(err.value).startswith(message)


def test_signals_accept_names_with_or_without_sig():
    c = LaunchConfig(signals_to_handle="term, usr1,SIGTERM")
    assert [s.name for s in c.signals()] == ["SIGTERM", "SIGUSR1"]


def test_grace_one_value_from_either_name(monkeypatch):
    assert LaunchConfig(shutdown_timeout=5).grace() == 5
    assert LaunchConfig(stop_grace=6).grace() == 6
    c = LaunchConfig(shutdown_timeout=7, stop_grace=7)
    assert dataclasses.replace(c, stop_grace=7).grace() == 7  # fields stay as given
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "11")
    assert LaunchConfig().grace() == 11 and LaunchConfig(stop_grace=1).grace() == 1


def test_a_torch_logs_specs_object_gives_its_settings(tmp_path, torch_available):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    specs = DefaultLogsSpecs(
        log_dir=str(tmp_path), redirects=Std.ERR, tee={0: Std.OUT}, local_ranks_filter={1}
    )
    c = LaunchConfig(logs_specs=specs)
    assert (c.log_dir, c.redirects, c.tee, c.local_ranks_filter) == (str(tmp_path), 2, {0: 1}, {1})
    assert c.notices() == []  # torch's default layout is the one etcdrun writes
    mine = LaunchConfig(logs_specs=specs, log_dir="/elsewhere", redirects=3)
    assert (mine.log_dir, mine.redirects) == ("/elsewhere", 3)  # ours win

    class Custom(DefaultLogsSpecs):
        pass

    notes = LaunchConfig(logs_specs=Custom(log_dir=str(tmp_path))).notices()
    assert notes == [
        "logs_specs Custom: its log_dir, redirects, tee and local_ranks_filter are used; "
        "its reify() (the file layout) is not"
    ]


def test_notices_name_what_is_not_honoured(monkeypatch, tmp_path):
    from etcdrun.agent import accelerators

    monkeypatch.setattr(accelerators, "ROOT", str(tmp_path))  # a node without GPUs
    assert LaunchConfig().notices() == []
    notes = LaunchConfig(
        logs_specs="mine",
        event_log_handler="dynamic_rendezvous",
        numa_options="node",
        duplicate_stdout_filters=["loss"],
        duplicate_stderr_filters=["err"],
        tee="0:2",
    ).notices()
    assert len(notes) == 4, notes
    assert notes[0].startswith("--logs-specs mine: not honoured")
    assert notes[1].startswith("--event-log-handler dynamic_rendezvous: the events go to")
    assert LaunchConfig(event_log_handler="console").notices() == []  # honoured
    assert notes[2].startswith("--numa-binding node: not honoured: no GPU is visible")
    assert notes[3].startswith("--duplicate-stdout-filters: no worker's stdout is teed")
