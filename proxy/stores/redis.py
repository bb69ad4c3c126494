"""The shared rate-limit backend: GCRA buckets in Redis, one Lua script call per decision.

Every replica of an operator asks the same Redis, so a limit holds for the operator as a whole.
One decision is one ``EVALSHA`` of ``gcra.lua`` (redis-py's ``register_script`` loads it once and
re-loads it on ``NOSCRIPT``) over all the call's buckets; the script reads Redis ``TIME``, so the
replicas' clocks never matter, and sets each key to expire when its TAT has passed (a missing key
is a full bucket). Keys are ``<prefix>{<shard>}:<key>``: the hash tag keeps all buckets of one
call in one Redis Cluster slot, so they are decided in one atomic script call. Should a call
span several shards (only in Cluster mode), shards are decided one after the other and the
tokens of earlier shards are given back when a later one denies.

Connections come from a URL: ``redis://`` / ``rediss://`` (TLS) / ``unix://``, Cluster with
``redis+cluster://`` / ``rediss+cluster://``, Sentinel with
``redis+sentinel://[:password@]host:port[,host:port]/mastername[/db]`` (``rediss+sentinel`` for
TLS). Every call is bounded by ``timeout``; a failure raises :class:`StoreUnavailable` (the
breaker in :mod:`proxy.stores.breaker` decides what then happens).

Quota reservations are one ``EVALSHA`` of ``quota.lua`` per admitted create (admit and reserve
at once, against Redis ``TIME``) and one per settlement, on the sorted set
``<quota_prefix>{<group>/<resource>/<namespace>}`` (one key: one Cluster slot), whose members
expire by themselves and whose key expires with its last member.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import re
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.engine import telemetry
from proxy.stores.base import (
    US,
    BucketRequest,
    Reservation,
    Reserved,
    StoreUnavailable,
    Verdict,
    interval_us,
    redacted_url,
    verdict_from,
)

__all__ = ["QUOTA_SCRIPT", "SCRIPT", "RedisStore", "connect", "probe"]

log = logging.getLogger("opgate.ratelimit.store")
SCRIPT = importlib.resources.files("proxy.stores").joinpath("gcra.lua").read_text("utf-8")
QUOTA_SCRIPT = importlib.resources.files("proxy.stores").joinpath("quota.lua").read_text("utf-8")
DEFAULT_PREFIX = "opgate:rl:"
DEFAULT_QUOTA_PREFIX = "opgate:quota:"
WARM_BUDGET = 0.25  # seconds, once per process (see RedisStore._warm_up)
WARM_CONNECTIONS = 4
# a probe's first call may take this many timeouts (at least WARM_BUDGET) to connect afresh
RECONNECT_TIMEOUTS = 5
MAX_CONNECTIONS = 16  # per process; a call waits for a free one (within its own timeout)
_FIELDS = 5  # per-key values in the script's reply


_TLS_QUERY = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _tls_options(url: str) -> tuple[str, dict[str, str]]:
    """Take ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile`` out of a ``rediss://`` URL's
    query (redis-py does not read them from a URL) and return them as client arguments, so that
    a CA and a client certificate mounted from a Secret can be named in the URL alone."""
    parts = urlsplit(url)
    if not parts.query:
        return url, {}
    kept, tls = [], {}
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if name in _TLS_QUERY:
            tls[name] = unquote(value)
        else:
            kept.append(pair)
    return parts._replace(query="&".join(kept)).geturl(), tls


class FilePassword(CredentialProvider):
    """The password in a file (``--redis-password-file``, a mounted Secret), read again for
    every new connection: after the Secret is rotated (the kubelet swaps the file) and Redis
    asks for the new password, reconnecting works without a restart. A file that cannot be
    read then keeps the last password read."""

    def __init__(self, path: str, *, username: str = "", password: str | None = None) -> None:
        self.path = path
        self.username = username
        self.password = password or ""

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        try:
            self.password = Path(self.path).read_text("utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.debug("reading the Redis password file %s: %s (the last one read is used)",
                      self.path, exc)
        if not self.password:
            return ()  # type: ignore[return-value]  # no AUTH, as without a password
        return (self.username, self.password) if self.username else (self.password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


def connect(url: str, *, password: str | None = None, password_file: str | None = None,
            timeout: float = 0.05) -> tuple[Any, bool]:
    """A redis-py asyncio client for ``url`` and whether it is a Cluster client.

    ``password`` is used when the URL carries none; read from ``password_file``, it is read
    again for each new connection (:class:`FilePassword`). A command whose connection turns out
    closed is sent once more on a new one: after Redis restarts, every pooled connection is
    dead, and failing a call on each would trip the breaker with Redis back. Nothing else is
    retried (a timeout is the breaker's business), and each call is bounded by ``timeout``.
    """
    url, tls = _tls_options(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    common: dict[str, Any] = {
        **tls,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    if password_file and parts.password is None:
        common["credential_provider"] = FilePassword(
            password_file, username=unquote(parts.username or ""), password=password)
        # the provider gives the username too: redis-py refuses one from the URL beside it
        url = _without_userinfo(url)
    elif password:
        common["password"] = password
    if scheme in ("redis+cluster", "rediss+cluster"):
        plain = scheme.split("+", 1)[0] + url[len(parts.scheme):]
        return RedisCluster.from_url(plain, **common), True
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return _sentinel_master(url, common), False
    if scheme in ("redis", "rediss", "unix"):
        # a bounded pool that makes callers wait for a free connection: a burst of first
        # calls (a controller starting its informers) would otherwise open a connection each,
        # their handshakes would miss the timeout and trip the breaker
        pool = BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS,
                                               timeout=None, **common)
        _check_options(pool, scheme)
        return Redis.from_pool(pool), False
    raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r} (redis, rediss, unix, "
                     "redis+cluster, rediss+cluster, redis+sentinel, rediss+sentinel)")


def _without_userinfo(url: str) -> str:
    """``url`` without its ``user@`` (``redis://opgate@h/0`` → ``redis://h/0``)."""
    scheme, sep, rest = url.partition("://")
    end = min(i for i in (rest.find("/"), rest.find("?"), len(rest)) if i >= 0)
    return f"{scheme}{sep}{rest[:end].rpartition('@')[2]}{rest[end:]}"


_UNEXPECTED = re.compile(r"unexpected keyword argument '([^']*)'")


def _check_options(pool: BlockingConnectionPool, scheme: str) -> None:
    """Raise ``ValueError`` for a query option no connection takes (``?ssl_ca_cert=``, or
    ``?ssl_ca_certs=`` on ``redis://``): redis-py passes unknown ones on as arguments, so every
    connection would fail with a ``TypeError`` (Redis "unavailable" for as long as opgate
    runs) instead of opgate refusing the flag at start. Building a connection does no I/O."""
    try:
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as exc:
        found = _UNEXPECTED.search(str(exc))
        if found is None:
            raise ValueError(str(exc)) from None
        name = found.group(1)
        hint = " (a TLS option: it needs rediss://)" if name in _TLS_QUERY else ""
        raise ValueError(f"the query option {name!r} is not one a {scheme}:// connection "
                         f"takes{hint}") from None


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The master's connections through a Sentinel in a bounded pool whose callers wait for a
    free one, as ``connect`` makes for ``redis://``: redis-py's Sentinel pool opens one per call
    in flight (each asking a Sentinel first) and refuses the 101st with "Too many
    connections", which failed calls and tripped the breaker with Redis fine."""


def _sentinel_master(url: str, common: dict[str, Any]) -> Redis:
    """``redis+sentinel://[:pw@]h1:p1,h2:p2/master[/db][?sentinel_password=…]``."""
    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host:
            host, port = port, "26379"
        nodes.append((host.strip("[]"), int(port or 26379)))
    pieces = [p for p in path.split("/") if p]
    if not pieces:
        raise ValueError("a redis+sentinel URL needs the master name: …/mastername")
    kwargs = dict(common)
    if userinfo:
        user, _, pw = userinfo.partition(":")
        if pw:
            kwargs["password"] = unquote(pw)
        if user:
            kwargs["username"] = unquote(user)
    if len(pieces) > 1:
        kwargs["db"] = int(pieces[1])
    options = parse_qs(query)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": common["socket_timeout"],
        "socket_connect_timeout": common["socket_connect_timeout"],
        # a Sentinel that fails is skipped for the next one at once: with redis-py's default
        # (10 tries, with backoff) a first Sentinel that was down or hung took every call's
        # timeout, and no new connection reached the master (at start, after a restart)
        "retry": Retry(NoBackoff(), 0),
    }
    if "sentinel_password" in options:
        sentinel_kwargs["password"] = options["sentinel_password"][0]
    if scheme.startswith("rediss"):
        kwargs["ssl"] = True
        # the Sentinels speak TLS with the same CA (and client certificate) as the master
        sentinel_kwargs.update({"ssl": True, **{k: v for k, v in common.items()
                                                if k in _TLS_QUERY}})
    sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs, **kwargs)  # type: ignore[no-untyped-call]
    master: Redis = sentinel.master_for(
        unquote(pieces[0]), connection_pool_class=_BlockingSentinelPool,
        max_connections=MAX_CONNECTIONS, timeout=None)
    return master


class RedisStore:
    """GCRA in Redis. Raises :class:`StoreUnavailable` on any failure or after ``timeout``."""

    backend = "redis"

    def __init__(
        self, client: Any, *, cluster: bool = False, timeout: float = 0.05,
        prefix: str = DEFAULT_PREFIX, url: str = "", quota_prefix: str = DEFAULT_QUOTA_PREFIX,
    ) -> None:
        self.client = client
        self.cluster = cluster
        self.timeout = timeout
        self.prefix = prefix
        self.quota_prefix = quota_prefix
        self.url = redacted_url(url)
        self.calls = 0  # script calls made (the benchmark reads it)
        self._script = client.register_script(SCRIPT)
        self._quota_script = client.register_script(QUOTA_SCRIPT)
        self._warm: asyncio.Task[None] | None = None
        # a Cluster client opens a connection per call in flight to a node and refuses the
        # 101st (MaxConnectionsError), with no pool that makes callers wait as ``connect``'s
        # do: calls wait here instead, for one of MAX_CONNECTIONS (within their own timeout)
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS) if cluster else None

    @classmethod
    def from_url(
        cls, url: str, *, password: str | None = None, password_file: str | None = None,
        timeout: float = 0.05, prefix: str = DEFAULT_PREFIX,
        quota_prefix: str = DEFAULT_QUOTA_PREFIX,
    ) -> RedisStore:
        client, cluster = connect(url, password=password, password_file=password_file,
                                  timeout=timeout)
        return cls(client, cluster=cluster, timeout=timeout, prefix=prefix, url=url,
                   quota_prefix=quota_prefix)

    def redis_key(self, request: BucketRequest) -> str:
        return f"{self.prefix}{{{request.shard or request.key}}}:{request.key}"

    async def acquire(self, requests: Sequence[BucketRequest], now: float | None = None) -> Verdict:
        """Decide all ``requests`` atomically; ``now`` (µs) replaces Redis TIME, for tests only."""
        if self._warm is None or not self._warm.done():
            await self._warm_up()
        if not self.cluster or len({r.shard or r.key for r in requests}) <= 1:
            allowed, results = await self._call(requests, now)
            return verdict_from(allowed, results, backend=self.backend)
        return await self._acquire_sharded(requests, now)

    async def _acquire_sharded(
        self, requests: Sequence[BucketRequest], now: float | None
    ) -> Verdict:
        groups: dict[str, list[int]] = {}
        for index, r in enumerate(requests):
            groups.setdefault(r.shard or r.key, []).append(index)
        results: list[Any] = [None] * len(requests)
        charged: list[BucketRequest] = []
        allowed = True
        for indexes in groups.values():
            part = [requests[i] for i in indexes]
            ok, answers = await self._call(part, now)
            for i, answer in zip(indexes, answers, strict=True):
                results[i] = answer
            if not ok:
                allowed = False
                break
            charged.extend(
                BucketRequest(key=r.key, rate=r.rate, burst=r.burst, shard=r.shard,
                              cost=-(r.cost + int(a[1])))
                for r, a in zip(part, answers, strict=True)
            )
        if not allowed:
            await self._refund(charged, now)
            for i, r in enumerate(requests):  # shards never asked: report a neutral "allowed"
                if results[i] is None:
                    results[i] = (1, 0, r.burst, 0, 0)
        return verdict_from(allowed, results, backend=self.backend)

    async def _refund(self, charged: list[BucketRequest], now: float | None) -> None:
        groups: dict[str, list[BucketRequest]] = {}
        for r in charged:
            groups.setdefault(r.shard or r.key, []).append(r)
        for part in groups.values():
            await self._call(part, now)

    async def _call(
        self, requests: Sequence[BucketRequest], now: float | None
    ) -> tuple[bool, list[tuple[int, int, int, int, int]]]:
        keys = [self.redis_key(r) for r in requests]
        args: list[Any] = ["" if now is None else int(now)]
        for r in requests:
            args += (interval_us(r.rate), r.burst, r.cost, r.extra)
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self._run(self._script, keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            telemetry.REDIS_ERRORS.inc()
            raise StoreUnavailable(describe_failure(exc, timeout=self.timeout)) from exc
        values = [int(v) for v in reply]
        results = [
            tuple(values[1 + i * _FIELDS: 1 + (i + 1) * _FIELDS]) for i in range(len(requests))
        ]
        return values[0] == 1, results  # type: ignore[return-value]

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """``script(keys, args)``, on a Cluster once one of its call slots is free."""
        if self._slots is None:
            return await script(keys=keys, args=args)
        async with self._slots:
            return await script(keys=keys, args=args)

    # --- quota reservations ---------------------------------------------------------------

    def quota_key(self, scope: str) -> str:
        return f"{self.quota_prefix}{{{scope}}}"

    async def reserve(self, request: Reservation, now: float | None = None) -> Reserved:
        """Admit and reserve atomically (``quota.lua``); ``now`` (µs) replaces Redis TIME, for
        tests only."""
        args: list[Any] = ["" if now is None else int(now), "reserve", request.member,
                           request.observed, request.limit, round(request.ttl * US),
                           "1" if request.check_only else "0", *request.seen]
        reply = await self._quota_call(request.scope, args)
        return Reserved(allowed=int(reply[0]) == 1, used=int(reply[1]), backend=self.backend)

    async def settle(self, scope: str, member: str, ttl: float | None,
                     now: float | None = None) -> None:
        await self.settle_found(scope, member, ttl, now)

    async def settle_found(self, scope: str, member: str, ttl: float | None,
                           now: float | None = None) -> bool:
        args: list[Any] = ["" if now is None else int(now), "settle", member,
                           -1 if ttl is None else round(ttl * US)]
        reply = await self._quota_call(scope, args)
        return int(reply[0]) == 1

    async def _quota_call(self, scope: str, args: list[Any]) -> list[Any]:
        if self._warm is None or not self._warm.done():
            await self._warm_up()
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout):
                reply: list[Any] = await self._run(self._quota_script,
                                                   [self.quota_key(scope)], args)
        except (RedisError, OSError, TimeoutError) as exc:
            telemetry.REDIS_ERRORS.inc()
            raise StoreUnavailable(describe_failure(exc, timeout=self.timeout)) from exc
        return reply

    async def _warm_up(self) -> None:
        """Once, on first use: load the script and open a few connections with a budget of
        ``WARM_BUDGET`` s instead of ``timeout``, shared by every caller of a cold start. A burst
        of first calls would otherwise spend its few milliseconds on handshakes and NOSCRIPT
        reloads, and trip the breaker. Failure is fine: calls then go on as usual."""
        if self._warm is None:
            self._warm = asyncio.get_running_loop().create_task(self._open())
        await asyncio.wait([self._warm])

    async def _open(self) -> None:
        try:
            async with asyncio.timeout(max(self.timeout, WARM_BUDGET)):
                self._script.sha = await self.client.script_load(SCRIPT)
                self._quota_script.sha = await self.client.script_load(QUOTA_SCRIPT)
                if not self.cluster:
                    await asyncio.gather(*(self.client.ping() for _ in range(WARM_CONNECTIONS)))
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("redis warm-up failed (%s); calls go on with %.3fs timeouts", exc,
                      self.timeout)

    async def ping(self) -> bool:
        """True when a decision would succeed now, else :class:`StoreUnavailable` saying why
        (the breaker's probe: its reason is what ``/readyz`` shows, so a Redis back with
        another password says so, not the refused connection that opened the circuit). Not
        a ``PING``, which a Redis answers while it refuses every write (``maxmemory`` with
        ``noeviction``, a read-only replica after a failover), so the circuit would close and
        trip again every probe; one ``gcra.lua`` call that writes (cost 0 on a key of its
        own, expiring at once), as decisions do, and also reloads the script if Redis lost
        it. Not counted in ``opgate_redis_errors_total``: the breaker counts failed probes.

        Two such calls: the first may take :data:`RECONNECT_TIMEOUTS` timeouts, to connect
        afresh after an outage (a Sentinel that hangs is asked first and takes one timeout
        before the next one is asked, and only an answer puts that one first; TLS, AUTH, the
        script loaded again): held to one timeout, a probe never got through while a reconnect
        cost more, and the store stayed "down" with Redis fine. The second is held to one
        timeout, on the connection just made: a Redis slower than ``timeout`` stays down."""
        for within in (max(WARM_BUDGET, RECONNECT_TIMEOUTS * self.timeout), self.timeout):
            await self._probe_call(within)
        return True

    async def _probe_call(self, within: float) -> None:
        key = f"{self.prefix}{{probe}}:probe"
        try:
            async with asyncio.timeout(within):
                await self._run(self._script, [key], ["", US, 1, 0, 0])
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(describe_failure(exc, timeout=within)) from exc

    def health(self) -> dict[str, object]:
        return {"backend": self.backend, "url": self.url, "cluster": self.cluster,
                "timeout_seconds": self.timeout}

    async def close(self) -> None:
        close = getattr(self.client, "aclose", None) or self.client.close
        await close()


PROBE_TIMEOUT = 2.0  # seconds for the start-up probe (connect, TLS, AUTH, PING)


async def probe(url: str, *, password: str | None = None,
                within: float = PROBE_TIMEOUT) -> str | None:
    """PING Redis once with its own short-lived client; None when it answers, else what went
    wrong in words a user can act on (authentication, TLS, unreachable). Never raises."""
    client: Any = None
    try:
        client, _ = connect(url, password=password, timeout=within)
        async with asyncio.timeout(within):
            await client.ping()
        return None
    except Exception as exc:  # a probe never takes anything down
        problem = describe_failure(exc, timeout=within)
        if isinstance(exc, TimeoutError) and url.lower().startswith("rediss"):
            problem = (f"TLS failed or unreachable: no TLS handshake within {within:g}s "
                       "(does the server speak TLS, as rediss:// says?)")
        return problem
    finally:
        if client is not None:
            close = getattr(client, "aclose", None) or client.close
            try:
                await close()
            except Exception as exc:  # the client failed already; nothing to keep
                log.debug("closing the probe's Redis client: %s", exc)


def describe_failure(exc: BaseException, *, timeout: float = PROBE_TIMEOUT) -> str:
    """What a failed Redis call means, as one phrase."""
    text = str(exc) or type(exc).__name__
    # what Redis answered while connecting (AUTH, SELECT) comes wrapped in redis-py's
    # ConnectionError on a unix:// socket, and TLS errors on any connection
    chain = _causes(exc)
    if any(isinstance(e, AuthenticationError) for e in chain) or any(
            word in text for word in ("NOAUTH", "WRONGPASS", "invalid password",
                                      "Authentication required")):
        return (f"authentication failed ({text}): check the password (in --redis-url or "
                "--redis-password-file)")
    if any(isinstance(e, ssl.SSLError) or "SSL" in str(e) for e in chain):
        return (f"TLS failed ({text}): does the server speak TLS (rediss://) and is "
                "ssl_ca_certs its CA?")
    if isinstance(exc, TimeoutError):
        return f"unreachable: no answer within {timeout:g}s"
    if any(isinstance(e, ResponseError) for e in chain):
        return f"answered with an error: {text}"
    return f"unreachable: {text}"


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain
