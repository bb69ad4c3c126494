"""Non-resource URL matching and validation, as RBAC and the audit policy read an entry."""

from __future__ import annotations

import pytest

from proxy.engine.nonresource import url_matches, url_problem


@pytest.mark.parametrize(("path", "urls", "matches"), [
    ("/healthz", ("/healthz",), True),
    ("/healthz/", ("/healthz",), False),       # exact means exact
    ("/healthz/etcd", ("/healthz",), False),
    ("/healthz/etcd", ("/healthz/*",), True),  # a prefix ending in *
    ("/healthz", ("/healthz/*",), False),
    ("/healthzz", ("/healthz*",), True),       # a prefix, not a path segment
    ("/anything", ("*",), True),
    ("/version", ("/api", "/version"), True),
    ("/version", (), False),
])
def test_url_matches(path: str, urls: tuple[str, ...], matches: bool) -> None:
    assert url_matches(path, urls) is matches


@pytest.mark.parametrize(("url", "problem"), [
    ("/healthz", None), ("*", None), ("/apis/*", None), ("/", None),
    ("healthz", 'must begin with "/"'),
    ("/a*b", '"*" is only allowed at the end'),
    ("/a**", '"*" is only allowed at the end'),
])
def test_url_problem(url: str, problem: str | None) -> None:
    found = url_problem(url)
    assert found is None if problem is None else (found is not None and problem in found)
