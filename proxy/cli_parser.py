"""``opgate``'s parsers: the commands and the table of ``serve``'s flags.

Every ``serve`` flag is declared with :func:`proxy.cli_env.add_flag` (its ``OPGATE_*`` twin) and
a value parser of :mod:`proxy.cli_values`; usage errors are one line naming the command and the
flag, not argparse's usage block.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import NoReturn

from proxy.cli_env import EnvDefaults, add_flag
from proxy.cli_values import (
    LOG_LEVELS,
    LOOPS,
    RELAYS,
    accept_hosts,
    listen_address,
    log_level,
    loop_name,
    non_negative,
    positive_int,
    positive_seconds,
    redis_url,
    relay_name,
    seconds,
    worker_count,
)
from proxy.relay.hostguard import DEFAULT_ACCEPT_HOSTS

__all__ = ["build_parser", "commands"]


class _Parser(argparse.ArgumentParser):
    """A command's parser whose usage errors are one line (the flag and what is wrong), not
    the usage block of every flag."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _TopParser(_Parser):
    """``opgate`` itself. argparse reports arguments no parser took at the top level, so a
    misspelt ``serve`` flag read ``opgate: error: unrecognized arguments``; here the command
    they were given to says it (``opgate serve: error: ...``)."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = commands(self).get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _add_rotation(parser: argparse._ActionsContainer, flag: str, what: str) -> None:
    """``<flag>-maxsize`` and ``<flag>-maxbackup``: size rotation as the apiserver's audit log."""
    add_flag(parser, f"{flag}-maxsize", kind=non_negative, default="100", metavar="MB",
             help=f"rotate the {what} before it grows past this size (0: never)")
    add_flag(parser, f"{flag}-maxbackup", kind=non_negative, default="5", metavar="N",
             help=f"rotated {what}s kept (0: all)")


def commands(parser: argparse.ArgumentParser) -> Mapping[str, argparse.ArgumentParser]:
    """The parsers of ``opgate``'s commands, by name."""
    return next((a.choices for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("opgate")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(
        prog="opgate",
        description="A sidecar reverse proxy for Kubernetes operators: every API call from the "
        "controller to kube-apiserver passes through identity, rate-limit, quota and audit "
        "policies read from hot-reloaded YAML files.",
    )
    parser.add_argument("--version", action="version", version=f"opgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the sidecar proxy", formatter_class=EnvDefaults,
                           description="Relay the Kubernetes API from a local listener to "
                           "kube-apiserver through the policy chain.")
    g = serve.add_argument_group("listeners")
    add_flag(g, "--listen", kind=listen_address, default="127.0.0.1:8001", metavar="ADDR",
             help="API listener: HOST:PORT, [V6]:PORT or unix:/path")
    add_flag(g, "--tls-cert", metavar="FILE",
             help="serve TLS on the API listener with this certificate (reloaded when it changes)")
    add_flag(g, "--tls-key", metavar="FILE", help="private key for --tls-cert")
    add_flag(g, "--admin-listen", kind=listen_address, default="127.0.0.1:9091", metavar="ADDR",
             help="admin listener for /metrics, /healthz, /readyz and /debug/policies")
    add_flag(g, "--accept-hosts", kind=accept_hosts, default=DEFAULT_ACCEPT_HOSTS,
             metavar="REGEXPS",
             help="comma-separated regular expressions of the Host names the API listener answers "
             "(others get 403: a guard against DNS rebinding, as kubectl proxy's); '.*' for any")
    g = serve.add_argument_group("upstream (kube-apiserver)")
    add_flag(g, "--upstream", metavar="URL",
             help="apiserver URL; default: in-cluster service and mounted CA, else the current "
             "context of --kubeconfig")
    add_flag(g, "--kubeconfig", metavar="FILE",
             help="kubeconfig whose current context is the upstream (default $KUBECONFIG, "
             "~/.kube/config)")
    add_flag(g, "--upstream-ca", metavar="FILE", help="CA bundle that signs the apiserver's cert")
    add_flag(g, "--upstream-insecure", kind=bool,
             help="do not verify the apiserver's certificate (testing only)")
    add_flag(g, "--token-file", metavar="FILE",
             help="bearer token sent upstream when the client sent none (re-read when it changes)")
    add_flag(g, "--connect-timeout", kind=seconds, default="5", metavar="SECONDS",
             help="time to open a connection to the apiserver")
    add_flag(g, "--header-timeout", kind=seconds, default="30", metavar="SECONDS",
             help="time for the apiserver to answer headers before opgate answers 504")
    add_flag(g, "--request-timeout", kind=seconds, default="300", metavar="SECONDS",
             help="total time of a non-long-running call (0: none); watches, exec, logs have none")
    add_flag(g, "--watch-idle-timeout", kind=seconds, default="0", metavar="SECONDS",
             help="end a long-running stream after this long without bytes (0: never)")
    g = serve.add_argument_group("policies and state")
    add_flag(g, "--policies", metavar="PATH",
             help="policy file or directory of *.yaml, watched and hot-reloaded")
    add_flag(g, "--redis-url", kind=redis_url, metavar="URL",
             help="Redis for rate-limit buckets and quota reservations shared by replicas "
             "(redis://, rediss:// with ?ssl_ca_certs=/path/ca.crt, unix://, redis+sentinel://, "
             "redis+cluster://); default: in-process")
    add_flag(g, "--redis-password-file", metavar="FILE",
             help="file holding the Redis password (a mounted Secret), when the URL has none; "
             "without it, the password is $OPGATE_REDIS_PASSWORD (no flag: it would show in "
             "the process's arguments)")
    add_flag(g, "--redis-timeout", kind=positive_seconds, default="0.05", metavar="SECONDS",
             help="timeout of one Redis call before the rule's failure mode applies")
    add_flag(g, "--replicas", kind=positive_int, default="1", metavar="N",
             help="replicas sharing the budgets; with Redis down each admits qps/N locally")
    g = serve.add_argument_group("processes")
    add_flag(g, "--workers", kind=worker_count, default="1", metavar="N",
             help="worker processes sharing the API port (SO_REUSEPORT) under a supervisor; "
             "auto: one per CPU; more than 1 needs --redis-url and a TCP --listen")
    add_flag(g, "--loop", kind=loop_name, default="auto", metavar="|".join(LOOPS),
             help="event loop: auto is uvloop when it is installed, else asyncio")
    add_flag(g, "--relay", kind=relay_name, default="fast", metavar="|".join(RELAYS),
             help="relay core: fast (asyncio protocols + httptools) or aiohttp (client + server)")
    add_flag(g, "--shutdown-grace", kind=seconds, default="10", metavar="SECONDS",
             help="on SIGTERM, time the calls in flight get to finish before they are cut "
             "(watches end at once)")
    g = serve.add_argument_group("logging")
    add_flag(g, "--log-level", kind=log_level, default="info", metavar="|".join(LOG_LEVELS),
             help="debug, info, warning or error")
    add_flag(g, "--no-access-log", kind=bool, help="do not write one JSON line per request")
    add_flag(g, "--audit-log", metavar="PATH",
             help="write audit.k8s.io/v1 Events (one JSON line each) to this file, - for stdout; "
             "what is recorded follows the policies' spec.audit, without one every call at "
             "Metadata level (default: no audit log)")
    _add_rotation(g, "--audit-log", "audit log file")
    add_flag(g, "--capture", metavar="PATH",
             help="traffic capture: write the calls the policies' spec.capture selects (without "
             "one: every call) as mitmproxy flows to this file (read it with mitmproxy -r, "
             "mitmweb -r, mitmdump -r); tokens are redacted, Secret bodies left out; needs "
             "mitmproxy (pip install 'opgate[capture]') (default: no capture)")
    _add_rotation(g, "--capture", "capture file")

    check = sub.add_parser("check", help="validate policy files offline",
                           description="Validate policy files; print file:line: message per "
                           "error; exit 0 when valid, 1 otherwise.")
    check.add_argument("paths", nargs="+", metavar="PATH", help="policy file or directory")

    demo = sub.add_parser("demo", help="run the demo: a real apiserver, opgate, a sample operator",
                          description="Start etcd + kube-apiserver, Redis when available, "
                          "opgate with policies/ and the sample reconciler; Ctrl-C stops all.")
    demo.add_argument("--policies", default="policies/demo", metavar="PATH",  # DEFAULT_POLICIES
                      help="policies to serve (edit them while the demo runs)")
    demo.add_argument("--widgets", type=non_negative, default=5, help="widgets to create")
    demo.add_argument("--duration", type=seconds, default=0.0,
                      help="stop by itself after this many seconds (0: run until Ctrl-C)")
    return parser
