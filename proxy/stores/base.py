"""The storage protocol the rate limiter and the quota reservations go through, shared by every
backend.

A rate-limit decision is one call, :meth:`Store.acquire`, over all the buckets a request must pass
(one per matching rule). It is all-or-nothing: when any bucket denies, no bucket is charged. The
algorithm is GCRA ("virtual scheduling"), kept as one number per bucket: the theoretical arrival
time (TAT) in integer microseconds. :func:`gcra_step` is the reference arithmetic; the Redis
script ``gcra.lua`` performs exactly the same operations on the same IEEE doubles, so the
in-process and the Redis backends agree decision for decision (the table tests check it).

Quota reservations (:meth:`Store.reserve`, :meth:`Store.settle`) are a second, separate table:
per scope (``<group>/<resource>/<namespace>``) a set of members ``<name>|<token>`` each with an
expiry time. :func:`reserve_step` / :func:`settle_step` are the reference operations; the Redis
script ``quota.lua`` performs the same ones, so a single process (the in-process store) and
several replicas sharing Redis count reservations alike (the table tests check it too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "GONE",
    "SHOWN",
    "BucketRequest",
    "Held",
    "KeyVerdict",
    "Reservation",
    "Reserved",
    "Store",
    "StoreUnavailable",
    "Verdict",
    "decide",
    "gcra_step",
    "interval_us",
    "redacted_url",
    "reserve_step",
    "settle_step",
]

US = 1_000_000


class StoreUnavailable(Exception):
    """The backend could not answer (connection refused, timeout, circuit open)."""


@dataclass(frozen=True, slots=True)
class BucketRequest:
    """Take ``cost`` tokens from the bucket ``key`` (``rate`` tokens/s, at most ``burst`` saved).

    ``shard`` is the hash tag: requests of one call with the same shard are decided in one atomic
    backend call (Redis Cluster puts them in one slot). ``extra`` asks for up to that many more
    tokens when plenty are left (token leasing; see :mod:`proxy.stores.lease`). ``lease`` lets the
    leasing layer serve this key from local tokens; ``fail_open`` says what happens while the
    shared store is down: an in-process bucket (True) or "unavailable" (False).
    """

    key: str
    rate: float
    burst: int
    cost: int = 1
    shard: str = ""
    extra: int = 0
    lease: bool = False
    fail_open: bool = True


@dataclass(frozen=True, slots=True)
class KeyVerdict:
    """One bucket's answer. Times in seconds; ``granted`` = extra (leased) tokens taken."""

    allowed: bool
    remaining: int
    retry_after: float = 0.0
    reset: float = 0.0
    granted: int = 0


# What ``take_local`` (:mod:`proxy.stores.lease`) answers for a token this replica already
# holds: the ``(remaining, reset)`` of the ``KeyVerdict(allowed=True, remaining=..., reset=...)``
# that ``acquire`` would give (``reset`` never below 0). A plain tuple: it is built on every
# leased call, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field)
# costs about four times as much.
Held = tuple[int, float]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer for a whole call: ``keys`` in the order of the requests.

    ``unavailable`` means the store could not answer for a ``fail_open=False`` request; the
    caller rejects with 503. ``backend`` is ``redis``, ``local``, ``lease`` or ``fallback``.
    """

    allowed: bool
    keys: tuple[KeyVerdict, ...]
    backend: str = "local"
    unavailable: bool = False

    @property
    def retry_after(self) -> float:
        """Seconds until every denying bucket would admit the call (0 when allowed)."""
        return max((k.retry_after for k in self.keys if not k.allowed), default=0.0)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Admit one create against ``limit`` and reserve room for it, in one atomic step.

    ``scope`` is ``<group>/<resource>/<namespace>`` (the Redis hash tag: one key, one slot);
    ``member`` is ``<name>|<token>`` (name ``""`` when the apiserver will generate it; the
    token is unique per create). ``observed`` is how many objects the caller's own watch shows;
    ``seen`` lists the names (and ``|<token>`` entries) whose objects that watch already shows,
    so their reservations are not counted twice, and ``/<name>`` for names whose object it
    showed and then saw deleted (a reservation its creator marked shown is not counted).
    ``used`` = ``observed`` + the live reservations not in ``seen``; the create is allowed
    when ``limit < 0`` (none) or ``used + 1 <= limit``, and then ``member`` lives ``ttl``
    seconds (unless ``check_only``: a dry-run create).
    ``fail_open`` says what happens while the shared store is down: reserve in-process (True)
    or "unavailable" (False).
    """

    scope: str
    member: str
    observed: int
    limit: int
    ttl: float
    seen: tuple[str, ...] = ()
    check_only: bool = False
    fail_open: bool = True


@dataclass(frozen=True, slots=True)
class Reserved:
    """The answer to a :class:`Reservation`: ``used`` before this create; ``backend`` is
    ``redis``, ``local`` or ``fallback``; ``unavailable`` as in :class:`Verdict`."""

    allowed: bool
    used: int
    backend: str = "local"
    unavailable: bool = False


@runtime_checkable
class Store(Protocol):
    """A rate-limit and quota-reservation backend. ``acquire``, ``reserve`` and ``settle`` never
    raise for a store outage once wrapped in :class:`proxy.stores.breaker.ResilientStore`; bare
    backends raise :class:`StoreUnavailable`."""

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict: ...

    async def reserve(self, request: Reservation) -> Reserved: ...

    async def settle(self, scope: str, member: str, ttl: float | None) -> None:
        """A reservation's create answered: ``ttl`` ``None`` drops it (failed), else it now
        expires within ``ttl`` seconds (never later than it already would)."""
        ...

    def health(self) -> dict[str, object]: ...

    async def close(self) -> None: ...


def interval_us(rate: float) -> int:
    """The emission interval (µs between tokens) for ``rate`` tokens/s, at least 1 µs."""
    return max(1, round(US / rate))


def gcra_step(
    tat: float, now: float, *, interval: float, burst: float, cost: float, extra: float
) -> tuple[bool, float, float, float, float, float]:
    """One bucket: ``(allowed, new_tat, granted, remaining, retry_us, reset_us)``.

    Mirrors ``gcra.lua`` operation for operation (doubles holding integers, ``math.floor`` of a
    quotient). A stored TAT at or before ``now`` is a full bucket, which is why a Redis key may
    expire as soon as its TAT has passed. A TAT more than ``burst`` intervals ahead is an empty
    bucket: a debt run up at a lower qps (a reload, an instance's own qps raised) would
    otherwise keep the caller waiting as long as the old rate needed to pay it off; on a
    denial ``new_tat`` is then that cut TAT, which the store keeps (see :func:`decide`).
    """
    if tat < now:
        tat = now
    limit = burst * interval
    if tat > now + limit:  # deeper than this bucket: its qps was raised (or burst lowered)
        tat = now + limit  # since, so it is empty, and its next token comes at the new rate
    new_tat = tat + cost * interval
    allow_at = new_tat - limit
    if allow_at > now:
        remaining = math.floor((now + limit - tat) / interval)
        if remaining < 0:
            remaining = 0
        return False, tat, 0.0, float(remaining), allow_at - now, tat - now
    left = math.floor((now - allow_at) / interval)
    granted = float(math.floor(left / 2))
    if granted > extra:
        granted = extra
    new_tat = new_tat + granted * interval
    return True, new_tat, granted, float(left - granted), 0.0, new_tat - now


def decide(
    tats: dict[str, float], requests: Sequence[BucketRequest], now: float
) -> tuple[bool, list[tuple[bool, float, float, float, float]], dict[str, float]]:
    """All-or-nothing over ``requests`` against ``tats`` (missing key = full bucket).

    Returns ``(allowed, per-key (allowed, granted, remaining, retry_us, reset_us), writes)``;
    the caller stores ``writes``: the charged TATs when allowed, else only the debts that
    :func:`gcra_step` cut to a bucket's new depth (no charge). A key named twice sees its
    first charge.
    """
    pending: dict[str, float] = {}
    cut: dict[str, float] = {}
    results: list[tuple[bool, float, float, float, float]] = []
    allowed = True
    for r in requests:
        fresh = r.key not in pending
        tat = tats.get(r.key, 0.0) if fresh else pending[r.key]
        ok, new_tat, granted, remaining, retry, reset = gcra_step(
            tat, now, interval=interval_us(r.rate), burst=r.burst, cost=r.cost, extra=r.extra
        )
        results.append((ok, granted, remaining, retry, reset))
        if ok:
            pending[r.key] = new_tat
        else:
            allowed = False
            if fresh and new_tat < tat:
                cut[r.key] = new_tat
    return allowed, results, pending if allowed else cut


def verdict_from(
    allowed: bool, results: Sequence[Sequence[float]], *, backend: str
) -> Verdict:
    """Build a :class:`Verdict` from per-key ``(allowed, granted, remaining, retry_us, reset_us)``.

    When the call is denied, the buckets that would have admitted it report no grant.
    """
    keys = tuple(
        KeyVerdict(
            allowed=bool(ok),
            remaining=int(remaining),
            retry_after=retry / US,
            reset=reset / US,
            granted=int(granted) if allowed else 0,
        )
        for ok, granted, remaining, retry, reset in results
    )
    return Verdict(allowed=allowed, keys=keys, backend=backend)


# --- quota reservations ------------------------------------------------------------------------

SHOWN = "~"  # a member ending so: its creator's watch showed its object (see settle_step)
GONE = "/"  # "/<name>" in ``seen``: an object of that name was shown, then deleted


def _counted(member: str, seen: frozenset[str] | set[str]) -> bool:
    name, _, token = member.partition("|")
    shown = token.endswith(SHOWN)
    if shown:
        token = token[:-1]
    return not ((name and name in seen) or ("|" + token) in seen
                or (shown and GONE + name in seen))


def reserve_step(
    members: dict[str, float], now: float, request: Reservation
) -> tuple[bool, int]:
    """One :class:`Reservation` against ``members`` (member -> expiry, µs), changed in place:
    ``(allowed, used)``. Mirrors ``quota.lua``: expired members (expiry <= now) are dropped
    first, then the live ones not in ``seen`` are counted; a named member whose name a counted
    one has already is the same object, allowed within the room that one holds (nothing is
    added)."""
    for member in [m for m, expiry in members.items() if expiry <= now]:
        del members[member]
    seen = frozenset(request.seen)
    counted = [m for m in members if _counted(m, seen)]
    used = request.observed + len(counted)
    name = request.member.partition("|")[0]
    if name and any(m.partition("|")[0] == name for m in counted):
        # the same object as a live reservation (an apply racing the create it follows, or
        # a second create of the name): it needs no more room than that one already holds
        return request.limit < 0 or used <= request.limit, used
    allowed = request.limit < 0 or used + 1 <= request.limit
    if allowed and not request.check_only:
        members[request.member] = now + float(round(request.ttl * US))
    return allowed, used


def settle_step(members: dict[str, float], now: float, member: str, ttl: float | None) -> bool:
    """Drop ``member`` (``ttl`` None) or let it expire within ``ttl`` s, never later than it
    would; ``False`` when it is not (or no longer) there. ``member`` + :data:`SHOWN` also marks
    it shown (renamed so): once its name is :data:`GONE` it is not counted, while a new
    reservation of the name is. A member is found marked or not. Mirrors ``quota.lua``."""
    shown = member.endswith(SHOWN)
    base = member[:-1] if shown else member
    found = base if base in members else base + SHOWN
    expiry = members.get(found)
    if expiry is None or expiry <= now:
        members.pop(found, None)
        return False
    if ttl is None:
        del members[found]
        return True
    expiry = min(expiry, now + float(round(ttl * US)))
    if shown and found != member:
        del members[found]
        found = member
    members[found] = expiry
    return True


def redacted_url(url: str) -> str:
    """A Redis URL without its passwords (``redis://user:***@host``, ``?password=***``), for
    logs and messages: redis-py also reads ``password`` from the query (its documented form
    for ``unix://`` sockets) and Sentinel's from ``sentinel_password``."""
    head, mark, query = url.partition("?")
    if mark:
        url = head + mark + "&".join(_redacted_pair(pair) for pair in query.split("&"))
    # then up to the last "@" (a password may hold a "?" or "@" not percent-encoded, and
    # hiding a little too much is safe)
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hostpart}"


def _redacted_pair(pair: str) -> str:
    name, eq, value = pair.partition("=")
    return f"{name}=***" if eq and value and name.lower().endswith("password") else pair
