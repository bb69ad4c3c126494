"""Kubernetes ``Status`` bodies: the only place that renders opgate's own error responses.

kubectl and client-go decode any non-2xx body of kind ``Status`` and show its ``message``; a
``429`` with an integer ``Retry-After`` is retried by client-go after that many seconds. Every
error opgate answers itself goes through :class:`StatusError`, so all of them look like the
apiserver's own (see the table in DESIGN.md). opgate never answers 422: clients take it for a
conflict to retry silently.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from proxy.engine.requestinfo import RequestInfo

_REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True, slots=True)
class StatusError:
    """An error response opgate sends instead of relaying the call.

    ``headers`` are extra response headers (``Retry-After``, ``RateLimit-*``, ``Warning``).
    ``details`` is sent when not ``None``, even empty (the apiserver's 403 of a non-resource
    path has ``"details":{}``).
    """

    code: int
    message: str
    reason: str = ""
    details: dict[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def body(self) -> bytes:
        obj: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason or _REASONS.get(self.code, ""),
        }
        if self.details is not None:  # metav1.Status' field order: details before code
            obj["details"] = self.details
        obj["code"] = self.code
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    def response_headers(self) -> list[tuple[str, str]]:
        return [("Content-Type", "application/json"), *self.headers]


def bad_request(message: str) -> StatusError:
    return StatusError(400, message, "BadRequest")


def unauthorized(message: str = "Unauthorized") -> StatusError:
    return StatusError(401, message, "Unauthorized")


def forbidden(message: str, *, details: dict[str, Any] | None = None) -> StatusError:
    """A 403; ``details``: :func:`object_details` (or :func:`call_details`), as the apiserver's
    Forbidden has them (client-go's ``IsForbidden`` reads the reason and code only)."""
    return StatusError(403, message, "Forbidden", details)


def object_details(*, group: str, resource: str, name: str = "") -> dict[str, Any]:
    """``details`` as the apiserver's ``apierrors.NewForbidden`` fills them: the object's
    ``name``, its API ``group`` and, as ``kind``, the resource (without its subresource), in
    ``metav1.StatusDetails``' order, empty ones left out."""
    details: dict[str, Any] = {"name": name} if name else {}
    if group:
        details["group"] = group
    if resource:
        details["kind"] = resource
    return details


def call_details(info: RequestInfo) -> dict[str, Any]:
    """The ``details`` of the apiserver's own 403 for the call ``info`` describes (its
    authorization filter's, from the same request info): ``{}`` for a non-resource path."""
    if not info.is_resource_request:
        return {}
    return object_details(group=info.api_group, resource=info.resource, name=info.name)


def too_many_requests(
    message: str, *, retry_after: float, extra_headers: tuple[tuple[str, str], ...] = ()
) -> StatusError:
    """429 the way the apiserver sends it: integer ``Retry-After`` (at least 1 s)."""
    seconds = max(1, math.ceil(retry_after))
    return StatusError(
        429,
        message,
        "TooManyRequests",
        {"retryAfterSeconds": seconds},
        (("Retry-After", str(seconds)), *extra_headers),
    )


def internal_error(message: str) -> StatusError:
    return StatusError(500, message, "InternalError")


def service_unavailable(message: str, *, retry_after: float | None = None) -> StatusError:
    """503; with ``retry_after`` (something opgate needs will be back: a store, the apiserver's
    keys; or the call never reached the apiserver) an integer ``Retry-After`` and
    ``details.retryAfterSeconds``, so client-go waits and retries the call itself (it retries a
    5xx only when told when), as for a 429."""
    return _retryable(503, message, "ServiceUnavailable", retry_after)


def gateway_timeout(message: str, *, retry_after: float | None = None) -> StatusError:
    """504 ``Timeout``; ``retry_after`` as for :func:`service_unavailable` (only for a call
    that never reached the apiserver: one it may have seen could be made twice)."""
    return _retryable(504, message, "Timeout", retry_after)


def _retryable(code: int, message: str, reason: str, retry_after: float | None) -> StatusError:
    if retry_after is None:
        return StatusError(code, message, reason)
    seconds = max(1, math.ceil(retry_after))
    return StatusError(code, message, reason, {"retryAfterSeconds": seconds},
                       (("Retry-After", str(seconds)),))


# what may not go into a header value as it is: control characters (a CR LF would end the header
# and start one of the request's choosing) and anything beyond ASCII (the fast relay writes
# latin-1, aiohttp UTF-8, client-go takes UTF-8 only)
_UNSAFE = re.compile(r"[^\x20-\x7e]+")
# the apiserver's warning recorder (k8s.io/apiserver, endpoints/filters/warning.go): once a
# call's warning texts pass WARNINGS_RUNES runes, each is cut to its first WARNING_RUNES and
# later ones are dropped once WARNINGS_RUNES are sent
WARNINGS_RUNES = 4 * 1024
WARNING_RUNES = 256


def _escaped(found: re.Match[str]) -> str:
    return quote(found.group(), safe="", errors="surrogatepass")  # (JSON lets a claim hold one)


def _printable(text: str) -> str:
    """``text`` as kubectl prints it: characters other than printable ASCII percent-encoded."""
    return text if text.isascii() and text.isprintable() else _UNSAFE.sub(_escaped, text)


def _cut(text: str, length: int) -> str:
    """The longest start of ``_printable(text)`` of at most ``length`` characters that ends
    between two of ``text``'s characters (never inside a percent-encoding)."""
    units = [_printable(c) for c in text[:length]]
    kept = 0
    for count, unit in enumerate(units):
        kept += len(unit)
        if kept > length:
            return "".join(units[:count])
    return "".join(units)


def _header(printable: str) -> tuple[str, str]:
    escaped = printable.replace("\\", "\\\\").replace('"', '\\"')
    return ("Warning", f'299 - "{escaped}"')


def warning_header(text: str) -> tuple[str, str]:
    """A ``Warning: 299`` header that kubectl and client-go print (RFC 7234 warn-text quoting).

    The text may hold what a request sent (a percent-decoded path, a namespace, a token's user
    name): characters other than printable ASCII go percent-encoded (UTF-8), as in a URL."""
    return _header(_printable(f"opgate: {text}"))


def warning_headers(texts: list[str]) -> list[tuple[str, str]]:
    """The ``Warning`` headers of a call that warned ``texts`` (each once, in order; with
    their ``opgate: ``), within the apiserver's bounds (``WARNINGS_RUNES``), so a warning that
    names a long path cannot make a header line a client refuses (aiohttp's: 8190 bytes). The
    runes counted are those kubectl prints (:func:`warning_header`'s percent-encoding)."""
    sent: list[str] = []
    written, cutting = 0, False
    for count, text in enumerate(texts):
        if cutting and written >= WARNINGS_RUNES:
            break
        printable = _cut(text, WARNING_RUNES) if cutting else _printable(text)
        if cutting or written + len(printable) <= WARNINGS_RUNES:
            sent.append(printable)
            written += len(printable)
            continue
        cutting = True  # the apiserver's replay: every text so far, cut
        sent = [_cut(before, WARNING_RUNES) for before in texts[:count + 1]]
        written = sum(map(len, sent))
    return [_header(printable) for printable in sent]
