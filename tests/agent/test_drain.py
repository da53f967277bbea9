"""``etcdrun drain NODE`` end to end (docs/drain.md): real agents on a real etcd, real workers.

What a drain must do, each checked here: the drained agent stops its workers with a normal stop
(SIGTERM, recorded by the worker), leaves (its lease revoked: nothing of it stays in etcd) and
exits 0 with one line naming run id, round and node; the others go on in a new round with no
restart charged; a drain that would take the job below min nodes, and one of an unknown node,
are one line and a non-zero exit, and change nothing. SIGTERM takes the same path while the
job has more than min nodes, and torchrun's at min nodes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from agent_helpers import clean_env, etcdrun_bin, wait_for

from etcdrun.rendezvous.client import EtcdClient


def status(job) -> dict:
    out = subprocess.run(
        [
            etcdrun_bin(),
            "status",
            "--rdzv-endpoint",
            job.endpoints,
            "--rdzv-id",
            job.run_id,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def drain(job, node: str, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            etcdrun_bin(),
            "drain",
            node,
            "--rdzv-endpoint",
            job.endpoints,
            "--rdzv-id",
            job.run_id,
            *more,
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )


def node_of(job, agent) -> str:
    """The agent's node id, as an operator finds it: ``etcdrun status`` (participants' pids)."""
    nodes = {p["pid"]: p["node_id"] for p in status(job)["participants"]}
    return nodes[agent.pid]


TTL = 10  # the others must not wait for the drained node's lease to expire


def three_nodes(job_factory):
    """A 3-node job (min 2) in its first round, and the agent of rank 2's node (the one to go)."""
    job = job_factory(
        nnodes="2:3", conf=f"lease_ttl={TTL},join_timeout=30", extra=("--stop-grace", "10")
    )
    agents = [job.start() for _ in range(3)]
    first = job.wait_round(6)
    leaving = next(a for a in agents if a.pid == next(s.ppid for s in first if s.rank == 2))
    return job, agents, first, leaving


def test_drain_one_of_three_leaves_cleanly_and_the_others_go_on_uncharged(etcd, job_factory):
    ttl = TTL
    job, agents, first, leaving = three_nodes(job_factory)
    round1 = first[0].round
    its_workers = {s.pid for s in first if s.ppid == leaving.pid}
    node = node_of(job, leaving)

    t0 = time.monotonic()
    asked = drain(job, node)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.strip() == (
        f"run {job.run_id} round {round1}: node {node} asked to drain; 2 node(s) remain (min 2)"
    )
    second = job.wait_round(4, after=round1, timeout=30)
    assert leaving.wait(30) == 0, leaving.stderr
    took = time.monotonic() - t0
    print(f"drain of 1 of 3 nodes -> the other 4 workers running again after {took:.2f} s")
    assert took < ttl / 2, "the others waited for the drained node's lease to expire"

    lines = [ln for ln in leaving.stderr.splitlines() if " drained (asked by etcdrun drain (" in ln]
    assert len(lines) == 1, leaving.stderr
    assert f"run {job.run_id} round {round1}: node {node} drained" in lines[0]
    assert "no restart charged" in lines[0]
    got = {pid: rec["signal"] for pid, rec in job.signals().items() if pid in its_workers}
    assert got == dict.fromkeys(its_workers, 15), "its workers were not stopped with SIGTERM"

    assert {s.ppid for s in second} == {a.pid for a in agents if a is not leaving}
    assert {s.env["TORCHELASTIC_RESTART_COUNT"] for s in second} == {"0"}  # charged nothing
    s = status(job)
    assert (s["restart_count"], len(s["participants"])) == (0, 2)
    assert node not in {p["node_id"] for p in s["participants"]}
    for a in agents:
        if a is not leaving:
            wait_for(lambda a=a: f"{node}" in a.stderr and "left" in a.stderr, 10, "the cause")
    with EtcdClient(job.endpoints) as c:  # nothing of the drained node is left in etcd
        keys = [kv.key.decode() for kv in c.get_prefix(f"/etcdrun/{job.run_id}/").kvs]
    assert not [k for k in keys if node in k], keys


def test_drain_below_min_is_refused_and_an_unknown_node_is_one_line(etcd, job_factory):
    job = job_factory(nnodes="2:3", conf="lease_ttl=10,join_timeout=30,last_call_timeout=0")
    agents = [job.start() for _ in range(2)]
    first = job.wait_round(4)
    node = node_of(job, agents[0])

    refused = drain(job, node)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"etcdrun drain: error: draining {node} would leave 1 node(s), below min nodes 2: "
        "refused (--force drains it anyway; the job then waits for a node) "
        f"(run {job.run_id}, round {first[0].round}, node {node})"
    ]
    unknown = drain(job, "no-such-node")
    assert unknown.returncode == 1 and len(unknown.stderr.strip().splitlines()) == 1
    assert "cannot drain 'no-such-node': no live node matches" in unknown.stderr
    assert f"run {job.run_id}" in unknown.stderr

    # Nothing changed: the same round runs on both nodes, nothing was asked of them.
    with EtcdClient(job.endpoints) as c:
        assert c.get_prefix(f"/etcdrun/{job.run_id}/drain/").kvs == []
    assert set(job.rounds()) == {first[0].round}
    assert [a.proc.poll() for a in agents] == [None, None]


def test_sigterm_drains_above_min_nodes_and_stops_as_torchrun_at_min(etcd, job_factory):
    """Spot preemption, Kubernetes' pod deletion: SIGTERM to one agent of three (nnodes 2:3)
    is a drain — exit 0, the line, no restart, the others on at once. The next SIGTERM, with
    the job at its min nodes, keeps torchrun's meaning: forwarded to the workers, exit 143.
    """
    ttl = TTL
    job, agents, first, leaving = three_nodes(job_factory)
    round1 = first[0].round
    node = node_of(job, leaving)

    t0 = time.monotonic()
    leaving.proc.send_signal(signal.SIGTERM)
    second = job.wait_round(4, after=round1, timeout=30)
    assert leaving.wait(30) == 0, leaving.stderr
    took = time.monotonic() - t0
    print(f"SIGTERM to 1 of 3 nodes (a drain) -> the other 4 workers again after {took:.2f} s")
    gone = dict(zip(status(job)["departed"], status(job)["departed_cause"], strict=True))
    assert gone == {node: "left"}, f"the others waited for its lease to expire ({ttl} s): {gone}"
    line = f"run {job.run_id} round {round1}: node {node} drained (asked by SIGTERM)"
    assert sum(line in ln for ln in leaving.stderr.splitlines()) == 1, leaving.stderr
    assert {s.env["TORCHELASTIC_RESTART_COUNT"] for s in second} == {"0"}

    at_min = next(a for a in agents if a.pid == next(s.ppid for s in second if s.rank == 0))
    its_workers = {s.pid for s in second if s.ppid == at_min.pid}
    at_min.proc.send_signal(signal.SIGTERM)
    assert at_min.wait(30) == 128 + signal.SIGTERM, at_min.stderr
    assert "drained" not in at_min.stderr
    got = {pid: rec["signal"] for pid, rec in job.signals().items() if pid in its_workers}
    assert got == dict.fromkeys(its_workers, signal.SIGTERM), job.signals()


def test_sigterm_to_every_node_at_once_is_a_cancel_not_three_drains(etcd, job_factory):
    """A compose or pod teardown, ``scancel``, the demo's Ctrl-C: SIGTERM to every agent at
    once. Each judged alone that the job kept its min without it, so all three drained, exited
    0 and removed the run's record: a scheduler marked a cancelled job as completed (issue 44).
    Decided in etcd now: one node drains while the job still has its min (2 of 3), the others
    stop as under torchrun (exit 143), and the run's record says CANCELLED.
    """
    job, agents, first, _ = three_nodes(job_factory)
    for a in agents:
        a.proc.send_signal(signal.SIGTERM)
    codes = sorted(a.wait(60) for a in agents)
    assert codes == [0, 143, 143], [a.stderr[-1500:] for a in agents]
    said = [a for a in agents if "the run is CANCELLED" in a.stderr]
    assert len(said) == 1, [a.stderr[-1500:] for a in agents]
    s = status(job)
    assert (s["phase"], s["outcome"], s["state"]) == ("CLOSED", "CANCELLED", "cancelled"), s
