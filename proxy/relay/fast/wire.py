"""HTTP/1.1 heads as bytes: header hygiene both ways and the serialised request/response heads.

The same rules as :mod:`proxy.relay.headers` (RFC 9110 §7.6.1 hop-by-hop headers, every name
listed in ``Connection``, ``Proxy-*``; upwards also ``Host``/``Expect``, ``Opgate-*``,
``Impersonate-*`` unless allowed, ``X-Remote-*`` identities, and the names middlewares
dropped), but over the plain
``(name, value)`` byte pairs httptools hands out, so a relayed call never builds a multidict on
the way through. Framing headers (``Content-Length``, ``Transfer-Encoding``) are decided by the
relay and appended by the callers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from http import HTTPStatus

from proxy.engine.subprotocol import carries_token
from proxy.relay.headers import REQUEST_HEADER_EXTRA, REQUEST_HEADER_IDENTITY

__all__ = [
    "NOTHING",
    "Headers",
    "WireHeaders",
    "carries_credentials",
    "connection_tokens",
    "request_head",
    "response_head",
    "status_line",
    "switch_head",
]

Headers = list[tuple[bytes, bytes]]

_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
     b"transfer-encoding", b"upgrade"}
)
# and the request-header authenticator's identity headers (proxy.relay.headers says why)
# (and Content-Length: the relay frames the body itself)
_REQUEST_DROP = (_HOP | {b"host", b"expect", b"content-length"}
                 | {n.encode() for n in REQUEST_HEADER_IDENTITY})
# the names request_head looks at once past the drops: one dict lookup per header decides
_AUTHORIZATION, _AUDIT_ID, _SUBPROTOCOL, _FORWARDED_FOR = 1, 2, 3, 4
_NOTED = {b"authorization": _AUTHORIZATION, b"audit-id": _AUDIT_ID,
          b"sec-websocket-protocol": _SUBPROTOCOL, b"x-forwarded-for": _FORWARDED_FOR}
_HOP_ONLY = frozenset({b"keep-alive", b"close", b"upgrade"})  # Connection values naming no header
_DROP_PREFIXES = (b"proxy-", b"opgate-", REQUEST_HEADER_EXTRA.encode())
_IMPERSONATE = b"impersonate-"
NOTHING: frozenset[bytes] = frozenset()
# the lengths of the names response_head drops (hop-by-hop, Content-Length; any Proxy-* name
# starts with P): the names of other lengths go out without a lower() each
_DROP_LENGTHS = frozenset({len(n) for n in _HOP} | {len(b"content-length")})
_P = frozenset(b"Pp")
# status lines by (code, reason as received; b"": the standard phrase), the first ones
_STATUS_LINES: dict[tuple[int, bytes], bytes] = {}
_MAX_STATUS_LINES = 64
_EXTRA: dict[tuple[str, str], bytes] = {}  # encoded middleware header lines, the first ones
_MAX_EXTRA = 256
_KEYS: dict[str, bytes] = {}  # header names middlewares ask for, as the index's keys
_MAX_KEYS = 256


def _wire_key(key: str) -> bytes:
    """A header name as :class:`WireHeaders`' index keys it (remembered for the first names)."""
    want = key.lower().encode("latin-1")
    if len(_KEYS) < _MAX_KEYS:
        _KEYS[key] = want
    return want


class WireHeaders(Mapping[str, str]):
    """The request's header pairs as the case-insensitive ``Mapping[str, str]`` middlewares read
    (``ctx.headers``). The first lookup indexes the pairs by lower-case name (the first of
    repeated names wins, as ``CIMultiDict.get``); values are decoded only when asked for."""

    __slots__ = ("_index", "_pairs")

    def __init__(self, pairs: Headers) -> None:
        self._pairs = pairs
        self._index: dict[bytes, bytes] | None = None

    # get, raw and __contains__ each look up in one Python call (no shared helper call per
    # lookup): middlewares ask a few headers of every call
    def _build(self) -> dict[bytes, bytes]:
        index: dict[bytes, bytes] = {}
        for name, value in self._pairs:
            index.setdefault(name.lower(), value)
        self._index = index
        return index

    def by_name(self) -> dict[bytes, bytes]:
        """Every header as received, by lower-case name (the first of repeated names): for a
        middleware that reads several headers of every call, one call instead of one each."""
        index = self._index
        return index if index is not None else self._build()

    def raw(self, key: str) -> bytes | None:
        """The value of ``key`` as received (bytes, not decoded): for a middleware that only
        hashes or compares a long value (the identity middleware's bearer token)."""
        index = self._index
        if index is None:
            index = self._build()
        want = _KEYS.get(key)
        return index.get(want if want is not None else _wire_key(key))

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        index = self._index
        if index is None:
            index = self._build()
        want = _KEYS.get(key)
        value = index.get(want if want is not None else _wire_key(key))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, key: str) -> str:
        value = self.raw(key)
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        index = self._index
        if index is None:
            index = self._build()
        want = _KEYS.get(key)
        return (want if want is not None else _wire_key(key)) in index

    def __iter__(self) -> Iterator[str]:
        seen: set[bytes] = set()
        for name, _ in self._pairs:
            low = name.lower()
            if low not in seen:
                seen.add(low)
                yield name.decode("latin-1")

    def __len__(self) -> int:
        return len({name.lower() for name, _ in self._pairs})

    def pairs(self) -> Headers:
        """Every ``(name, value)`` pair as received, repeated names included (bytes)."""
        return self._pairs

    def getall(self, key: str) -> list[str]:
        want = key.lower().encode("latin-1")
        return [v.decode("latin-1") for n, v in self._pairs if n.lower() == want]


def status_line(code: int, reason: bytes = b"") -> bytes:
    """``HTTP/1.1 <code> <reason>\r\n`` (the standard phrase when ``reason`` is empty),
    remembered for the first (code, reason) pairs: upstreams say "200 OK" over and over."""
    line = _STATUS_LINES.get((code, reason))
    if line is not None:
        return line
    if reason:
        line = b"HTTP/1.1 %d %s\r\n" % (code, reason)
    else:
        try:
            phrase = HTTPStatus(code).phrase.encode()
        except ValueError:
            phrase = b"Unknown"
        line = b"HTTP/1.1 %d %s\r\n" % (code, phrase)
    if len(_STATUS_LINES) < _MAX_STATUS_LINES:
        _STATUS_LINES[code, reason] = line
    return line


def connection_tokens(headers: Headers) -> frozenset[bytes]:
    """Lower-case names listed in every ``Connection`` header."""
    found: set[bytes] | None = None
    for name, value in headers:
        if len(name) == 10 and name.lower() == b"connection":
            found = found or set()
            found.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(found) if found else NOTHING


def carries_credentials(headers: Headers) -> bool:
    """Whether the client sent credentials of its own (any ``Authorization``, even one listed
    in ``Connection``, or a WebSocket bearer-token subprotocol): such a call never goes with
    opgate's, its token nor its client certificate (:attr:`Endpoint.caller_tls`)."""
    for name, value in headers:
        size = len(name)
        if size == 13 and name.lower() == b"authorization":
            return True
        if size == 22 and name.lower() == b"sec-websocket-protocol" and carries_token(value):
            return True
    return False


def request_head(
    *,
    method: bytes,
    target: bytes,
    host: bytes,
    headers: Headers,
    named: frozenset[bytes],
    drop: Collection[str],
    allow_impersonation: bool,
    authorization: bytes | None,
    framing: bytes,
    audit_id: bytes | None = None,
    upgrade: bool = False,
    forwarded_for: bytes = b"",
) -> tuple[bytes, bool]:
    """The upstream request head, and whether the client sent any ``Impersonate-*`` header.

    ``named`` are the client's ``Connection`` tokens, ``drop`` the lower-case ``str`` names the
    middlewares removed, ``framing`` the ``Content-Length``/``Transfer-Encoding`` line(s). With
    ``upgrade`` the client's ``Upgrade`` header is kept and ``Connection: Upgrade`` sent.
    ``authorization`` (opgate's own) is added only when the client sent no credentials: no
    ``Authorization`` and no WebSocket bearer-token subprotocol (the apiserver would take
    opgate's token first: :mod:`proxy.engine.subprotocol`), ``audit_id`` (the trace id) only
    when it sent no ``Audit-ID``. ``forwarded_for`` (the caller's address, none on a Unix
    socket) is appended to the client's ``X-Forwarded-For`` values, in one header, as
    kubectl proxy and Go's ReverseProxy do.
    """
    parts = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    dropped = {d.encode("latin-1") for d in drop} if drop else NOTHING
    impersonating = False
    prior: list[bytes] = []  # the client's X-Forwarded-For values
    for name, value in headers:
        low = name.lower()
        if upgrade and low == b"upgrade":
            parts += (name, b": ", value, b"\r\n")
            continue
        if low in _REQUEST_DROP or low.startswith(_DROP_PREFIXES):
            continue
        if low.startswith(_IMPERSONATE):
            impersonating = True
            if not allow_impersonation:
                continue
        noted = _NOTED.get(low)
        if noted is not None:
            if noted == _AUTHORIZATION:  # the client's own credentials go upstream, not
                authorization = None  # opgate's, and never opgate's instead of them
                # (Connection: Authorization)
            elif noted == _AUDIT_ID:  # the client's own names the call in the audit log
                audit_id = None
            elif noted == _SUBPROTOCOL and carries_token(value):
                authorization = None  # a token of the client's (the apiserver reads it second)
            if (named and low in named) or (dropped and low in dropped):
                continue
            if noted == _FORWARDED_FOR and forwarded_for:
                prior.append(value)
                continue
        elif (named and low in named) or (dropped and low in dropped):
            continue
        parts += (name, b": ", value, b"\r\n")
    if authorization is not None:
        parts += (b"Authorization: ", authorization, b"\r\n")
    if audit_id is not None:
        parts += (b"Audit-ID: ", audit_id, b"\r\n")
    if forwarded_for:
        parts += (b"X-Forwarded-For: ", b", ".join((*prior, forwarded_for)) if prior
                  else forwarded_for, b"\r\n")
    if upgrade:
        parts.append(b"Connection: Upgrade\r\n")
    parts += (framing, b"\r\n")
    return b"".join(parts), impersonating


def response_head(
    *,
    status: int,
    reason: bytes,
    headers: Headers,
    extra: Iterable[tuple[str, str]],
    framing: bytes,
) -> bytes:
    """The client response head: the upstream's end-to-end headers, ``extra``, ``framing``."""
    # status_line's memory read here: a hit without its call
    parts = [_STATUS_LINES.get((status, reason)) or status_line(status, reason)]
    named: frozenset[bytes] = NOTHING
    for name, value in headers:
        size = len(name)
        if size in _DROP_LENGTHS or (size > 5 and name[0] in _P):
            low = name.lower()
            if low in _HOP or low.startswith(b"proxy-") or low == b"content-length":
                if low == b"connection" and value.strip().lower() not in _HOP_ONLY:
                    named = connection_tokens(headers) - _HOP  # names beyond the standard ones
                continue
        parts += (name, b": ", value, b"\r\n")
    if named:  # rare: names the upstream listed in Connection are hop-by-hop too
        parts = [parts[0]] + [
            p for i in range(1, len(parts), 4) if parts[i].lower() not in named
            for p in parts[i : i + 4]
        ]
    for pair in extra:
        line = _EXTRA.get(pair)  # header_line's memory read here: a hit without its call
        if line is None:
            line = header_line(pair)
        parts.append(line)
    parts += (framing, b"\r\n")
    return b"".join(parts)


def header_line(pair: tuple[str, str]) -> bytes:
    """``name: value\\r\\n`` of a header opgate adds (a middleware's, or one of its own
    answer's), latin-1; remembered for the first pairs: most repeat, as ``RateLimit-Limit``
    does."""
    line = _EXTRA.get(pair)
    if line is None:
        line = f"{pair[0]}: {pair[1]}\r\n".encode("latin-1")
        if len(_EXTRA) < _MAX_EXTRA:
            _EXTRA[pair] = line
    return line


def switch_head(*, reason: bytes, headers: Headers, extra: Iterable[tuple[str, str]]) -> bytes:
    """The client's ``101`` head: the upstream's headers with its ``Upgrade``, ``Connection:
    Upgrade``, and ``extra``; no framing (the connection is a tunnel from here on)."""
    named = connection_tokens(headers) - {b"upgrade"}
    parts = [status_line(101, reason)]
    for name, value in headers:
        low = name.lower()
        if low == b"connection" or (low in _HOP and low != b"upgrade"):
            continue
        if low.startswith(b"proxy-") or (named and low in named):
            continue
        parts += (name, b": ", value, b"\r\n")
    parts += map(header_line, extra)
    parts.append(b"Connection: Upgrade\r\n\r\n")
    return b"".join(parts)
