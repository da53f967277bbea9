"""``etcdrun status``: which node is missing, which round, why it restarted — from etcd alone.

Real etcd, real handlers for the job, the real command for the operator; ``--watch`` runs in a
real terminal (tmux) and redraws when the run changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from dataclasses import replace

import pytest
from agent_helpers import clean_env, etcdrun_bin, wait_for
from etcd_helpers import require_local
from rdzv_helpers import crash, exit_barriers, handler, new_run_id, rendezvous, shutdown_all

from etcdrun.agent.status_cmd import render
from etcdrun.rendezvous.api import FailureInfo, KeptRound
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.node import joining
from etcdrun.rendezvous.tools import status as status_mod
from etcdrun.rendezvous.tools.status import Node, RunStatus


def status(endpoints: str, run: str, *extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [etcdrun_bin(), "status", "--rdzv-endpoint", endpoints, "--rdzv-id", run, *extra],
        capture_output=True,
        text=True,
        timeout=30,
        env=env or clean_env(),
    )


def as_json(endpoints: str, run: str) -> dict:
    proc = status(endpoints, run, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_job_that_lost_a_node_which_node_which_round_why(etcd, monkeypatch):
    # Agents of protocol 1 (an older etcdrun) are never carried (design.md §3a): the round
    # after the loss gathers, and status names the node it waits for.
    monkeypatch.setattr(joining, "PROTOCOL", 1)
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 4, lease_ttl=2, last_call_timeout=0) for _ in range(3)]
    try:
        infos = rendezvous(hs)
        before = as_json(etcd.endpoints, run)
        assert (before["round"], before["phase"], before["world_size"]) == (1, "FROZEN", 3)
        assert before["state"] == "running"  # people's word, not the protocol's phase
        assert [n["node_rank"] for n in before["participants"]] == [0, 1, 2]
        assert all(n["lease_ttl_left"] is not None for n in before["participants"])
        victim = next(h for h, i in zip(hs, infos, strict=True) if i.node_rank == 1)
        lost = victim.node_id
        crash(victim)
        rest = [h for h in hs if h is not victim]
        for h in rest:
            assert h.membership_changed.wait(10)
        during = as_json(etcd.endpoints, run)  # the survivors have not rejoined yet
        assert (during["round"], during["phase"]) == (2, "JOINING")
        assert during["missing"] == [lost] and during["departed"] == [lost]  # which node, why
        assert lost in during["reason"] and lost not in [n["node_id"] for n in during["previous"]]
        text = status(etcd.endpoints, run).stdout
        assert f"MISSING: {lost}" in text and f"run {run}: forming: round 2" in text
        assert during["state"] == "forming"  # 2 live, min 2: the next round forms
        assert "(the next round goes on without it)" in text  # 2 live, min 2
        rendezvous(rest)
        after = as_json(etcd.endpoints, run)
        assert (after["round"], after["phase"], after["restart_count"]) == (2, "FROZEN", 0)
        assert lost not in [n["node_id"] for n in after["participants"]] and not after["missing"]
        assert (after["min_nodes"], after["max_nodes"], after["schema"]) == (2, 4, 1)
    finally:
        shutdown_all(hs)


def test_right_after_etcd_restarts_a_dead_node_is_unknown_not_running(etcd):
    """Found by a new user: right after etcd restarted, a dead run looked live (its leases at
    "2 s"), since a new etcd leader renews every lease. A node is alive only once its agent has
    renewed its lease since (its term mark); until then, or until the lease runs out, unknown.
    """
    local = require_local(etcd)
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 3, lease_ttl=6, last_call_timeout=0) for _ in range(3)]
    try:
        rendezvous(hs)
        assert as_json(etcd.endpoints, run)["state"] == "running"
        victim = hs[2]
        dead = victim.node_id
        crash(victim)  # kill -9: no revoke; its lease lives on until its TTL
        local.members[0].restart()  # the new leader renews every lease, the dead one's too
        first = as_json(etcd.endpoints, run)
        seen = {n["node_id"]: n for n in first["participants"]}
        assert seen[dead]["lease_ttl_left"] > 0  # what misled: a lease with time left
        assert seen[dead]["alive"] is None and first["state"] == "unknown", first
        assert f"UNKNOWN: {dead}" in status(etcd.endpoints, run).stdout
        survivors = {h.node_id for h in hs[:2]}

        def survivors_alive() -> bool:
            got = {n["node_id"]: n["alive"] for n in as_json(etcd.endpoints, run)["participants"]}
            return all(got.get(n) is True for n in survivors)

        wait_for(survivors_alive, 20, "the survivors to renew their leases in the new term")

        def dead_told() -> bool:  # its lease ran out: missing, then left out of the new round
            now = as_json(etcd.endpoints, run)
            mine = [n for n in now["participants"] if n["node_id"] == dead]
            return now["state"] != "unknown" and all(n["alive"] is False for n in mine)

        wait_for(dead_told, 30, "the dead node to be told gone")
    finally:
        shutdown_all(hs)


def test_a_failed_run_shows_its_outcome_and_root_cause(etcd):
    run = new_run_id()
    h = handler(etcd.endpoints, run, 1, 1)
    try:
        rendezvous([h])
        h.close_with_failure(FailureInfo("n", "host-b", 3, 1, "", "ValueError: boom", "tb", 1.0, 1))
        s = as_json(etcd.endpoints, run)
        assert (s["phase"], s["outcome"]) == ("CLOSED", "FAILED") and s["closed_unix_ms"] > 0
        assert s["state"] == "failed"
        cause = s["root_cause"]
        assert (cause["global_rank"], cause["host"], cause["message"]) == (
            3,
            "host-b",
            "ValueError: boom",
        )
        text = status(etcd.endpoints, run).stdout
        assert "ended: FAILED" in text and "root cause: rank 3 (local 1) on host-b" in text
        assert f"run {run}: failed: round " in text
    finally:
        shutdown_all([h])


def test_a_finished_run_names_no_node_missing(etcd):
    """Found by a new user: after `ended: SUCCEEDED`, every node of the run was listed MISSING
    ("its agent is gone") and the world size was 0.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 2, lws=2) for _ in range(2)]
    try:
        rendezvous(hs)
        assert exit_barriers(hs, 10) == [True, True]
    finally:
        shutdown_all(hs)  # the agents leave, as they do after a success
    s = as_json(etcd.endpoints, run)
    assert (s["phase"], s["outcome"], s["missing"]) == ("CLOSED", "SUCCEEDED", [])
    assert s["world_size"] == 4
    text = status(etcd.endpoints, run).stdout
    assert "ended: SUCCEEDED" in text and "MISSING" not in text and "world size 4" in text


def test_rounds_taken_in_place_are_shown_the_last_twenty_kept(etcd):
    """The node ranked 0 records each round taken in place (ReportPort.kept, one write per
    round); status shows the last ones with their pause, and etcd keeps only the last 20.
    """
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 2, 2, lease_ttl=2) for _ in range(2)]
    keys = RunKeys("/etcdrun", run)
    try:
        rendezvous(hs)
        with EtcdClient(etcd.endpoints) as c:
            for r in range(2, 24):
                hs[0].report().kept(KeptRound(r, r - 1, hs[0].node_id, 2, 0.05, 0.02, 2213))
                wait_for(lambda r=r: c.get(keys.kept(r)) is not None, 10, f"round {r}'s record")
        s = as_json(etcd.endpoints, run)
        assert [k["round"] for k in s["kept_rounds"]] == list(range(4, 24))
        assert s["kept_rounds"][-1] == dict(
            round=23,
            previous_round=22,
            node=hs[0].node_id,
            world_size=2,
            pause_s=0.05,
            form_s=0.02,
            sync_bytes=2213,
        )
        text = status(etcd.endpoints, run).stdout
        assert "in place: 15 earlier round(s) not shown" in text
        assert (
            "in place: round 23 (from round 22, world size 2): workers kept, training "
            "paused 0.05 s, group formed in 0.020 s, 2213 bytes synced" in text
        )
        assert "round 18 (" not in text and "round 19 (" in text
    finally:
        shutdown_all(hs)


def test_an_unknown_run_is_one_line_and_exit_1(etcd):
    proc = status(etcd.endpoints, "no-such-run")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no run no-such-run" in proc.stderr


def test_status_speaks_tls_like_the_agent(etcd_tls):
    run = new_run_id()
    conf = f"cacert={etcd_tls.tls.ca_file}"
    h = handler(etcd_tls.endpoints, run, 1, 1, cacert=etcd_tls.tls.ca_file)
    try:
        rendezvous([h])
        proc = status(etcd_tls.endpoints, run, "--rdzv-conf", conf, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["phase"] == "FROZEN"
        plain = status(etcd_tls.endpoints, run)  # no CA: one line, as the agent would say
        assert plain.returncode == 1 and plain.stderr.count("\n") == 1
    finally:
        shutdown_all([h])


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("tmux is not installed [CI=true: .ci/run installs it]", pytrace=False)
        pytest.skip("tmux not installed (apt-get install tmux)")
    name = "etcdrun-status-" + uuid.uuid4().hex[:8]
    yield name
    subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def test_watch_redraws_in_a_real_terminal_when_the_run_changes(etcd, tmux):
    run = new_run_id()
    hs = [handler(etcd.endpoints, run, 1, 3, lease_ttl=2, last_call_timeout=0)]
    try:
        rendezvous(hs)
        cmd = f"{etcdrun_bin()} status --watch --rdzv-endpoint {etcd.endpoints} --rdzv-id {run}"
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", tmux, "-x", "160", "-y", "40", cmd], check=True
        )

        def screen() -> str:
            return subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", tmux], capture_output=True, text=True
            ).stdout

        wait_for(lambda: "running: round 1, 1 nodes" in screen(), 20, "the first drawing")
        hs.append(handler(etcd.endpoints, run, 1, 3, lease_ttl=2))
        rendezvous(hs)  # a newcomer: round 2 with both
        wait_for(lambda: "running: round 2, 2 nodes" in screen(), 20, "a redraw after the change")
        assert "round 1," not in screen()  # redrawn in place, not appended
    finally:
        shutdown_all(hs)


def frozen_round(nodes: tuple[Node, ...], **kw) -> RunStatus:
    """Run "r" in its FROZEN round 1 with ``nodes``, min 2 nodes (``kw``: the other fields)."""
    return RunStatus(
        "r", "/etcdrun", 7, True, round=1, phase="FROZEN", min_nodes=2, **kw, participants=nodes
    )


@pytest.mark.parametrize(("alive", "said"), [(2, "goes on without it"), (1, "waits for 1 more")])
def test_missing_line_says_whether_the_next_round_can_form(alive, said):
    """Found by a new user: at min nodes, MISSING said the next round goes on without the node,
    where it waits for a newcomer.
    """
    nodes = tuple(Node(f"n{i}", host="h", node_rank=i) for i in range(alive + 1))
    s = frozen_round(nodes, max_nodes=4, missing=("n0",))
    line = next(x for x in render(s).splitlines() if "MISSING: n0" in x)
    assert said in line, line


@pytest.mark.parametrize(
    ("phase", "kw", "state"),
    [
        ("FROZEN", {}, "running"),
        ("FROZEN", {"missing": ("n0",)}, "forming"),  # 2 of 3 left, min 2: a round forms
        ("FROZEN", {"missing": ("n0", "n1")}, "waiting for nodes"),
        ("FROZEN", {"alive": None}, "unknown"),  # a lease that could not be read, or not
        # renewed since etcd's leader changed
        ("JOINING", {"joining": 2}, "forming"),
        ("JOINING", {"joining": 1}, "waiting for nodes"),
        ("CLOSED", {"outcome": "SUCCEEDED"}, "finished"),
        ("CLOSED", {"outcome": "FAILED"}, "failed"),
        ("CLOSED", {"outcome": "CANCELLED"}, "cancelled"),
    ],
)
def test_the_state_is_said_in_peoples_words(phase, kw, state):
    """A healthy running job showed "round 1 FROZEN" (the docs say "frozen" of a stopped node):
    the first line says running, forming, waiting for nodes, finished, failed or cancelled, and
    unknown when a node's liveness cannot be read.
    """
    alive = kw.get("alive", True)
    nodes = tuple(
        Node(f"n{i}", host="h", node_rank=i, lease_ttl_left=3, alive=alive) for i in range(3)
    )
    joining = tuple(Node(f"n{i}", host="h") for i in range(kw.get("joining", 0)))
    s = RunStatus(
        "r",
        "/etcdrun",
        7,
        True,
        round=1,
        phase=phase,
        min_nodes=2,
        max_nodes=4,
        participants=nodes if phase == "FROZEN" else (),
        missing=kw.get("missing", ()),
        joining=joining,
        outcome=kw.get("outcome"),
    )
    assert s.state == state and s.to_json()["state"] == state
    assert render(s).splitlines()[0].startswith(f"run r: {state}: round 1")


def test_a_mistyped_endpoint_gets_an_answer_in_seconds_not_the_agents_30():
    """Found by a new user: `etcdrun status` at a wrong port retried for the agent's 30 s."""
    proc = status("127.0.0.1:1", "no-such-run")
    assert proc.returncode == 1, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "unreachable since" in ln]
    assert len(said) == 1 and "(retry_timeout 5 s)" in said[0], proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("etcdrun status: error: etcd unreachable")
    # the job's own retry_timeout, when the operator passes its --rdzv-conf, still wins
    proc = status("127.0.0.1:1", "no-such-run", "--rdzv-conf", "retry_timeout=1")
    assert proc.returncode == 1 and "(retry_timeout 1 s)" in proc.stderr, proc.stderr


def test_a_node_whose_agent_registered_again_is_said_so_not_only_missing():
    """Found by a new user: after an etcd outage a node showed as MISSING ("its agent is
    gone") while its process lived on as the next incarnation, itself listed as a hot spare of
    a job at max. Both lines now say what happened: the same agent, registered again.
    """
    nodes = tuple(Node(f"h-{c}.1", host="h", node_rank=i) for i, c in enumerate("abc"))
    waiting = (Node("h-c.2", host="h"), Node("h-d.1", host="h"))
    s = frozen_round(nodes, max_nodes=3, missing=("h-c.1",), waiting=waiting)
    assert status_mod._rejoined(s) == {"h-c.1": "h-c.2"}
    text = render(replace(s, rejoined=status_mod._rejoined(s)))
    missing = next(x for x in text.splitlines() if "MISSING: h-c.1" in x)
    assert "registered again as h-c.2" in missing, missing
    assert "waiting: h-c.2 on h — registered again (was h-c.1" in text, text
    assert "waiting: h-d.1 on h — newcomer" in text  # 2 places held of max 3: not a hot spare
