"""What a core woken from idle costs on this machine: the two effects behind the added latency
at an operator's pace (50 req/s, a call every 20 ms).

A proxy on a core of its own takes each call across cores four times (client → proxy →
upstream → proxy → client), while the direct path stays on one core (the load generator and the
upstream share it on 2 cores, :class:`bench.procstat.Layout`). On a VM two things then cost more
than the proxy's own work does on a busy core:

* **waking a core**: a ``send()`` that makes a process runnable on an idle core pays for the
  wake-up (on a VM an inter-processor interrupt is a trip through the hypervisor) inside the
  sender's system call;
* **a core woken from idle runs slowly for a while**: the same Python code right after 20 ms of
  idle takes longer than back to back (clock ramp-up on the host, caches and branch predictors
  refilled), and a proxy's per-call code is then slower by that factor.

:func:`probe` measures both with two processes pinned as the bench pins its client and proxy:
a sender that sends one byte and waits for the answer, and a receiver that runs a fixed piece of
Python (:func:`_work`) when the byte arrives and answers with how long it took; once with 20 ms
between calls and once back to back. ``python -m bench.wakeup`` prints it for this machine.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

GAP = 0.02  # seconds between calls at 50 req/s
CALLS = 200
_STAMP = struct.Struct("!q")


def _work() -> int:
    """A fixed piece of interpreter work of about the size of a relayed call's (dicts, bytes,
    small objects; ~50 µs on a busy core here)."""
    seen: dict[bytes, tuple[int, str]] = {}
    for i in range(100):
        seen[b"h%d" % i] = (i, str(i))
    return sum(len(v[1]) for v in seen.values())


def _serve(port: int, cpu: int) -> None:
    """The receiver: pinned to ``cpu``; per byte received, :func:`_work` timed, then the ns."""
    os.sched_setaffinity(0, {cpu})
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while s.recv(1):
            started = time.perf_counter_ns()
            _work()
            s.sendall(_STAMP.pack(time.perf_counter_ns() - started))


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = s.recv(n - len(data))
        if not more:
            raise ConnectionError("the receiver ended")
        data += more
    return data


def probe(sender: int, receiver: int, *, calls: int = CALLS, gap: float = GAP) -> dict[str, Any]:
    """Medians of the sender's ``send()`` (µs) and of the receiver's work (µs), with ``gap``
    seconds between calls and back to back, with the sender pinned to core ``sender`` and the
    receiver to core ``receiver``."""
    before = os.sched_getaffinity(0)
    listener = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.wakeup", "--serve",
         str(listener.getsockname()[1]), str(receiver)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        os.sched_setaffinity(0, {sender})
        out: dict[str, Any] = {"sender_cpu": sender, "receiver_cpu": receiver,
                               "gap_ms": gap * 1e3, "calls": calls}
        for label, pause in (("idle", gap), ("busy", 0.0)):
            sends: list[float] = []
            work: list[float] = []
            for i in range(calls + 20):  # the first 20: warm-up
                if pause:
                    time.sleep(pause)
                started = time.perf_counter_ns()
                conn.send(b"x")
                sent = time.perf_counter_ns()
                (work_ns,) = _STAMP.unpack(_recv_exactly(conn, _STAMP.size))
                if i >= 20:
                    sends.append((sent - started) / 1e3)
                    work.append(work_ns / 1e3)
            out[f"send_us_{label}"] = round(statistics.median(sends), 1)
            out[f"work_us_{label}"] = round(statistics.median(work), 1)
        out["slowdown"] = round(out["work_us_idle"] / out["work_us_busy"], 2)
        conn.close()
        return out
    finally:
        os.sched_setaffinity(0, before)
        listener.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def describe(p: dict[str, Any]) -> str:
    return (f"a send() that wakes a core idle for {p['gap_ms']:.0f} ms took "
            f"{p['send_us_idle']:.0f} µs (back to back: {p['send_us_busy']:.0f} µs); the same "
            f"Python ran {p['slowdown']:.1f}x slower right after the idle "
            f"({p['work_us_idle']:.0f} µs against {p['work_us_busy']:.0f} µs back to back)")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]), int(sys.argv[3]))
        return
    cpus = sorted(os.sched_getaffinity(0))
    sender, receiver = cpus[0], cpus[1 % len(cpus)]
    result = probe(sender, receiver)
    print(f"cpu {sender} → cpu {receiver}: {describe(result)}")


if __name__ == "__main__":
    main()
