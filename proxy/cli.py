"""The ``opgate`` command: ``serve`` the sidecar, ``check`` policy files, run the ``demo``.

``python -m proxy`` is the same command. Every ``serve`` flag can also come from an ``OPGATE_*``
environment variable named after it (``--redis-url`` ↔ ``OPGATE_REDIS_URL``); a flag given on the
command line wins over the environment, and an ``OPGATE_*`` variable opgate does not read (a
misspelt ``OPGATE_WORKER``) is warned about at start. ``serve --workers N`` (N > 1) hands over
to the supervisor in :mod:`proxy.workers`; otherwise :mod:`proxy.app` runs the sidecar in this
process.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from proxy.relay.hostguard import DEFAULT_ACCEPT_HOSTS
from proxy.settings import (
    ListenSettings,
    LogSettings,
    PolicySettings,
    RateLimitSettings,
    RuntimeSettings,
    Settings,
    UpstreamSettings,
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
LOOPS = ("auto", "asyncio", "uvloop")
RELAYS = ("fast", "aiohttp")
LOG_LEVELS = ("debug", "info", "warning", "error")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# OPGATE_* variables read elsewhere than from serve's flags: the Redis password (proxy.stores),
# the test harness's (proxy.envtest, tests/) and the benchmarks' (bench/interpreter.py)
OTHER_VARIABLES = frozenset({
    "OPGATE_REDIS_PASSWORD", "OPGATE_CACHE_DIR", "OPGATE_KEEP_CLUSTER_DIR", "OPGATE_KUBECTL",
    "OPGATE_HELM", "OPGATE_E2E_SERVE_CMD", "OPGATE_TEST_REDIS_SERVER", "OPGATE_BENCH_PYTHON"})


def _whole_number(minimum: int, *, alternative: str = "") -> Callable[[str], int]:
    """A flag's parser of whole numbers >= ``minimum`` (naming ``alternative`` words in the
    error, e.g. ``auto``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a number >= {minimum}{alternative}, got {text!r}")
        return value

    return parse


non_negative = _whole_number(0)  # a rotation flag (--audit-log-maxsize …)
positive_int = _whole_number(1)  # --replicas
_worker_number = _whole_number(1, alternative=" or auto")


def worker_count(text: str) -> int:
    """``--workers``: a positive number, or ``auto`` for one per CPU."""
    if text.strip().lower() == "auto":
        return os.cpu_count() or 1
    return _worker_number(text)


def _seconds(*, zero: bool) -> Callable[[str], float]:
    """A flag's parser of a finite number of seconds, 0 allowed (``zero``: it means none)
    or not."""
    bound = ">= 0" if zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {text!r}")
        return value

    return parse


seconds = _seconds(zero=True)  # a timeout flag where 0 means none
positive_seconds = _seconds(zero=False)  # --redis-timeout


def listen_address(text: str) -> str:
    """``--listen`` / ``--admin-listen``: ``HOST:PORT``, ``[V6]:PORT`` or ``unix:/path``."""
    from proxy.relay.listen import parse_listen

    try:
        parse_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def exposure_warning(listen: str) -> str:
    """What to warn about an API listener (``--listen``) off loopback ("" for none).

    opgate relays a call that carries no token with its own credentials (``--token-file``,
    the pod's service-account token, the kubeconfig's user), as ``kubectl proxy`` does: on the
    pod IP or ``0.0.0.0`` anyone who can reach the port calls the apiserver as opgate. Only a
    warning, since a container published on the host's loopback (docker-compose.yml) needs it.
    """
    from proxy.relay.listen import parse_listen

    address = parse_listen(listen)
    if isinstance(address, str):  # a Unix socket: its directory's permissions guard it
        return ""
    host = address[0]
    try:
        if ipaddress.ip_address(host).is_loopback:
            return ""
    except ValueError:  # a host name
        if host.lower() == "localhost":
            return ""
    return (f"--listen {listen} is not a loopback address: a call that reaches it without a "
            "token is relayed with opgate's own credentials (--token-file, the pod's token, "
            "the kubeconfig's user); keep the API port on 127.0.0.1 or unix:/path")


def accept_hosts(text: str) -> str:
    """``--accept-hosts``: comma-separated regular expressions that compile."""
    from proxy.relay.hostguard import parse_accept_hosts

    try:
        parse_accept_hosts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def redis_url(text: str) -> str:
    """``--redis-url``: a URL of a scheme opgate knows, with a host and a numeric port."""
    from proxy.stores import redis_url_problem

    problem = redis_url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A flag's parser of one of ``choices``, in any case."""
    def parse(text: str) -> str:
        name = text.strip().lower()
        if name not in choices:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(choices)}, got {text!r}")
        return name

    return parse


log_level = _choice(LOG_LEVELS)
loop_name = _choice(LOOPS)
relay_name = _choice(RELAYS)


def _var(flag: str) -> str:
    return "OPGATE_" + flag.lstrip("-").upper().replace("-", "_")


def _env(flag: str) -> str | None:
    return os.environ.get(_var(flag))


class _FromEnv(str):
    """A flag's default taken from its ``OPGATE_*`` variable: argparse converts it with the
    flag's type only when the ``serve`` command is parsed (never for ``check`` or ``--help``),
    and an error names the variable."""

    var: str

    def __new__(cls, value: str, var: str) -> _FromEnv:
        self = super().__new__(cls, value)
        self.var = var
        return self


def _env_aware(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """``kind``, but a bad value from the environment is reported as the variable's."""

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            if not isinstance(text, _FromEnv):
                raise
            detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else (
                f"not a valid {getattr(kind, '__name__', 'value')}")
            raise argparse.ArgumentTypeError(
                f"environment variable {text.var}={str(text)!r}: {detail}") from None

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


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
            owner = _commands(self).get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


class _EnvDefaults(argparse.HelpFormatter):
    """Shows each flag's environment variable in ``--help``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        long_flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if long_flags:
            var = "OPGATE_" + long_flags[0][2:].upper().replace("-", "_")
            text += f" [env {var}]"
            if action.default not in (None, False, argparse.SUPPRESS):
                text += " (default: %(default)s)"
        return text


def _add_rotation(parser: argparse._ActionsContainer, flag: str, what: str) -> None:
    """``<flag>-maxsize`` and ``<flag>-maxbackup``: size rotation as the apiserver's audit log."""
    _add(parser, f"{flag}-maxsize", kind=non_negative, default="100", metavar="MB",
         help=f"rotate the {what} before it grows past this size (0: never)")
    _add(parser, f"{flag}-maxbackup", kind=non_negative, default="5", metavar="N",
         help=f"rotated {what}s kept (0: all)")


def _add(
    parser: argparse._ActionsContainer, flag: str, *, help: str, default: object = None,
    kind: Callable[[str], Any] = str, metavar: str | None = None,
) -> None:
    env = _env(flag)
    if kind is bool:
        if env is not None and env.strip().lower() not in _TRUE | _FALSE:
            # reported by main() only when the serve command is parsed (a subparser's defaults)
            problems = parser.get_default("env_problems") or []
            parser.set_defaults(env_problems=[
                *problems, f"argument {flag}: environment variable {_var(flag)}={env!r}: "
                "expected one of 1, true, yes, on, 0, false, no, off"])
        on = env.strip().lower() in _TRUE if env is not None else bool(default)
        parser.add_argument(flag, action="store_true", default=on, help=help)
        return
    # a string default (the flag's own or the variable's) is converted by argparse, which
    # reports a bad one as a usage error; only when the serve command is parsed
    value = _FromEnv(env, _var(flag)) if env is not None else default
    parser.add_argument(flag, type=_env_aware(kind), default=value, help=help, metavar=metavar)


def unknown_variables(parser: argparse.ArgumentParser,
                      environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``OPGATE_*`` variable in ``environ`` that opgate does not read,
    naming the closest one it does (a misspelt ``OPGATE_WORKER=4`` was ignored without a word,
    where a misspelt flag is an error)."""
    known = OTHER_VARIABLES | {
        _var(option) for action in _commands(parser)["serve"]._actions
        for option in action.option_strings if option.startswith("--") and option != "--help"}
    prefix = len("OPGATE_")  # compared without it, which every name shares
    tails = {name[prefix:]: name for name in known}
    warnings = []
    for name in sorted(n for n in environ if n.startswith("OPGATE_") and n not in known):
        close = difflib.get_close_matches(name[prefix:], tails, n=1)
        hint = f"did you mean {tails[close[0]]}?" if close else "see opgate serve --help"
        warnings.append(
            f"environment variable {name} is not one opgate reads, ignored ({hint})")
    return warnings


def _commands(parser: argparse.ArgumentParser) -> Mapping[str, argparse.ArgumentParser]:
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

    serve = sub.add_parser("serve", help="run the sidecar proxy", formatter_class=_EnvDefaults,
                           description="Relay the Kubernetes API from a local listener to "
                           "kube-apiserver through the policy chain.")
    g = serve.add_argument_group("listeners")
    _add(g, "--listen", kind=listen_address, default="127.0.0.1:8001", metavar="ADDR",
         help="API listener: HOST:PORT, [V6]:PORT or unix:/path")
    _add(g, "--tls-cert", metavar="FILE",
         help="serve TLS on the API listener with this certificate (reloaded when it changes)")
    _add(g, "--tls-key", metavar="FILE", help="private key for --tls-cert")
    _add(g, "--admin-listen", kind=listen_address, default="127.0.0.1:9091", metavar="ADDR",
         help="admin listener for /metrics, /healthz, /readyz and /debug/policies")
    _add(g, "--accept-hosts", kind=accept_hosts, default=DEFAULT_ACCEPT_HOSTS,
         metavar="REGEXPS",
         help="comma-separated regular expressions of the Host names the API listener answers "
         "(others get 403: a guard against DNS rebinding, as kubectl proxy's); '.*' for any")
    g = serve.add_argument_group("upstream (kube-apiserver)")
    _add(g, "--upstream", metavar="URL",
         help="apiserver URL; default: in-cluster service and mounted CA, else the current "
         "context of --kubeconfig")
    _add(g, "--kubeconfig", metavar="FILE",
         help="kubeconfig whose current context is the upstream (default $KUBECONFIG, "
         "~/.kube/config)")
    _add(g, "--upstream-ca", metavar="FILE", help="CA bundle that signs the apiserver's cert")
    _add(g, "--upstream-insecure", kind=bool,
         help="do not verify the apiserver's certificate (testing only)")
    _add(g, "--token-file", metavar="FILE",
         help="bearer token sent upstream when the client sent none (re-read when it changes)")
    _add(g, "--connect-timeout", kind=seconds, default="5", metavar="SECONDS",
         help="time to open a connection to the apiserver")
    _add(g, "--header-timeout", kind=seconds, default="30", metavar="SECONDS",
         help="time for the apiserver to answer headers before opgate answers 504")
    _add(g, "--request-timeout", kind=seconds, default="300", metavar="SECONDS",
         help="total time of a non-long-running call (0: none); watches, exec, logs have none")
    _add(g, "--watch-idle-timeout", kind=seconds, default="0", metavar="SECONDS",
         help="end a long-running stream after this long without bytes (0: never)")
    g = serve.add_argument_group("policies and state")
    _add(g, "--policies", metavar="PATH",
         help="policy file or directory of *.yaml, watched and hot-reloaded")
    _add(g, "--redis-url", kind=redis_url, metavar="URL",
         help="Redis for rate-limit buckets and quota reservations shared by replicas "
         "(redis://, rediss:// with ?ssl_ca_certs=/path/ca.crt, unix://, redis+sentinel://, "
         "redis+cluster://); default: in-process")
    _add(g, "--redis-password-file", metavar="FILE",
         help="file holding the Redis password (a mounted Secret), when the URL has none")
    _add(g, "--redis-timeout", kind=positive_seconds, default="0.05", metavar="SECONDS",
         help="timeout of one Redis call before the rule's failure mode applies")
    _add(g, "--replicas", kind=positive_int, default="1", metavar="N",
         help="replicas sharing the budgets; with Redis down each admits qps/N locally")
    g = serve.add_argument_group("processes")
    _add(g, "--workers", kind=worker_count, default="1", metavar="N",
         help="worker processes sharing the API port (SO_REUSEPORT) under a supervisor; "
         "auto: one per CPU; more than 1 needs --redis-url and a TCP --listen")
    _add(g, "--loop", kind=loop_name, default="auto", metavar="|".join(LOOPS),
         help="event loop: auto is uvloop when it is installed, else asyncio")
    _add(g, "--relay", kind=relay_name, default="fast", metavar="|".join(RELAYS),
         help="relay core: fast (asyncio protocols + httptools) or aiohttp (client + server)")
    _add(g, "--shutdown-grace", kind=seconds, default="10", metavar="SECONDS",
         help="on SIGTERM, time the calls in flight get to finish before they are cut "
         "(watches end at once)")
    g = serve.add_argument_group("logging")
    _add(g, "--log-level", kind=log_level, default="info", metavar="|".join(LOG_LEVELS),
         help="debug, info, warning or error")
    _add(g, "--no-access-log", kind=bool, help="do not write one JSON line per request")
    _add(g, "--audit-log", metavar="PATH",
         help="write audit.k8s.io/v1 Events (one JSON line each) to this file, - for stdout; "
         "what is recorded follows the policies' spec.audit, without one every call at "
         "Metadata level (default: no audit log)")
    _add_rotation(g, "--audit-log", "audit log file")
    _add(g, "--capture", metavar="PATH",
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


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        listen=ListenSettings(listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              admin_listen=args.admin_listen, accept_hosts=args.accept_hosts),
        upstream=UpstreamSettings(
            url=args.upstream, kubeconfig=args.kubeconfig, ca_file=args.upstream_ca,
            insecure=args.upstream_insecure, token_file=args.token_file,
            connect_timeout=args.connect_timeout, header_timeout=args.header_timeout,
            request_timeout=args.request_timeout, watch_idle_timeout=args.watch_idle_timeout,
        ),
        policies=PolicySettings(paths=(args.policies,) if args.policies else ()),
        ratelimit=RateLimitSettings(redis_url=args.redis_url, redis_timeout=args.redis_timeout,
                                    replicas=args.replicas,
                                    redis_password_file=args.redis_password_file),
        log=LogSettings(level=args.log_level, access_log=not args.no_access_log,
                        audit_log=args.audit_log or None,
                        audit_log_maxsize=args.audit_log_maxsize,
                        audit_log_maxbackup=args.audit_log_maxbackup,
                        capture=args.capture or None, capture_maxsize=args.capture_maxsize,
                        capture_maxbackup=args.capture_maxbackup),
        runtime=RuntimeSettings(workers=args.workers, loop=args.loop, relay=args.relay,
                                shutdown_grace=args.shutdown_grace),
    )


def main(argv: Sequence[str] | None = None) -> int:
    if (sys.argv[1:2] if argv is None else list(argv[:1])) == ["serve"]:
        # a SIGHUP reloads the policies once serving (proxy/app.py); until then the files are
        # about to be read anyway, and it must not end the process (its default): from the
        # start, as reading the arguments alone takes a good part of it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if argv is None:  # the process's own command line (not a test's call)
            # SIGTERM/SIGINT wait (pending) until serving handles them (proxy.workers.
            # release_stop_signals): as a container's PID 1 one met with no handler is dropped
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and getattr(args, "env_problems", None):
        print(f"opgate serve: error: {args.env_problems[0]} (see opgate serve --help)",
              file=sys.stderr)
        return 2
    if args.command == "serve":
        for warning in unknown_variables(parser, os.environ):
            print(f"opgate: warning: {warning}", file=sys.stderr)
    if args.command == "check":
        from proxy.app import check_paths

        return check_paths(args.paths)
    if args.command == "demo":
        from proxy.demo import run_demo

        return run_demo(policies=args.policies, widgets=args.widgets, duration=args.duration)
    if bool(args.tls_cert) != bool(args.tls_key):
        print("opgate: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.tls_cert:
        from proxy.relay.listen import TLSFilesError, server_tls_context

        try:
            server_tls_context(args.tls_cert, args.tls_key)
        except TLSFilesError as exc:
            print(f"opgate: {exc}", file=sys.stderr)
            return 2
    settings = settings_from(args)
    warning = exposure_warning(settings.listen.listen)
    if warning:
        print(f"opgate: warning: {warning}", file=sys.stderr)
    if settings.log.capture:
        from proxy.capture import MitmproxyMissing, load_mitmproxy

        try:
            load_mitmproxy()
        except MitmproxyMissing as exc:
            print(f"opgate: {exc}", file=sys.stderr)
            return 2
    if settings.runtime.workers > 1:
        from proxy.workers import refusal, supervise

        problem = refusal(settings)
        if problem:
            print(f"opgate: {problem}", file=sys.stderr)
            return 2
        return supervise(settings)
    from proxy.app import serve

    return serve(settings)


if __name__ == "__main__":
    raise SystemExit(main())
