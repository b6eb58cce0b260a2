"""The URL forms of redis.url beyond redis-py's own (redis://, rediss://, unix://).

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]
    rediss+sentinel://...     the same over TLS (Sentinels and data nodes), with
                              ?ssl_ca_certs=, ?ssl_certfile=, ?ssl_keyfile=, ?ssl_cert_reqs=
    redis+cluster://[[user]:password@]host:port[,host:port...]

Sentinel: the addresses are the Sentinels', the service name is the one their
``sentinel monitor`` line gives the primary; user and password are the data nodes'
(the primary's and its replicas'). Sentinels that want a password of their own get
``?sentinel_password=...`` (and ``?sentinel_username=...``). Cluster: the addresses
are some of the cluster's nodes (one is enough; more ride out one being down); a
cluster has only database 0.

Messages never repeat a part of the URL that could hold the password.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote

SENTINEL = "redis+sentinel"
SENTINEL_TLS = "rediss+sentinel"
CLUSTER = "redis+cluster"
SCHEMES = (SENTINEL, SENTINEL_TLS, CLUSTER)
SENTINELS = (SENTINEL, SENTINEL_TLS)
SENTINEL_EXAMPLE = "redis+sentinel://:password@host1:26379,host2:26379/mymaster/0"
CLUSTER_EXAMPLE = "redis+cluster://:password@host1:7000,host2:7001"
_QUERY = ("sentinel_password", "sentinel_username")
TLS_QUERY = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


@dataclass(frozen=True)
class MultiHostUrl:
    """A parsed redis+sentinel:// or redis+cluster:// URL."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.scheme == SENTINEL_TLS


def scheme_of(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def is_multi_host(url: str) -> bool:
    return scheme_of(url) in SCHEMES


def parse(url: str) -> MultiHostUrl:
    """The parts of a redis+sentinel:// or redis+cluster:// URL; ValueError naming what is
    wrong (never the password) otherwise."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(SCHEMES)}")
    example = SENTINEL_EXAMPLE if scheme in SENTINELS else CLUSTER_EXAMPLE
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    at = rest.rfind("@")
    userinfo, rest = (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)
    netloc, _, path = rest.partition("/")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts = []
    for part in netloc.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host:
            raise ValueError(f"each address must be host:port, as in {example}")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"a port is not valid: it must be a number from 1 to 65535, as in {example}")
        hosts.append((host.strip("[]"), int(port)))
    options: dict[str, str] = {}
    for name, values in parse_qs(query).items():
        known = (*_QUERY, *TLS_QUERY) if scheme == SENTINEL_TLS else _QUERY if scheme == SENTINEL else ()
        if name not in known:
            allowed = ", ".join(known) or "none"
            raise ValueError(f"query parameter {name!r} is not known (allowed: {allowed})")
        options[name] = values[0]
    segments = [s for s in path.split("/") if s] if path else []
    service, db = "", 0
    if scheme in SENTINELS:
        if not segments:
            raise ValueError(f"the service name is missing (the path after the Sentinels), as in {example}")
        if len(segments) > 2:
            raise ValueError(f"the path is service_name[/db], as in {example}")
        service = unquote(segments[0])
        if len(segments) == 2:
            db = _db(segments[1], example)
    elif segments and (len(segments) > 1 or _db(segments[0], example) != 0):
        raise ValueError(f"a Redis Cluster has only database 0: leave the path out, as in {example}")
    return MultiHostUrl(scheme, tuple(hosts), service, db, username, password, options)


def _db(text: str, example: str) -> int:
    if not text.isdigit():
        raise ValueError(f"the database is not a whole number: it must be 0 or more, as in {example}")
    return int(text)
