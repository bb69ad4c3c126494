"""Non-resource URLs (``/healthz``, ``/version``, discovery …) as the apiserver reads them.

RBAC's ``nonResourceURLs`` (``NonResourceURLMatches`` in k8s.io/kubernetes pkg/apis/rbac) and
the audit policy's (``pathMatches`` in k8s.io/apiserver pkg/audit/policy) read an entry alike:
``*`` is every path, an entry ending in ``*`` is a prefix, any other entry is the exact path
(``/healthz`` is not ``/healthz/`` nor ``/healthz/etcd``). One reading here, so the identity
rules and the audit rules never disagree about which calls a list names.

``DISCOVERY_URLS`` are the discovery paths of RBAC's default ``system:discovery`` ClusterRole
(k8s.io/kubernetes plugin/pkg/auth/authorizer/rbac/bootstrappolicy), which every authenticated
user has: what a client reads to learn the resources (``/api``, ``/apis``, ``/openapi``) and the
server version, before any resource call. That role also lists ``/livez``, ``/readyz`` and
``/healthz``, which are about the server, not its resources: they are not here. A match about
every resource (:mod:`proxy.engine.match`) covers these paths and no other.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DISCOVERY_URLS", "is_discovery", "url_matches", "url_problem"]

DISCOVERY_URLS = ("/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*", "/version",
                  "/version/")


def url_matches(path: str, urls: Sequence[str]) -> bool:
    """Whether the request path ``path`` is one of ``urls`` (module docstring)."""
    for url in urls:
        if url == "*" or url == path:
            return True
        if url.endswith("*") and path.startswith(url.rstrip("*")):
            return True
    return False


def is_discovery(path: str) -> bool:
    """Whether a non-resource path is one of ``DISCOVERY_URLS`` (module docstring)."""
    return url_matches(path, DISCOVERY_URLS)


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a ``nonResourceURLs`` entry (the audit policy's validation: a path
    beginning with ``/``, or ``*``; a ``*`` only at the end), or ``None``."""
    if url != "*" and not url.startswith("/"):
        return f'"{url}" must begin with "/" (or be "*")'
    if "*" in url.rstrip("*") or url.count("*") > 1:
        return f'"{url}": "*" is only allowed at the end'
    return None
