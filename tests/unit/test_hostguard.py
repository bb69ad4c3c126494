"""Which Host names the API listener answers (proxy/relay/hostguard.py): kubectl proxy's
--accept-hosts, with its default."""

from __future__ import annotations

import json

import pytest

from proxy.relay.hostguard import (
    DEFAULT_ACCEPT_HOSTS,
    MEMO,
    HostGuard,
    host_name,
    parse_accept_hosts,
)


@pytest.mark.parametrize(("value", "name"), [
    ("localhost", "localhost"),
    ("127.0.0.1:8001", "127.0.0.1"),
    ("LocalHost:8001", "localhost"),
    ("[::1]:8001", "[::1]"),
    ("[::1]", "[::1]"),
    (" evil.example:8001 ", "evil.example"),
])
def test_host_name_is_the_value_without_its_port(value: str, name: str) -> None:
    assert host_name(value) == name


@pytest.mark.parametrize(("value", "accepted"), [
    (b"127.0.0.1:8001", True),
    (b"localhost", True),
    (b"localhost:9", True),
    (b"[::1]:8001", True),
    (b"evil.example:8001", False),  # a name pointed at 127.0.0.1 by its owner: DNS rebinding
    (b"localhost.evil.example", False),
    (b"127.0.0.1.nip.io:8001", False),
    (b"10.0.0.7:8001", False),
])
def test_the_default_accepts_only_loopback_names(value: bytes, accepted: bool) -> None:
    assert HostGuard(parse_accept_hosts(DEFAULT_ACCEPT_HOSTS)).accepts(value) is accepted


def test_patterns_are_searched_as_kubectl_proxy_does() -> None:
    guard = HostGuard(parse_accept_hosts(r"^opgate$, \.svc$"))
    assert guard.accepts(b"opgate:8001") and guard.accepts(b"op.ns.svc")
    assert not guard.accepts(b"127.0.0.1:8001")
    assert HostGuard(parse_accept_hosts(".*")).accepts(b"anything.example:1")


def test_each_value_is_matched_once_and_the_memo_is_bounded() -> None:
    guard = HostGuard(parse_accept_hosts(DEFAULT_ACCEPT_HOSTS))
    for i in range(MEMO + 10):
        assert not guard.accepts(b"h%d.example" % i)
    assert len(guard._memo) == MEMO
    assert guard.accepts(b"127.0.0.1:8001")  # (past the bound: matched every time, the same)


@pytest.mark.parametrize(("text", "problem"), [
    ("", "no pattern"),
    (" , ", "no pattern"),
    ("^ok$,(", "is not a regular expression"),
])
def test_bad_accept_hosts_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_accept_hosts(text)


def test_the_refusal_is_a_forbidden_status_naming_the_host() -> None:
    status = HostGuard.refusal(b"evil.example:8001")
    body = json.loads(status.body())
    assert (body["code"], body["reason"]) == (403, "Forbidden")
    assert body["message"].startswith('opgate: Host "evil.example" is not accepted here')
