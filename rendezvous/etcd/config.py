"""The ``etcd`` backend's configuration keys (``--rdzv-conf k=v,...``), validated.

Why strict: a misspelled key (``lease_tll=2``) silently ignored is a job that behaves differently
from what its owner believes. Every key is checked; an unknown one is an error naming it, with a
"did you mean". torchrun's own keys (``timeout``, ``read_timeout``, ``keep_alive_interval``, ...)
are read through the plugin's mapping (torch/conf.py: one mapping for both agents), so a
torchrun command line keeps its ``--rdzv-conf``; keys with no meaning here get one notice line.
Credentials may come from the conf, from etcdctl's environment variables (``ETCDCTL_USER``,
``ETCDCTL_PASSWORD``, ``ETCDCTL_CACERT``, ``ETCDCTL_CERT``, ``ETCDCTL_KEY``) or from a file
(``password_file``); the password is never logged or shown in a repr.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client pulls in gRPC: checking a config must stay cheap
    from etcdrun.rendezvous.client.config import ClientConfig

# Keys the launcher itself passes through the rendezvous config (the seed's behaviour).
_PASSTHROUGH = {"min_nodes", "max_nodes", "rank"}
log = logging.getLogger("etcdrun.rendezvous")


def _seconds(name: str, positive: bool = True):
    def conv(v: Any) -> float:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"rdzv_conf {name}={v!r}: expected a number of seconds") from None
        if f < 0 or (positive and f == 0):
            raise ValueError(f"rdzv_conf {name}={v!r}: must be {'> 0' if positive else '>= 0'}")
        return f

    return conv


def _int_seconds(name: str):
    def conv(v: Any) -> int:
        f = _seconds(name)(v)
        if f != int(f):
            raise ValueError(f"rdzv_conf {name}={v!r}: etcd leases take whole seconds")
        return int(f)

    return conv


def _text(name: str):
    def conv(v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise ValueError(f"rdzv_conf {name}: expected a non-empty string")
        return v

    return conv


def _path(name: str):
    def conv(v: Any) -> str:
        p = _text(name)(v)
        if not os.path.isfile(p):
            raise ValueError(f"rdzv_conf {name}: file not found: {p}")
        return p

    return conv


_KEYS = {
    "join_timeout": _seconds("join_timeout"),
    "last_call_timeout": _seconds("last_call_timeout", positive=False),
    "close_timeout": _seconds("close_timeout"),
    "lease_ttl": _int_seconds("lease_ttl"),
    "request_timeout": _seconds("request_timeout"),
    "retry_timeout": _seconds("retry_timeout"),
    "prefix": _text("prefix"),
    "cacert": _path("cacert"),
    "cert": _path("cert"),
    "key": _path("key"),
    "user": _text("user"),
    "password": _text("password"),
    "password_file": _path("password_file"),
    "max_restarts": lambda v: _count("max_restarts", v),
}


def _count(name: str, v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv_conf {name}={v!r}: expected an integer") from None
    if n < 0 or str(n) != str(v).strip():
        raise ValueError(f"rdzv_conf {name}={v!r}: expected a non-negative integer")
    return n


@dataclass(frozen=True)
class EtcdRendezvousConfig:
    join_timeout: float = 600.0  # a round must complete within this
    last_call_timeout: float = 30.0  # first round only, while fewer than max agents registered
    close_timeout: float = 300.0  # exit barrier: how long a finished node waits for peers
    lease_ttl: int = 5  # liveness; keep-alive every ttl/3
    request_timeout: float = 2.0  # one etcd request on one endpoint
    retry_timeout: float = 30.0  # an etcd call across endpoints before giving up
    prefix: str = "/etcdrun"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    max_restarts: int = 0  # job-wide worker-failure budget (the launcher passes it)
    https: bool = False  # torchrun's protocol=https: endpoints without a scheme get https://

    @property
    def run_lease_ttl(self) -> int:
        """How long a run's round key and hints outlive its last agent: long enough to ride out
        a leader failover (the next leader adopts the lease within about one lease_ttl), short
        enough that a job whose every agent was killed leaves nothing for long."""
        return max(10, 6 * self.lease_ttl)

    def client_config(self, endpoints: str) -> ClientConfig:
        """How this backend reaches etcd: the endpoints plus the TLS, auth and timeout keys."""
        from etcdrun.rendezvous.client.config import ClientConfig
        from etcdrun.rendezvous.torch.conf import endpoints as with_scheme

        if self.https:
            endpoints = with_scheme(endpoints, https=True)
        return ClientConfig.create(
            endpoints,
            ca_cert=self.cacert,
            cert=self.cert,
            key=self.key,
            user=self.user,
            password=self.password,
            request_timeout=self.request_timeout,
            retry_timeout=self.retry_timeout,
        )

    @classmethod
    def from_conf(
        cls, conf: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> EtcdRendezvousConfig:
        from etcdrun.rendezvous.torch.conf import read_torch_conf

        env = os.environ if environ is None else environ
        read = read_torch_conf(conf, strict=True)  # torchrun's keys mapped; unknown: ValueError
        for line in read.notices:
            log.warning("%s", line)
        vals: dict[str, Any] = {"https": read.https}
        for k, v in read.config.items():
            if k not in _KEYS:
                continue
            try:
                vals[k] = _KEYS[k](v)
            except ValueError as e:
                if k not in read.origin:
                    raise
                raise ValueError(f"{e} (read from torchrun's {read.origin[k]})") from None
        if "password_file" in vals:
            if "password" in vals:
                raise ValueError("rdzv_conf: give password or password_file, not both")
            with open(vals.pop("password_file")) as f:
                vals["password"] = f.read().strip()
        for key, var in (
            ("cacert", "ETCDCTL_CACERT"),
            ("cert", "ETCDCTL_CERT"),
            ("key", "ETCDCTL_KEY"),
        ):
            if key not in vals and env.get(var):
                vals[key] = _path(var)(env[var])
        if "user" not in vals and env.get("ETCDCTL_USER"):
            user, sep, pw = env["ETCDCTL_USER"].partition(":")  # etcdctl accepts user:password
            vals["user"] = user
            if sep and "password" not in vals:
                vals["password"] = pw
        if "user" in vals and "password" not in vals and env.get("ETCDCTL_PASSWORD"):
            vals["password"] = env["ETCDCTL_PASSWORD"]
        if ("user" in vals) != ("password" in vals):
            raise ValueError("rdzv_conf: etcd auth needs both user and password")
        if ("cert" in vals) != ("key" in vals):
            raise ValueError("rdzv_conf: a client certificate needs both cert and key")
        if not vals.get("prefix", "/").startswith("/"):
            raise ValueError("rdzv_conf prefix must start with '/'")
        return cls(**vals)
