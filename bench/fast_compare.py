"""CPU per relayed small GET: the aiohttp relay against the fast relay (issue #5). Not a test.

Starts its own nginx (one worker, 127.0.0.1 only, a temp config, a ~1 KB JSON, plain and TLS
with a self-signed certificate made with ``cryptography``), then one relay process per
configuration: {aiohttp relay, fast relay} x {asyncio, uvloop} x {empty chain, Metrics +
AccessLog (to a file)} x {http, tls upstream}, plus ``python -m proxy serve`` as shipped. Every
round runs ``wrk -t1 -c16 -d<duration>`` against each configuration in turn (rounds
interleaved); CPU is the relay process's utime+stime from ``/proc/PID/stat`` over the run.
Prints medians of µs CPU per request and requests/s. Every process it starts is stopped by PID.

    python bench/fast_compare.py [--duration 10] [--rounds 3] [--only fast,aiohttp]
    python bench/fast_compare.py serve --relay fast --loop uvloop --chain metrics ...  (launcher)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = "/api/v1/namespaces/bench/configmaps/small"
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not open after {timeout}s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def make_cert(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    crt, pem = directory / "up.crt", directory / "up.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return crt, pem


def start_nginx(work: Path, *, http_port: int, tls_port: int) -> subprocess.Popen[bytes]:
    doc = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "small", "namespace": "bench", "resourceVersion": "48211"},
           "data": {"config.yaml": "k" * 880}}
    (work / "small.json").write_text(json.dumps(doc) + "\n")
    crt, key = make_cert(work)
    (work / "tmp").mkdir()
    conf = work / "nginx.conf"
    conf.write_text(f"""worker_processes 1; daemon off; pid {work}/nginx.pid;
error_log {work}/nginx.error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; client_body_temp_path {work}/tmp; proxy_temp_path {work}/tmp;
  fastcgi_temp_path {work}/tmp; uwsgi_temp_path {work}/tmp; scgi_temp_path {work}/tmp;
  keepalive_requests 100000000; keepalive_timeout 600s; types {{ }}
  default_type application/json;
  server {{
    listen 127.0.0.1:{http_port}; listen 127.0.0.1:{tls_port} ssl;
    ssl_certificate {crt}; ssl_certificate_key {key};
    location = {SMALL} {{ alias {work}/small.json; }}
    location / {{ return 200 "ok"; }}
  }}
}}
""")
    proc = subprocess.Popen(["nginx", "-p", str(work), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(http_port, proc)
    return proc


# --- the launcher (runs one relay in this process) -------------------------------------------

async def _serve(args: argparse.Namespace) -> None:
    from proxy.engine.chain import Chain
    from proxy.middlewares.accesslog import AccessLog
    from proxy.middlewares.metrics import Metrics
    from proxy.relay import Relay, UpstreamConfig, serve_api
    from proxy.relay.fast import FastRelay
    from tests.integration.fakes import Policies

    if args.chain == "metrics":
        handler = logging.FileHandler(args.log)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access = logging.getLogger("opgate.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    chain = Chain([Metrics(), AccessLog()] if args.chain == "metrics" else [])
    upstream = UpstreamConfig(url=args.upstream, ca_file=args.ca, token="bench-token")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    relay_class = FastRelay if args.relay == "fast" else Relay
    relay = relay_class(upstream=upstream, chain=chain, policies=Policies())
    await relay.start()
    listener = await serve_api(relay, listen=f"127.0.0.1:{args.port}")
    await stop.wait()
    await listener.close()
    await relay.close()


def serve_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="fast_compare serve")
    p.add_argument("--relay", choices=["fast", "aiohttp"], required=True)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--chain", choices=["empty", "metrics"], default="empty")
    p.add_argument("--upstream", required=True)
    p.add_argument("--ca")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", default=os.devnull)
    args = p.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(_serve(args))
    else:
        asyncio.run(_serve(args))


# --- the comparison --------------------------------------------------------------------------

def wrk(port: int, seconds: int) -> tuple[int, float, int]:
    """(requests, requests/s, non-2xx count)."""
    out = subprocess.run(
        ["wrk", "-t1", "-c16", f"-d{seconds}s", f"http://127.0.0.1:{port}{SMALL}"],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return total, rps, int(bad.group(1)) if bad else 0


def start_target(name: str, argv: list[str], port: int, work: Path) -> subprocess.Popen[bytes]:
    log = (work / f"{name}.out").open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    wait_port(port, proc)
    return proc


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma list of substrings of target names")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opgate-fastcmp-"))
    work.chmod(0o755)  # nginx's worker (nobody) reads the JSON from here
    http_port, tls_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_nginx(work, http_port=http_port, tls_port=tls_port))
        ups = {"http": (f"http://127.0.0.1:{http_port}", None),
               "tls": (f"https://127.0.0.1:{tls_port}", str(work / "up.crt"))}
        (work / "token").write_text("bench-token\n")
        targets: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        plan: list[tuple[str, list[str], int]] = []
        for up, (url, ca) in ups.items():
            for relay in ("aiohttp", "fast"):
                for loop in ("asyncio", "uvloop"):
                    for chain in ("empty", "metrics"):
                        port = free_port()
                        argv = [sys.executable, __file__, "serve", "--relay", relay, "--loop",
                                loop, "--chain", chain, "--upstream", url, "--port", str(port),
                                "--log", str(work / f"access-{relay}-{loop}-{chain}-{up}.log")]
                        plan.append((f"{relay}/{loop}/{chain}/{up}",
                                     argv + (["--ca", ca] if ca else []), port))
            port = free_port()
            argv = [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{port}",
                    "--admin-listen", f"127.0.0.1:{free_port()}", "--upstream", url,
                    "--token-file", str(work / "token")] + (["--upstream-ca", ca] if ca else [])
            plan.append((f"serve(shipped)/asyncio/full/{up}", argv, port))
        only = [o for o in args.only.split(",") if o]
        plan = [t for t in plan if not only or any(o in t[0] for o in only)]
        for name, argv, port in plan:
            proc = start_target(name.replace("/", "-"), argv, port, work)
            procs.append(proc)
            targets[name] = (proc, port)
            wrk(port, 1)  # warm up: connections, caches
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        for rnd in range(args.rounds):
            for name, (proc, port) in targets.items():
                before = cpu_seconds(proc.pid)
                total, rps, bad = wrk(port, args.duration)
                used = cpu_seconds(proc.pid) - before
                if bad:
                    print(f"  {name}: {bad} non-2xx responses!", file=sys.stderr)
                results[name].append((used / max(total, 1) * 1e6, rps))
                print(f"round {rnd + 1} {name:40s} {used / max(total, 1) * 1e6:7.1f} µs/req "
                      f"{rps:9.0f} req/s", file=sys.stderr, flush=True)
        print(f"\n| target (relay/loop/chain/upstream) | CPU µs/req (median of {args.rounds}) "
              "| req/s (median) |\n|---|---:|---:|")
        for name, rows in results.items():
            print(f"| {name} | {statistics.median(r[0] for r in rows):.1f} "
                  f"| {statistics.median(r[1] for r in rows):.0f} |")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if proc is not procs[0] else signal.SIGQUIT)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"(work dir {work})", file=sys.stderr)


if __name__ == "__main__":
    main()
