"""Reconcile one Widget: finalizer, owned ConfigMap, status; or clean up when it is deleted.

Level-triggered: every call compares the cluster with what ``resources.py`` says it should be
and makes only the calls needed. A ConfigMap write the server refuses (403, 422, ...) is put in
the Widget's status (``Ready=False``, reason ``ConfigMapRefused``) before the reconcile fails
and is retried, so the status never goes on saying Ready for a ConfigMap that is not. Every
write carries the ``resourceVersion`` it was computed from, so a stale read ends in ``409
Conflict``; the object is then read again and the pass repeated (a few times at most). Every
call is sent with ``Opgate-Instance: <ns>/Widget/<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import resources as r
from .kube import MERGE_PATCH, ApiError, KubeClient

CONFLICT_RETRIES = 5


@dataclass
class Outcome:
    """What one reconcile did, for its log line."""

    actions: list[str] = field(default_factory=list)
    generation: int = 0
    conflicts: int = 0

    @property
    def summary(self) -> str:
        return ",".join(self.actions) or "unchanged"


def widget_path(namespace: str, name: str, subresource: str = "") -> str:
    path = f"/apis/{r.GROUP}/{r.VERSION}/namespaces/{namespace}/{r.PLURAL}/{name}"
    return f"{path}/{subresource}" if subresource else path


def configmap_path(namespace: str, name: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    return f"{path}/{name}" if name else path


def is_refusal(err: ApiError) -> bool:
    """A write the server will go on refusing until something changes (a quota, an admission
    webhook, opgate's policy, an invalid ``spec.data`` key): worth telling in the status.

    Not a conflict or a missing object (``reconcile`` reads again), not a throttled call (a
    status write would spend the same budget), a 401, a 5xx or a lost connection (passing).
    """
    return 400 <= err.code < 500 and err.code not in (401, 404, 409, 429)


class Reconciler:
    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def reconcile(self, widget: r.Obj | None, *, key: str) -> Outcome:
        """Bring the cluster in line with ``widget`` (the cached copy; may be stale or gone)."""
        namespace, name = r.split_key(key)
        instance = r.instance_header(namespace, name)
        outcome = Outcome()
        for _ in range(CONFLICT_RETRIES):
            if widget is None:
                outcome.actions.append("gone")
                return outcome
            try:
                await self._once(widget, instance=instance, outcome=outcome)
                return outcome
            except ApiError as err:
                if err.code not in (404, 409):
                    raise
                fresh = await self._get(widget_path(namespace, name), instance=instance)
                if err.code == 404 and fresh is not None:
                    raise  # something else is missing (e.g. the namespace is going away)
                outcome.conflicts += err.code == 409
                widget = fresh
        raise ApiError(code=409, reason="Conflict",
                       message=f"still conflicting after {CONFLICT_RETRIES} fresh reads")

    async def _get(self, path: str, *, instance: str) -> r.Obj | None:
        try:
            return await self._client.request("GET", path, instance=instance)
        except ApiError as err:
            if err.code == 404:
                return None
            raise

    async def _patch(self, path: str, patch: dict[str, Any], *, instance: str) -> r.Obj:
        return await self._client.request("PATCH", path, body=patch, content_type=MERGE_PATCH,
                                          instance=instance)

    async def _once(self, widget: r.Obj, *, instance: str, outcome: Outcome) -> None:
        meta = widget["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        outcome.generation = int(meta.get("generation") or 0)
        if r.is_deleting(widget):
            await self._finalize(widget, instance=instance, outcome=outcome)
            return
        if r.FINALIZER not in r.finalizers(widget):
            widget = await self._patch(widget_path(namespace, name), {"metadata": {
                "finalizers": [*r.finalizers(widget), r.FINALIZER],
                "resourceVersion": meta["resourceVersion"]}}, instance=instance)
            outcome.actions.append("finalizer-added")
        refused: ApiError | None = None
        try:
            ready, reason, message = await self._ensure_configmap(widget, instance=instance,
                                                                   outcome=outcome)
        except ApiError as err:
            if not is_refusal(err):
                raise
            refused = err
            ready, reason, message = False, "ConfigMapRefused", (
                f"writing ConfigMap {name} was refused: {err}")
        status = r.desired_status(widget, ready=ready, reason=reason, message=message)
        if r.status_needs_update(widget, status):
            await self._patch(widget_path(namespace, name, "status"), {
                "metadata": {"resourceVersion": widget["metadata"]["resourceVersion"]},
                "status": status}, instance=instance)
            outcome.actions.append("status")
        if refused is not None:
            raise refused  # still a failure: the work queue tries again later

    async def _ensure_configmap(
        self, widget: r.Obj, *, instance: str, outcome: Outcome
    ) -> tuple[bool, str, str]:
        namespace, name = widget["metadata"]["namespace"], widget["metadata"]["name"]
        desired = r.desired_configmap(widget)
        current = await self._get(configmap_path(namespace, name), instance=instance)
        if current is None:
            await self._client.request("POST", configmap_path(namespace), body=desired,
                                       instance=instance)
            outcome.actions.append("configmap-created")
        elif r.owned_elsewhere(current, widget):
            return False, "ConfigMapOwnedElsewhere", (
                f"ConfigMap {name} is controlled by another object; not touching it")
        elif r.configmap_needs_update(current, desired):
            await self._client.request("PUT", configmap_path(namespace, name),
                                       body=r.merge_configmap(current, desired), instance=instance)
            outcome.actions.append("configmap-updated")
        return True, "Reconciled", f"ConfigMap {name} is up to date"

    async def _finalize(self, widget: r.Obj, *, instance: str, outcome: Outcome) -> None:
        meta = widget["metadata"]
        if r.FINALIZER not in r.finalizers(widget):
            outcome.actions.append("deleting")
            return
        namespace, name = meta["namespace"], meta["name"]
        current = await self._get(configmap_path(namespace, name), instance=instance)
        if current is not None and r.is_controlled_by(current, widget):
            try:
                await self._client.request(
                    "DELETE", configmap_path(namespace, name), instance=instance,
                    body={"kind": "DeleteOptions", "apiVersion": "v1",
                          "preconditions": {"uid": current["metadata"]["uid"]}})
                outcome.actions.append("configmap-deleted")
            except ApiError as err:
                if err.code != 404:
                    raise
        remaining = [f for f in r.finalizers(widget) if f != r.FINALIZER]
        await self._patch(widget_path(namespace, name), {"metadata": {
            "finalizers": remaining or None, "resourceVersion": meta["resourceVersion"]}},
            instance=instance)
        outcome.actions.append("finalizer-removed")
