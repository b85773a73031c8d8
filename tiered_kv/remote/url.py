"""The remote tier's url: parsed into a :class:`RemoteTarget`, and redacted for every log line and error.

Forms: ``redis://[user:pass@]host:port[/db]``, ``rediss://`` (TLS), ``unix:///path?db=N``, and the
cluster forms ``redis+cluster://[user:pass@]h1:p1,h2:p2`` / ``rediss+cluster://...`` (the seeds).
Credentials come from the url, else from ``TIERED_KV_REMOTE_USERNAME`` / ``TIERED_KV_REMOTE_PASSWORD``; the
environment's user name only when the url has no user info at all (``redis://:pass@host`` is the default user).
A password is never logged: every message that names the url goes through :func:`redact_url`.
TLS query parameters: ``ssl_ca_certs=PATH``, ``ssl_cert_reqs=none|optional|required``,
``ssl_certfile=PATH``, ``ssl_keyfile=PATH``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import parse_qs, unquote

from ..errors import ConfigError

__all__ = ["RemoteTarget", "parse_url", "redact_url", "ENV_USERNAME", "ENV_PASSWORD", "DEFAULT_PORT"]

ENV_USERNAME = "TIERED_KV_REMOTE_USERNAME"
ENV_PASSWORD = "TIERED_KV_REMOTE_PASSWORD"
DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
TLS_PARAMS = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile")
_PARAMS = (*TLS_PARAMS, "db")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#]*)@")   # greedy: up to the last '@' of the netloc
# user info holding an unencoded '/', '?' or '#' (see _misplaced_at): up to the url's last '@'
_USERINFO_SPILLED = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)(.*)@", re.S)


def redact_url(url: str) -> str:
    """``url`` with the password (everything after the first ``:`` of the user info, and the value of a
    query parameter named like one) as ``***``.

    Works on malformed urls too (it is what error messages about them show)."""
    if not isinstance(url, str):
        return "<not a string>"
    m = _USERINFO.match(url)
    if not m:
        _, sep, rest = url.partition("://")
        cut = re.search(r"[/?#]", rest)
        if not sep or cut is None or not _misplaced_at(rest[cut.start():]):
            return _redact_query(url)
        m = _USERINFO_SPILLED.match(url)
        if not m:
            return _redact_query(url)
    user, sep, _ = m.group(2).partition(":")
    if not sep:
        return _redact_query(url)   # a lone user info is a user name (as redis-py reads it), no secret
    return _redact_query(m.group(1) + user + ":***@" + url[m.end():])


_SECRET_PARAM = re.compile(r"([?&;][^=&;#]*(?:pass|auth|secret|token)[^=&;#]*=)[^&;#]*", re.I)


def _redact_query(url: str) -> str:
    """``url`` with the value of every query parameter named like a credential (``password=``,
    ``auth=``, redis-py's own forms, which this parser refuses) as ``***``."""
    return _SECRET_PARAM.sub(r"\1***", url)


@dataclass(frozen=True)
class RemoteTarget:
    """Where the store connects and how; ``password`` never appears in ``repr``."""

    scheme: str
    cluster: bool
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    unix_path: Optional[str] = None
    db: int = 0
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str], ...] = ()
    redacted: str = ""


def _port(text: str, url: str) -> int:
    if not (text.isascii() and text.isdigit()):   # int() would take " 1", "+1", "1_0"
        raise ConfigError(f"remote url {redact_url(url)!r}: port {text!r} is not a number")
    port = int(text)
    if not 0 < port < 65536:
        raise ConfigError(f"remote url {redact_url(url)!r}: port {port} out of range")
    return port


def _host_port(item: str, url: str) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise ConfigError(f"remote url {redact_url(url)!r}: empty host")
    if item.startswith("["):   # [ipv6]:port
        host, closed, rest = item[1:].partition("]")
        if not closed or not host or (rest and not rest.startswith(":")):
            raise ConfigError(f"remote url {redact_url(url)!r}: malformed host {item!r}: expected [ipv6] or "
                              f"[ipv6]:port")
        return host, _port(rest[1:], url) if rest else DEFAULT_PORT
    if item.count(":") > 1:
        raise ConfigError(f"remote url {redact_url(url)!r}: host {item!r}: an IPv6 address must be in brackets, "
                          f"[addr]:port")
    host, sep, port = item.rpartition(":")
    if not sep:
        return item, DEFAULT_PORT
    if not host:
        raise ConfigError(f"remote url {redact_url(url)!r}: empty host in {item!r}")
    return host, _port(port, url)


def _misplaced_at(tail: str) -> bool:
    """Whether an ``@`` after the host can only end user info that holds an unencoded ``/``, ``?`` or
    ``#``: one in the path, the fragment or a query item other than a known parameter's (whose
    value, a key file's path, may hold one)."""
    head, _, fragment = tail.partition("#")
    path, _, query = head.partition("?")
    return "@" in path or "@" in fragment or any("@" in item and item.partition("=")[0] not in _PARAMS
                                                 for item in query.split("&"))


def parse_url(url: str) -> RemoteTarget:
    """Parse ``url``; :class:`~tiered_kv.errors.ConfigError` (naming it redacted) when malformed."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"remote url {redact_url(url)!r}: expected scheme://..., one of {', '.join(SCHEMES)}")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"remote url {redact_url(url)!r}: unknown scheme {scheme!r}, expected one of "
                          f"{', '.join(SCHEMES)}")
    if scheme == "unix":
        netloc, tail = "", rest
    else:
        m = re.search(r"[/?#]", rest)
        netloc, tail = (rest[:m.start()], rest[m.start():]) if m else (rest, "")
        if _misplaced_at(tail):   # no part of such user info may be quoted by the errors below
            raise ConfigError(f"remote url {redact_url(url)!r}: a '/', '?', '#' or '@' in the user name or password "
                              f"must be percent-encoded")
    path, _, query = tail.partition("?")
    if "#" in query:
        query = query.partition("#")[0]
    parsed = parse_qs(query, keep_blank_values=True)
    repeated = sorted(k for k, v in parsed.items() if len(v) > 1)
    if repeated:   # which one was meant is a guess (parse_qs keeps them all): refuse it, naming no value
        raise ConfigError(f"remote url {redact_url(url)!r}: parameter(s) given more than once: {', '.join(repeated)}")
    params = {k: v[0] for k, v in parsed.items()}
    username: Optional[str] = None
    password: Optional[str] = None
    userinfo, at, hostpart = netloc.rpartition("@")
    if at:
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None   # redis://:pass@host: no user name (the default user)
        if sep:
            password = unquote(pw)
    if not at:   # no user info at all: the environment's user; 'redis://:pass@host' is the url's default user
        username = os.environ.get(ENV_USERNAME) or None
    if password is None:
        password = os.environ.get(ENV_PASSWORD) or None
    unknown = set(params) - set(_PARAMS)
    if unknown:
        raise ConfigError(f"remote url {redact_url(url)!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
    tls = scheme.startswith("rediss")
    tls_options = tuple(sorted((k, v) for k, v in params.items() if k in TLS_PARAMS))
    if tls_options and not tls:
        raise ConfigError(f"remote url {redact_url(url)!r}: TLS parameters need rediss:// or rediss+cluster://")
    if params.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise ConfigError(f"remote url {redact_url(url)!r}: ssl_cert_reqs must be none, optional or required")
    db_text = params.get("db")
    if scheme != "unix" and path.strip("/"):
        if db_text is not None:
            raise ConfigError(f"remote url {redact_url(url)!r}: the database is given twice")
        db_text = path.strip("/")
    if db_text and not (db_text.isascii() and db_text.isdigit()):   # int() would take " 1", "+1", "1_0", "-1"
        raise ConfigError(f"remote url {redact_url(url)!r}: database {db_text!r} is not a number")
    db = int(db_text) if db_text else 0
    common = dict(username=username, password=password, tls_options=tls_options, redacted=redact_url(url))
    if scheme == "unix":
        if not path.startswith("/"):
            raise ConfigError(f"remote url {redact_url(url)!r}: expected unix:///absolute/path")
        return RemoteTarget(scheme, False, False, unix_path=path, db=db, **common)   # type: ignore[arg-type]
    cluster = scheme.endswith("+cluster")
    items = [s for s in hostpart.split(",")] if hostpart else []
    if not items:
        raise ConfigError(f"remote url {redact_url(url)!r}: no host")
    hosts = tuple(_host_port(s, url) for s in items)
    if len(hosts) > 1 and not cluster:
        raise ConfigError(f"remote url {redact_url(url)!r}: several hosts need redis+cluster:// or rediss+cluster://")
    if cluster and db:
        raise ConfigError(f"remote url {redact_url(url)!r}: a cluster has database 0 only")
    return RemoteTarget(scheme, cluster, tls, hosts=hosts, db=db, **common)   # type: ignore[arg-type]
