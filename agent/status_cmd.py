"""``etcdrun status``: a run as etcd holds it, for people (text) and scripts (``--json``).

Why a subcommand of etcdrun: the operator already has it wherever the job runs, with the same
``--rdzv-endpoint``/``--rdzv-id``/``--rdzv-conf`` (TLS and auth exactly like the agent's, from
the conf or from etcdctl's environment variables). ``--watch`` redraws on every change of the
run's keys, driven by a watch from the revision it read — never polling — so a lease countdown
moves only when something happens.

A script that is literally called ``status`` must be given as ``./status`` to be run as a job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from etcdrun.agent.flags import UsageError
from etcdrun.agent.run_flags import OneLineParser, add_run_flags, keys_and_client, run_config

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: --watch redraws in place


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="etcdrun status",
        description="Show a run as etcd holds it: its round, nodes, restarts and outcome.",
        allow_abbrev=False,
    )
    add_run_flags(p)
    p.add_argument("--watch", action="store_true", help="redraw on every change (a watch)")
    p.add_argument("--json", action="store_true", help="one JSON object (one per change)")
    return p


def render(s: Any) -> str:
    """The text view of a RunStatus: the facts an operator asks for first, one per line."""
    if not s.exists:
        return f"run {s.run_id}: nothing in etcd under {s.prefix}"
    job = _job_line(s)
    lines = [job]
    if s.reason and s.phase != "CLOSED":
        lines.append(f"  opened because: {s.reason}")
    if s.phase == "CLOSED":
        lines += _closed_lines(s)
    if s.participants:
        lines.append(f"  master: {s.master_addr}:{s.master_port}" if s.master_port else "")
        lines.append(
            "  rank  node                                host            pid  workers  lease"
        )
        for n in s.participants:
            left = _lease_cell(s, n)
            lines.append(
                f"  {n.node_rank:>4}  {n.node_id[:34]:<34}  {n.host[:14]:<14} {n.pid:>6}"
                f"  {n.local_world_size:>7}  {left}"
            )
    if s.previous:
        ranks = ", ".join(f"{n.node_rank}: {n.node_id}" for n in s.previous)
        lines.append(f"  last round's nodes (rank: node): {ranks}")
    if s.last_call_deadline_unix_ms and s.phase == "JOINING":
        left = max(0.0, s.last_call_deadline_unix_ms / 1000 - time.time())
        lines.append(
            f"  first round: {s.last_call_joined} of max {s.max_nodes} joined "
            f"(min {s.min_nodes}); starting in {left:.0f} s unless more join"
        )
    lines += _missing_lines(s)
    lines += _unknown_lines(s)
    for n in s.joining:
        lines.append(f"  {'joined' if n.joined else 'not yet joined'}: {n.node_id} on {n.host}")
    if s.waiting:
        held = [n for n in s.participants if n.node_id not in s.missing]  # a lost place is free
        room = s.max_nodes is not None and len(held) >= s.max_nodes
        what = "hot spare (the job is at max)" if room else "newcomer"
        resting = {c.node_id for c in s.cooldowns if c.resting}
        was = {new: old for old, new in s.rejoined.items()}
        for n in s.waiting:
            label = "cooled down (below)" if n.node_id in resting else what
            if n.node_id in was:
                label = f"registered again (was {was[n.node_id]}, missing above)"
            lines.append(f"  waiting: {n.node_id} on {n.host} — {label}")
    lines += _cooldown_lines(s)
    lines += _kept_lines(s)
    lines += _pace_lines(s)
    for key in s.unreadable:
        lines.append(f"  UNREADABLE: {key} (not written by etcdrun?)")
    return "\n".join(line for line in lines if line)


def _missing_lines(s: Any) -> list[str]:
    """One line per lost node: why it is gone, and whether the next round can form without it."""
    causes = dict(zip(s.departed, s.departed_cause, strict=False))
    known = {n.node_id: n for n in (*s.participants, *s.previous)}
    lines: list[str] = []
    # Without the missing nodes the next round forms only if the live ones and the waiting ones
    # reach min; below that it waits for newcomers, and saying "goes on" would mislead the pager.
    if s.phase == "JOINING":
        live = len(s.joining)
    else:
        live = sum(n.node_id not in s.missing for n in s.participants) + len(s.waiting)
    if s.min_nodes is not None and live < s.min_nodes:
        short = s.min_nodes - live
        after = f"the job is below its min of {s.min_nodes}: the next round waits for {short} more"
    else:
        after = "the next round goes on without it"
    for node in s.missing:
        n = known.get(node)
        who = f" ({n.host}, pid {n.pid})" if n is not None and n.host else ""
        why = causes.get(node, "its agent is gone")
        again = s.rejoined.get(node)
        back = f"; its agent lives on and registered again as {again}" if again else ""
        lines.append(f"  MISSING: {node}{who}: {why}{back} ({after})")
    return lines


def _lease_cell(s: Any, n: Any) -> str:
    """A participant's lease column: its time left, or why there is none to show."""
    if n.lease_ttl_left is None and n.node_id in s.missing:
        return "gone"
    if n.alive is None:
        return "unknown"
    return "?" if n.lease_ttl_left is None else f"{n.lease_ttl_left} s"


def _unknown_lines(s: Any) -> list[str]:
    """One line per node whose liveness cannot be told (``Node.alive`` is None), and when it
    will be: right after etcd restarts or changes leader, every lease looks freshly renewed,
    a dead agent's too, until its agent renews it (alive) or it runs out (gone).
    """
    return [
        f"  UNKNOWN: {n.node_id} ({n.host}, pid {n.pid}): not heard from since etcd restarted "
        "or changed leader, which renews every lease; told within its lease TTL "
        "(renewed: alive; run out: gone)"
        if n.lease_ttl_left is not None
        else f"  UNKNOWN: {n.node_id} ({n.host}, pid {n.pid}): its lease could not be read"
        for n in (*s.participants, *s.joining)
        if n.alive is None
    ]


def _cooldown_lines(s: Any) -> list[str]:
    """Bad-host cooldowns (docs/hangs.md, "Bad hosts"): who sits rounds out, for how long."""
    return [
        f"  COOLED DOWN: {c.node_id} for {c.seconds_left:.0f} s more (cooldown {c.cooldowns}; "
        f"last failure: {c.why})"
        for c in s.cooldowns
        if c.resting
    ]


def _kept_lines(s: Any, shown: int = 5) -> list[str]:
    """The last rounds taken in place (docs/in-place.md): the workers kept, and their pause."""
    lines = []
    for k in s.kept_rounds[-shown:]:
        pause = "?" if k.pause_s is None else f"{k.pause_s:.2f} s"
        form = "" if k.form_s is None else f", group formed in {k.form_s:.3f} s"
        synced = "" if k.sync_bytes is None else f", {k.sync_bytes} bytes synced"
        lines.append(
            f"  in place: round {k.round} (from round {k.previous_round}, world size "
            f"{k.world_size}): workers kept, training paused {pause}{form}{synced}"
        )
    earlier = len(s.kept_rounds) - shown
    if earlier > 0:
        lines.insert(0, f"  in place: {earlier} earlier round(s) not shown (--json has them)")
    return lines


def _pace_lines(s: Any) -> list[str]:
    """Each node's published pace, and the stragglers (docs/hangs.md, "Stragglers")."""
    if not s.paces:
        return []
    median = "" if s.median_rate is None else f"; median {s.median_rate:.2f} steps/CPU-s"
    lines = [
        f"  progress (straggler: below {s.straggler_fraction:g} of the median{median}):",
        "  node                                round     step  steps/s  steps/CPU-s   lag",
    ]
    for p in s.paces:
        mark = "  STRAGGLER" if p.straggler else ""
        lines.append(
            f"  {p.node_id[:34]:<34}  {p.round:>5} {p.step:>8}  {p.step_rate:>7.2f}"
            f"  {p.rate:>11.2f} {p.lag:>5}{mark}"
        )
    return lines


def _job_line(s: Any) -> str:
    """The job's state in people's words first (``RunStatus.state``), then the round."""
    size = "" if s.min_nodes is None else f" (nodes {s.min_nodes}..{s.max_nodes})"
    budget = "" if s.max_restarts is None else f"/{s.max_restarts}"
    if s.round is None:
        return f"run {s.run_id}: {s.state}: agents registered, no round yet{size}"
    nodes = f", {len(s.participants)} nodes, world size {s.world_size}" if s.participants else ""
    return (
        f"run {s.run_id}: {s.state}: round {s.round}{nodes}{size}, "
        f"restarts {s.restart_count}{budget}"
    )


def _closed_lines(s: Any) -> list[str]:
    when = ""
    if s.closed_unix_ms:
        when = " at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.closed_unix_ms / 1e3))
    lines = [f"  ended: {s.outcome or 'CLOSED'}{when}"]
    c = s.root_cause
    if c is not None:
        how = f"signal {c.signal}" if c.signal else f"exit code {c.exit_code}"
        lines.append(
            f"  root cause: rank {c.global_rank} (local {c.local_rank}) on {c.host}: {how}"
            + (f": {c.message}" if c.message else "")
        )
    return lines


def _show(s: Any, as_json: bool, out: TextIO, redraw: bool) -> None:
    if as_json:
        out.write(json.dumps(s.to_json(), sort_keys=True) + "\n")
    else:
        out.write((CLEAR if redraw else "") + render(s) + "\n")
    out.flush()


def run(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Show the run; with ``--watch``, again after every change, until interrupted."""
    from etcdrun.rendezvous.tools import status

    ns = _parser().parse_args(list(argv))
    keys, client = keys_and_client(ns, "status")
    fraction = run_config(ns).straggler_fraction
    with client:
        s = status.read(client, keys, fraction=fraction)
        if not s.exists and not ns.watch:
            raise LookupError(
                f"no run {keys.run_id} in etcd at {client.endpoints} (nothing under {keys.root})"
            )
        _show(s, ns.json, out, redraw=ns.watch and not ns.json)
        if not ns.watch:
            return 0
        w = client.watch(keys.root, prefix=True, start_revision=s.revision + 1)
        try:
            while True:
                if w.get(timeout=None) is not None:
                    _show(
                        status.read(client, keys, fraction=fraction),
                        ns.json,
                        out,
                        redraw=not ns.json,
                    )
        finally:
            w.cancel()


def main(argv: Sequence[str]) -> int:
    """Exit codes: 0 shown; 1 the run is unknown or etcd failed (one line); 2 a usage error."""
    from etcdrun.rendezvous.client import EtcdError
    from etcdrun.rendezvous.errors import RendezvousError

    try:
        return run(argv)
    except UsageError as exc:
        print(f"etcdrun status: error: {exc}", file=sys.stderr)
        return 2
    except (LookupError, EtcdError, RendezvousError) as exc:
        print(f"etcdrun status: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad --rdzv-conf key or value
        print(f"etcdrun status: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


__all__ = ["main", "render", "run"]
