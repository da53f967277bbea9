"""The etcd backend's rdzv_conf: every key validated, credentials from conf, env or file."""

from __future__ import annotations

import pytest

from etcdrun.rendezvous.etcd_config import EtcdRendezvousConfig as C


def test_defaults():
    c = C.from_conf({}, environ={})
    assert (c.join_timeout, c.last_call_timeout, c.lease_ttl, c.prefix) == (600, 30, 5, "/etcdrun")
    assert c.user is None and c.password is None and c.cacert is None


def test_values_are_converted_and_checked():
    c = C.from_conf(
        {
            "join_timeout": "12.5",
            "lease_ttl": "2",
            "last_call_timeout": 0,
            "min_nodes": 1,
            "max_nodes": 2,
            "rank": 0,
        },
        environ={},
    )
    assert c.join_timeout == 12.5 and c.lease_ttl == 2 and c.last_call_timeout == 0
    for bad in [
        {"join_timeout": "soon"},
        {"join_timeout": 0},
        {"lease_ttl": 1.5},
        {"last_call_timeout": -1},
        {"prefix": "etcdrun"},
        {"cacert": "/nope.pem"},
    ]:
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            C.from_conf(bad, environ={})


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="lease_tll"):
        C.from_conf({"lease_tll": 2}, environ={})


def test_credentials_from_etcdctl_env_and_never_shown():
    c = C.from_conf({}, environ={"ETCDCTL_USER": "alice:s3cret"})
    assert (c.user, c.password) == ("alice", "s3cret")
    assert "s3cret" not in repr(c)
    c = C.from_conf({}, environ={"ETCDCTL_USER": "bob", "ETCDCTL_PASSWORD": "pw"})
    assert (c.user, c.password) == ("bob", "pw")
    with pytest.raises(ValueError, match="user and password"):
        C.from_conf({}, environ={"ETCDCTL_USER": "bob"})


def test_password_file(tmp_path):
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    c = C.from_conf({"user": "u", "password_file": str(f)}, environ={})
    assert c.password == "from-file"
    with pytest.raises(ValueError, match="not both"):
        C.from_conf({"user": "u", "password": "x", "password_file": str(f)}, environ={})


def test_tls_files_from_env(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    c = C.from_conf({}, environ={"ETCDCTL_CACERT": str(ca)})
    assert c.cacert == str(ca)
    with pytest.raises(ValueError, match="cert and key"):
        C.from_conf({"cert": str(ca)}, environ={})
