"""Real Kubernetes parts for opgate's e2e tier: etcd, kube-apiserver, kubectl and helm.

``binaries`` finds or builds etcd + kube-apiserver, ``tools`` fetches kubectl + helm,
``cluster.LocalCluster`` runs them on loopback; ``api`` calls the API as admin; ``pki`` and
``procs`` are their key material and process handling. Test and demo support: the relay, the
engine and the middlewares never import it (``opgate demo`` does, to run a local cluster).
Names are re-exported lazily so that ``python -m proxy.envtest.binaries`` (or ``.tools``) runs
without importing the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ApiError": "api", "ApiResponse": "api",
    "BinariesUnavailable": "binaries", "KubeBinaries": "binaries", "find_or_build": "binaries",
    "DEFAULT_ISSUER": "cluster", "LocalCluster": "cluster",
    "KubeTools": "tools", "find_tools": "tools",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
