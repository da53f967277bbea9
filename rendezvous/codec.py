"""Values in etcd are our protobuf messages; this is the one place that reads and writes them.

Why strict: a value another program wrote under our prefix, a truncated value, or one from a newer
schema must stop the rendezvous with a RendezvousStateError naming the key — not surface later as
an AttributeError deep inside a decision.
"""

from __future__ import annotations

import threading
import time
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import Departure, FailureInfo, RoundCause
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.protocol import Agent, Join, Member, Phase, Round

SCHEMA_VERSION = 1
M = TypeVar("M", bound=Message)


def decode(cls: type[M], key: bytes | str, value: bytes, run_id: str | None = None) -> M:
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    try:
        msg = cls.FromString(value)
    except (DecodeError, ValueError) as e:
        raise RendezvousStateError(f"corrupt value at {k}: {e}", run_id=run_id) from None
    ver = getattr(msg, "schema_version", None)
    if ver != SCHEMA_VERSION:
        what = "not an etcdrun value" if not ver else f"unknown schema version {ver}"
        raise RendezvousStateError(
            f"cannot read {k}: {what} ({cls.__name__} expected)", run_id=run_id
        )
    return msg


def encode(msg: Message) -> bytes:
    msg.schema_version = SCHEMA_VERSION  # type: ignore[attr-defined]
    return msg.SerializeToString()


_ROUND_CACHE_SIZE = 8
_round_cache: dict[tuple[str, int, bytes], tuple[Round, st.RoundState]] = {}
_round_cache_lock = threading.Lock()


def round_and_message(
    key: bytes | str, value: bytes, mod_revision: int, run_id: str | None
) -> tuple[Round, st.RoundState]:
    """Decode a round value once per process: with many handlers sharing a client (the scale
    bench, a torchrun plugin) each watcher would otherwise rebuild the same N participants — N^2
    work per round.

    The cache is keyed by the value's bytes (with the key and mod_revision the Round carries),
    not by (key, mod_revision) alone: two etcd clusters in one process, or an etcd rebuilt with
    the same prefix and run id, reuse revisions, and must never get each other's rounds. Equal
    bytes decode to equal rounds whatever cluster they came from; the lookup costs one hash of
    bytes etcd just sent (hashed once per bytes object) and one comparison."""
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    cache_key = (k, mod_revision, bytes(value))
    with _round_cache_lock:
        hit = _round_cache.get(cache_key)
    if hit is not None:
        return hit
    msg = decode(st.RoundState, k, value, run_id)
    if msg.phase not in (st.JOINING, st.FROZEN, st.CLOSED) or msg.number < 1:
        raise RendezvousStateError(
            f"cannot read {k}: round {msg.number} in phase {msg.phase}", run_id=run_id
        )
    failure = failure_from(msg.failure) if msg.HasField("failure") else None
    r = Round(
        msg.number,
        Phase(msg.phase),
        members_from(msg),
        msg.restart_count,
        msg.master_addr,
        msg.master_port,
        mod_revision,
        failure,
        msg.run_lease,
    )
    with _round_cache_lock:
        if len(_round_cache) >= _ROUND_CACHE_SIZE:
            _round_cache.pop(next(iter(_round_cache)))  # the oldest entry
        _round_cache[cache_key] = (r, msg)
    return r, msg


def round_from(key: bytes | str, value: bytes, mod_revision: int, run_id: str | None) -> Round:
    return round_and_message(key, value, mod_revision, run_id)[0]


TAIL_LINES, TAIL_LINE_CHARS, TAIL_CHARS = 20, 300, 4000  # what of a stderr tail goes to etcd


def _tail_to(lines: tuple[str, ...]) -> list[str]:
    """The last lines of a stderr tail that fit the budget: the round key every agent watches
    must stay small (a frozen round carries its failure)."""
    out: list[str] = []
    total = 0
    for line in reversed(lines[-TAIL_LINES:]):
        line = line[:TAIL_LINE_CHARS]
        total += len(line)
        if total > TAIL_CHARS:
            break
        out.append(line)
    return out[::-1]


def failure_to(f: FailureInfo) -> st.Failure:
    return st.Failure(
        node_id=f.node_id,
        host=f.host,
        global_rank=f.global_rank,
        exit_code=f.exit_code,
        signal_name=f.signal_name,
        message=f.message[:2000],
        traceback=f.traceback[-8000:],
        timestamp_ms=int(f.timestamp * 1000),
        local_rank=f.local_rank,
        pid=f.pid,
        stderr_tail=_tail_to(tuple(f.stderr_tail)),
    )


def failure_from(f: st.Failure) -> FailureInfo:
    return FailureInfo(
        f.node_id,
        f.host,
        f.global_rank,
        f.exit_code,
        f.signal_name,
        f.message,
        f.traceback,
        f.timestamp_ms / 1000.0,
        f.local_rank,
        f.pid,
        tuple(f.stderr_tail),
    )


def members_from(msg: st.RoundState) -> tuple[Member, ...]:
    return tuple(
        Member(
            p.node_id, p.node_rank, p.local_world_size, p.addr, p.first_global_rank, p.host, p.pid
        )
        for p in msg.participants
    )


def cause_from(msg: st.RoundState | None) -> RoundCause | None:
    """Why the round in ``msg`` opened (a JOINING round, or the FROZEN one that keeps it)."""
    if msg is None or msg.phase == st.CLOSED:
        return None
    causes = list(msg.departed_cause)
    departed = tuple(
        Departure(n, causes[i] if i < len(causes) and causes[i] else "gone")
        for i, n in enumerate(msg.departed)
    )
    failure = failure_from(msg.failure) if msg.HasField("failure") else None
    return RoundCause(msg.reason, departed, tuple(msg.arrived), failure)


def hint_to(number: int, members: tuple[Member, ...]) -> bytes:
    return round_to(Round(number, Phase.JOINING, members))


def hint_from(key: bytes | str, value: bytes, run_id: str | None) -> tuple[Member, ...]:
    return members_from(decode(st.RoundState, key, value, run_id))


def round_to(
    r: Round,
    *,
    reason: str = "",
    decided_by: str = "",
    outcome: int = 0,
    failure: st.Failure | None = None,
    departed: tuple[str, ...] = (),
    arrived: tuple[str, ...] = (),
    departed_cause: tuple[str, ...] = (),
    last_call: tuple[int, int] | None = None,
) -> bytes:
    msg = st.RoundState(
        number=r.number,
        phase=r.phase.value,
        restart_count=r.restart_count,
        master_addr=r.master_addr,
        master_port=r.master_port,
        reason=reason,
        decided_by=decided_by,
        outcome=outcome,
        closed_unix_ms=int(time.time() * 1000) if r.phase is Phase.CLOSED else 0,
        run_lease=r.run_lease,
        departed=list(departed),
        arrived=list(arrived),
        departed_cause=list(departed_cause),
        world_size=sum(m.local_world_size for m in r.members) if r.phase is Phase.FROZEN else 0,
        participants=[
            st.Participant(
                node_id=m.node_id,
                node_rank=m.node_rank,
                local_world_size=m.local_world_size,
                addr=m.addr,
                first_global_rank=m.first_global_rank,
                host=m.host,
                pid=m.pid,
            )
            for m in r.members
        ],
    )
    if last_call is not None:
        msg.last_call_deadline_unix_ms, msg.last_call_joined = last_call
    if failure is None and r.failure is not None:
        failure = failure_to(r.failure)
    if failure is not None:
        msg.failure.CopyFrom(failure)
    return encode(msg)


def round_message(value: bytes, key: str, run_id: str | None = None) -> st.RoundState:
    return decode(st.RoundState, key, value, run_id)


def agent_info(key: bytes | str, value: bytes, run_id: str | None, lease: int) -> st.AgentInfo:
    """An agent's published record, from its key under agents/ — only when the key's ``lease``
    is the one its value names (an agent of an older version, which names none, must at least
    hold a lease). Anything else was not written by its agent (an ``etcdctl put`` strips the
    lease) and must not count: such a key would outlive every agent and hold the run forever."""
    msg = decode(st.AgentInfo, key, value, run_id)
    if lease == 0 or (msg.lease_id and msg.lease_id != lease):
        k = key.decode(errors="replace") if isinstance(key, bytes) else key
        raise RendezvousStateError(
            f"{k} is not an agent: the key is held by lease {lease:x}, its value names "
            f"lease {msg.lease_id:x} (written by something other than its etcdrun agent?)",
            run_id=run_id,
        )
    return msg


def agent_from(
    key: bytes | str, value: bytes, create_revision: int, run_id: str | None, lease: int
) -> Agent:
    msg = agent_info(key, value, run_id, lease)
    return Agent(msg.node_id, create_revision, msg.local_world_size, msg.addr)


def join_from(key: bytes | str, value: bytes, run_id: str | None) -> Join:
    msg = decode(st.JoinRecord, key, value, run_id)
    return Join(
        msg.node_id,
        msg.local_world_size,
        msg.addr,
        msg.master_port,
        msg.agent_create_revision,
        msg.host,
        msg.pid,
    )
