"""The static upstream: nginx serving apiserver-shaped JSON, plain HTTP and TLS + HTTP/2.

A Python proxy's own cost is only visible in front of an upstream that costs next to nothing,
so nginx (one worker, ``daemon off``, loopback only, a config generated into the run's temp
dir) serves pre-generated files at apiserver paths: a ~1 KB ConfigMap GET, a 64 MB and a
200 MB ConfigMapList, ``/version`` and ``/readyz``, and forwards the ``watch`` namespace to
:mod:`bench.watchserver` for timestamped watch events. The same server listens on a plain port
and on a TLS port with HTTP/2 (a certificate signed by a CA generated with ``cryptography``,
by the e2e harness's :mod:`proxy.envtest.pki`), because a real apiserver speaks TLS and HTTP/2
and that changes how proxies pool their connections.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.caller import Caller, write_issuer
from bench.procs import Procs, free_port, wait_http, wait_port
from proxy.envtest import pki

SMALL = "/api/v1/namespaces/bench/configmaps/small"
PROBE = "/api/v1/namespaces/bench/secrets/probe"
LISTS = {64: "/api/v1/namespaces/list64/configmaps", 200: "/api/v1/namespaces/list200/configmaps"}
# Go's TLS 1.3 preference (crypto/tls, AES hardware): what kube-apiserver negotiates
APISERVER_TLS13_SUITES = (
    "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384")
WATCH = "/api/v1/namespaces/watch/configmaps?watch=true"
NOT_FOUND = '{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}'


@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream as the paths see it."""

    name: str  # "http" | "tls" | "apiserver"
    url: str
    ca_file: str | None
    pid: int  # the process (tree) that serves it, for reference only
    token: str | None = None  # the proxies' own token (--token-file; the real apiserver's admin)
    caller: Caller | None = None  # who the clients are: every client sends its token
    cipher: str | None = None  # the TLS 1.3 suite an OpenSSL client (opgate's side) gets

    @property
    def tls(self) -> bool:
        return self.url.startswith("https:")


def _configmap(name: str, namespace: str, payload: int) -> dict[str, object]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "48211",
                     "uid": "0d6ac0b4-1c57-4a39-9a2c-6b4c9b0f7e31",
                     "creationTimestamp": "2025-01-01T00:00:00Z",
                     "labels": {"app.kubernetes.io/name": "bench", "tier": "cache"},
                     "annotations": {"opgate.dev/owner": "bench/widget/one"}},
        "data": {"config.yaml": "k" * payload},
    }


def write_list(path: Path, *, mb: int, namespace: str) -> None:
    """A ConfigMapList of ~4 KB items adding up to ``mb`` MB, written in chunks."""
    size = mb * 1024 * 1024
    with path.open("wb") as out:
        head = {"kind": "ConfigMapList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "48211"}}
        out.write(json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"items":[')
        written, i = 0, 0
        while written < size:
            item = json.dumps(_configmap(f"cm-{i:07d}", namespace, 3600),
                              separators=(",", ":")).encode()
            chunk = (b"," if i else b"") + item
            out.write(chunk)
            written += len(chunk)
            i += 1
        out.write(b"]}\n")


def write_data(root: Path, *, big: bool) -> dict[str, Path]:
    """The files nginx serves (``big``: also the 200 MB list)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"small": root / "small.json", "version": root / "version.json",
             "apiv1": root / "apiv1.json"}
    files["small"].write_text(json.dumps(_configmap("small", "bench", 650)) + "\n")
    files["apiv1"].write_text(json.dumps({  # discovery, for the quota counter
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
        "resources": [{"name": "configmaps", "singularName": "configmap", "namespaced": True,
                       "kind": "ConfigMap", "verbs": ["get", "list", "watch"]}]}) + "\n")
    files["version"].write_text(json.dumps({"major": "1", "minor": "33", "gitVersion": "v1.33.0",
                                            "platform": "linux/amd64"}) + "\n")
    for mb in (64, 200) if big else (64,):
        files[f"list{mb}"] = root / f"list{mb}.json"
        write_list(files[f"list{mb}"], mb=mb, namespace=f"list{mb}")
    return files


def nginx_upstream_conf(
    work: Path, *, files: dict[str, Path], http_port: int, tls_port: int, watch_port: int,
    cert: Path, key: Path, issuer: dict[str, Path] | None = None,
) -> str:
    lists = "".join(
        f"    location = {path} {{ alias {files[f'list{mb}']}; }}\n"
        for mb, path in LISTS.items() if f"list{mb}" in files)
    lists += "".join(f"    location = {path} {{ alias {file}; }}\n"
                     for path, file in (issuer or {}).items())
    return f"""\
worker_processes 1;
daemon off;
pid {work}/nginx-upstream.pid;
error_log {work}/nginx-upstream.error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {work}/tmp-up/body; proxy_temp_path {work}/tmp-up/proxy;
  fastcgi_temp_path {work}/tmp-up/fcgi; uwsgi_temp_path {work}/tmp-up/uwsgi;
  scgi_temp_path {work}/tmp-up/scgi;
  sendfile on; tcp_nopush on; tcp_nodelay on;
  keepalive_requests 100000000; keepalive_timeout 600s;
  types {{ }} default_type application/json;
  upstream watch {{ server 127.0.0.1:{watch_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{http_port} backlog=4096;
    listen 127.0.0.1:{tls_port} ssl http2 backlog=4096;
    ssl_certificate {cert}; ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3; ssl_session_cache shared:up:1m;
    # the cipher a real apiserver picks: Go's TLS 1.3 server uses its own order, AES-128-GCM
    # first, on a CPU with AES instructions when the client lists an AES-GCM suite first (as
    # OpenSSL and Go clients do); nginx would follow each client's order instead and give
    # opgate's OpenSSL client AES-256-GCM, while Go clients (kubectl) ask for AES-128 first
    ssl_prefer_server_ciphers on;
    ssl_conf_command Ciphersuites {APISERVER_TLS13_SUITES};
    location = {SMALL} {{ alias {files['small']}; }}
    location = {PROBE} {{ alias {files['small']}; }}
{lists}\
    location = /version {{ alias {files['version']}; }}
    location = /api/v1 {{ alias {files['apiv1']}; }}
    location = /api/v1/configmaps {{
      proxy_pass http://watch; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 3600s;
    }}
    location = /readyz {{ return 200 "ok"; }}
    location /api/v1/namespaces/watch/ {{
      proxy_pass http://watch; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 3600s;
    }}
    location / {{ return 404 '{NOT_FOUND}'; }}
  }}
}}
"""


def negotiated_cipher(port: int, ca_file: str) -> str:
    """The TLS 1.3 suite the loopback TLS listener on ``port`` agrees with Python's OpenSSL
    client defaults (what opgate's upstream connections offer)."""
    ctx = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        cipher = tls.cipher()
    assert cipher is not None
    return cipher[0]


@dataclass(frozen=True, slots=True)
class StaticUpstreams:
    http: Upstream
    tls: Upstream
    nginx_pid: int
    watch_pid: int
    ca_file: Path
    caller: Caller


def start_static(procs: Procs, work: Path, *, big: bool) -> StaticUpstreams:
    """Generate data and certificates, start the watch server and nginx; wait until both answer."""
    os.chmod(work, 0o755)  # nginx workers run as nobody when the bench runs as root
    files = write_data(work / "data", big=big)
    caller, issuer = write_issuer(work / "data")
    for f in (work / "data", *files.values(), *issuer.values()):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    pki_files = pki.write_pki(work / "pki")
    watch_port, http_port, tls_port = free_port(), free_port(), free_port()
    watch = procs.start("watch-upstream", [sys.executable, "-m", "bench.watchserver",
                                           str(watch_port)], cwd=Path(__file__).parent.parent)
    wait_port(watch_port, proc=watch)
    conf = work / "nginx-upstream.conf"
    conf.write_text(nginx_upstream_conf(work, files=files, http_port=http_port,
                                        tls_port=tls_port, watch_port=watch_port,
                                        cert=pki_files.serving_cert, key=pki_files.serving_key,
                                        issuer=issuer))
    (work / "tmp-up").mkdir(exist_ok=True)
    nginx = procs.start("nginx-upstream", ["nginx", "-p", str(work), "-c", str(conf)])
    wait_http(f"http://127.0.0.1:{http_port}/readyz", proc=nginx)
    wait_port(tls_port, proc=nginx)
    assert nginx.pid is not None and watch.pid is not None
    ca = str(pki_files.ca_cert)
    cipher = negotiated_cipher(tls_port, ca)
    if cipher != APISERVER_TLS13_SUITES.split(":")[0]:
        raise RuntimeError(f"the TLS upstream negotiated {cipher} with an OpenSSL client, where a "
                           "Go apiserver picks TLS_AES_128_GCM_SHA256: check nginx's OpenSSL")
    return StaticUpstreams(
        http=Upstream("http", f"http://127.0.0.1:{http_port}", None, nginx.pid, caller=caller),
        tls=Upstream("tls", f"https://127.0.0.1:{tls_port}", ca, nginx.pid, caller=caller,
                     cipher=cipher),
        nginx_pid=nginx.pid, watch_pid=watch.pid, ca_file=pki_files.ca_cert, caller=caller)
