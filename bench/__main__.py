"""``python -m bench``: run the benchmark suite and write ``bench/results/REPORT.md`` + JSON.

Benchmarks are not tests (pytest never collects them): they take minutes, need nginx, wrk,
redis-server and kubectl, and their numbers are to be read, not asserted. ``make bench``
installs what is missing (``scripts/bootstrap.sh --bench``) and runs this.
"""

from __future__ import annotations

import argparse
import datetime as dt
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from bench import interpreter, report
from bench.paths import AIOHTTP, NAMES
from bench.plan import MEASURES, Plan
from bench.procstat import machine
from bench.run import run

RESULTS = Path(__file__).parent / "results"
NEEDED = ("nginx", "wrk", "curl", "redis-server", "taskset")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="one round, short durations: a smoke run of a few minutes")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only these measures (repeat or comma-separate): "
                   f"{', '.join(MEASURES)}")
    p.add_argument("--no-apiserver", action="store_true",
                   help="skip the real etcd + kube-apiserver tier")
    p.add_argument("--profile", action="store_true",
                   help="also sample opgate with py-spy under the small-GET load (TLS, full "
                   "chain) and list its top functions in the report")
    p.add_argument("--with-aiohttp", action="store_true",
                   help="also measure opgate-aiohttp: the full chain on --relay aiohttp, next "
                   "to opgate-full on the default relay")
    p.add_argument("--out", type=Path, default=RESULTS, metavar="DIR",
                   help="where REPORT.md and latest.json go (default: bench/results)")
    return p


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: each process is stopped by PID


def _kubectl_version() -> str:
    try:
        from proxy.envtest.tools import find_tools

        out = subprocess.run([str(find_tools(log=False).kubectl), "version", "--client"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split("\n")[0].split(":")[-1].strip() or "?"
    except Exception:
        return "?"


def _default_relay() -> str:
    """The relay ``opgate serve`` uses when ``--relay`` is not given (its CLI default)."""
    try:
        from proxy.cli_parser import build_parser

        return str(getattr(build_parser().parse_args(["serve"]), "relay", "aiohttp"))
    except (Exception, SystemExit):
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    only = tuple(n.strip() for item in args.only for n in item.split(",") if n.strip())
    unknown = [n for n in only if n not in MEASURES]
    if unknown:
        print(f"bench: unknown measure {', '.join(unknown)} (known: {', '.join(MEASURES)})",
              file=sys.stderr)
        return 2
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        print(f"bench: missing {', '.join(missing)}; run `bash scripts/bootstrap.sh --bench`",
              file=sys.stderr)
        return 2
    plan = Plan.quick_plan() if args.quick else Plan.full_plan()
    fields = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    if only:
        fields["measures"] = only
    if args.with_aiohttp:
        fields["paths"] = (*NAMES, AIOHTTP)
    plan = Plan(**fields)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 20000)), hard))
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    started = dt.datetime.now(dt.UTC)
    try:
        results = run(plan, apiserver=not args.no_apiserver, profile=args.profile)
    except KeyboardInterrupt:
        print("bench: interrupted; every process it started has been stopped", file=sys.stderr)
        return 130
    results.update(
        date=started.strftime("%Y-%m-%d %H:%M UTC"), mode="quick" if args.quick else "full",
        measures=list(plan.measures), machine={**machine(), "opgate_relay": _default_relay(),
                 "opgate_python": interpreter.describe()},
        kubectl_version=_kubectl_version(),
        plan={f: getattr(plan, f) for f in plan.__dataclass_fields__})
    text = report.write(results, args.out)
    print(text)
    print(f"bench: wrote {args.out / 'REPORT.md'} and {args.out / 'latest.json'}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
