"""Values in etcd are our protobuf messages; this is the one place that reads and writes them.

Why strict: a value another program wrote under our prefix, a truncated value, or one from a newer
schema must stop the rendezvous with a RendezvousStateError naming the key — not surface later as
an AttributeError deep inside a decision.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import Departure, DepartureCause, FailureInfo, RoundCause
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core.protocol import Agent, Join, Member, Phase, Round, Sharded

SCHEMA_VERSION = 1
PACKED_SCHEMA_VERSION = 2  # a RoundState whose participants are deflated (participants_zlib)
PACK_AT = 64  # participants from which a round value carries them deflated
MAX_INFLATED = 64 << 20  # a deflated list larger than this is corrupt, not a round to read
M = TypeVar("M", bound=Message)
_T = TypeVar("_T")


def decode(cls: type[M], key: bytes | str, value: bytes, run_id: str | None = None) -> M:
    """Parse ``value`` as ``cls``; a RoundState comes back with its participants inflated, so
    every reader (agents, status, the checker) sees one shape whatever size the round is.
    """
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    try:
        msg = cls.FromString(value)
    except (DecodeError, ValueError) as e:
        raise RendezvousStateError(f"corrupt value at {k}: {e}", run_id=run_id) from None
    ver = getattr(msg, "schema_version", None)
    packed = cls is st.RoundState and ver == PACKED_SCHEMA_VERSION
    if ver != SCHEMA_VERSION and not packed:
        what = "not an etcdrun value" if not ver else f"unknown schema version {ver}"
        raise RendezvousStateError(
            f"cannot read {k}: {what} ({cls.__name__} expected)", run_id=run_id
        )
    if cls is st.RoundState:
        _inflate(msg, packed, k, run_id)  # type: ignore[arg-type]
    return msg


def _inflate(msg: st.RoundState, packed: bool, key: str, run_id: str | None) -> None:
    """Move a packed round's participants back into ``participants``. A value that says one
    thing and holds the other (a schema-1 value with a deflated list, a schema-2 value with
    plain participants or none) was not written by etcdrun and must not be read as a round.
    """
    data = msg.participants_zlib
    if packed != bool(data) or (packed and len(msg.participants)):
        raise RendezvousStateError(
            f"corrupt value at {key}: schema version {msg.schema_version} with "
            f"{'a deflated' if data else 'no deflated'} participant list",
            run_id=run_id,
        )
    if not packed:
        return
    try:
        d = zlib.decompressobj()
        raw = d.decompress(data, MAX_INFLATED)
        if d.unconsumed_tail or not d.eof:
            raise ValueError(f"not a whole list of at most {MAX_INFLATED} bytes")
        msg.participants.extend(st.ParticipantList.FromString(raw).participants)
    except (zlib.error, DecodeError, ValueError) as e:
        raise RendezvousStateError(
            f"corrupt value at {key}: its deflated participants: {e}", run_id=run_id
        ) from None
    msg.ClearField("participants_zlib")


def encode(msg: Message) -> bytes:
    msg.schema_version = SCHEMA_VERSION  # type: ignore[attr-defined]
    return msg.SerializeToString()


def encode_round(msg: st.RoundState) -> bytes:
    """A round value as etcd stores it: from PACK_AT participants on, deflated. Every watcher
    receives the frozen round, so its size times N is what etcd sends per round: O(N^2) bytes,
    hundreds of megabytes at thousands of nodes (bench/results/rendezvous_scale.md). Below
    PACK_AT the value stays schema 1, readable by any agent version.
    """
    if len(msg.participants) < PACK_AT:
        return encode(msg)
    out = st.RoundState()
    out.CopyFrom(msg)
    out.ClearField("participants")
    plain = st.ParticipantList(participants=msg.participants).SerializeToString()
    out.participants_zlib = zlib.compress(plain, 1)  # level 6: a little smaller, much slower
    out.schema_version = PACKED_SCHEMA_VERSION
    return out.SerializeToString()


_ROUND_CACHE_SIZE = 8
_round_cache: dict[tuple[str, int, bytes], tuple[Round, st.RoundState]] = {}
_cache_lock = threading.Lock()
_SHARD_CACHE_SIZE = 128  # two sharded rounds' worth of the run's shard keys (shards.SHARDS)
_shard_cache: dict[tuple[str, int, bytes], Round] = {}


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
    bytes etcd just sent (hashed once per bytes object) and one comparison.
    """
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    return _memo(
        _round_cache,
        _ROUND_CACHE_SIZE,
        (k, mod_revision, bytes(value)),
        lambda: _round_and_message(k, value, mod_revision, run_id),
    )


def _memo(cache: dict, size: int, cache_key: tuple, build: Callable[[], _T]) -> _T:
    """``cache[cache_key]``, built on a miss; past ``size`` entries the oldest goes. Shared by
    the round and the shard decodes (``round_and_message`` says why they are cached).
    """
    with _cache_lock:
        hit = cache.get(cache_key)
    if hit is not None:
        return hit
    made = build()
    with _cache_lock:
        if len(cache) >= size:
            cache.pop(next(iter(cache)))  # the oldest entry
        cache[cache_key] = made
    return made


def _round_and_message(
    k: str, value: bytes, mod_revision: int, run_id: str | None
) -> tuple[Round, st.RoundState]:
    msg = decode(st.RoundState, k, value, run_id)
    if msg.phase not in (st.JOINING, st.FROZEN, st.CLOSED) or msg.number < 1:
        raise RendezvousStateError(
            f"cannot read {k}: round {msg.number} in phase {msg.phase}", run_id=run_id
        )
    failure = failure_from(msg.failure) if msg.HasField("failure") else None
    sharded = _sharded(msg, k, run_id)
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
        carried=msg.carried,
        held=tuple((p.node_id, tuple(p.held_from)) for p in msg.participants if p.held_from),
        protocol=msg.protocol,
        sharded=sharded,
        cancelled=msg.phase == st.CLOSED and msg.outcome == st.CANCELLED,
    )
    return r, msg


def _sharded(msg: st.RoundState, key: str, run_id: str | None) -> Sharded | None:
    """A sharded round's header (shards.py): frozen or closed, listing nobody itself."""
    if not msg.shards:
        return None
    if msg.phase == st.JOINING or len(msg.participants) or not msg.node_count:
        raise RendezvousStateError(
            f"corrupt value at {key}: round {msg.number} in {msg.shards} shards, "
            f"phase {msg.phase}, {len(msg.participants)} participants listed, "
            f"node count {msg.node_count}",
            run_id=run_id,
        )
    return Sharded(msg.shards, msg.node_count, msg.world_size)


def round_from(key: bytes | str, value: bytes, mod_revision: int, run_id: str | None) -> Round:
    return round_and_message(key, value, mod_revision, run_id)[0]


TAIL_LINES, TAIL_LINE_CHARS, TAIL_CHARS = 20, 300, 4000  # what of a stderr tail goes to etcd


def _tail_to(lines: tuple[str, ...]) -> list[str]:
    """The last lines of a stderr tail that fit the budget: the round key every agent watches
    must stay small (a frozen round carries its failure).
    """
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
        Departure(n, DepartureCause.parse(causes[i] if i < len(causes) else ""))
        for i, n in enumerate(msg.departed)
    )
    failure = failure_from(msg.failure) if msg.HasField("failure") else None
    return RoundCause(msg.reason, departed, tuple(msg.arrived), failure)


def shard_to(r: Round, members: tuple[Member, ...]) -> bytes:
    """One shard of the sharded round ``r`` (rounds/shard/<i>): a RoundState of its number,
    phase FROZEN and these participants alone, deflated as a round is from PACK_AT. The number
    says which round wrote it: the keys are the same every sharded round.
    """
    return round_to(Round(r.number, Phase.FROZEN, members, held=r.held))


def shard_message(
    key: bytes | str, value: bytes, number: int | None, run_id: str | None
) -> st.RoundState:
    """A shard as stored (its participants inflated), checked to be one: of round ``number``,
    or of any round when it is None (the caller reads the number).
    """
    msg = decode(st.RoundState, key, value, run_id)
    wrong_round = number is not None and msg.number != number
    if wrong_round or msg.phase != st.FROZEN or msg.shards:
        k = key.decode(errors="replace") if isinstance(key, bytes) else key
        raise _not_a_shard(k, number, msg.number, msg.phase, run_id)
    return msg


def shard_from(
    key: bytes | str, value: bytes, number: int | None, run_id: str | None, mod_revision: int = 0
) -> Round:
    """A shard (of round ``number``, or of any round when None): its round's number, its
    members and what they held (``Round.held``). Decoded once per process and version, as a
    round is (``round_and_message``): the handlers sharing a client that hash to one shard key
    all get its event.
    """
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    got = _memo(
        _shard_cache,
        _SHARD_CACHE_SIZE,
        (k, mod_revision, bytes(value)),
        lambda: _shard(shard_message(k, value, None, run_id), mod_revision),
    )
    if number is not None and got.number != number:
        raise _not_a_shard(k, number, got.number, st.FROZEN, run_id)
    return got


def _shard(msg: st.RoundState, mod_revision: int) -> Round:
    held = tuple((p.node_id, tuple(p.held_from)) for p in msg.participants if p.held_from)
    return Round(msg.number, Phase.FROZEN, members_from(msg), held=held, mod_revision=mod_revision)


def _not_a_shard(
    key: str, number: int | None, got: int, phase: int, run_id: str | None
) -> RendezvousStateError:
    return RendezvousStateError(
        f"corrupt value at {key}: not a shard of round {number or 'any'} (round {got}, "
        f"phase {phase})",
        run_id=run_id,
    )


def hint_to(number: int, members: tuple[Member, ...]) -> bytes:
    return round_to(Round(number, Phase.JOINING, members))


def hint_from(key: bytes | str, value: bytes, run_id: str | None) -> tuple[Member, ...]:
    return members_from(decode(st.RoundState, key, value, run_id))


@dataclass(frozen=True)
class Why:
    """Why a round opened, as its round key carries it and its frozen round keeps (design.md
    §2): the reason line, the nodes that went (with how: "lease expired", "left", "gone") and
    the nodes that came. A worker failure that opened it travels in the Round itself.
    """

    reason: str = ""
    departed: tuple[str, ...] = ()
    departed_cause: tuple[str, ...] = ()
    arrived: tuple[str, ...] = ()

    @classmethod
    def of(cls, msg: st.RoundState) -> Why:
        return cls(msg.reason, tuple(msg.departed), tuple(msg.departed_cause), tuple(msg.arrived))


def round_to(
    r: Round,
    *,
    why: Why = Why(),
    decided_by: str = "",
    outcome: int = 0,
    failure: st.Failure | None = None,
) -> bytes:
    msg = st.RoundState(
        number=r.number,
        phase=r.phase.value,
        restart_count=r.restart_count,
        master_addr=r.master_addr,
        master_port=r.master_port,
        reason=why.reason,
        decided_by=decided_by,
        outcome=outcome,
        closed_unix_ms=int(time.time() * 1000) if r.phase is Phase.CLOSED else 0,
        run_lease=r.run_lease,
        departed=list(why.departed),
        arrived=list(why.arrived),
        departed_cause=list(why.departed_cause),
        world_size=r.world_size if r.phase is Phase.FROZEN or r.sharded is not None else 0,
        participants=[]
        if r.sharded is not None
        else [
            st.Participant(
                node_id=m.node_id,
                node_rank=m.node_rank,
                local_world_size=m.local_world_size,
                addr=m.addr,
                first_global_rank=m.first_global_rank,
                host=m.host,
                pid=m.pid,
                held_from=r.held_by(m.node_id),
            )
            for m in r.members
        ],
        carried=r.carried,
        protocol=r.protocol,
        shards=r.sharded.shards if r.sharded is not None else 0,
        node_count=r.sharded.nodes if r.sharded is not None else 0,
    )
    if failure is None and r.failure is not None:
        failure = failure_to(r.failure)
    if failure is not None:
        msg.failure.CopyFrom(failure)
    return encode_round(msg)


def round_message(value: bytes, key: str, run_id: str | None = None) -> st.RoundState:
    return decode(st.RoundState, key, value, run_id)


def agent_info(key: bytes | str, value: bytes, run_id: str | None, lease: int) -> st.AgentInfo:
    """An agent's published record, from its key under agents/ — only when the key's ``lease``
    is the one its value names (an agent of an older version, which names none, must at least
    hold a lease). Anything else was not written by its agent (an ``etcdctl put`` strips the
    lease) and must not count: such a key would outlive every agent and hold the run forever.
    """
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
    return agent_of(agent_info(key, value, run_id, lease), create_revision)


def agent_of(msg: st.AgentInfo, create_revision: int) -> Agent:
    """What the protocol knows of a live agent, from its checked AgentInfo."""
    return Agent(
        msg.node_id,
        create_revision,
        msg.local_world_size,
        msg.addr,
        msg.host,
        msg.pid,
        msg.protocol,
        msg.spare_port,
    )


def join_from(key: bytes | str, value: bytes, run_id: str | None, create_revision: int = 0) -> Join:
    """A join record; one written with its agent key (agent_create_revision 0, see
    joining.FoldedJoin) shares the agent key's create revision: the record's own.
    """
    msg = decode(st.JoinRecord, key, value, run_id)
    return Join(
        msg.node_id,
        msg.local_world_size,
        msg.addr,
        msg.master_port,
        msg.agent_create_revision or create_revision,
        msg.host,
        msg.pid,
    )
