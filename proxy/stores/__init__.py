"""Rate-limit storage: a small protocol (:mod:`.base`) and its backends.

``build_store`` is what the CLI calls: with no Redis URL, in-process GCRA buckets (one replica's
view); with one, GCRA in Redis behind token leasing (:mod:`.lease`, used by rules with
``lease: true`` or by every rule with ``lease=True``) and a circuit breaker with an in-process
fallback (:mod:`.breaker`). The Redis password comes from the URL, else ``password``, else the
file named by ``password_file`` / ``$OPGATE_REDIS_PASSWORD_FILE`` (a mounted Secret; read again
for every new connection, so a rotated Secret needs no restart), else ``$OPGATE_REDIS_PASSWORD``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from proxy.stores.base import (
    BucketRequest,
    KeyVerdict,
    Store,
    StoreUnavailable,
    Verdict,
    redacted_url,
)
from proxy.stores.memory import MemoryStore

__all__ = [
    "BucketRequest",
    "KeyVerdict",
    "MemoryStore",
    "Store",
    "StoreConfigError",
    "StoreUnavailable",
    "Verdict",
    "build_store",
    "redis_password",
    "redis_url_problem",
]

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel",
                 "rediss+sentinel")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class StoreConfigError(ValueError):
    """The Redis settings cannot work (an unreadable password or CA file); ``str()`` names the
    flag and the reason."""


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a ``--redis-url`` (its form only; no file is read), or None."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return f"{url!r} is not a URL: {exc}"
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES:
        return (f"{redacted_url(url)!r}: the scheme must be one of "
                f"{', '.join(s + '://' for s in REDIS_SCHEMES)}")
    if scheme == "unix":
        if not parts.path:
            return f"{redacted_url(url)!r}: unix:// needs a socket path"
        return _query_db_problem(url, parts.query)
    netloc = parts.netloc.rpartition("@")[2]
    if scheme.endswith("+sentinel"):
        nodes = [n for n in netloc.split(",") if n]
        if not nodes:
            return f"{redacted_url(url)!r}: a redis+sentinel URL needs sentinel host:port pairs"
        for node in nodes:
            host, colon, port = node.rpartition(":")
            if colon and host and not port.isdigit() and not node.endswith("]"):
                return f"{redacted_url(url)!r}: sentinel port {port!r} is not a number"
        pieces = [p for p in parts.path.split("/") if p]
        if not pieces:
            return (f"{redacted_url(url)!r}: a redis+sentinel URL needs the master name: "
                    "…/mastername")
        if len(pieces) > 1 and not pieces[1].isdigit():
            return f"{redacted_url(url)!r}: the database {pieces[1]!r} is not a number"
        return None
    if not netloc or not parts.hostname:
        return f"{redacted_url(url)!r}: no host (expected {scheme}://HOST:PORT/DB)"
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        return f"{redacted_url(url)!r}: the port is not a number from 1 to 65535"
    db = parts.path.strip("/")
    if db and not scheme.endswith("+cluster") and not db.isdigit():
        return f"{redacted_url(url)!r}: the database {db!r} is not a number (…/0)"
    return _query_db_problem(url, parts.query)


def _query_db_problem(url: str, query: str) -> str | None:
    """``?db=`` (redis-py's form for ``unix://``) that is not a number: redis-py refuses it
    only when the client is built."""
    for value in parse_qs(query).get("db", ()):
        if not value.isdigit():
            return f"{redacted_url(url)!r}: the database {value!r} in ?db= is not a number"
    return None


def redis_tls_files(url: str) -> list[tuple[str, str]]:
    """The ``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile`` files a URL names."""
    query = urlsplit(url).query
    found = []
    for pair in query.split("&") if query else ():
        name, _, value = pair.partition("=")
        if name in _TLS_FILES:
            found.append((name, unquote(value)))
    return found


def redis_password(password: str | None = None, password_file: str | None = None) -> str | None:
    """The password to use when the URL has none (explicit, then file, then environment)."""
    if password:
        return password
    path = password_file or os.environ.get("OPGATE_REDIS_PASSWORD_FILE")
    if path:
        try:
            return Path(path).read_text("utf-8").strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise StoreConfigError(
                f"--redis-password-file {path}: cannot read it: {reason}") from exc
    return os.environ.get("OPGATE_REDIS_PASSWORD") or None


def build_store(
    *,
    redis_url: str | None,
    password: str | None = None,
    password_file: str | None = None,
    timeout: float = 0.05,
    replicas: int = 1,
    lease: bool = False,
    breaker_failures: int = 3,
    breaker_reset: float = 1.0,
    prefix: str = "opgate:rl:",
) -> Store:
    """The store the rate-limit middleware decides with (see the module docstring).

    ``replicas`` is the number of opgate replicas sharing the limits: while Redis is down each
    one runs ``failure: open`` rules at ``qps / replicas``. Redis is not contacted here; the
    first decision connects (and the breaker copes if it cannot). A URL of a wrong form, or a
    password file or TLS file (``?ssl_ca_certs=``…) that cannot be read, raises
    :class:`StoreConfigError`: configuration errors, unlike Redis being down.
    """
    from proxy.stores.breaker import ResilientStore, set_backend_gauge

    if not redis_url:
        set_backend_gauge("local")
        return MemoryStore()
    problem = redis_url_problem(redis_url)
    if problem:
        raise StoreConfigError(f"--redis-url {problem}")
    for name, path in redis_tls_files(redis_url):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise StoreConfigError(
                f"--redis-url: {name}={path}: cannot read it: {exc.strerror}") from exc
    from proxy.stores.lease import LeasingStore
    from proxy.stores.redis import RedisStore

    secret = redis_password(password, password_file)  # a file that cannot be read: raises
    secret_file = None if password else (
        password_file or os.environ.get("OPGATE_REDIS_PASSWORD_FILE"))
    try:  # redis-py reads the query's options (?db=, ?socket_timeout=) only here
        shared = RedisStore.from_url(
            redis_url, password=secret, password_file=secret_file, timeout=timeout,
            prefix=prefix,
        )
    except ValueError as exc:
        raise StoreConfigError(f"--redis-url {redacted_url(redis_url)!r}: {exc}") from None
    leased = LeasingStore(shared, replicas=replicas, lease_all=lease)
    return ResilientStore(leased, replicas=replicas, failures=breaker_failures,
                          reset_after=breaker_reset)
