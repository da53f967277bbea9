"""The ``etcd`` backend's configuration keys (``--rdzv-conf k=v,...``), validated.

Why strict: a misspelled key (``lease_tll=2``) silently ignored is a job that behaves differently
from what its owner believes. Every key is checked; an unknown one is an error naming it, with a
"did you mean". torchrun's own keys (``timeout``, ``read_timeout``, ``keep_alive_interval``, ...)
are read through the plugin's mapping (etcd/core/rdzv_conf.py: one mapping for both agents), so a
torchrun command line keeps its ``--rdzv-conf``; keys with no meaning here get one notice line.
Credentials may come from the conf, from etcdctl's environment variables (``ETCDCTL_USER``,
``ETCDCTL_PASSWORD``, ``ETCDCTL_CACERT``, ``ETCDCTL_CERT``, ``ETCDCTL_KEY``) or from a file
(``password_file``); the password is never logged or shown in a repr.

Every setting has one name and one default, here: ``SETTINGS`` names the keys and how each is
read, ``EtcdRendezvousConfig`` holds their defaults. torchrun's keys are mapped onto these by
etcd/core/rdzv_conf.py, which depends on this module and never the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client pulls in gRPC: checking a config must stay cheap
    from etcdrun.rendezvous.client.config import ClientConfig

# Keys the launcher itself passes through the rendezvous config (the seed's behaviour).
PASSTHROUGH = frozenset({"min_nodes", "max_nodes", "rank"})


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


SETTINGS = {
    "join_timeout": _seconds("join_timeout"),
    "closed_ttl": _int_seconds("closed_ttl"),
    "run_lease_ttl": _int_seconds("run_lease_ttl"),
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
    "cooldown_failures": lambda v: _count("cooldown_failures", v),
    "cooldown_base": _seconds("cooldown_base"),
    "cooldown_cap": _seconds("cooldown_cap"),
    "straggler_fraction": lambda v: _fraction("straggler_fraction", v),
    "evict_stragglers": lambda v: _flag("evict_stragglers", v),
    "shard_at": lambda v: _off_or_at_least("shard_at", v, 2),
}


def _fraction(name: str, v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv_conf {name}={v!r}: expected a number") from None
    if not 0 <= f < 1:
        raise ValueError(f"rdzv_conf {name}={v!r}: must be >= 0 and < 1 (0: off)")
    return f


def _flag(name: str, v: Any) -> bool:
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"rdzv_conf {name}={v!r}: expected true or false (1 or 0)")


def _off_or_at_least(name: str, v: Any, low: int) -> int:
    n = _count(name, v)
    if n != 0 and n < low:
        raise ValueError(f"rdzv_conf {name}={v!r}: must be 0 (off) or at least {low}")
    return n


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
    """The etcd backend's settings, validated (``from_values``); each field's comment says what
    it bounds. Why ``closed_ttl`` apart from ``join_timeout``: the CLOSED marker keeps a run id
    refused until it expires, and a job that waits an hour for its nodes need not lock its id
    for an hour. Why ``run_lease_ttl`` is derived by default: it must outlast a leader failover
    (about one lease_ttl), so it follows lease_ttl unless set.
    """

    join_timeout: float = 600.0  # a round must complete within this
    last_call_timeout: float = 30.0  # first round only, while fewer than max agents registered
    close_timeout: float = 300.0  # exit barrier: how long a finished node waits for peers
    closed_ttl: int = 600  # how long a closed run's marker refuses its id to late joiners
    lease_ttl: int = 5  # liveness; keep-alive every ttl/3
    run_lease_ttl: int = 0  # how long the run's keys outlive its last agent; 0: max(10, 6 x ttl)
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
    cooldown_failures: int = 3  # a node's failures that cool it down (node/cooldown.py); 0: off
    cooldown_base: float = 10.0  # its first cooldown; each next one lasts twice as long
    cooldown_cap: float = 300.0  # the longest cooldown
    straggler_fraction: float = 0.5  # below this share of the median rate: a straggler; 0: off
    evict_stragglers: bool = False  # the leader drains a named straggler (--evict-stragglers)
    shard_at: int = 0  # participants from which a frozen round is sharded; 0: never (shards.py)

    def __post_init__(self) -> None:
        if self.cooldown_cap < self.cooldown_base:
            raise ValueError(
                f"rdzv_conf cooldown_cap={self.cooldown_cap:g} is shorter than "
                f"cooldown_base={self.cooldown_base:g}: the cap bounds the doubling from the base"
            )
        if not self.run_lease_ttl:  # long enough to ride out a leader failover, short enough
            # that a job whose every agent was killed leaves nothing for long
            object.__setattr__(self, "run_lease_ttl", max(10, 6 * self.lease_ttl))

    def client_config(self, endpoints: str) -> ClientConfig:
        """How this backend reaches etcd: the endpoints plus the TLS, auth and timeout keys."""
        from etcdrun.rendezvous.client.config import ClientConfig

        return ClientConfig.create(
            with_scheme(endpoints, self.https),
            ca_cert=self.cacert,
            cert=self.cert,
            key=self.key,
            user=self.user,
            password=self.password,
            request_timeout=self.request_timeout,
            retry_timeout=self.retry_timeout,
        )

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Any],
        *,
        https: bool = False,
        origin: Mapping[str, str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> EtcdRendezvousConfig:
        """Validate our keys (``values``: others are left to their readers) and take the
        credentials etcdctl's environment gives; ``origin`` names the torchrun key a value was
        read from, for the message when it is bad.
        """
        env = os.environ if environ is None else environ
        vals: dict[str, Any] = {"https": https}
        for k, v in values.items():
            if k not in SETTINGS:
                continue
            try:
                vals[k] = SETTINGS[k](v)
            except ValueError as e:
                if not origin or k not in origin:
                    raise
                raise ValueError(f"{e} (read from torchrun's {origin[k]})") from None
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


def with_scheme(endpoints: str, https: bool) -> str:
    """The endpoints as etcdrun's client reads them: ``https://`` on those without a scheme
    when torchrun's ``protocol=https`` asked for it; unchanged otherwise.
    """
    if not https:
        return endpoints
    parts = [p.strip() for p in endpoints.split(",") if p.strip()]
    return ",".join(p if "://" in p else f"https://{p}" for p in parts)
