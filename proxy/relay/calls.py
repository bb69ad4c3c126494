"""What both relay cores share about a call: their settings, the policy store they read, and
whether a call's body is read for the middlewares."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from proxy.engine.chain import Chain
from proxy.engine.context import RequestContext

__all__ = [
    "IMPERSONATION_DROPPED",
    "PolicyStoreLike",
    "RelaySettings",
    "body_predicate",
    "malformed_escape",
    "origin_form",
    "trace_ids",
]


class PolicyStoreLike(Protocol):
    @property
    def current(self) -> object: ...


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """Timeouts in seconds (0 = off) and the bound on bodies read for middlewares."""

    connect_timeout: float = 5.0
    header_timeout: float = 30.0
    request_timeout: float = 300.0
    watch_idle_timeout: float = 0.0
    max_body_bytes: int = 3 * 1024 * 1024


def _always(ctx: RequestContext) -> bool:
    return True


def body_predicate(chain: Chain) -> Callable[[RequestContext], bool]:
    """Whether to read a call's body: some middleware that ``needs_body`` wants it (one without
    a ``wants_body`` method wants every body)."""
    checks: list[Callable[[RequestContext], bool]] = []
    for m in chain.middlewares:
        if getattr(m, "needs_body", False):
            check = getattr(m, "wants_body", None)
            if check is None:
                return _always
            checks.append(check)
    if len(checks) == 1:
        return checks[0]
    return lambda ctx: any(check(ctx) for check in checks)


def trace_ids(marker: str) -> Callable[[], str]:
    """Trace ids of one relay core in this process: a random prefix, ``marker`` (which core),
    then a counter in hex (unique per process without a syscall or a lock per call)."""
    prefix = os.urandom(4).hex() + marker
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter):x}"


# told to the client (a Warning kubectl prints) when a client's Impersonate-* headers are dropped:
# `kubectl --as bob` through opgate runs as the caller itself (opgate's own token when it sent
# none), and must not look as if it ran as bob
IMPERSONATION_DROPPED = (
    "Impersonate-* headers dropped (no policy allows impersonation): the call was made as the "
    "caller itself"
)

_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def origin_form(target: str) -> str | None:
    """The origin-form (``/path?query``) of a request target that is not one: an absolute-form
    target (``http://host:port/path?query``; HTTP/1.1 servers must accept it, Go's does and
    routes by its path) is what the apiserver serves and what the policies must see; ``None``
    for anything else (``*``, authority-form), which no API call is."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None
    ends = [i for i in (rest.find("/"), rest.find("?")) if i >= 0]
    if not ends:
        return "/"
    cut = min(ends)
    return rest[cut:] if rest[cut] == "/" else "/" + rest[cut:]


def malformed_escape(path: str) -> bool:
    """Whether ``path`` holds a ``%`` not followed by two hex digits: Go's server answers such a
    request line 400 before the apiserver sees it, so opgate must not classify it."""
    return _BAD_ESCAPE.search(path) is not None
