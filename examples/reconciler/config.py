"""Read a kubeconfig the way kubectl does, for the one case this operator needs: a bearer token.

Behind opgate the kubeconfig's server is the sidecar (``http://127.0.0.1:8001``) and the user is
the ServiceAccount's token, inline (``token``) or in a file (``tokenFile``) that the kubelet
rotates, so the file is read again when it changes and at least once a minute, as client-go's
cached token source does. A kubeconfig without a user (the Helm chart's) sends no token: opgate
then adds the pod's own upstream. A CA (``certificate-authority[-data]``) is used when the server is
``https``. The token is never logged or put in an exception message.
"""

from __future__ import annotations

import base64
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REREAD_SECONDS = 60.0


class ConfigError(Exception):
    """The kubeconfig is missing or lacks what the operator needs."""


class TokenSource:
    """The current bearer token: inline, or read from ``token_file`` when it may have changed."""

    def __init__(
        self,
        *,
        token: str | None = None,
        token_file: Path | None = None,
        reread_seconds: float = REREAD_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._token = token
        self._file = token_file
        self._reread = reread_seconds
        self._clock = clock
        self._stamp: tuple[float, int] | None = None
        self._read_at = 0.0
        self._cached: str | None = None

    def get(self) -> str | None:
        if self._file is None:
            return self._token
        try:
            stat = self._file.stat()
        except OSError:
            return self._cached or self._token
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._stamp or self._clock() - self._read_at >= self._reread:
            self.reload()
        return self._cached or self._token

    def reload(self) -> None:
        """Read the token file now (after a 401, or when it changed)."""
        if self._file is None:
            return
        try:
            stat = self._file.stat()
            text = self._file.read_text().strip()
        except OSError:
            return
        self._stamp = (stat.st_mtime, stat.st_size)
        self._read_at = self._clock()
        if text:
            self._cached = text

    @property
    def from_file(self) -> bool:
        return self._file is not None


@dataclass(frozen=True)
class ClusterConfig:
    server: str
    tokens: TokenSource
    ssl_context: ssl.SSLContext | bool | None  # None: plain http; False: TLS unverified
    namespace: str | None  # the context's namespace, if any


def _named(items: Any, name: str, what: str) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return dict(item.get(what) or {})
    raise ConfigError(f"kubeconfig has no {what} named {name!r}")


def _resolve(base: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base / path


def load_kubeconfig(path: str | os.PathLike[str] | None, *, context: str | None = None
                    ) -> ClusterConfig:
    """Load ``path`` (default ``$KUBECONFIG``, first entry) into a :class:`ClusterConfig`."""
    if not path:
        env = os.environ.get("KUBECONFIG", "")
        path = env.split(os.pathsep)[0] if env else os.path.expanduser("~/.kube/config")
    file = Path(path)
    try:
        doc = yaml.safe_load(file.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read kubeconfig {file}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"kubeconfig {file} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"kubeconfig {file} is not a mapping")
    name = context or doc.get("current-context")
    if not name:
        raise ConfigError(f"kubeconfig {file} has no current-context (use --context)")
    ctx = _named(doc.get("contexts"), name, "context")
    cluster = _named(doc.get("clusters"), ctx.get("cluster", ""), "cluster")
    user = _named(doc.get("users"), ctx.get("user", ""), "user") if ctx.get("user") else {}
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise ConfigError(f"kubeconfig cluster {ctx.get('cluster')!r} has no http(s) server")
    base = file.parent
    token_file = _resolve(base, user["tokenFile"]) if user.get("tokenFile") else None
    if token_file is not None and not os.access(token_file, os.R_OK):
        raise ConfigError(f"kubeconfig user {ctx.get('user')!r}: cannot read its tokenFile "
                          f"{token_file}")
    # no user, or one without a token: no Authorization header, as client-go does (behind
    # opgate, the sidecar adds the pod's ServiceAccount token upstream: the Helm chart's case)
    tokens = TokenSource(token=user.get("token"), token_file=token_file)
    return ClusterConfig(
        server=server,
        tokens=tokens,
        ssl_context=_ssl_context(server, cluster, base),
        namespace=ctx.get("namespace"),
    )


def _ssl_context(server: str, cluster: dict[str, Any], base: Path) -> ssl.SSLContext | bool | None:
    if server.startswith("http://"):
        return None
    if cluster.get("insecure-skip-tls-verify"):
        return False
    if cluster.get("certificate-authority-data"):
        pem = base64.b64decode(cluster["certificate-authority-data"]).decode()
        return ssl.create_default_context(cadata=pem)
    if cluster.get("certificate-authority"):
        ca_file = _resolve(base, cluster["certificate-authority"])
        return ssl.create_default_context(cafile=str(ca_file))
    return ssl.create_default_context()
