"""Builders for transaction compares and operations.

Why: the rendezvous fences every state change with a Txn on mod_revision or create_revision;
these builders keep those guards one readable line each instead of nested protobuf literals.
"""

from __future__ import annotations

from collections.abc import Sequence

from etcdrun.proto import etcd_api_pb2 as pb

Key = str | bytes
_OPS = {
    "==": pb.Compare.EQUAL,
    "!=": pb.Compare.NOT_EQUAL,
    ">": pb.Compare.GREATER,
    "<": pb.Compare.LESS,
}


def to_bytes(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else key


def prefix_end(prefix: Key) -> bytes:
    """The range_end that selects every key starting with ``prefix``."""
    b = bytearray(to_bytes(prefix))
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # the prefix was all 0xff: every key from there on


def range_end(key: Key, prefix: bool = False, end: Key | None = None) -> bytes:
    """The one rule for a request's range_end: every key under ``key`` with ``prefix``, up to
    ``end`` (exclusive) when given, else the single key (empty).
    """
    if prefix:
        return prefix_end(key)
    return to_bytes(end) if end else b""


def _compare(key: Key, op: str, target: int, prefix: bool = False, **field) -> pb.Compare:
    """With ``prefix``, the comparison must hold for every key under ``key``."""
    if op not in _OPS:
        raise ValueError(f"unknown compare operator {op!r}")
    return pb.Compare(
        key=to_bytes(key),
        result=_OPS[op],
        target=target,
        range_end=range_end(key, prefix),
        **field,
    )


def mod_revision(key: Key, op: str, rev: int, prefix: bool = False) -> pb.Compare:
    return _compare(key, op, pb.Compare.MOD, prefix, mod_revision=rev)


def create_revision(key: Key, op: str, rev: int, prefix: bool = False) -> pb.Compare:
    """``create_revision(k, "==", 0)`` means: k does not exist. With ``prefix``, every key under
    ``k`` must match: ``create_revision(agents/, "==", mine, prefix=True)`` means "I am the only
    agent left".
    """
    return _compare(key, op, pb.Compare.CREATE, prefix, create_revision=rev)


def lease(key: Key, op: str, lease_id: int) -> pb.Compare:
    """``lease(k, "==", id)``: k exists and is held by that lease (a missing key has lease 0)."""
    return _compare(key, op, pb.Compare.LEASE, lease=lease_id)


def put(key: Key, val: bytes, lease: int = 0) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=to_bytes(key), value=val, lease=lease))


def get(key: Key, prefix: bool = False, **kw) -> pb.RequestOp:
    end = range_end(key, prefix)
    return pb.RequestOp(request_range=pb.RangeRequest(key=to_bytes(key), range_end=end, **kw))


def delete(key: Key, prefix: bool = False, end: Key | None = None) -> pb.RequestOp:
    end = range_end(key, prefix, end)
    return pb.RequestOp(
        request_delete_range=pb.DeleteRangeRequest(key=to_bytes(key), range_end=end)
    )


def nested(
    compare: Sequence[pb.Compare],
    success: Sequence[pb.RequestOp] = (),
    failure: Sequence[pb.RequestOp] = (),
) -> pb.RequestOp:
    """A Txn inside a Txn (etcd >= 3.3): its own if/then/else, applied in the outer one's
    revision — one raft proposal for two decisions (register, and join if the round held).
    """
    req = pb.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
    return pb.RequestOp(request_txn=req)
