"""Where the apiserver is and how to authenticate to it, resolved the way kubectl does.

An explicit URL wins; else the in-cluster service account (``KUBERNETES_SERVICE_HOST``/``_PORT``
and the mounted token and CA, the sidecar case); else the current context of the kubeconfig
(``--kubeconfig``, else the first file of ``$KUBECONFIG``, else ``~/.kube/config``, the local
development case). The result is one immutable :class:`UpstreamConfig`; every problem is an
:class:`UpstreamConfigError` with a message a user can act on.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import os
import shutil
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "UpstreamConfig",
    "UpstreamConfigError",
    "check_ca_file",
    "resolve_upstream",
]

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class UpstreamConfigError(Exception):
    """The upstream cannot be configured; ``str()`` says why and what to change."""


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """The apiserver to relay to. ``token_file`` is re-read when it changes (projected tokens)."""

    url: str
    ca_file: str | None = None
    ca_data: str | None = None  # PEM text
    insecure: bool = False
    client_cert_file: str | None = None
    client_key_file: str | None = None
    token: str | None = None
    token_file: str | None = None
    server_name: str | None = None  # kubeconfig tls-server-name
    source: str = ""  # "flag", "in-cluster" or "kubeconfig PATH (context NAME)"

    def __repr__(self) -> str:  # never print the token
        token = "<set>" if self.token else None
        return (
            f"UpstreamConfig(url={self.url!r}, source={self.source!r}, ca_file={self.ca_file!r}, "
            f"insecure={self.insecure}, client_cert_file={self.client_cert_file!r}, "
            f"token={token}, token_file={self.token_file!r})"
        )


def resolve_upstream(
    *,
    url: str | None = None,
    kubeconfig: str | None = None,
    ca_file: str | None = None,
    insecure: bool = False,
    token_file: str | None = None,
    serviceaccount_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> UpstreamConfig:
    """Resolve the upstream; explicit ca_file, insecure and token_file override any source."""
    env = os.environ if environ is None else environ
    sa_dir = serviceaccount_dir or SERVICE_ACCOUNT_DIR
    if url:
        config = UpstreamConfig(url=_check_url(url, "--upstream"), source="flag")
    elif env.get("KUBERNETES_SERVICE_HOST") and not kubeconfig:
        config = _in_cluster(env, sa_dir, need_token=token_file is None)
    else:
        config = _from_kubeconfig(_kubeconfig_path(kubeconfig, env))
    overrides: dict[str, Any] = {}
    if ca_file:
        _must_read(ca_file, "--upstream-ca")
        overrides.update(ca_file=ca_file, ca_data=None)
    if insecure:
        overrides["insecure"] = True
    if token_file:
        _must_read(token_file, "--token-file")
        overrides.update(token_file=token_file, token=None)
    return replace(config, **overrides) if overrides else config


def _check_url(url: str, where: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamConfigError(f"{where}: {url!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment:
        raise UpstreamConfigError(f"{where}: {url!r} must not have a query or fragment")
    return url.rstrip("/")


def _in_cluster(env: Mapping[str, str], sa_dir: str, *, need_token: bool) -> UpstreamConfig:
    host = env["KUBERNETES_SERVICE_HOST"]
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    token = os.path.join(sa_dir, "token")
    ca = os.path.join(sa_dir, "ca.crt")
    if need_token:
        _must_read(token, "the in-cluster service-account token")
    _must_read(ca, "the in-cluster CA")
    return UpstreamConfig(
        url=f"https://{host}:{port}",
        ca_file=ca,
        token_file=token if need_token else None,
        source="in-cluster",
    )


def _kubeconfig_path(flag: str | None, env: Mapping[str, str]) -> str:
    if flag:
        return flag
    listed = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        return listed[0]
    home = env.get("HOME") or os.path.expanduser("~")
    path = os.path.join(home, ".kube", "config")
    if not os.path.exists(path):
        raise UpstreamConfigError(
            "no upstream: pass --upstream URL, run in a pod (KUBERNETES_SERVICE_HOST), "
            f"or provide a kubeconfig (--kubeconfig, $KUBECONFIG or {path})"
        )
    return path


def _from_kubeconfig(path: str) -> UpstreamConfig:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise UpstreamConfigError(f"kubeconfig {path}: cannot read it: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise UpstreamConfigError(f"kubeconfig {path}: not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise UpstreamConfigError(f"kubeconfig {path}: not a kubeconfig (expected a mapping)")
    name = doc.get("current-context")
    if not name:
        raise UpstreamConfigError(f"kubeconfig {path}: no current-context is set")
    context = _named(doc, "contexts", "context", name, path)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"), path)
    user_name = context.get("user")
    user = _named(doc, "users", "user", user_name, path) if user_name else {}
    if "exec" in user or "auth-provider" in user:
        raise UpstreamConfigError(
            f"kubeconfig {path}: user {user_name!r} uses an exec/auth-provider credential plugin, "
            "which opgate does not run; use a token, a token file or a client certificate"
        )
    base = os.path.dirname(os.path.abspath(path))
    where = f"kubeconfig {path}"
    server = cluster.get("server")
    if not server:
        raise UpstreamConfigError(f"{where}: cluster {context.get('cluster')!r} has no server")
    cert_file = _file_field(cluster, "certificate-authority", base, where)
    ca_data = _data_field(cluster, "certificate-authority-data", where)
    client_cert = _file_field(user, "client-certificate", base, where)
    client_key = _file_field(user, "client-key", base, where)
    cert_data = _data_field(user, "client-certificate-data", where)
    key_data = _data_field(user, "client-key-data", where)
    if cert_data or key_data:
        if not (cert_data and key_data):
            raise UpstreamConfigError(
                f"{where}: user {user_name!r} needs both client-certificate-data and "
                "client-key-data"
            )
        client_cert, client_key = _private_pair(cert_data, key_data)
    if bool(client_cert) != bool(client_key):
        raise UpstreamConfigError(
            f"{where}: user {user_name!r} needs both a client certificate and a client key"
        )
    token_file = _file_field(user, "tokenFile", base, where)
    return UpstreamConfig(
        url=_check_url(str(server), f"{where}: cluster server"),
        ca_file=cert_file,
        ca_data=ca_data,
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        client_cert_file=client_cert,
        client_key_file=client_key,
        token=str(user["token"]) if user.get("token") else None,
        token_file=token_file,
        server_name=cluster.get("tls-server-name") or None,
        source=f"kubeconfig {path} (context {name})",
    )


def _named(doc: dict[str, Any], key: str, inner: str, name: Any, path: str) -> dict[str, Any]:
    for entry in doc.get(key) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(inner) or {}
            if not isinstance(value, dict):
                break
            return value
    raise UpstreamConfigError(f"kubeconfig {path}: no {inner} named {name!r} in {key}")


def _file_field(node: dict[str, Any], key: str, base: str, where: str) -> str | None:
    value = node.get(key)
    if not value:
        return None
    file = os.path.join(base, os.path.expanduser(str(value)))
    _must_read(file, f"{where}: {key}")
    return file


def _data_field(node: dict[str, Any], key: str, where: str) -> str | None:
    value = node.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError) as e:
        raise UpstreamConfigError(f"{where}: {key} is not base64-encoded PEM") from e


def _must_read(path: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise UpstreamConfigError(f"{what} {path}: cannot read it: {e.strerror}") from e


def check_ca_file(path: str, what: str = "--upstream-ca") -> None:
    """``path`` holds PEM CA certificates ssl can load (as the upstream's TLS context will);
    else :class:`UpstreamConfigError` naming ``what``."""
    try:
        ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise UpstreamConfigError(
            f"{what} {path}: not a PEM CA certificate bundle "
            f"({getattr(e, 'reason', None) or e})") from e
    except OSError as e:
        raise UpstreamConfigError(f"{what} {path}: cannot read it: {e.strerror}") from e


_private_dirs: list[str] = []


def _remove_private_dirs() -> None:
    for directory in _private_dirs:
        shutil.rmtree(directory, ignore_errors=True)


def _private_pair(cert: str, key: str) -> tuple[str, str]:
    """Write inline cert/key data to files only this user can read (ssl needs files)."""
    directory = tempfile.mkdtemp(prefix="opgate-client-")  # mode 0700
    if not _private_dirs:
        atexit.register(_remove_private_dirs)
    _private_dirs.append(directory)
    paths = []
    for name, text in (("client.crt", cert), ("client.key", key)):
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        paths.append(path)
    return paths[0], paths[1]
