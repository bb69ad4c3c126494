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
import ipaddress
import os
import signal
import sys
from collections.abc import Sequence

from proxy.cli_env import unknown_variables
from proxy.cli_parser import build_parser, commands
from proxy.settings import (
    ListenSettings,
    LogSettings,
    PolicySettings,
    RateLimitSettings,
    RuntimeSettings,
    Settings,
    UpstreamSettings,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        for warning in unknown_variables(commands(parser)["serve"], os.environ):
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
