"""How to reach etcd: endpoints, TLS, credentials, timeouts.

Why short per-request deadlines: a request in flight to a follower when the leader dies is never
answered (measured: it waits for the client's deadline, every time). A short deadline plus retry
on the next endpoint turns a dead leader into a ~deadline + election pause instead of a hang.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from etcdrun.rendezvous.client.policy import RetryPolicy

DEFAULT_PORT = 2379
_HOST_PORT = re.compile(
    r"^(?:\[(?P<ip6>[0-9a-fA-F:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+))(?::(?P<port>\d+))?$"
)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    secure: bool | None  # True for https://, False for http://, None when no scheme was given

    @property
    def target(self) -> str:
        """The grpc target string."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        scheme = {True: "https://", False: "http://", None: ""}[self.secure]
        return f"{scheme}{self.target}"


def parse_endpoint(text: str) -> Endpoint:
    """Parse ``host[:port]`` with an optional ``http://`` or ``https://`` scheme."""
    raw = text.strip()
    secure: bool | None = None
    for scheme, flag in (("https://", True), ("http://", False)):
        if raw.lower().startswith(scheme):
            raw, secure = raw[len(scheme) :], flag
            break
    raw = raw.rstrip("/")
    m = _HOST_PORT.match(raw)
    if not m:
        raise ValueError(f"malformed etcd endpoint {text!r}: expected host[:port]")
    port = int(m.group("port") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise ValueError(f"malformed etcd endpoint {text!r}: port {port} out of range")
    if m.group("host") is not None and not _hostname(m.group("host")):
        raise ValueError(
            f"malformed etcd endpoint {text!r}: {m.group('host')!r} is not a host name"
        )
    return Endpoint(m.group("ip6") or m.group("host"), port, secure)


def _hostname(host: str) -> bool:
    """Whether ``host`` can name a host: dot-separated labels of 1-63 characters, none that
    starts or ends with a hyphen (RFC 1123). Why check: ``-1`` (a value meant for another flag)
    was taken for a host and retried as "unreachable -1:2379" for the whole retry timeout.
    """
    labels = host.removesuffix(".").split(".")
    return all(
        0 < len(lb) <= 63 and not lb.startswith("-") and not lb.endswith("-") for lb in labels
    )


def parse_endpoints(spec: str | list[str] | tuple[str, ...]) -> tuple[Endpoint, ...]:
    """Parse a comma list (or a sequence) of endpoints; at least one is required."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    eps = tuple(parse_endpoint(s) for s in items if s.strip())
    if not eps:
        raise ValueError("no etcd endpoint given")
    return eps


# What each TLS file must hold: gRPC takes PEM only, and a file that is not one was read as an
# unreachable etcd, retried for the whole retry_timeout, and ended as "Failed to create security
# handshaker" without naming the file.
_PEM = {"ca_cert": "CERTIFICATE-----", "cert": "CERTIFICATE-----", "key": "PRIVATE KEY-----"}


def check_pem(name: str, path: str, marker: str) -> None:
    """ValueError naming the file unless it exists and holds a PEM block of ``marker``'s kind."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20).decode("ascii", errors="replace")
    except FileNotFoundError:
        raise ValueError(f"etcd TLS {name} file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"etcd TLS {name} file {path}: {e.strerror}") from None
    kind = marker.removesuffix("-----")
    if "-----BEGIN " not in text or marker not in text:
        raise ValueError(
            f"etcd TLS {name} file {path} is not a PEM {kind.lower()} (no BEGIN {kind})"
        )


@dataclass(frozen=True)
class ClientConfig:
    """Everything the client needs; ``password`` is never printed (repr hides it)."""

    endpoints: tuple[Endpoint, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    request_timeout: float = 2.0  # one attempt on one endpoint
    retry_timeout: float = 30.0  # all attempts of one call, across endpoints

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth needs both user and password")
        for name, marker in _PEM.items():
            path = getattr(self, name)
            if path is not None:
                check_pem(name, path, marker)
        self.policy  # noqa: B018 - validates the timeouts

    @property
    def policy(self) -> RetryPolicy:
        """The retry and timeout policy every loop of the client and the rendezvous asks."""
        return RetryPolicy(self.request_timeout, self.retry_timeout)

    @property
    def tls(self) -> bool:
        return self.ca_cert is not None or self.cert is not None

    def secure(self, ep: Endpoint) -> bool:
        """An explicit scheme wins; without one, TLS is used when TLS files were given."""
        return self.tls if ep.secure is None else ep.secure

    @classmethod
    def create(cls, endpoints: str | list[str] | tuple[str, ...], **kw) -> ClientConfig:
        return cls(endpoints=parse_endpoints(endpoints), **kw)
