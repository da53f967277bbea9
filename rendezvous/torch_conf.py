"""torchrun's ``--rdzv-conf`` keys, read as the ``etcd-v3`` plugin's configuration.

Why a translation: a torchrun user keeps the keys of torchrun's own backends (c10d, etcd-v2, the
legacy etcd one), and torchrun itself always adds ``timeout`` (900 s unless given). The keys that
mean something here are mapped onto etcdrun's (``etcd_config.py`` then validates them strictly:
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
``heartbeat_timeout``, ``close_timeout``, ``max_restarts``, ``rank``) are accepted with one notice
line. Any other key follows torch's convention — a backend ignores the keys it does not read —
but not silently: one warning line names it, with a "did you mean" when it is close to a known
key.

No torch here: the mapping is plain data, tested without it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# etcdrun's keys, as etcd_config validates them (its table, not a copy that could drift).
from etcdrun.rendezvous.etcd_config import _KEYS as OURS

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
MEANINGLESS = {
    "is_host": "no store host here: the store is etcd",
    "store_type": "the store is etcd",
    "use_libuv": "no TCPStore here",
    "heartbeat_timeout": "keep-alives follow request_timeout",
    "close_timeout": "closing is one etcd transaction",
    "max_restarts": "torchrun's --max-restarts decides, per node, as with its own backends",
    "rank": "node ranks come from the rendezvous",
}
# Ours that the plugin does not use: torchrun runs its own exit barrier and restart budget.
_OURS_UNUSED = {"close_timeout", "max_restarts"}


@dataclass(frozen=True)
class TorchConf:
    """The plugin's reading of a torchrun rendezvous config."""

    config: dict[str, Any]  # etcdrun's keys, for EtcdRendezvousConfig
    https: bool = False  # protocol=https: endpoints without a scheme get https://
    notices: list[str] = field(default_factory=list)  # one line each, for the log


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


def _unknown_notice(key: str) -> str:
    known = sorted({*OURS, *ALIASES, *_HEARTBEAT, *MEANINGLESS, "protocol"})
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"etcd-v3: ignoring unknown rdzv_conf key {key!r}{hint}, as torch's backends do"


def read_torch_conf(conf: Mapping[str, Any]) -> TorchConf:
    """Map torchrun's rendezvous config onto etcdrun's keys (see the module docstring)."""
    ours: dict[str, Any] = {}
    notices: list[str] = []
    https = False
    for key, value in conf.items():
        if key in OURS and key not in _OURS_UNUSED:
            ours[key] = value
        elif key in ALIASES:
            if ALIASES[key] not in conf:  # etcdrun's own key wins over torchrun's alias
                ours[ALIASES[key]] = value
        elif key in MEANINGLESS:
            notices.append(f"etcd-v3: rdzv_conf {key} has no effect here ({MEANINGLESS[key]})")
        elif key == "protocol":
            https = _protocol(value)
        elif key not in _HEARTBEAT:
            notices.append(_unknown_notice(key))
    if any(k in conf for k in _HEARTBEAT) and "lease_ttl" not in conf:
        ours["lease_ttl"] = _lease_ttl(conf)
    return TorchConf(ours, https, notices)


def endpoints(endpoint: str, https: bool) -> str:
    """torchrun's ``--rdzv-endpoint`` as etcdrun's client reads it (``https://`` when asked)."""
    parts = [p.strip() for p in endpoint.split(",") if p.strip()]
    if not parts:
        raise ValueError("etcd-v3 needs --rdzv-endpoint host[:port][,host[:port]...] of etcd")
    if https:
        parts = [p if "://" in p else f"https://{p}" for p in parts]
    return ",".join(parts)


__all__ = ["ALIASES", "MEANINGLESS", "TorchConf", "endpoints", "read_torch_conf"]
