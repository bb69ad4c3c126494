"""Header hygiene tables: what goes upstream, what comes back, and what counts as an upgrade."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.relay.headers import (
    connection_tokens,
    is_upgrade_request,
    request_headers,
    response_headers,
)


def h(*pairs: tuple[str, str]) -> CIMultiDict[str]:
    return CIMultiDict(pairs)


@pytest.mark.parametrize(
    ("headers", "tokens"),
    [
        (h(), frozenset()),
        (h(("Connection", "keep-alive")), {"keep-alive"}),
        (h(("Connection", "Upgrade, X-A ,x-b")), {"upgrade", "x-a", "x-b"}),
        (h(("Connection", "close"), ("connection", "X-C")), {"close", "x-c"}),
        (h(("Connection", " , ")), frozenset()),
    ],
)
def test_connection_tokens(headers: CIMultiDict[str], tokens: frozenset[str]) -> None:
    assert connection_tokens(headers) == tokens


@pytest.mark.parametrize(
    ("headers", "upgrade"),
    [
        (h(("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")), True),
        (h(("Connection", "keep-alive, upgrade"), ("Upgrade", "websocket")), True),
        (h(("Upgrade", "websocket")), False),
        (h(("Connection", "Upgrade")), False),
        (h(("Connection", "keep-alive")), False),
    ],
)
def test_is_upgrade_request(headers: CIMultiDict[str], upgrade: bool) -> None:
    assert is_upgrade_request(headers) is upgrade


REQUEST_DROPPED = [
    ("Connection", "keep-alive"),
    ("Keep-Alive", "timeout=5"),
    ("TE", "trailers"),
    ("Trailer", "X-T"),
    ("Transfer-Encoding", "chunked"),
    ("Upgrade", "h2c"),
    ("Proxy-Authorization", "Basic x"),
    ("Proxy-Connection", "keep-alive"),
    ("Host", "client.example"),
    ("Expect", "100-continue"),
    ("Opgate-Instance", "ns/Kind/name"),
    ("opgate-anything", "x"),
]
REQUEST_KEPT = [
    ("Authorization", "Bearer t"),
    ("Accept", "application/json"),
    ("Content-Type", "application/json"),
    ("Content-Length", "12"),
    ("Content-Encoding", "gzip"),
    ("Warning", '299 - "a"'),
    ("Warning", '299 - "b"'),
    ("Audit-Id", "x"),
    ("X-Kubernetes-PF-FlowSchema-UID", "u"),
    ("User-Agent", "kubectl/v1.33"),
]


def test_request_headers_drop_hop_by_hop_and_keep_end_to_end() -> None:
    out, impersonating = request_headers(h(*REQUEST_DROPPED, *REQUEST_KEPT))
    assert list(out.items()) == REQUEST_KEPT
    assert impersonating is False


def test_request_headers_drop_what_connection_names_and_what_middlewares_drop() -> None:
    headers = h(("Connection", "X-Secret, keep-alive"), ("X-Secret", "s"), ("X-Mine", "m"),
                ("X-Other", "o"))
    out, _ = request_headers(headers, drop={"x-mine"})
    assert list(out.items()) == [("X-Other", "o")]


IMPERSONATE = [
    ("Impersonate-User", "alice"),
    ("Impersonate-Group", "g1"),
    ("Impersonate-Group", "g2"),
    ("Impersonate-Uid", "1"),
    ("Impersonate-Extra-Scopes", "s"),
]


@pytest.mark.parametrize("allowed", [False, True])
def test_impersonation_headers_need_permission(allowed: bool) -> None:
    out, impersonating = request_headers(
        h(("Accept", "*/*"), *IMPERSONATE), allow_impersonation=allowed
    )
    assert impersonating is True
    expected = [("Accept", "*/*"), *IMPERSONATE] if allowed else [("Accept", "*/*")]
    assert list(out.items()) == expected


def test_upgrade_request_keeps_upgrade_and_normalises_connection() -> None:
    headers = h(("Connection", "Upgrade, X-Hop"), ("Upgrade", "SPDY/3.1"), ("X-Hop", "1"),
                ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
                ("X-Stream-Protocol-Version", "channel.k8s.io"), ("Host", "h"))
    out, _ = request_headers(headers, upgrade=True)
    assert list(out.items()) == [
        ("Upgrade", "SPDY/3.1"),
        ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
        ("X-Stream-Protocol-Version", "channel.k8s.io"),
        ("Connection", "Upgrade"),
    ]


def test_response_headers_filter_and_add_extra() -> None:
    upstream = h(
        ("Connection", "X-Named"), ("X-Named", "1"), ("Keep-Alive", "timeout=1"),
        ("Transfer-Encoding", "chunked"), ("Trailer", "X"), ("Upgrade", "h2c"),
        ("Proxy-Authenticate", "Basic"), ("Content-Type", "application/json"),
        ("Content-Length", "5"), ("Content-Encoding", "gzip"), ("Warning", '299 - "a"'),
        ("Warning", '299 - "b"'), ("Retry-After", "2"), ("Audit-Id", "a"),
        ("X-Kubernetes-PF-PriorityLevel-UID", "p"),
    )
    out = response_headers(upstream, extra=[("Warning", '299 - "opgate: c"'), ("X-Mine", "1")])
    assert list(out.items()) == [
        ("Content-Type", "application/json"),
        ("Content-Length", "5"),
        ("Content-Encoding", "gzip"),
        ("Warning", '299 - "a"'),
        ("Warning", '299 - "b"'),
        ("Retry-After", "2"),
        ("Audit-Id", "a"),
        ("X-Kubernetes-PF-PriorityLevel-UID", "p"),
        ("Warning", '299 - "opgate: c"'),
        ("X-Mine", "1"),
    ]


def test_response_headers_for_a_101_keep_the_upgrade() -> None:
    upstream = h(("Connection", "Upgrade"), ("Upgrade", "websocket"),
                 ("Sec-WebSocket-Accept", "abc"), ("Sec-WebSocket-Protocol", "v4.channel.k8s.io"))
    out = response_headers(upstream, upgrade=True)
    assert list(out.items()) == [
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Accept", "abc"),
        ("Sec-WebSocket-Protocol", "v4.channel.k8s.io"),
        ("Connection", "Upgrade"),
    ]
