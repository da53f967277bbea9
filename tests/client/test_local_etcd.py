"""LocalEtcd against the real etcd binary: the ground every other test stands on."""

from __future__ import annotations

import os
import socket
import stat

import grpc
import pytest
from etcd_helpers import ExternalEtcd, assert_no_leases, pid_alive, require_local

import etcdrun.rendezvous.localetcd.cluster as local_etcd
from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto.etcd_stubs import bind
from etcdrun.rendezvous.localetcd import LocalEtcd, TlsConfig, find_etcd, grpc_channel


def put(
    endpoint: str, key: bytes, value: bytes, tls: TlsConfig | None = None, client_cert: bool = True
) -> None:
    with grpc_channel(endpoint, tls, client_cert=client_cert) as ch:
        bind(ch, "Put")(pb.PutRequest(key=key, value=value), timeout=5)


def get(
    endpoint: str, key: bytes, tls: TlsConfig | None = None, *, serializable: bool = False
) -> bytes | None:
    """``serializable``: answered from this member's own store, without asking the leader."""
    with grpc_channel(endpoint, tls) as ch:
        resp = bind(ch, "Range")(pb.RangeRequest(key=key, serializable=serializable), timeout=5)
    return resp.kvs[0].value if resp.kvs else None


# --- finding the binary ------------------------------------------------------------------------
def test_find_etcd_prefers_etcd_bin_and_rejects_a_wrong_one(monkeypatch, tmp_path, etcd_bin):
    monkeypatch.setenv("ETCD_BIN", etcd_bin)
    assert find_etcd() == etcd_bin
    not_exe = tmp_path / "etcd"
    not_exe.write_text("#!/bin/sh\n")
    not_exe.chmod(stat.S_IRUSR)
    monkeypatch.setenv("ETCD_BIN", str(not_exe))
    with pytest.raises(RuntimeError, match="not an executable"):
        find_etcd()


# --- single member ------------------------------------------------------------------------------
def test_single_member_answers_put_and_range(etcd):
    endpoint = etcd.endpoint_list[0]
    if isinstance(etcd, LocalEtcd):
        host, port = endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == etcd.members[0].client_port
        assert etcd.endpoints == endpoint
    put(endpoint, b"/test/local_etcd/k", b"v1")
    assert get(endpoint, b"/test/local_etcd/k") == b"v1"
    assert get(endpoint, b"/test/local_etcd/missing") is None


def test_restart_keeps_data_on_the_same_port(etcd):
    local = require_local(etcd)
    member = local.members[0]
    put(member.endpoint, b"survives", b"restart")
    old_pid, old_port = member.pid, member.client_port
    member.restart()
    assert member.pid != old_pid and not pid_alive(old_pid)
    assert member.client_port == old_port and member.is_running()
    # A single member has nowhere else to learn the key from: it came from its data dir.
    assert get(member.endpoint, b"survives", serializable=True) == b"restart"


def test_stop_kills_every_member_and_removes_the_data_dir(etcd_bin):
    cluster = LocalEtcd(3, etcd_bin=etcd_bin).start()
    root, pids = cluster.root, cluster.pids
    assert root is not None and os.path.isdir(root) and len(pids) == 3
    assert all(os.path.isdir(m.data_dir) for m in cluster.members)
    cluster.stop()
    assert not os.path.exists(root)
    assert [p for p in pids if pid_alive(p)] == []
    assert not any(m.is_running() for m in cluster.members)
    cluster.stop()  # idempotent


def test_start_failure_raises_with_etcds_log_and_leaves_nothing(etcd_bin, tmp_path):
    bad = LocalEtcd(etcd_bin=etcd_bin, extra_args=["--no-such-flag"], data_root=str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-flag"):
        bad.start(timeout=5)
    assert list(tmp_path.iterdir()) == []
    assert not any(m.is_running() for m in bad.members)


def test_port_clash_is_retried_with_fresh_ports(etcd_bin, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = local_etcd._free_ports, []

    def first_pick_clashes(n: int) -> list[int]:
        calls.append(n)
        return [taken, *real(n - 1)] if len(calls) == 1 else real(n)

    monkeypatch.setattr(local_etcd, "_free_ports", first_pick_clashes)
    try:
        with LocalEtcd(etcd_bin=etcd_bin) as e:
            assert len(calls) == 2
            assert e.members[0].client_port != taken
            put(e.endpoints, b"k", b"v")
    finally:
        squatter.close()


# --- three members ------------------------------------------------------------------------------
def test_cluster_elects_a_new_leader_after_kill_9(etcd_cluster):
    assert len(etcd_cluster.endpoint_list) == 3
    assert etcd_cluster.endpoints == ",".join(m.endpoint for m in etcd_cluster.members)
    old = etcd_cluster.wait_leader(5)
    put(old.endpoint, b"before", b"kill")
    old_pid = old.pid
    old.kill()
    assert not old.is_running() and not pid_alive(old_pid)
    new = etcd_cluster.wait_leader(5)
    assert new is not old and new.is_running()
    assert get(new.endpoint, b"before") == b"kill"
    put(new.endpoint, b"after", b"kill")
    # The killed member comes back on its own data and catches up with the newer write.
    old.restart()
    assert get(old.endpoint, b"after", serializable=True) == b"kill"


def test_paused_leader_is_replaced_and_rejoins_after_resume(etcd_cluster):
    old = etcd_cluster.wait_leader(5)
    old.pause()
    try:
        assert old.status(timeout=0.2) is None
        assert etcd_cluster.wait_leader(5) is not old
    finally:
        old.resume()
    etcd_cluster.wait_healthy(5)
    assert old.status(timeout=1) is not None


# --- TLS ---------------------------------------------------------------------------------------
def test_tls_member_serves_grpc_to_a_client_that_trusts_the_ca(etcd_tls):
    endpoint = etcd_tls.endpoints
    assert endpoint.startswith("https://127.0.0.1:")
    put(endpoint, b"tls", b"yes", etcd_tls.tls, client_cert=False)
    assert get(endpoint, b"tls", etcd_tls.tls) == b"yes"
    with grpc.insecure_channel(endpoint.removeprefix("https://")) as plain:
        with pytest.raises(grpc.RpcError) as err:
            bind(plain, "Range")(pb.RangeRequest(key=b"tls"), timeout=2)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


def test_mtls_accepts_the_client_cert_and_refuses_a_client_without_one(etcd_mtls):
    tls = etcd_mtls.tls
    assert tls.client_cert_auth and tls.client_cert_file
    put(etcd_mtls.endpoints, b"mtls", b"ok", tls)
    assert get(etcd_mtls.endpoints, b"mtls", tls) == b"ok"
    with pytest.raises(grpc.RpcError) as err:
        put(etcd_mtls.endpoints, b"mtls", b"no-cert", tls, client_cert=False)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert get(etcd_mtls.endpoints, b"mtls", tls) == b"ok"


def test_auth_token_ttl_reaches_etcd(etcd_auth_ttl):
    cmd = etcd_auth_ttl.members[0].command()
    assert cmd[cmd.index("--auth-token-ttl") + 1] == "2"
    with open(f"/proc/{etcd_auth_ttl.members[0].pid}/cmdline", "rb") as f:
        assert b"--auth-token-ttl\x002\x00" in f.read()


# --- helpers other tests rely on ----------------------------------------------------------------
def test_assert_no_leases_sees_a_granted_lease_until_it_is_revoked(etcd):
    require_local(etcd)  # an external etcd may hold other people's leases
    with grpc_channel(etcd.endpoints) as ch:
        lease = bind(ch, "LeaseGrant")(pb.LeaseGrantRequest(TTL=30), timeout=5)
        bind(ch, "Put")(pb.PutRequest(key=b"leased", value=b"x", lease=lease.ID), timeout=5)
        with pytest.raises(pytest.fail.Exception, match="1 lease.*leased"):
            assert_no_leases(etcd.endpoints)
        bind(ch, "LeaseRevoke")(pb.LeaseRevokeRequest(ID=lease.ID), timeout=5)
    assert_no_leases(etcd.endpoints)


def test_require_local_skips_for_an_external_etcd():
    with pytest.raises(pytest.skip.Exception, match="ETCDRUN_TEST_ENDPOINTS"):
        require_local(ExternalEtcd("127.0.0.1:1"))
