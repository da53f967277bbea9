"""LaunchConfig parity with the reference launcher (shared/seed/000_1956a0ba1b82183c.txt)."""

from __future__ import annotations

import dataclasses

import pytest

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
    ("event_log_handler", "null"),  # torch's launcher has it; the seed reference does not
]


def test_fields_order_and_declared_defaults_match_the_reference():
    fields = dataclasses.fields(LaunchConfig)
    assert [f.name for f in fields] == [n for n, _ in SEED_FIELDS + EXTRA_FIELDS]
    for f, (name, default) in zip(fields, SEED_FIELDS + EXTRA_FIELDS, strict=True):
        if default == "factory":
            assert f.default_factory() == {}, name
        else:
            assert f.default == default, name


def test_instance_defaults():
    c = LaunchConfig()
    expected = dict(SEED_FIELDS + EXTRA_FIELDS)
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
