"""Which custom-resource instance a call is made for: the ``{instance}`` of rate-limit keys.

DESIGN.md's order, the first source that answers wins:

1. the ``Opgate-Instance: <namespace>/<kind>/<name>`` request header (the controller says so);
2. the controlling ownerReference (``controller: true``) in a create/update body, or in a
   server-side apply's: the ConfigMap a Widget's reconcile creates or applies counts against that
   Widget;
3. the object itself when its resource is a watched custom resource: ``PUT …/widgets/w1/status``
   is for ``<ns>/Widget/w1`` (a create names it in the body's ``metadata.name``);
4. ``-`` (``None`` here).

It runs per call, so it stays cheap: only when a matched rule's key needs ``{instance}``; the
header is a dict lookup; a body is looked at only for POST/PUT with ``Content-Type:
application/json`` or ``application/vnd.kubernetes.protobuf`` (what client-go sends for built-in
kinds by default; only its ``metadata`` is read, :mod:`proxy.engine.protometa`; CBOR bodies are
never decoded: such calls fall through to 3 and 4), for a PATCH with ``application/apply-patch+
yaml`` or ``+json`` (parsed as JSON, which client-go sends; a YAML body falls through), and only
when the relay read it (the
rate-limit middleware's ``wants_body``); the JSON is parsed only when the bytes contain
``"ownerReferences"``, or for a create of a watched kind (for its name), at any depth the
apiserver decodes (:mod:`proxy.engine.jsonbody`). A malformed body falls through, never fails
the call.

An :class:`InstanceOverrides` (``proxy.relay.informer.InformerPool`` when serving,
:class:`MemoryInstanceOverrides` in tests) says which resources are watched CR kinds and holds
each instance's annotations. The resolver asks it to watch a custom resource (``want``) the first
time a call for one needs ``{instance}``; that never blocks, and until the watch is up such calls
get ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from proxy.engine.context import RequestContext
from proxy.engine.jsonbody import loads
from proxy.engine.kinds import is_custom_group, parse_qps
from proxy.engine.protometa import PROTOBUF, read_meta

__all__ = ["INSTANCE_HEADER", "InstanceOverrides", "InstanceResolver", "MemoryInstanceOverrides",
           "header_instance", "is_custom_group", "is_readable_write"]

INSTANCE_HEADER = "Opgate-Instance"
# server-side apply bodies that may be JSON (client-go marshals its apply configurations to
# JSON under either type); application/apply-patch+cbor is never decoded
APPLY_TEXT = frozenset({"application/apply-patch+yaml", "application/apply-patch+json"})
_OWNER_MARK = b'"ownerReferences"'
MAX_NAME = 253
MAX_KIND = 63


class InstanceOverrides(Protocol):
    """What opgate knows of the operator's custom resources (an informer, or a dict in tests).

    Every method is non-blocking and cheap (the hot path calls them); an implementation may
    start watching a kind the first time ``get`` names it.
    """

    def get(self, namespace: str, kind: str, name: str, annotation: str) -> float | None:
        """The instance's own qps from its annotation (``None``: unknown or not a valid qps)."""
        ...

    def kind_of(self, group: str, resource: str) -> str | None:
        """The kind of a watched custom resource (``None``: not watched, or not yet)."""
        ...

    def want(self, group: str, version: str, resource: str) -> None:
        """Ask to watch this custom resource (idempotent, bounded, never blocks)."""
        ...

    def cluster_scoped(self, kind: str) -> bool:
        """True when ``kind`` is a watched cluster-scoped kind (its instances have no namespace)."""
        ...


class MemoryInstanceOverrides:
    """Annotations and watched kinds set by hand (tests, ``opgate demo``)."""

    def __init__(self) -> None:
        self._annotations: dict[tuple[str, str, str], Mapping[str, str]] = {}
        self._kinds: dict[tuple[str, str], str] = {}
        self._cluster_kinds: set[str] = set()
        self.wanted: list[tuple[str, str, str]] = []

    def set(self, namespace: str, kind: str, name: str, annotations: Mapping[str, str]) -> None:
        self._annotations[(namespace, kind, name)] = dict(annotations)

    def delete(self, namespace: str, kind: str, name: str) -> None:
        self._annotations.pop((namespace, kind, name), None)

    def watch(self, group: str, resource: str, kind: str, *, cluster_scoped: bool = False) -> None:
        """Make ``group``/``resource`` a watched CR kind."""
        self._kinds[(group, resource)] = kind
        if cluster_scoped:
            self._cluster_kinds.add(kind)

    def get(self, namespace: str, kind: str, name: str, annotation: str) -> float | None:
        return parse_qps(self._annotations.get((namespace, kind, name), {}).get(annotation))

    def kind_of(self, group: str, resource: str) -> str | None:
        return self._kinds.get((group, resource))

    def want(self, group: str, version: str, resource: str) -> None:
        if (group, version, resource) not in self.wanted:
            self.wanted.append((group, version, resource))

    def cluster_scoped(self, kind: str) -> bool:
        return kind in self._cluster_kinds


def header_instance(ctx: RequestContext) -> str | None:
    """``<namespace>/<kind>/<name>`` from the ``Opgate-Instance`` header, when well formed."""
    value = ctx.headers.get(INSTANCE_HEADER)
    if not value:
        return None
    parts = value.strip().split("/")
    if len(parts) != 3 or not parts[1] or not parts[2] or len(value) > 600:
        return None
    return "/".join(parts)



def is_readable_write(ctx: RequestContext) -> bool:
    """A create (POST) or update (PUT) whose body is JSON, or protobuf to a built-in kind (the
    apiserver serves custom resources no protobuf), or a server-side apply (PATCH): the bodies
    opgate reads. An apply is controller-runtime's create-or-update (``Client.Apply``); its body
    is the whole intent, ownerReferences included, in JSON as client-go sends it whatever the
    ``+yaml`` of its type (a YAML one is not parsed: it falls through)."""
    method = ctx.method
    kind = ctx.media_type
    if method == "PATCH":
        return kind in APPLY_TEXT
    if method != "POST" and method != "PUT":
        return False
    return kind == "application/json" or (kind == PROTOBUF
                                          and not is_custom_group(ctx.info.api_group))


def _load(body: bytes) -> dict[str, Any] | None:
    try:
        doc = loads(body)
    except ValueError:  # UnicodeDecodeError is one, and so is a body nested too deep
        return None
    return doc if isinstance(doc, dict) else None


def _metadata(doc: dict[str, Any] | None) -> dict[str, Any]:
    meta = doc.get("metadata") if doc is not None else None
    return meta if isinstance(meta, dict) else {}


def _valid(value: object, limit: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and "/" not in value


def controller_owner(doc: dict[str, Any] | None) -> tuple[str, str] | None:
    """``(kind, name)`` of the ownerReference with ``controller: true``, if any."""
    refs = _metadata(doc).get("ownerReferences")
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if isinstance(ref, dict) and ref.get("controller") is True:
            return _checked((ref.get("kind"), ref.get("name")))
    return None


def _checked(owner: tuple[object, object] | None) -> tuple[str, str] | None:
    if owner is None:
        return None
    kind, name = owner
    return (str(kind), str(name)) if _valid(kind, MAX_KIND) and _valid(name, MAX_NAME) else None


class InstanceResolver:
    """``resolver(ctx) -> "<namespace>/<kind>/<name>" | None`` in DESIGN.md's order."""

    def __init__(self, overrides: InstanceOverrides) -> None:
        self.overrides = overrides

    def __call__(self, ctx: RequestContext) -> str | None:
        found = header_instance(ctx)
        if found:
            return found
        info = ctx.info
        if not info.is_resource_request:
            return None
        body = ctx.body if ctx.body is not None and is_readable_write(ctx) else None
        doc: dict[str, Any] | None = None
        if body is not None and ctx.media_type == PROTOBUF:
            # protobuf: a built-in kind, so only its controlling owner can name an instance
            meta = read_meta(body)
            owner = _checked(meta.controller) if meta is not None else None
            if owner is not None:
                namespace = "" if self.overrides.cluster_scoped(owner[0]) else info.namespace
                return f"{namespace}/{owner[0]}/{owner[1]}"
            return None
        if body is not None and _OWNER_MARK in body:
            doc = _load(body)
            owner = controller_owner(doc)
            if owner is not None:
                namespace = "" if self.overrides.cluster_scoped(owner[0]) else info.namespace
                return f"{namespace}/{owner[0]}/{owner[1]}"
        group = info.api_group
        if not is_custom_group(group) or not info.resource:
            return None
        kind = self.overrides.kind_of(group, info.resource)
        if kind is None:
            self.overrides.want(group, info.api_version, info.resource)
            return None
        name: object = info.name
        if not name and ctx.method == "POST" and body is not None:
            name = _metadata(doc if doc is not None else _load(body)).get("name")
        return f"{info.namespace}/{kind}/{name}" if _valid(name, MAX_NAME) else None
