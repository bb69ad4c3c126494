"""The fast relay's header handling on byte pairs (proxy/relay/fast/wire.py)."""

from __future__ import annotations

import pytest

from proxy.relay.fast import wire
from proxy.relay.fast.wire import WireHeaders, request_head, response_head, switch_head


def test_wire_headers_read_like_a_case_insensitive_mapping() -> None:
    h = WireHeaders([(b"Authorization", b"Bearer x"), (b"X-A", b"1"), (b"x-a", b"2")])
    assert h.get("authorization") == "Bearer x"
    assert h["x-A"] == "1"  # the first of repeated names, as CIMultiDict.get
    assert h.getall("X-A") == ["1", "2"]
    assert "X-a" in h and "Opgate-Instance" not in h and 3 not in h
    assert h.get("missing") is None and h.get("missing", "d") == "d"
    with pytest.raises(KeyError):
        h["missing"]
    assert list(h) == ["Authorization", "X-A"] and len(h) == 2
    assert dict(h) == {"Authorization": "Bearer x", "X-A": "1"}


def test_response_head_drops_hop_by_hop_and_connection_named_headers() -> None:
    head = response_head(
        status=200, reason=b"OK",
        headers=[(b"Connection", b"close, X-Hop"), (b"X-Hop", b"1"), (b"Content-Type", b"a/b"),
                 (b"Keep-Alive", b"5"), (b"Proxy-Foo", b"p"), (b"Content-Length", b"9"),
                 (b"Warning", b'299 - "w"')],
        extra=[("Retry-After", "1")], framing=b"Content-Length: 3\r\n",
    )
    assert head == (b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nWarning: 299 - \"w\"\r\n"
                    b"Retry-After: 1\r\nContent-Length: 3\r\n\r\n")


def test_response_head_drops_by_name_whatever_the_case_and_keeps_same_length_names() -> None:
    """Only names of a dropped name's length, or starting with P, are compared lower-cased."""
    head = response_head(
        status=200, reason=b"OK",
        headers=[(b"CONNECTION", b"keep-alive"), (b"proxy-authenticate", b"x"), (b"TE", b"t"),
                 (b"pRoXy-X", b"p"), (b"content-LENGTH", b"9"), (b"TRANSFER-encoding", b"c"),
                 (b"Trailer", b"t"), (b"Upgrade", b"u"), (b"KEEP-ALIVE", b"5"),
                 (b"X-Same-Len", b"10"), (b"Content-Langu", b"13"), (b"X-Length-Is-14", b"14"),
                 (b"Pragma", b"no-cache"), (b"Proxy", b"5"), (b"P", b"1"), (b"", b"0"),
                 (b"X-Seventeen-Chars", b"17"), (b"X-Sixteen-Chars-", b"16")],
        extra=[], framing=b"",
    )
    assert head == (b"HTTP/1.1 200 OK\r\nX-Same-Len: 10\r\nContent-Langu: 13\r\n"
                    b"X-Length-Is-14: 14\r\nPragma: no-cache\r\nProxy: 5\r\nP: 1\r\n: 0\r\n"
                    b"X-Seventeen-Chars: 17\r\nX-Sixteen-Chars-: 16\r\n\r\n")


def test_response_head_encodes_middleware_headers_the_same_once_remembered() -> None:
    pairs = [("RateLimit-Limit", "10"), ("RateLimit-Remaining", "9"), ("Warning", '299 - "w"')]
    want = (b"HTTP/1.1 200 OK\r\nRateLimit-Limit: 10\r\nRateLimit-Remaining: 9\r\n"
            b'Warning: 299 - "w"\r\n\r\n')
    for _ in range(2):  # the second time from what the first remembered
        assert response_head(status=200, reason=b"OK", headers=[], extra=pairs,
                             framing=b"") == want
    assert wire._EXTRA[("RateLimit-Limit", "10")] == b"RateLimit-Limit: 10\r\n"
    for i in range(wire._MAX_EXTRA + 10):  # past the bound: still encoded, no longer kept
        extra = [("X-N", str(i)), ("X-\xe9", "\xff")]
        assert response_head(status=204, reason=b"", headers=[], extra=extra, framing=b"") == (
            b"HTTP/1.1 204 No Content\r\nX-N: %d\r\nX-\xe9: \xff\r\n\r\n" % i)
    assert len(wire._EXTRA) <= wire._MAX_EXTRA
    with pytest.raises(UnicodeEncodeError):  # as before: latin-1 or nothing
        response_head(status=200, reason=b"OK", headers=[], extra=[("X", "\u2603")],
                      framing=b"")


def test_request_head_for_an_upgrade_keeps_upgrade_and_strips_the_rest() -> None:
    head, impersonating = request_head(
        method=b"POST", target=b"/api/v1/namespaces/a/pods/b/exec?command=sh", host=b"up:6443",
        headers=[(b"Host", b"x"), (b"Connection", b"Upgrade"), (b"Upgrade", b"SPDY/3.1"),
                 (b"X-Stream-Protocol-Version", b"v4.channel.k8s.io"),
                 (b"Impersonate-User", b"admin"), (b"Opgate-Instance", b"w")],
        named=frozenset({b"upgrade"}), drop=(), allow_impersonation=False,
        authorization=b"Bearer t", framing=b"", upgrade=True,
    )
    assert impersonating
    assert head == (b"POST /api/v1/namespaces/a/pods/b/exec?command=sh HTTP/1.1\r\n"
                    b"Host: up:6443\r\nUpgrade: SPDY/3.1\r\n"
                    b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n"
                    b"Authorization: Bearer t\r\nConnection: Upgrade\r\n\r\n")


def test_switch_head_keeps_the_upgrade() -> None:
    head = switch_head(reason=b"Switching Protocols",
                       headers=[(b"Connection", b"Upgrade"), (b"Upgrade", b"SPDY/3.1"),
                                (b"X-Stream-Protocol-Version", b"v4.channel.k8s.io")],
                       extra=[])
    assert head == (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: SPDY/3.1\r\n"
                    b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\nConnection: Upgrade\r\n\r\n")


def test_request_head_adds_opgates_token_only_when_the_client_sent_none() -> None:
    def head(headers: list[tuple[bytes, bytes]]) -> bytes:
        return request_head(method=b"GET", target=b"/api", host=b"up", headers=headers,
                            named=frozenset(), drop=(), allow_impersonation=False,
                            authorization=b"Bearer opgate", framing=b"")[0]

    assert b"Authorization: Bearer opgate\r\n" in head([(b"Accept", b"*/*")])
    own = head([(b"authorization", b"Bearer client")])
    assert b"authorization: Bearer client\r\n" in own and b"opgate" not in own



def test_response_head_status_lines_the_same_once_remembered() -> None:
    for _ in range(2):
        assert response_head(status=200, reason=b"OK", headers=[], extra=[],
                             framing=b"") == b"HTTP/1.1 200 OK\r\n\r\n"
        assert response_head(status=404, reason=b"", headers=[], extra=[],
                             framing=b"") == b"HTTP/1.1 404 Not Found\r\n\r\n"
    for code in range(100, 100 + wire._MAX_STATUS_LINES + 10):  # past the bound: not kept
        assert response_head(status=code, reason=b"Odd", headers=[], extra=[],
                             framing=b"") == b"HTTP/1.1 %d Odd\r\n\r\n" % code
    assert len(wire._STATUS_LINES) <= wire._MAX_STATUS_LINES
