"""Generated protobuf code: reproducible, loadable next to another etcd library, wire-correct."""

from __future__ import annotations

import subprocess
import sys

from google.protobuf import descriptor_pb2, descriptor_pool
from layout import ROOT

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.proto.etcd_stubs import METHODS


def test_regenerating_reproduces_committed_files():
    """The pinned generator (installed --no-deps into .cache) gives byte-identical output."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "regenerate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_descriptor_clash_with_another_etcd_library():
    """Another library's etcd protos (package etcdserverpb, file rpc.proto, same message names)
    load into the same default pool without clashing with ours.
    """
    f = descriptor_pb2.FileDescriptorProto(
        name="rpc.proto", package="etcdserverpb", syntax="proto3"
    )
    for name in ("KeyValue", "RangeRequest", "PutRequest", "WatchRequest"):
        m = f.message_type.add(name=name)
        m.field.add(
            name="key",
            number=1,
            type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    descriptor_pool.Default().Add(f)
    assert descriptor_pool.Default().FindMessageTypeByName("etcdserverpb.RangeRequest")
    assert pb.RangeRequest.DESCRIPTOR.full_name == "etcdrun.etcdapi.RangeRequest"
    assert pb.DESCRIPTOR.name == "etcdrun/proto/etcd_api.proto"


def test_rpc_paths_are_etcds():
    assert METHODS["Range"].path == "/etcdserverpb.KV/Range"
    assert METHODS["Watch"].path == "/etcdserverpb.Watch/Watch" and METHODS["Watch"].streaming
    assert METHODS["LeaseKeepAlive"].path == "/etcdserverpb.Lease/LeaseKeepAlive"
    assert METHODS["Authenticate"].path == "/etcdserverpb.Auth/Authenticate"
    assert METHODS["Status"].path == "/etcdserverpb.Maintenance/Status"
    assert METHODS["MemberList"].path == "/etcdserverpb.Cluster/MemberList"


def test_wire_field_numbers_match_etcd():
    """Spot checks against etcd's rpc.proto/kv.proto: a mismatch would corrupt every call."""

    def num(msg, field):
        return msg.DESCRIPTOR.fields_by_name[field].number

    assert num(pb.RangeRequest, "max_create_revision") == 13
    assert num(pb.Compare, "mod_revision") == 6 and num(pb.Compare, "range_end") == 64
    assert num(pb.WatchCreateRequest, "watch_id") == 7
    assert num(pb.WatchResponse, "events") == 11 and num(pb.WatchResponse, "cancel_reason") == 6
    assert num(pb.KeyValue, "lease") == 6 and num(pb.Event, "prev_kv") == 3
    assert num(pb.LeaseKeepAliveResponse, "TTL") == 3
    # A PutRequest as etcd's Go client encodes key "a", value "b", lease 7:
    assert (
        pb.PutRequest(key=b"a", value=b"b", lease=7).SerializeToString()
        == b"\n\x01a\x12\x01b\x18\x07"
    )


def test_state_messages_carry_schema_version():
    for cls in (st.AgentInfo, st.JoinRecord, st.RoundState):
        assert cls.DESCRIPTOR.fields_by_name["schema_version"].number == 1
