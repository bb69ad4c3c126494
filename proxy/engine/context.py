"""Per-request state shared by the relay and the middleware chain, free of any transport type.

The relay builds one :class:`RequestContext` per call and hands it to the chain; middlewares read
it, may add response headers or drop request headers, and decide with a :class:`Deny` or a
:class:`Delay`. After the response the relay fills in the outcome (status code, bytes, timings)
for the exit and retry hooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from proxy.engine.requestinfo import RequestInfo
from proxy.engine.status import StatusError, warning_headers

if TYPE_CHECKING:
    from proxy.engine.policies import PolicySet


def media_type(content_type: str | None) -> str:
    """A ``Content-Type`` without its parameters, lower-case ("" for none)."""
    return "" if content_type is None else content_type.partition(";")[0].strip().lower()


Extra = tuple[tuple[str, tuple[str, ...]], ...]  # Identity.extra: (key, values), by key


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling, once a middleware has verified it (never the token itself).

    ``extra`` is the user's extra information as the apiserver's authenticator would give it
    (``user.extra`` in its audit log): ``(key, values)`` pairs sorted by key, as the apiserver's
    JSON writes a Go map; empty for none (see :func:`user_extra`)."""

    user: str
    groups: tuple[str, ...] = ()
    uid: str = ""
    source: str = ""  # serviceaccount | oidc | tokenreview
    extra: Extra = ()


def user_extra(pairs: Iterable[tuple[str, Iterable[str]]]) -> Extra:
    """:attr:`Identity.extra` from ``(key, values)`` pairs: sorted by key, a repeated key's
    values joined."""
    merged: dict[str, list[str]] = {}
    for key, values in pairs:
        merged.setdefault(key, []).extend(values)
    return tuple((key, tuple(merged[key])) for key in sorted(merged))


@dataclass(frozen=True, slots=True)
class Deny:
    """End the chain: answer ``status`` instead of relaying.

    ``decision`` is the bounded label recorded in metrics and the access log
    (``denied``, ``throttled``, ``quota``, ``fault``, ``unauthorized``).
    """

    status: StatusError
    decision: str = "denied"


@dataclass(frozen=True, slots=True)
class Delay:
    """Wait ``seconds``, then go on with the next hook."""

    seconds: float


Decision = Deny | Delay


class BodyTap(Protocol):
    """What a middleware may set as ``ctx.tap`` to see the bytes of one call as they pass
    (traffic capture): the relay calls it with each request body chunk it forwards, the
    response head it received and each response body chunk it forwards, on the event loop, so
    it must be quick and must not keep what it does not need. For an upgrade only the response
    head (the ``101``). A body read whole for the middlewares (``ctx.body``) is not passed to
    ``request_body``; opgate's own answers (``ctx.answer``) are not passed at all. Headers are
    ``(name, value)`` pairs of ``bytes`` or ``str``."""

    def request_body(self, chunk: bytes) -> None: ...
    def response_head(self, status: int, reason: bytes | str,
                      headers: Iterable[tuple[bytes | str, bytes | str]]) -> None: ...
    def response_body(self, chunk: bytes) -> None: ...


@dataclass(slots=True, eq=False)
class RequestContext:
    """One API call on its way through opgate.

    ``headers`` is a case-insensitive, read-only view of the client's request headers.
    ``body`` is set only for a request that carries one and that a middleware asked to see
    (``needs_body``, narrowed per call by ``wants_body``); the relay bounds it.
    """

    info: RequestInfo
    method: str
    path: str  # percent-decoded, as the apiserver routes by it
    query: str
    headers: Mapping[str, str]
    policies: PolicySet
    trace_id: str = ""
    remote: str = ""  # the caller's address as the listener saw it ("" on a Unix socket)
    raw_path: str = ""  # the path as the client sent it, when it held escapes ("": ``path``)
    started: float = field(default_factory=time.monotonic)
    wall_time: float = field(default_factory=time.time)
    identity: Identity | None = None
    body: bytes | None = None
    # what middlewares ask of the relay
    drop_request_headers: set[str] = field(default_factory=set)  # lower-case names
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the texts of warn(), each once
    allow_impersonation: bool = False
    decision: str = "allowed"
    tap: BodyTap | None = None  # set by a middleware's entry hook; None: the relay passes nothing
    # the Status opgate answered with itself instead of a relayed response (set by the relay)
    answer: StatusError | None = None
    # the outcome, filled in by the relay before the exit hooks
    status_code: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    upstream_seconds: float = 0.0
    finished: float = 0.0
    error: str = ""
    # scratch space for middlewares, keyed by middleware name
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def user(self) -> str:
        return self.identity.user if self.identity else ""

    @property
    def media_type(self) -> str:
        """The request's ``Content-Type`` without its parameters, lower-case ("" for none)."""
        return media_type(self.headers.get("Content-Type"))

    @property
    def audit_id(self) -> str:
        """The call's ``Audit-ID``: the client's header when it sent one, as the apiserver takes
        it, else the trace id. The relay sends it upstream and on opgate's own answers, so the
        apiserver's audit log, opgate's and the ``Audit-Id`` the client sees name the call alike."""
        return self.headers.get("audit-id") or self.trace_id

    @property
    def duration(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def warn(self, text: str) -> None:
        """Add a ``Warning: 299`` header (kubectl prints it) to whatever the client gets; a
        text already warned is not sent again, and all stay within the apiserver's bounds
        (:func:`~proxy.engine.status.warning_headers`), as its own warnings do."""
        text = f"opgate: {text}"
        if text in self.warnings:
            return
        self.warnings.append(text)
        headers = self.response_headers
        if len(self.warnings) > 1:  # the bounds apply to them all: the earlier ones again
            headers[:] = [header for header in headers if header[0] != "Warning"]
        headers += warning_headers(self.warnings)
