"""The etcd backend's rdzv_conf: every key validated, credentials from conf, env or file."""

from __future__ import annotations

import pytest

from etcdrun.agent.flags import parse_rdzv_conf
from etcdrun.rendezvous.etcd.core.rdzv_conf import etcd_config


def test_defaults():
    c = etcd_config({}, environ={})
    assert (c.join_timeout, c.last_call_timeout, c.lease_ttl, c.prefix) == (600, 30, 5, "/etcdrun")
    assert c.user is None and c.password is None and c.cacert is None


def test_values_are_converted_and_checked():
    c = etcd_config(
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
            etcd_config(bad, environ={})


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match="lease_tll") as err:
        etcd_config({"lease_tll": 2}, environ={})
    assert "(did you mean lease_ttl?)" in str(err.value)
    with pytest.raises(ValueError, match=r"'read_timeuot' \(did you mean read_timeout\?\)"):
        etcd_config({"read_timeuot": 2}, environ={})  # a typo of torchrun's key too
    with pytest.raises(ValueError) as err:
        etcd_config({"zzz": 1}, environ={})
    assert "zzz" in str(err.value) and "did you mean" not in str(err.value)


def test_an_unknown_key_is_shown_as_given_stray_quotes_included():
    """``--rdzv-conf "'join_timeout=5,lease_ttl=2'"`` (quotes kept by a manifest): the key is
    ``'join_timeout``, and the message must show that quote, not hide it before the hint.
    """
    with pytest.raises(ValueError) as err:
        etcd_config(parse_rdzv_conf("'join_timeout=5,lease_ttl=2'"), environ={})
    assert '"\'join_timeout" (did you mean join_timeout?)' in str(err.value)


def test_torchruns_keys_are_read_as_ours(caplog):
    """A torchrun command line keeps its --rdzv-conf: the plugin's mapping, for our agent too."""
    c = etcd_config(
        {"timeout": "900", "read_timeout": "7", "keep_alive_interval": "1", "etcd_prefix": "/p"},
        environ={},
    )
    assert (c.join_timeout, c.request_timeout, c.lease_ttl, c.prefix) == (900, 7, 3, "/p")
    assert etcd_config({"keep_alive_max_attempt": "2"}, environ={}).lease_ttl == 10  # 5 x 2
    assert etcd_config({"timeout": "900", "join_timeout": "60"}, environ={}).join_timeout == 60
    # our agent reads close_timeout and max_restarts as its own (the plugin's agent does not)
    c = etcd_config({"close_timeout": "5", "max_restarts": "2"}, environ={})
    assert (c.close_timeout, c.max_restarts) == (5, 2)
    with pytest.raises(ValueError, match="read_timeout"):
        etcd_config({"read_timeout": "soon"}, environ={})  # a bad value stays an error
    assert caplog.records == []  # mapped keys need no notice


def test_torchruns_keys_without_a_meaning_get_one_notice_each(caplog):
    caplog.set_level("INFO", logger="etcdrun.rendezvous")
    c = etcd_config(
        {"is_host": "1", "store_type": "tcp", "use_libuv": "0", "heartbeat_timeout": "9"},
        environ={},
    )
    assert c == etcd_config({}, environ={})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all("has no effect here" in line for line in lines), lines
    assert lines[0].startswith("etcd: rdzv_conf is_host has no effect here")


def test_protocol_https_gives_bare_endpoints_the_scheme():
    c = etcd_config({"protocol": "https"}, environ={})
    assert c.https and not etcd_config({}, environ={}).https
    cfg = c.client_config("a:2379,http://b:1")
    assert [str(e) for e in cfg.endpoints] == ["https://a:2379", "http://b:1"]


def test_credentials_from_etcdctl_env_and_never_shown():
    c = etcd_config({}, environ={"ETCDCTL_USER": "alice:s3cret"})
    assert (c.user, c.password) == ("alice", "s3cret")
    assert "s3cret" not in repr(c)
    c = etcd_config({}, environ={"ETCDCTL_USER": "bob", "ETCDCTL_PASSWORD": "pw"})
    assert (c.user, c.password) == ("bob", "pw")
    with pytest.raises(ValueError, match="user and password"):
        etcd_config({}, environ={"ETCDCTL_USER": "bob"})


def test_password_file(tmp_path):
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    c = etcd_config({"user": "u", "password_file": str(f)}, environ={})
    assert c.password == "from-file"
    with pytest.raises(ValueError, match="not both"):
        etcd_config({"user": "u", "password": "x", "password_file": str(f)}, environ={})


def test_tls_files_from_env(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    c = etcd_config({}, environ={"ETCDCTL_CACERT": str(ca)})
    assert c.cacert == str(ca)
    with pytest.raises(ValueError, match="cert and key"):
        etcd_config({"cert": str(ca)}, environ={})


def test_the_closed_marker_and_the_run_lease_are_settings_of_their_own():
    """A long join_timeout no longer locks a finished run's id for as long: the CLOSED
    marker's TTL is closed_ttl; the run lease follows lease_ttl unless set.
    """
    c = etcd_config({"join_timeout": "3600"}, environ={})
    assert (c.join_timeout, c.closed_ttl) == (3600, 600)
    assert c.run_lease_ttl == 30  # max(10, 6 x lease_ttl 5)
    assert etcd_config({"lease_ttl": "1"}, environ={}).run_lease_ttl == 10
    c = etcd_config({"closed_ttl": "60", "run_lease_ttl": "45"}, environ={})
    assert (c.closed_ttl, c.run_lease_ttl) == (60, 45)
    for bad in ({"closed_ttl": "1.5"}, {"run_lease_ttl": "0"}, {"closed_ttl": "-3"}):
        with pytest.raises(ValueError, match="rdzv_conf"):
            etcd_config(bad, environ={})
