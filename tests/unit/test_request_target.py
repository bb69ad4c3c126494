"""The request-target helpers both relay cores use (the real apiserver's view of the same
targets: tests/e2e/test_request_target.py)."""

from __future__ import annotations

import pytest

from proxy.relay.calls import malformed_escape, origin_form


@pytest.mark.parametrize(("target", "origin"), [
    ("http://kubernetes.default.svc/api/v1/pods?watch=1", "/api/v1/pods?watch=1"),
    ("https://10.0.0.1:6443/apis", "/apis"),
    ("HTTPS://h/x", "/x"),
    ("http://h", "/"),
    ("http://h?limit=5", "/?limit=5"),
    ("http://h/a?b=http://c/d", "/a?b=http://c/d"),
    ("*", None),
    ("opgate:8001", None),
    ("ftp://h/x", None),
    ("api/v1/pods", None),
])
def test_origin_form(target: str, origin: str | None) -> None:
    assert origin_form(target) == origin


@pytest.mark.parametrize(("path", "bad"), [
    ("/api/v1/namespaces/a%2Fb", False),
    ("/api/v1/%63onfigmaps", False),
    ("/api/v1/namespaces/%zz", True),
    ("/x/%", True),
    ("/x/%2", True),
    ("/x/%%41", True),
])
def test_malformed_escape(path: str, bad: bool) -> None:
    assert malformed_escape(path) is bad
