"""What a fault puts on the console: one line per event a person can act on, the details in
agent.log (issue 44, item 4).

Why: an etcd blip printed about 16 internal lines per node (a lease "in doubt", "lost", "revoke
failed: requested lease not found", the warden's own account of what the agent also said), and
the person paged at 2 a.m. had to find the three that matter. Here one agent's etcd is paused
past the agent's lease: its console must say that etcd is unreachable, that the workers were
fenced, that etcd is back and the new round, and no lease details; agent.log has them.
"""

from __future__ import annotations

from agent_helpers import WORKER, Job, clean_env, wait_for
from etcd_helpers import require_local


def test_an_etcd_outage_says_what_matters_on_the_console_and_the_rest_in_agent_log(etcd, tmp_path):
    local = require_local(etcd)
    logs = tmp_path / "logs"
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1",
        nproc=1,
        conf="lease_ttl=2",
        extra=("--log-dir", str(logs)),
    )
    try:
        agent = job.start(WORKER, str(job.out), "sleep", env=clean_env())
        job.wait_round(1, timeout=60)
        member = local.members[0]
        member.pause()
        try:
            wait_for(lambda: "fenced:" in agent.stderr, 30, "the agent fencing its workers")
        finally:
            member.resume()
        wait_for(lambda: "reachable again" in agent.stderr, 30, "etcd answering again")
        job.wait_round(1, after=1, timeout=60)  # the node rejoined in a new round
    finally:
        job.close()
    console = [ln for ln in agent.stderr.splitlines() if "etcdrun" in ln]
    assert any("unreachable since" in ln for ln in console), console
    details = ("in doubt", "revoke failed", "lease not found", "etcdrun warden:")
    assert not [ln for ln in console if any(d in ln for d in details)], console
    assert not [ln for ln in console if "etcd lease" in ln and " lost: " in ln], console
    kept = (logs / "agent.log").read_text()
    assert "in doubt" in kept and " lost: " in kept, "agent.log lost the details"
