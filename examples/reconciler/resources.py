"""What a Widget should look like in the cluster: pure functions, no I/O.

Given a Widget these compute the ConfigMap it owns, whether an existing ConfigMap must change,
and the ``status`` (``observedGeneration`` + a ``Ready`` condition) to write through the status
subresource. Keeping them pure lets the unit tests cover every case with tables and leaves
``reconciler.py`` with nothing but the calls.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

GROUP = "demo.opgate.dev"
VERSION = "v1"
KIND = "Widget"
PLURAL = "widgets"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = "demo.opgate.dev/cleanup"
MANAGED_BY = "opgate-sample-operator"
WIDGET_LABEL = "demo.opgate.dev/widget"
COLOR_ANNOTATION = "demo.opgate.dev/color"
# The ConfigMaps this operator watches: those it labelled when it made them, not every one.
CONFIGMAP_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"

Obj = dict[str, Any]


def key_of(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta['name']}"


def split_key(key: str) -> tuple[str, str]:
    namespace, _, name = key.partition("/")
    return namespace, name


def instance_header(namespace: str, name: str) -> str:
    """The ``Opgate-Instance`` value that ties a call to the Widget it is made for."""
    return f"{namespace}/{KIND}/{name}"


def owner_reference(widget: Obj) -> Obj:
    meta = widget["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def desired_configmap(widget: Obj) -> Obj:
    """The ConfigMap a Widget owns: same name and namespace, ``data`` = ``spec.data``."""
    meta = widget["metadata"]
    spec = widget.get("spec") or {}
    data = {str(k): str(v) for k, v in (spec.get("data") or {}).items()}
    annotations = {}
    if spec.get("color"):
        annotations[COLOR_ANNOTATION] = str(spec["color"])
    cm_meta: Obj = {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, WIDGET_LABEL: meta["name"]},
        "ownerReferences": [owner_reference(widget)],
    }
    if annotations:
        cm_meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": cm_meta, "data": data}


def controller_of(obj: Obj) -> Obj | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def owner_key(obj: Obj) -> str | None:
    """The key of the Widget controlling ``obj`` (a ConfigMap), or ``None`` if none does.

    As controller-runtime's ``Owns()``: an event about an owned object is work for its owner.
    The group is compared, not the version, so a Widget served at another version still counts.
    """
    ref = controller_of(obj)
    if ref is None or ref.get("kind") != KIND or not ref.get("name"):
        return None
    if str(ref.get("apiVersion") or "").partition("/")[0] != GROUP:
        return None
    return f"{(obj.get('metadata') or {}).get('namespace', '')}/{ref['name']}"


def is_controlled_by(obj: Obj, widget: Obj) -> bool:
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") == widget["metadata"].get("uid")


def owned_elsewhere(obj: Obj, widget: Obj) -> bool:
    """Another controller (not this Widget) owns ``obj``: it must not be adopted or deleted."""
    ref = controller_of(obj)
    return ref is not None and ref.get("uid") != widget["metadata"].get("uid")


def merge_configmap(current: Obj, desired: Obj) -> Obj:
    """``current`` with our fields set: data, our labels/annotation, our controller reference.

    Labels, annotations and non-controller owner references set by others are kept. No data
    is no ``data`` key, the shape the apiserver answers with, so that it compares equal.
    """
    meta = dict(current.get("metadata") or {})
    want = desired["metadata"]
    meta["labels"] = {**(meta.get("labels") or {}), **want["labels"]}
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(COLOR_ANNOTATION, None)
    annotations.update(want.get("annotations") or {})
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    ours = want["ownerReferences"][0]
    others = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != ours["uid"]]
    meta["ownerReferences"] = [*others, ours]
    merged = dict(current)
    merged["metadata"] = meta
    merged.pop("binaryData", None)
    if desired["data"]:
        merged["data"] = dict(desired["data"])
    else:  # as the apiserver serves an empty one (omitempty): else a PUT on every reconcile
        merged.pop("data", None)
    return merged


def configmap_needs_update(current: Obj, desired: Obj) -> bool:
    return merge_configmap(current, desired) != current


def now_rfc3339(now: datetime | None = None) -> str:
    """``metav1.Time`` serialisation: UTC, second precision, ``Z``."""
    moment = now or datetime.now(UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: list[Obj] | None, ctype: str) -> Obj | None:
    for cond in conditions or []:
        if cond.get("type") == ctype:
            return cond
    return None


def build_condition(
    *,
    ctype: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    previous: Obj | None,
    now: str,
) -> Obj:
    """A ``metav1.Condition``; ``lastTransitionTime`` moves only when ``status`` changes."""
    if previous is not None and previous.get("status") == status and previous.get(
        "lastTransitionTime"
    ):
        transition = previous["lastTransitionTime"]
    else:
        transition = now
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": transition,
    }


def set_condition(conditions: list[Obj] | None, condition: Obj) -> list[Obj]:
    """Replace the condition of the same type in place, or append it."""
    out: list[Obj] = []
    replaced = False
    for cond in conditions or []:
        if cond.get("type") == condition["type"]:
            out.append(condition)
            replaced = True
        else:
            out.append(cond)
    if not replaced:
        out.append(condition)
    return out


def desired_status(
    widget: Obj, *, ready: bool, reason: str, message: str, now: str | None = None
) -> Obj:
    """The Widget's ``status`` after this reconcile (other condition types are kept)."""
    generation = int(widget["metadata"].get("generation") or 0)
    current = widget.get("status") or {}
    conditions = current.get("conditions") or []
    ready_cond = build_condition(
        ctype="Ready",
        status="True" if ready else "False",
        reason=reason,
        message=message,
        generation=generation,
        previous=find_condition(conditions, "Ready"),
        now=now or now_rfc3339(),
    )
    return {**current, "observedGeneration": generation,
            "conditions": set_condition(conditions, ready_cond)}


def status_needs_update(widget: Obj, status: Obj) -> bool:
    return (widget.get("status") or {}) != status


def finalizers(obj: Obj) -> list[str]:
    return list((obj.get("metadata") or {}).get("finalizers") or [])


def is_deleting(obj: Obj) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))
