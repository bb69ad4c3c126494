"""Classify a Kubernetes API call (method + path + query) exactly as kube-apiserver does.

Every policy in opgate is written in the apiserver's vocabulary (verb, group, resource,
subresource, namespace, name), so opgate must derive those attributes with the apiserver's own
rules, not a look-alike: a watch that opgate counted as a list, or a collection DELETE it saw as a
plain delete, would slip past the very rule meant for it. This module ports
``RequestInfoFactory.NewRequestInfo`` (k8s.io/apiserver ``pkg/endpoints/request/requestinfo.go``,
prefixes ``api`` and ``apis``, ``api`` groupless) plus the bits of list-option decoding it depends
on: the ``watch`` flag and the ``metadata.name`` field selector that names the object of a list
or watch.

It knows no transport: give it the decoded URL path (aiohttp's ``request.path``) and the raw query
string (``request.raw_query_string``). The query is only looked at for a GET/HEAD on a collection,
the one case where it changes the verb or the name.

A :class:`RequestInfo` is immutable and depends on nothing but (method, path, query), so
:func:`parse_request_info` answers repeated calls (an operator asks for the same objects over
and over) from a bounded cache, the very same object each time. Its ``shape`` is what a policy
rule can match on besides the user (verbs, group, resource, subresource, namespace, and for a
non-resource path whether it is discovery): calls that differ only by object name share it,
as do two paths of one verb that are both discovery or both not, which is what the
middlewares key their per-call decisions on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.engine.nonresource import is_discovery
from proxy.engine.selectors import list_or_watch

__all__ = [
    "CONNECT_SUBRESOURCES",
    "LONG_RUNNING_SUBRESOURCES",
    "LONG_RUNNING_VERBS",
    "RequestInfo",
    "Shape",
    "parse_request_info",
]

_API_PREFIXES = frozenset({"api", "apis"})
_GROUPLESS_PREFIXES = frozenset({"api"})
# Verbs that may stand in the path right after the version (the deprecated /watch/, /proxy/ forms).
_PATH_VERBS = frozenset({"proxy", "watch"})
# `/namespaces/{ns}/{x}`: these x are parts of the namespace object, anything else is a resource.
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})
_METHOD_VERBS = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}

# kube-apiserver's LongRunningFunc: BasicLongRunningRequestCheck(verbs, subresources).
LONG_RUNNING_VERBS = frozenset({"watch", "proxy"})
LONG_RUNNING_SUBRESOURCES = frozenset({"attach", "exec", "proxy", "log", "portforward"})
# pods/{exec,attach,portforward}: SPDY arrives as POST ("create"), WebSocket as GET ("get"); since
# 1.35 (AuthorizePodWebsocketUpgradeCreatePermission) the apiserver demands "create" for both.
CONNECT_SUBRESOURCES = frozenset({"exec", "attach", "portforward"})

CACHE_SIZE = 4096  # distinct (method, path, query) kept; the cache starts over when full

# (policy_verb, verb, api_group, resource, subresource, namespace, is_resource_request,
#  is_long_running, is_discovery): everything a rule's match can look at except the user and
#  the name (and a path other than discovery's, which only nonResourceURLs look at)
Shape = tuple[str, str, str, str, str, str, bool, bool, bool]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the apiserver's RequestInfo holds; ``parts`` starts at ``{resource}/{name}``."""

    is_resource_request: bool
    path: str
    verb: str
    api_prefix: str = ""
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    parts: tuple[str, ...] = ()
    # derived from the fields above once, when built: plain attributes, as the relay and the
    # middlewares read them several times per call
    shape: Shape = field(init=False, repr=False, compare=False)
    # True where the apiserver lifts its request timeout and in-flight limit
    is_long_running: bool = field(init=False, repr=False, compare=False)
    # the verb to authorize: ``verb``, except pod exec/attach/portforward are always create
    policy_verb: str = field(init=False, repr=False, compare=False)
    # a non-resource path of RBAC's system:discovery (/api, /apis, /openapi, /version …), which
    # a match about every resource covers (proxy.engine.nonresource)
    is_discovery: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.verb in LONG_RUNNING_VERBS:
            long_running = True
        elif self.is_resource_request:
            long_running = self.subresource in LONG_RUNNING_SUBRESOURCES
        else:
            long_running = self.path.startswith("/debug/pprof/")
        if (
            self.verb == "get"
            and self.subresource in CONNECT_SUBRESOURCES
            and self.resource == "pods"
            and self.api_group == ""
            and self.is_resource_request
        ):
            policy_verb = "create"
        else:
            policy_verb = self.verb
        discovery = not self.is_resource_request and is_discovery(self.path)
        object.__setattr__(self, "shape", (
            policy_verb, self.verb, self.api_group, self.resource, self.subresource,
            self.namespace, self.is_resource_request, long_running, discovery))
        object.__setattr__(self, "is_long_running", long_running)
        object.__setattr__(self, "policy_verb", policy_verb)
        object.__setattr__(self, "is_discovery", discovery)


_cache: dict[tuple[str, str, str], RequestInfo] = {}


def parse_request_info(method: str, path: str, query: str = "") -> RequestInfo:
    """Classify one request; ``query`` is the raw query string without its ``?``.

    Answered from the cache when the same (method, path, query) was classified before.
    """
    key = (method, path, query)
    info = _cache.get(key)
    if info is None:
        info = _parse(method, path, query)
        if len(_cache) >= CACHE_SIZE:
            _cache.clear()
        _cache[key] = info
    return info


def _parse(method: str, path: str, query: str) -> RequestInfo:
    """The classification itself (see :func:`parse_request_info`).

    A path with a verb prefix but nothing after it (``/api/v1/watch``) is one the apiserver
    answers with a 500; it comes back here as the partial info the apiserver had at that point
    (a resource request with an empty resource), and the upstream gives the error.
    """
    trimmed = path.strip("/")
    segments = trimmed.split("/") if trimmed else []
    if len(segments) < 3 or segments[0] not in _API_PREFIXES:
        return RequestInfo(is_resource_request=False, path=path, verb=method.lower())
    prefix = segments[0]
    if prefix in _GROUPLESS_PREFIXES:
        group, version, rest = "", segments[1], segments[2:]
    elif len(segments) < 4:
        # Not a resource request, though the apiserver has recorded the prefix by then.
        return RequestInfo(
            is_resource_request=False, path=path, verb=method.lower(), api_prefix=prefix
        )
    else:
        group, version, rest = segments[1], segments[2], segments[3:]

    if rest[0] in _PATH_VERBS:
        if len(rest) < 2:
            return RequestInfo(
                is_resource_request=True,
                path=path,
                verb=method.lower(),
                api_prefix=prefix,
                api_group=group,
                api_version=version,
            )
        verb = rest[0]
        rest = rest[1:]
    else:
        verb = _METHOD_VERBS.get(method, "")

    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]

    count = len(rest)
    name = rest[1] if count >= 2 else ""
    subresource = rest[2] if count >= 3 and verb != "proxy" else ""
    if not name:
        if verb == "get":
            verb, name = list_or_watch(query)
        elif verb == "delete":
            verb = "deletecollection"

    return RequestInfo(
        is_resource_request=True,
        path=path,
        verb=verb,
        api_prefix=prefix,
        api_group=group,
        api_version=version,
        namespace=namespace,
        resource=rest[0],
        subresource=subresource,
        name=name,
        parts=tuple(rest),
    )
