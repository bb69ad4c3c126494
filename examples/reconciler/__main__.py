"""``python -m examples.reconciler``: parse flags, set up logging and signals, run the controller.

Exits 0 after SIGINT/SIGTERM once in-flight reconciles are done; 2 on a bad kubeconfig.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
if __name__ == "__main__":
    # held (pending) through the imports and start until the event loop handles them: as a
    # container's PID 1 a signal met with no handler is dropped (the pod hangs in Terminating)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

from .config import ConfigError, load_kubeconfig  # noqa: E402
from .controller import Controller  # noqa: E402
from .kube import KubeClient  # noqa: E402

log = logging.getLogger("reconciler")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class PlainFormatter(logging.Formatter):
    """``<time> <LEVEL> <msg> key=value ...`` (values with spaces are quoted)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None) or {}
        extra = " ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) and ' ' in v else v}"
            for k, v in fields.items())
        if not extra:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback after the fields
        return f"{head} {extra}{sep}{tail}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.reconciler",
        description="Sample Widget operator: one ConfigMap per Widget, meant to run behind opgate.")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig path (default: $KUBECONFIG, then ~/.kube/config)")
    parser.add_argument("--context", default=None, help="kubeconfig context to use")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", default=None, help="watch only this namespace")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default)")
    parser.add_argument("--workers", type=int, default=4, help="concurrent reconciles (4)")
    parser.add_argument("--resync", type=float, default=0.0,
                        help="re-reconcile every cached Widget every N seconds (0: never)")
    parser.add_argument("--log-format", choices=("plain", "json"), default="plain")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser.parse_args(argv)


def setup_logging(*, fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one that came meanwhile: now
    try:
        config = load_kubeconfig(args.kubeconfig, context=args.context)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    namespace = None if args.all_namespaces else args.namespace
    log.info("starting: server=%s namespace=%s workers=%d",
             config.server, namespace or "*", args.workers)
    async with KubeClient(config) as client:
        controller = Controller(client, namespace=namespace, workers=max(1, args.workers),
                                resync_seconds=args.resync)
        await controller.run(stop)
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(fmt=args.log_format, level=args.log_level)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
