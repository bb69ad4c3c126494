"""Soak: drive many distinct inputs through a serving opgate and watch what it holds.

Not a test: ``python -m bench.soak --relay fast --calls 100000`` starts a fast fake upstream
(a process of its own: answers every call 200, every TokenReview as a user derived from the
token), a real ``redis-server`` and ``python -m proxy serve`` with the whole chain (identity,
rate limits on Redis with leasing keyed by ``{user}/{name}``, quota, faults, audit log, access
log, metrics), then sends ``--calls`` calls, each with a distinct token, namespace, name, query
string or 404 path, and prints opgate's RSS and open fds every ``--every`` calls, Redis's
``DBSIZE`` after the load (and again once the keys' TTLs lapsed), and the metrics series count.
A bounded opgate's RSS levels off after the first few tens of thousands of calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: soak}
spec:
  mode: enforce
  failure: open
  identity:
    issuers: [{kubernetes: {}}]
    allow: [{user: "*"}]
    rules: [{verbs: ["*"]}]  # every call, the "404" kind's /random/… paths too
  rateLimits:
    - {name: per-name, key: "{user}/{name}", qps: 100000, burst: 100000, lease: true}
    - {name: per-ns, key: "{namespace}/{instance}", qps: 100000, burst: 100000}
  quotas:
    - {name: cms, resources: [configmaps], namespaces: ["*"], max: 1000000}
  faults:
    - {name: never, match: {verbs: [update]}, probability: 0.0, respond: {code: 409}}
  audit:
    level: Metadata
"""

UPSTREAM = r'''
import asyncio, hashlib, sys, uvloop
BODY = b'{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"x","namespace":"n"}}'
class P(asyncio.Protocol):
    def connection_made(self, t): self.t, self.buf = t, b""
    def data_received(self, d):
        self.buf += d
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0: return
            head = self.buf[:end].decode("latin-1"); n = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.lower() == "content-length": n = int(v)
            if len(self.buf) < end + 4 + n: return
            body = self.buf[end + 4:end + 4 + n]; self.buf = self.buf[end + 4 + n:]
            path = head.split(" ", 2)[1]
            if "tokenreviews" in path:
                tok = body.split(b'"token": "', 1)[-1].split(b'"', 1)[0]
                user = "u-" + hashlib.md5(tok).hexdigest()[:8]
                out = ('{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":'
                       '{"authenticated":true,"user":{"username":"%s"}}}' % user).encode()
                code = b"201 Created"
            elif path.startswith("/api/v1/namespaces/") or path in ("/version", "/readyz"):
                out, code = BODY, b"200 OK"
            else:
                out, code = b'{"kind":"Status","code":404}', b"404 Not Found"
            self.t.write(b"HTTP/1.1 " + code + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(out)).encode() + b"\r\n\r\n" + out)
async def main():
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(P, "127.0.0.1", int(sys.argv[1]))
    await srv.serve_forever()
uvloop.run(main())
'''


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(pid: int) -> tuple[int, int]:
    """(VmRSS in KiB, open fds) of ``pid``."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def churn(port: int, count: int) -> None:
    """Short connections, half requests that vanish, watches opened and dropped."""
    for i in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(i, "name").replace(b"HTTP/1.1", b"HTTP/1.1", 1))
        await read_response(reader)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(i, "name")[:20])
        writer.transport.abort()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /api/v1/namespaces/soak/configmaps?watch=true&x={i} HTTP/1.1\r\n"
                     "Host: 127.0.0.1\r\nAuthorization: Bearer tok-fixed\r\n\r\n".encode())
        await asyncio.sleep(0)
        writer.transport.abort()


def request(i: int, kind: str) -> bytes:
    if kind == "ns":
        path = f"/api/v1/namespaces/ns-{i}/configmaps/cm-{i}"
    elif kind == "query":
        path = f"/api/v1/namespaces/soak/configmaps?labelSelector=app%3Dx{i}&limit={i}"
    elif kind == "404":
        path = f"/random/{i}/path"
    else:  # a fresh token, a fresh name
        path = f"/api/v1/namespaces/soak/configmaps/cm-{i}"
    token = f"tok-{i}" if kind in ("token", "ns") else "tok-fixed"
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            "Accept: application/json\r\n\r\n").encode()


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    code = int(head.split(b" ", 2)[1])
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    await reader.readexactly(n)
    return code


async def drive(port: int, start: int, count: int, kinds: list[str], conns: int) -> dict[int, int]:
    codes: dict[int, int] = {}

    async def one_conn(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(start + k, start + count, conns):
            writer.write(request(i, kinds[i % len(kinds)]))
            code = await read_response(reader)
            codes[code] = codes.get(code, 0) + 1
        writer.close()

    await asyncio.gather(*(one_conn(k) for k in range(conns)))
    return codes


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--relay", default="fast", choices=["fast", "aiohttp"])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=20_000)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--kinds", default="token,ns,query,404,name")
    ap.add_argument("--churn", type=int, default=0,
                    help="then this many short connections (open, one call, close), as many "
                         "that send half a request and vanish, and as many dropped watches")
    ap.add_argument("--reloads", type=int, default=0, help="then rewrite the policy this often")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opgate-soak-"))
    (work / "policies").mkdir()
    (work / "policies" / "soak.yaml").write_text(POLICY)
    up_port, api, admin, rport = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)]))
        procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                                       "--appendonly", "no", "--bind", "127.0.0.1"],
                                      stdout=subprocess.DEVNULL))
        time.sleep(1.0)
        gate = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{api}",
             "--admin-listen", f"127.0.0.1:{admin}", "--upstream", f"http://127.0.0.1:{up_port}",
             "--policies", str(work / "policies"), "--redis-url", f"redis://127.0.0.1:{rport}",
             "--relay", args.relay, "--audit-log", str(work / "audit.log"),
             "--log-level", "warning"],
            stdout=(work / "access.log").open("wb"), stderr=(work / "opgate.err").open("wb"))
        procs.append(gate)
        time.sleep(3.0)
        kinds = args.kinds.split(",")
        asyncio.run(drive(api, 10**9, 2000, kinds, args.conns))  # warm up
        print(f"relay={args.relay} baseline rss/fds", status(gate.pid), flush=True)
        done = 0
        while done < args.calls:
            t0 = time.monotonic()
            codes = asyncio.run(drive(api, done, args.every, kinds, args.conns))
            done += args.every
            print(f"{done:>8} calls ({args.every / (time.monotonic() - t0):.0f}/s) rss KiB, fds:",
                  status(gate.pid), codes, flush=True)
        if args.churn:
            asyncio.run(churn(api, args.churn))
            time.sleep(1.0)
            print(f"after {args.churn} x 3 churned connections rss KiB, fds, threads:",
                  status(gate.pid), threads(gate.pid), flush=True)
        for n in range(args.reloads):
            (work / "policies" / "soak.yaml").write_text(
                POLICY.replace("name: soak", f"name: soak-{n}").replace(
                    "per-name", f"per-name-{n}"))
            time.sleep(0.8)
            if n % 50 == 49 or n == args.reloads - 1:
                asyncio.run(drive(api, 0, 200, kinds, 2))
                print(f"after {n + 1} reloads rss KiB, fds, threads:", status(gate.pid),
                      threads(gate.pid), flush=True)
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics").read().decode()
        series = [line for line in text.splitlines() if line and not line.startswith("#")]
        print("metrics series:", len(series), flush=True)
        print("redis dbsize:", redis_cli(rport, "DBSIZE"),
              "no ttl:", sum(1 for k in redis_cli(rport, "KEYS", "*").split()
                             if redis_cli(rport, "TTL", k) == "-1"), flush=True)
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        print("work dir:", work)


if __name__ == "__main__":
    main()
