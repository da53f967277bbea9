"""TLS, mTLS, prefix-scoped users, and token expiry with automatic re-login — on real etcd."""

from __future__ import annotations

import re
import time

import pytest
from etcd_helpers import enable_auth

from etcdrun.rendezvous.client import (
    EtcdAuthError,
    EtcdClient,
    EtcdConnectionError,
    EtcdPermissionError,
)


def test_tls_with_ca(etcd_tls):
    c = EtcdClient(etcd_tls.endpoints, ca_cert=etcd_tls.tls.ca_file)
    try:
        assert etcd_tls.endpoints.startswith("https://")
        c.put("/tls", b"1")
        assert c.get("/tls").value == b"1"
    finally:
        c.close()


def test_tls_without_trusting_the_ca_is_refused(etcd_tls):
    c = EtcdClient(etcd_tls.endpoints, request_timeout=0.5, retry_timeout=1.0)
    try:
        with pytest.raises(EtcdConnectionError):
            c.put("/tls", b"1")
    finally:
        c.close()


def test_mtls_needs_a_client_certificate(etcd_mtls):
    tls = etcd_mtls.tls
    good = EtcdClient(
        etcd_mtls.endpoints, ca_cert=tls.ca_file, cert=tls.client_cert_file, key=tls.client_key_file
    )
    bad = EtcdClient(
        etcd_mtls.endpoints, ca_cert=tls.ca_file, request_timeout=0.5, retry_timeout=1.0
    )
    try:
        good.put("/mtls", b"1")
        assert good.get("/mtls").value == b"1"
        with pytest.raises(EtcdConnectionError):
            bad.get("/mtls")
    finally:
        good.close()
        bad.close()


def test_prefix_scoped_user_is_refused_outside_its_prefix(etcd):
    enable_auth(etcd.endpoints)
    c = EtcdClient(etcd.endpoints, user="alice", password="alicepw")
    try:
        rev = c.put("/jobs/42/a", b"1")
        assert c.get("/jobs/42/a").value == b"1"
        w = c.watch("/jobs/42/", prefix=True, start_revision=rev)
        assert w.get(timeout=5) is not None
        w.cancel()
        with pytest.raises(EtcdPermissionError):
            c.put("/jobs/43/a", b"1")
        with pytest.raises(EtcdPermissionError):
            c.get("/jobs/43/a")
        refused = c.watch("/jobs/43/", prefix=True)
        with pytest.raises(EtcdPermissionError, match="permission denied"):
            refused.get(timeout=5)
    finally:
        c.close()


def test_wrong_password_is_an_auth_error(etcd):
    enable_auth(etcd.endpoints)
    c = EtcdClient(etcd.endpoints, user="alice", password="nope")
    try:
        with pytest.raises(EtcdAuthError, match="authentication failed"):
            c.get("/jobs/42/a")
    finally:
        c.close()


def test_expired_token_logs_in_again(etcd_auth_ttl):
    eps = etcd_auth_ttl.endpoints
    enable_auth(eps)
    c = EtcdClient(eps, user="alice", password="alicepw")
    try:
        c.put("/jobs/42/t", b"1")
        first = c._t._token
        lease = c.lease(2)  # its keep-alives run through both expiries below
        time.sleep(3.5)  # --auth-token-ttl 2: the token expires while idle
        c.put("/jobs/42/t", b"2")  # refused with "invalid auth token", then re-login
        assert c._t._token != first
        assert c.get("/jobs/42/t").value == b"2"
        rev = c.put("/jobs/42/t", b"3")
        time.sleep(3.5)
        w = c.watch("/jobs/42/t", start_revision=rev)  # a stream opened with a stale token
        batch = w.get(timeout=5)
        assert batch is not None and batch.events[0].kv.value == b"3"
        w.cancel()
        assert not lease.lost.is_set()
    finally:
        c.close()


def test_a_tls_file_that_is_not_pem_is_named_at_once(tmp_path, etcd_mtls):
    """gRPC read a CA file that held no certificate as an unreachable etcd: retried for the
    whole retry_timeout, then "Failed to create security handshaker", the file never named.
    """
    tls = etcd_mtls.tls
    junk = tmp_path / "ca.pem"
    junk.write_text("this is not a certificate\n")
    cases = [
        ({"ca_cert": str(junk)}, f"etcd TLS ca_cert file {junk} is not a PEM certificate"),
        (
            {"ca_cert": tls.ca_file, "cert": tls.client_key_file, "key": tls.client_key_file},
            "etcd TLS cert file",
        ),
        (
            {"ca_cert": tls.ca_file, "cert": tls.client_cert_file, "key": tls.client_cert_file},
            "etcd TLS key file",
        ),
    ]
    for files, words in cases:  # refused when the client is made: no call, so no retrying
        with pytest.raises(ValueError, match=re.escape(words)):
            EtcdClient(etcd_mtls.endpoints, retry_timeout=30, **files)
