"""Upstream resolution (flag, in-cluster, kubeconfig), TLS material, the token file, addresses."""

from __future__ import annotations

import base64
import os
import ssl
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.relay import endpoint
from proxy.relay.endpoint import Endpoint, TokenSource, make_ssl_context
from proxy.relay.listen import parse_listen
from proxy.relay.upstream import UpstreamConfig, UpstreamConfigError, resolve_upstream

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def sa_dir(tmp_path: Path) -> Path:
    d = tmp_path / "sa"
    d.mkdir()
    (d / "token").write_text("sa-token\n")
    (d / "ca.crt").write_text(PEM)
    return d


def kubeconfig(tmp_path: Path, *, user: dict[str, Any], cluster: dict[str, Any] | None = None,
               current: str | None = "dev", name: str = "config") -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "contexts": [
            {"name": "other", "context": {"cluster": "nowhere", "user": "nobody"}},
            {"name": "dev", "context": {"cluster": "c1", "user": "u1"}},
        ],
        "clusters": [{"name": "c1", "cluster": cluster or {"server": "https://10.1.2.3:6443/"}}],
        "users": [{"name": "u1", "user": user}],
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_explicit_url_wins(sa_dir: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    cfg = resolve_upstream(url="https://api.example:6443/", environ=env,
                           serviceaccount_dir=str(sa_dir))
    assert cfg == UpstreamConfig(url="https://api.example:6443", source="flag")


@pytest.mark.parametrize("url", ["api.example:6443", "ftp://x", "https://", "https://h/?q=1"])
def test_bad_url(url: str) -> None:
    with pytest.raises(UpstreamConfigError, match="--upstream"):
        resolve_upstream(url=url, environ={})


@pytest.mark.parametrize(("host", "url"), [("10.0.0.1", "https://10.0.0.1:443"),
                                           ("fd00::1", "https://[fd00::1]:443")])
def test_in_cluster(sa_dir: Path, host: str, url: str) -> None:
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "443"}
    cfg = resolve_upstream(environ=env, serviceaccount_dir=str(sa_dir))
    assert cfg.url == url
    assert cfg.token_file == str(sa_dir / "token")
    assert cfg.ca_file == str(sa_dir / "ca.crt")
    assert cfg.token is None and cfg.source == "in-cluster"


def test_in_cluster_without_token_is_an_error(sa_dir: Path) -> None:
    (sa_dir / "token").unlink()
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    with pytest.raises(UpstreamConfigError, match="service-account token"):
        resolve_upstream(environ=env, serviceaccount_dir=str(sa_dir))
    other = sa_dir / "other-token"
    other.write_text("x")
    cfg = resolve_upstream(environ=env, serviceaccount_dir=str(sa_dir), token_file=str(other))
    assert cfg.token_file == str(other)


def test_kubeconfig_with_files_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text(PEM)
    (tmp_path / "client.crt").write_text("cert")
    (tmp_path / "client.key").write_text("key")
    (tmp_path / "token").write_text("tok")
    path = kubeconfig(
        tmp_path,
        user={"client-certificate": "client.crt", "client-key": "client.key", "tokenFile": "token"},
        cluster={"server": "https://10.1.2.3:6443", "certificate-authority": "ca.crt",
                 "tls-server-name": "kubernetes"},
    )
    cfg = resolve_upstream(kubeconfig=str(path), environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert cfg.url == "https://10.1.2.3:6443"
    assert cfg.ca_file == str(tmp_path / "ca.crt")
    assert cfg.client_cert_file == str(tmp_path / "client.crt")
    assert cfg.client_key_file == str(tmp_path / "client.key")
    assert cfg.token_file == str(tmp_path / "token")
    assert cfg.server_name == "kubernetes"
    assert "context dev" in cfg.source


def test_kubeconfig_inline_data_and_token_from_env_list(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path,
        user={"client-certificate-data": b64("CERT"), "client-key-data": b64("KEY"),
              "token": "secret-token"},
        cluster={"server": "https://10.1.2.3:6443", "certificate-authority-data": b64(PEM),
                 "insecure-skip-tls-verify": True},
    )
    env = {"KUBECONFIG": f"{path}{os.pathsep}/does/not/exist"}
    cfg = resolve_upstream(environ=env)
    assert cfg.ca_data == PEM and cfg.insecure is True and cfg.token == "secret-token"
    assert cfg.client_cert_file and cfg.client_key_file
    assert Path(cfg.client_cert_file).read_text() == "CERT"
    assert Path(cfg.client_key_file).read_text() == "KEY"
    assert stat.S_IMODE(os.stat(cfg.client_key_file).st_mode) == 0o600
    assert "secret-token" not in repr(cfg)


def test_home_kubeconfig_and_overrides(tmp_path: Path) -> None:
    (tmp_path / ".kube").mkdir()
    kubeconfig(tmp_path / ".kube", user={"token": "t"})
    (tmp_path / "other-ca").write_text(PEM)
    (tmp_path / "tf").write_text("file-token")
    cfg = resolve_upstream(environ={"HOME": str(tmp_path)}, ca_file=str(tmp_path / "other-ca"),
                           token_file=str(tmp_path / "tf"), insecure=True)
    assert cfg.url == "https://10.1.2.3:6443"
    assert cfg.ca_file == str(tmp_path / "other-ca") and cfg.insecure
    assert cfg.token is None and cfg.token_file == str(tmp_path / "tf")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"user": {"token": "t"}, "current": None}, "no current-context"),
        ({"user": {"token": "t"}, "current": "other"}, "no cluster named 'nowhere'"),
        ({"user": {"exec": {"command": "aws"}}}, "exec/auth-provider"),
        ({"user": {"client-certificate-data": b64("C")}}, "client-key-data"),
        ({"user": {"tokenFile": "missing"}}, "tokenFile"),
        ({"user": {}, "cluster": {"certificate-authority-data": b64(PEM)}}, "has no server"),
        ({"user": {}, "cluster": {"server": "https://h", "certificate-authority-data": "!!"}},
         "base64"),
    ],
)
def test_kubeconfig_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    path = kubeconfig(tmp_path, **kwargs)
    with pytest.raises(UpstreamConfigError, match=message):
        resolve_upstream(kubeconfig=str(path), environ={})


def test_no_upstream_anywhere(tmp_path: Path) -> None:
    with pytest.raises(UpstreamConfigError, match="no upstream"):
        resolve_upstream(environ={"HOME": str(tmp_path)})
    (tmp_path / "bad").write_text("- [unbalanced")
    with pytest.raises(UpstreamConfigError, match="not valid YAML"):
        resolve_upstream(kubeconfig=str(tmp_path / "bad"), environ={})


def test_ssl_context() -> None:
    assert make_ssl_context(UpstreamConfig(url="http://127.0.0.1:8080")) is None
    ctx = make_ssl_context(UpstreamConfig(url="https://h", insecure=True))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    ctx = make_ssl_context(UpstreamConfig(url="https://h"))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(UpstreamConfigError, match="upstream TLS"):
        make_ssl_context(UpstreamConfig(url="https://h", ca_data=PEM))


@pytest.mark.parametrize(
    ("url", "host", "port", "host_header", "prefix"),
    [
        ("https://10.0.0.1", "10.0.0.1", 443, "10.0.0.1", ""),
        ("http://127.0.0.1:8080", "127.0.0.1", 8080, "127.0.0.1:8080", ""),
        ("https://[fd00::1]:6443/k8s/clusters/c-1", "fd00::1", 6443, "[fd00::1]:6443",
         "/k8s/clusters/c-1"),
    ],
)
def test_endpoint(url: str, host: str, port: int, host_header: str, prefix: str) -> None:
    ep = Endpoint.from_config(UpstreamConfig(url=url), None)
    assert (ep.host, ep.port, ep.host_header, ep.prefix) == (host, port, host_header, prefix)
    assert ep.base == url


def test_token_source_follows_a_rotating_file(tmp_path: Path, monkeypatch: Any) -> None:
    clock = [1000.0]
    monkeypatch.setattr(endpoint.time, "monotonic", lambda: clock[0])
    path = tmp_path / "token"
    path.write_text("one\n")
    source = TokenSource(token_file=str(path))
    assert source.authorization() == "Bearer one"
    new = tmp_path / "token.new"
    new.write_text("two-longer")
    os.replace(new, path)
    clock[0] += 0.5
    assert source.authorization() == "Bearer one"  # checked at most once a second
    clock[0] += 0.6
    assert source.authorization() == "Bearer two-longer"
    path.unlink()
    clock[0] += 2
    assert source.authorization() == "Bearer two-longer"  # last good token kept
    assert TokenSource(token="fixed").authorization() == "Bearer fixed"
    assert TokenSource().authorization() is None


def test_token_source_raw_follows_the_file_as_bytes_at_the_callers_instant(
    tmp_path: Path, monkeypatch: Any,
) -> None:
    monkeypatch.setattr(endpoint.time, "monotonic", lambda: 1000.0)
    path = tmp_path / "token"
    path.write_text("one\n")
    source = TokenSource(token_file=str(path))
    assert source.authorization_raw() == b"Bearer one"
    path.write_text("two-longer")
    assert source.authorization_raw(1000.5) == b"Bearer one"  # checked at most once a second
    assert source.authorization_raw(1001.1) == b"Bearer two-longer"
    assert source.authorization(1001.2) == "Bearer two-longer"
    path.write_text("")
    assert source.authorization_raw(1002.2) is None  # an empty file: no credentials to add
    assert TokenSource(token="fixed").authorization_raw() == b"Bearer fixed"
    assert TokenSource().authorization_raw() is None
    with pytest.raises(UnicodeEncodeError):  # as the relay's encode of it raised
        TokenSource(token="\u2603").authorization_raw()


@pytest.mark.parametrize(
    ("listen", "parsed"),
    [
        ("127.0.0.1:8001", ("127.0.0.1", 8001)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:80", ("localhost", 80)),
        ("unix:/run/opgate.sock", "/run/opgate.sock"),
    ],
)
def test_parse_listen(listen: str, parsed: object) -> None:
    assert parse_listen(listen) == parsed


@pytest.mark.parametrize("listen", ["8001", ":8001", "host:", "host:99999", "unix:", "[::1]"])
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ValueError, match="listen address"):
        parse_listen(listen)
