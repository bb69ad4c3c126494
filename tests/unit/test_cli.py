"""The command line: every serve flag has an OPGATE_* twin, and --help says so."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest

from proxy.cli import main, settings_from
from proxy.cli_parser import build_parser

SERVE_FLAGS = [
    "--listen", "--tls-cert", "--tls-key", "--admin-listen", "--upstream", "--kubeconfig",
    "--upstream-ca", "--upstream-insecure", "--token-file", "--policies", "--redis-url",
    "--connect-timeout", "--header-timeout", "--request-timeout", "--watch-idle-timeout",
    "--redis-timeout", "--redis-password-file", "--replicas", "--log-level", "--no-access-log",
    "--workers", "--loop", "--relay", "--audit-log", "--audit-log-maxsize",
    "--audit-log-maxbackup",
]


def test_defaults_are_secure() -> None:
    s = settings_from(build_parser().parse_args(["serve"]))
    assert s.listen.listen == "127.0.0.1:8001"
    assert s.listen.admin_listen == "127.0.0.1:9091"
    assert s.upstream.insecure is False
    assert s.ratelimit.redis_url is None
    assert s.log.access_log is True
    assert (s.log.audit_log, s.log.audit_log_maxsize, s.log.audit_log_maxbackup) == (None, 100, 5)


@pytest.mark.parametrize(("var", "value", "read"), [
    ("OPGATE_LISTEN", "unix:/tmp/x.sock", lambda s: s.listen.listen),
    ("OPGATE_ADMIN_LISTEN", "127.0.0.1:9999", lambda s: s.listen.admin_listen),
    ("OPGATE_UPSTREAM", "https://127.0.0.1:6443", lambda s: s.upstream.url),
    ("OPGATE_UPSTREAM_INSECURE", "true", lambda s: s.upstream.insecure),
    ("OPGATE_REDIS_URL", "redis://127.0.0.1:6379/0", lambda s: s.ratelimit.redis_url),
    ("OPGATE_HEADER_TIMEOUT", "2.5", lambda s: s.upstream.header_timeout),
    ("OPGATE_REPLICAS", "3", lambda s: s.ratelimit.replicas),
    ("OPGATE_POLICIES", "/etc/opgate", lambda s: s.policies.paths),
    ("OPGATE_NO_ACCESS_LOG", "1", lambda s: not s.log.access_log),
    ("OPGATE_WORKERS", "3", lambda s: s.runtime.workers),
    ("OPGATE_LOOP", "asyncio", lambda s: s.runtime.loop),
    ("OPGATE_RELAY", "aiohttp", lambda s: s.runtime.relay),
    ("OPGATE_AUDIT_LOG", "/var/log/opgate/audit.log", lambda s: s.log.audit_log),
    ("OPGATE_AUDIT_LOG_MAXSIZE", "3", lambda s: s.log.audit_log_maxsize),
    ("OPGATE_AUDIT_LOG_MAXBACKUP", "3", lambda s: s.log.audit_log_maxbackup),
])
def test_environment_variables(monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                               read: object) -> None:
    monkeypatch.setenv(var, value)
    s = settings_from(build_parser().parse_args(["serve"]))
    got = read(s)  # type: ignore[operator]
    expected: object = value
    if var == "OPGATE_UPSTREAM_INSECURE" or var == "OPGATE_NO_ACCESS_LOG":
        expected = True
    elif var == "OPGATE_HEADER_TIMEOUT":
        expected = 2.5
    elif var in ("OPGATE_REPLICAS", "OPGATE_WORKERS", "OPGATE_AUDIT_LOG_MAXSIZE",
                 "OPGATE_AUDIT_LOG_MAXBACKUP"):
        expected = 3
    elif var == "OPGATE_POLICIES":
        expected = (value,)
    assert got == expected


def test_one_worker_on_the_best_loop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPGATE_WORKERS", raising=False)
    monkeypatch.delenv("OPGATE_LOOP", raising=False)
    monkeypatch.delenv("OPGATE_RELAY", raising=False)
    s = settings_from(build_parser().parse_args(["serve"]))
    assert (s.runtime.workers, s.runtime.loop, s.runtime.relay) == (1, "auto", "fast")


def test_workers_auto_is_one_per_cpu() -> None:
    s = settings_from(build_parser().parse_args(["serve", "--workers", "auto"]))
    assert s.runtime.workers == (os.cpu_count() or 1)


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--workers", "many"], ["--loop", "trio"],
                                  ["--relay", "nginx"]])
def test_bad_process_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2


def test_flag_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPGATE_LISTEN", "127.0.0.1:1")
    s = settings_from(build_parser().parse_args(["serve", "--listen", "127.0.0.1:2"]))
    assert s.listen.listen == "127.0.0.1:2"


def test_help_lists_every_flag_with_its_variable() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    for flag in SERVE_FLAGS:
        assert flag in out
        assert "OPGATE_" + flag[2:].upper().replace("-", "_") in flat


def test_help_names_the_redis_password_variable() -> None:
    """OPGATE_REDIS_PASSWORD is read (proxy.stores) but is no flag's twin: --help must say so
    where the password file is, or it is found only in the code."""
    out = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    start = flat.index("--redis-password-file FILE file")  # its entry, not the usage line
    entry = flat[start:flat.index("--redis-timeout SECONDS", start)]
    assert re.search(r"OPGATE_REDIS_PASSWORD(?!_FILE)", entry), entry


def test_top_level_help_names_the_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for command in ("serve", "check", "demo"):
        assert command in out


@pytest.mark.parametrize(("command", "ignored"), [("serve", True), ("check", False)])
def test_serve_ignores_sighup_before_it_reads_its_arguments(
        monkeypatch: pytest.MonkeyPatch, command: str, ignored: bool) -> None:
    """SIGHUP never stops ``opgate serve`` (README): reading the arguments takes a good part of
    the start (~150 ms of argparse alone), and a SIGHUP then ended the process (its default
    until the SIG_IGN that came after them). ``opgate check`` keeps the default."""
    from proxy import cli

    seen: list[object] = []

    def parser() -> Any:
        seen.append(signal.getsignal(signal.SIGHUP))
        raise SystemExit(0)  # (the arguments are not what this is about)

    monkeypatch.setattr(cli, "build_parser", parser)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit):
            cli.main([command])
    finally:
        signal.signal(signal.SIGHUP, before)
    assert seen == [signal.SIG_IGN if ignored else signal.SIG_DFL]


@pytest.mark.parametrize(("listen", "warned"), [
    ("0.0.0.0:8001", True), ("[::]:8001", True), ("10.1.2.3:8001", True),
    ("opgate.example:8001", True), ("127.0.0.1:8001", False), ("127.0.0.53:8001", False),
    ("[::1]:8001", False), ("localhost:8001", False), ("unix:/run/opgate/api.sock", False),
])
def test_an_api_listener_off_loopback_is_warned_about(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], listen: str,
        warned: bool) -> None:
    """Calls that come without a token are relayed with opgate's own credentials (the pod's
    token, the kubeconfig's user): on the pod IP, anyone who reaches the port has them. The
    chart refuses it; the command said nothing."""
    import proxy.app

    monkeypatch.setattr(proxy.app, "serve", lambda settings: 0)
    assert main(["serve", "--listen", listen]) == 0
    err = capsys.readouterr().err
    assert ("is not a loopback address" in err) is warned, err
    if warned:
        assert len(err.strip().splitlines()) == 1
        assert err.startswith(f"opgate: warning: --listen {listen} ")


def test_version_names_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"opgate {version('opgate')}\n"


def test_every_variable_read_in_the_tree_is_known_to_the_warning() -> None:
    """``opgate serve`` warns about an ``OPGATE_*`` variable it does not read: one read with
    ``os.environ`` anywhere (the Redis password, the test harness, the benchmarks; by its
    literal name, or the tools' names) must not be warned about, so a new one must join
    ``proxy.cli_env.OTHER_VARIABLES`` (or be a flag's)."""
    import re
    from pathlib import Path

    from proxy.cli_env import unknown_variables
    from proxy.cli_parser import commands
    from proxy.envtest.tools import _MEMBERS

    root = Path(__file__).resolve().parents[2]
    read = re.compile(r"""(?:environ(?:\.get)?[(\[]|getenv\()\s*["'](OPGATE_[A-Z0-9_]+)""")
    names = {name for folder in ("proxy", "tests", "bench", "examples")
             for path in (root / folder).rglob("*.py")
             for name in read.findall(path.read_text())}
    assert "OPGATE_REDIS_PASSWORD" in names  # (the pattern finds them)
    names |= {f"OPGATE_{name.upper()}" for name in _MEMBERS}  # OPGATE_KUBECTL, OPGATE_HELM
    env = dict.fromkeys(names, "x")
    assert unknown_variables(commands(build_parser())["serve"], env) == []
