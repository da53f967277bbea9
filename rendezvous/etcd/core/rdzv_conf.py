"""torchrun's ``--rdzv-conf`` keys, read as etcdrun's etcd configuration: one mapping for the
``etcd-v3`` plugin (torchrun's agent) and for etcdrun's own agent (``--rdzv-backend etcd``).

Why a translation: a torchrun user keeps the keys of torchrun's own backends (c10d, etcd-v2, the
legacy etcd one), and torchrun itself always adds ``timeout`` (900 s unless given). The keys that
mean something here are mapped onto etcdrun's (``etcd/core/config.py`` then validates them strictly:
a bad value is an error); etcdrun's own keys are read as they are, and win over a torchrun alias.

torchrun's key -> etcdrun's:
- ``timeout`` (the legacy etcd backend's; torchrun always sets it) -> ``join_timeout``;
- ``join_timeout``, ``last_call_timeout`` -> the same;
- ``read_timeout`` -> ``request_timeout``;
- ``keep_alive_interval`` x ``keep_alive_max_attempt`` (torch's defaults 5 and 3 fill the one not
  given) -> ``lease_ttl``, rounded up: torch calls a node dead after that many missed heartbeats,
  etcd after its lease's TTL;
- ``etcd_prefix`` -> ``prefix``;
- ``ca_cert``/``cacert``, ``ssl_cert``/``cert``, ``ssl_cert_key``/``key`` -> ``cacert``,
  ``cert``, ``key``;
- ``protocol=https`` -> ``https://`` endpoints.

Keys of torchrun's backends with no meaning here (``is_host``, ``store_type``, ``use_libuv``,
``heartbeat_timeout``; under torchrun's agent also ``close_timeout``, ``max_restarts``, ``rank``,
which torchrun's agent decides itself) are accepted with one notice line. Any other key:
- under torchrun's agent (the plugin), torch's convention: a backend ignores the keys it does not
  read, but not silently: one warning line names it, with a "did you mean";
- under etcdrun's agent (``strict``), an error naming it, with a "did you mean": a misspelled
  key (``lease_tll=2``) silently ignored is a job that behaves differently from what its owner
  believes.

No torch here: the mapping is plain data, tested without it.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# etcdrun's keys, as etcd/core/config.py validates them (its table, not a copy that could drift),
# and the keys etcdrun's launcher itself passes through the rendezvous config.
from etcdrun.rendezvous.etcd.core.config import PASSTHROUGH, EtcdRendezvousConfig, with_scheme
from etcdrun.rendezvous.etcd.core.config import SETTINGS as OURS

log = logging.getLogger("etcdrun.rendezvous")
ALIASES = {
    "timeout": "join_timeout",
    "read_timeout": "request_timeout",
    "etcd_prefix": "prefix",
    "ca_cert": "cacert",
    "ssl_cert": "cert",
    "ssl_cert_key": "key",
}
_HEARTBEAT = ("keep_alive_interval", "keep_alive_max_attempt")
_HEARTBEAT_DEFAULTS = {"keep_alive_interval": 5.0, "keep_alive_max_attempt": 3.0}  # torch's
# No meaning under either agent.
_NO_EFFECT = {
    "is_host": "no store host here: the store is etcd",
    "store_type": "the store is etcd",
    "use_libuv": "no TCPStore here",
    "heartbeat_timeout": "keep-alives follow request_timeout",
}
# No meaning under torchrun's agent, which runs its own exit barrier and restart budget and
# assigns node ranks itself; etcdrun's agent reads the first two as its own keys.
MEANINGLESS = {
    **_NO_EFFECT,
    "close_timeout": "closing is one etcd transaction",
    "max_restarts": "torchrun's --max-restarts decides, per node, as with its own backends",
    "rank": "node ranks come from the rendezvous",
}
# Ours that the plugin does not use: torchrun runs its own exit barrier and restart budget.
_OURS_UNUSED = {"close_timeout", "max_restarts"}


@dataclass(frozen=True)
class TorchConf:
    """A reading of a torchrun rendezvous config as etcdrun's."""

    config: dict[str, Any]  # etcdrun's keys, for EtcdRendezvousConfig
    https: bool = False  # protocol=https: endpoints without a scheme get https://
    notices: list[str] = field(default_factory=list)  # one line each, for the log
    origin: dict[str, str] = field(default_factory=dict)  # our key -> the torchrun key it came from


def _number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv_conf {key}={value!r}: expected a number") from None


def _lease_ttl(conf: Mapping[str, Any]) -> int:
    vals = {k: _number(k, conf.get(k, d)) for k, d in _HEARTBEAT_DEFAULTS.items()}
    product = vals["keep_alive_interval"] * vals["keep_alive_max_attempt"]
    if product <= 0:
        raise ValueError(f"rdzv_conf {', '.join(_HEARTBEAT)}: must be > 0")
    return max(1, math.ceil(product))


def _protocol(value: Any) -> bool:
    proto = str(value).strip().lower()
    if proto not in ("http", "https"):
        raise ValueError(f"rdzv_conf protocol={value!r}: http or https")
    return proto == "https"


def known_keys(strict: bool = False) -> list[str]:
    """Every key the reading accepts (etcdrun's agent: also the launcher's pass-through keys)."""
    extra = PASSTHROUGH if strict else set()
    return sorted({*OURS, *ALIASES, *_HEARTBEAT, *MEANINGLESS, "protocol", *extra})


def did_you_mean(key: str, strict: bool = False) -> str:
    """`` (did you mean lease_ttl?)`` when ``key`` is close to a known key, else ""."""
    close = difflib.get_close_matches(key, known_keys(strict), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _unknown_notice(key: str) -> str:
    return (
        f"etcd-v3: ignoring unknown rdzv_conf key {key!r}{did_you_mean(key)}, "
        "as torch's backends do"
    )


def read_torch_conf(conf: Mapping[str, Any], *, strict: bool = False) -> TorchConf:
    """Map torchrun's rendezvous config onto etcdrun's keys (see the module docstring).

    ``strict``: for etcdrun's own agent, which reads ``close_timeout`` and ``max_restarts`` as
    its own, passes the launcher's keys through, and refuses an unknown key (ValueError naming
    it, with a "did you mean"). Otherwise, for torchrun's agent: unknown keys become notices.
    """
    ours: dict[str, Any] = {}
    origin: dict[str, str] = {}
    notices: list[str] = []
    unknown: list[str] = []
    https = False
    no_effect = _NO_EFFECT if strict else MEANINGLESS
    label = "etcd" if strict else "etcd-v3"
    for key, value in conf.items():
        if key in OURS and (strict or key not in _OURS_UNUSED):
            ours[key] = value
        elif strict and key in PASSTHROUGH:
            ours[key] = value
        elif key in ALIASES:
            if ALIASES[key] not in conf:  # etcdrun's own key wins over torchrun's alias
                ours[ALIASES[key]] = value
                origin[ALIASES[key]] = key
        elif key in no_effect:
            notices.append(f"{label}: rdzv_conf {key} has no effect here ({no_effect[key]})")
        elif key == "protocol":
            https = _protocol(value)
        elif key in _HEARTBEAT:
            continue
        elif strict:
            unknown.append(key)
        else:
            notices.append(_unknown_notice(key))
    if unknown:  # each key as given, repr'd: a stray quote from a manifest must show
        named = ", ".join(f"{k!r}{did_you_mean(k, strict)}" for k in sorted(unknown))
        raise ValueError(
            f"unknown rdzv_conf key(s) for the etcd backend: {named} "
            f"(etcdrun's: {', '.join(sorted(OURS))}; torchrun's are read too)"
        )
    if any(k in conf for k in _HEARTBEAT) and "lease_ttl" not in conf:
        ours["lease_ttl"] = _lease_ttl(conf)
        origin["lease_ttl"] = " x ".join(k for k in _HEARTBEAT if k in conf)
    return TorchConf(ours, https, notices, origin)


def endpoints(endpoint: str, https: bool) -> str:
    """torchrun's ``--rdzv-endpoint`` as etcdrun's client reads it (``https://`` when asked)."""
    parts = [p.strip() for p in endpoint.split(",") if p.strip()]
    if not parts:
        raise ValueError("etcd-v3 needs --rdzv-endpoint host[:port][,host[:port]...] of etcd")
    return with_scheme(",".join(parts), https)


def etcd_config(
    conf: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> EtcdRendezvousConfig:
    """etcdrun's own agent's reading of ``--rdzv-conf``: torchrun's keys mapped (one notice line
    for each that means nothing here), then every value validated; an unknown key is an error.
    """
    read = read_torch_conf(conf, strict=True)
    for line in read.notices:
        log.warning("%s", line)
    return EtcdRendezvousConfig.from_values(
        read.config, https=read.https, origin=read.origin, environ=environ
    )


__all__ = [
    "ALIASES",
    "MEANINGLESS",
    "TorchConf",
    "did_you_mean",
    "endpoints",
    "etcd_config",
    "known_keys",
    "read_torch_conf",
]
