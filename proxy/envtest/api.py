"""Calling a kube-apiserver as its admin from tests: plain requests and the objects tests need.

Kept apart from the process handling in ``cluster.py``: this part only speaks HTTP (stdlib
``urllib``, so that no transport library leaks into the harness) and knows the few API shapes
the tests create: namespaces, ServiceAccounts with RBAC, TokenRequests, CRDs, ResourceQuota
status, kubeconfigs. ``LocalCluster`` mixes it in; any object with ``url``, ``admin_token``
and ``ca_file`` can.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class ApiResponse:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)

    def json(self) -> Any:
        return json.loads(self.body)

    def ok(self) -> ApiResponse:
        """Return self on 2xx, else raise with the Status body (never a token)."""
        if not 200 <= self.status < 300:
            raise ApiError(self.status, self.body.decode(errors="replace")[:2000])
        return self


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class AdminApi:
    """API helpers over ``self.url`` (https), ``self.admin_token`` and ``self.ca_file``."""

    url: str
    admin_token: str
    ca_file: str
    _ssl: ssl.SSLContext | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts ``ca_file`` (the apiserver's and opgate's certs)."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=self.ca_file)
        return self._ssl

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        server: str | None = None,
        timeout: float = 60.0,
    ) -> ApiResponse:
        """One API call (as admin unless ``token`` is given; ``token=""`` sends none).

        ``body``: bytes/str as is, anything else JSON-encoded. ``server`` defaults to the
        apiserver; an ``https://`` one is verified with ``ca_file`` (opgate's test certs come
        from the same CA), an ``http://`` one gets no TLS. Never raises on a status code: use
        ``.ok()``.
        """
        data: bytes | None
        if body is None or isinstance(body, bytes):
            data = body
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = json.dumps(body).encode()
        hdrs = {"Accept": "application/json", **(headers or {})}
        if data is not None:
            hdrs.setdefault("Content-Type", content_type or "application/json")
        bearer = self.admin_token if token is None else token
        if bearer:
            hdrs["Authorization"] = f"Bearer {bearer}"
        base = server or self.url
        req = urllib.request.Request(base + path, data=data, headers=hdrs, method=method)
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if base.startswith("https://"):  # never via $HTTPS_PROXY: everything is on loopback
            handlers.append(urllib.request.HTTPSHandler(context=self.ssl_context()))
        try:
            with urllib.request.build_opener(*handlers).open(req, timeout=timeout) as resp:
                return ApiResponse(resp.status, dict(resp.headers.items()), resp.read())
        except urllib.error.HTTPError as err:
            return ApiResponse(err.code, dict(err.headers.items()), err.read())

    async def request(self, method: str, path: str, **kwargs: Any) -> ApiResponse:
        """``call`` for async code (runs in a thread; same keyword arguments)."""
        return await asyncio.to_thread(self.call, method, path, **kwargs)

    def apply(self, obj: dict[str, Any], *, field_manager: str = "opgate-e2e") -> dict[str, Any]:
        """Server-side apply ``obj`` (any kind the discovery serves) as admin; returns it."""
        resp = self.call("PATCH", _object_path(obj) + f"?fieldManager={field_manager}&force=true",
                         body=obj, content_type="application/apply-patch+yaml").ok()
        return dict(resp.json())

    # ---- fixtures for tests ------------------------------------------------------------------

    def create_namespace(self, name: str, *, labels: dict[str, str] | None = None) -> None:
        """Create (or keep) a namespace."""
        self.apply({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels or {}}})

    def create_service_account_with_rbac(
        self,
        namespace: str,
        name: str,
        rules: list[dict[str, Any]],
        *,
        cluster_wide: bool = False,
    ) -> str:
        """Create a ServiceAccount bound to ``rules`` (RBAC PolicyRule dicts).

        A Role + RoleBinding in ``namespace``, or with ``cluster_wide`` a ClusterRole +
        ClusterRoleBinding named ``<namespace>-<name>``. Returns the user name
        ``system:serviceaccount:<namespace>:<name>``.
        """
        self.create_namespace(namespace)
        self.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": name, "namespace": namespace}})
        role_kind = "ClusterRole" if cluster_wide else "Role"
        role_meta: dict[str, str] = (
            {"name": f"{namespace}-{name}"} if cluster_wide
            else {"name": name, "namespace": namespace})
        rbac = "rbac.authorization.k8s.io/v1"
        self.apply({"apiVersion": rbac, "kind": role_kind, "metadata": role_meta, "rules": rules})
        self.apply({"apiVersion": rbac, "kind": role_kind + "Binding", "metadata": role_meta,
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                "name": role_meta["name"]},
                    "subjects": [{"kind": "ServiceAccount", "name": name,
                                  "namespace": namespace}]})
        return f"system:serviceaccount:{namespace}:{name}"

    def token_request(
        self,
        namespace: str,
        name: str,
        audiences: list[str] | None = None,
        expiration_seconds: int = 3600,
        bound_to: dict[str, str] | None = None,
    ) -> str:
        """A bound ServiceAccount token via the TokenRequest API, like a pod's projected token.

        ``audiences=None`` means the apiserver's own (the issuer). The apiserver refuses
        ``expiration_seconds`` below 600. ``bound_to``: the ``boundObjectRef`` (``kind``
        Pod, Node or Secret, ``apiVersion`` v1, ``name``) the token lives and dies with, as a
        kubelet asks for a pod's token.
        """
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if audiences is not None:
            spec["audiences"] = audiences
        if bound_to is not None:
            spec["boundObjectRef"] = bound_to
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        resp = self.call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                         body=body).ok()
        return str(resp.json()["status"]["token"])

    def install_crd(self, manifest: dict[str, Any] | str, *, timeout: float = 60.0) -> str:
        """Apply a CustomResourceDefinition (dict, or YAML/JSON text) and wait until it is
        Established and its resource is served; returns the CRD name."""
        if isinstance(manifest, str):
            import yaml  # only needed for text manifests

            manifest = yaml.safe_load(manifest)
        assert isinstance(manifest, dict)
        crd = self.apply(manifest)
        name, spec = crd["metadata"]["name"], crd["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("served", True))
        prefix = f"/apis/{spec['group']}/{version}"
        plural = spec["names"]["plural"]
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            conds = (self.call("GET", path).ok().json().get("status") or {}).get("conditions") or []
            established = any(c["type"] == "Established" and c["status"] == "True"
                              for c in conds)
            if established and self.call("GET", f"{prefix}/{plural}?limit=1").status == 200:
                return str(name)
            time.sleep(0.2)
        raise TimeoutError(f"CRD {name} not established within {timeout:.0f}s")

    def set_quota_status(self, namespace: str, name: str) -> None:
        """Write a ResourceQuota's ``status.hard`` (and ``used`` = 0) as the controller-manager
        would, so that ResourceQuota admission starts enforcing it."""
        path = f"/api/v1/namespaces/{namespace}/resourcequotas/{name}"
        quota = self.call("GET", path).ok().json()
        hard = quota["spec"].get("hard", {})
        quota["status"] = {"hard": hard, "used": dict.fromkeys(hard, "0")}
        self.call("PUT", path + "/status", body=quota).ok()

    def write_kubeconfig(
        self,
        path: str | os.PathLike[str],
        *,
        server: str,
        token: str,
        ca_file: str | None = None,
        insecure: bool = False,
    ) -> Path:
        """Write a one-context kubeconfig (mode 0600) for ``server`` with a bearer token."""
        cluster: dict[str, Any] = {"server": server}
        if ca_file:
            cluster["certificate-authority"] = str(ca_file)
        if insecure:
            cluster["insecure-skip-tls-verify"] = True
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "envtest", "cluster": cluster}],
            "users": [{"name": "envtest", "user": {"token": token}}],
            "contexts": [{"name": "envtest",
                          "context": {"cluster": "envtest", "user": "envtest",
                                      "namespace": "default"}}],
            "current-context": "envtest",
        }
        out = Path(path)
        out.touch(mode=0o600)
        out.write_text(json.dumps(config, indent=2) + "\n")
        return out


def _object_path(obj: dict[str, Any]) -> str:
    api_version, kind = obj["apiVersion"], obj["kind"]
    meta = obj["metadata"]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    plural = _PLURALS.get(kind) or kind.lower() + "s"
    ns = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
    return f"{base}{ns}/{plural}/{meta['name']}"


_PLURALS = {"CustomResourceDefinition": "customresourcedefinitions", "Ingress": "ingresses",
            "NetworkPolicy": "networkpolicies", "ResourceQuota": "resourcequotas",
            "PriorityClass": "priorityclasses", "StorageClass": "storageclasses"}
