"""Bad input on the command line or in ``OPGATE_*`` variables: one line naming the flag (or the
variable) and what is wrong, exit code 2, never a traceback; and the smaller start-up items
(log noise, ``*_created`` series, the demo's paths, the workers' temporary directory)."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.cli_parser import build_parser
from proxy.relay.upstream import UpstreamConfigError, resolve_upstream
from proxy.settings import RateLimitSettings, RuntimeSettings, Settings

ROOT = Path(__file__).resolve().parents[2]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, not the usage block of every flag
    return lines[0]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--header-timeout", "-5"], "--header-timeout"),
    (["--request-timeout", "-1"], "--request-timeout"),
    (["--connect-timeout", "-1"], "--connect-timeout"),
    (["--watch-idle-timeout", "-0.5"], "--watch-idle-timeout"),
    (["--header-timeout", "nan"], "--header-timeout"),
    (["--request-timeout", "inf"], "--request-timeout"),
    (["--redis-timeout", "0"], "--redis-timeout"),
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "-2"], "--replicas"),
    (["--workers", "-1"], "--workers"),
    (["--audit-log-maxsize", "-1"], "--audit-log-maxsize"),
    (["--audit-log-maxbackup", "-1"], "--audit-log-maxbackup"),
    (["--capture-maxsize", "-1"], "--capture-maxsize"),
    (["--capture-maxbackup", "-3"], "--capture-maxbackup"),
    (["--log-level", "loud"], "--log-level"),
    (["--listen", "notanaddr"], "--listen"),
    (["--listen", "127.0.0.1:99999"], "--listen"),
    (["--admin-listen", "notanaddr"], "--admin-listen"),
    (["--admin-listen", "127.0.0.1:99999"], "--admin-listen"),
    (["--listen", "unix:"], "--listen"),
    (["--redis-url", "http://x"], "--redis-url"),
    (["--redis-url", "redis://127.0.0.1:notaport/0"], "--redis-url"),
    (["--redis-url", "redis://127.0.0.1:6379/zero"], "--redis-url"),
    (["--redis-url", "redis+sentinel://h:26379"], "--redis-url"),
])
def test_bad_flag_values_are_one_line_usage_errors(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["serve", *argv], capsys)
    assert line.startswith("opgate serve: error: ")
    assert f"argument {flag}" in line


@pytest.mark.parametrize(("argv", "prog", "says"), [
    (["serve", "--polices", "/etc/opgate"], "opgate serve", "unrecognized arguments: --polices"),
    (["serve", "extra"], "opgate serve", "unrecognized arguments: extra"),
    (["check", "p.yaml", "--strict"], "opgate check", "unrecognized arguments: --strict"),
    (["serv"], "opgate", "invalid choice: 'serv'"),
    ([], "opgate", "required: COMMAND"),
])
def test_unknown_flags_and_commands_are_one_line_usage_errors(
        argv: list[str], prog: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt flag was reported by the top-level parser: its usage block, then ``opgate:
    error: unrecognized arguments``, not naming the command whose flags were meant."""
    line = _usage_error(argv, capsys)
    assert line.startswith(f"{prog}: error: "), line
    assert says in line
    assert line.endswith(f"(see {prog} --help)")


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "rediss://:pw@redis.example:6380/1?ssl_ca_certs=/x/ca.crt",
    "unix:///run/redis.sock", "redis+cluster://10.0.0.1:7000",
    "redis+sentinel://:pw@s1:26379,s2:26379/mymaster/0", "redis://[::1]:6379/0",
])
def test_good_redis_urls_are_accepted(url: str) -> None:
    assert build_parser().parse_args(["serve", "--redis-url", url]).redis_url == url


def test_log_level_is_a_choice_in_any_case() -> None:
    assert build_parser().parse_args(["serve", "--log-level", "DEBUG"]).log_level == "debug"
    assert build_parser().parse_args(["serve"]).log_level == "info"


@pytest.mark.parametrize(("var", "value"), [
    ("OPGATE_HEADER_TIMEOUT", "30s"),
    ("OPGATE_REPLICAS", "two"),
    ("OPGATE_REDIS_TIMEOUT", "-1"),
    ("OPGATE_AUDIT_LOG_MAXSIZE", "-1"),
    ("OPGATE_LISTEN", "notanaddr"),
    ("OPGATE_LOG_LEVEL", "verbose"),
    ("OPGATE_REDIS_URL", "http://x"),
])
def test_bad_environment_value_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], var: str,
        value: str) -> None:
    monkeypatch.setenv(var, value)
    line = _usage_error(["serve"], capsys)
    assert f"environment variable {var}={value!r}" in line


def test_a_bad_redis_url_from_the_environment_hides_its_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's way to keep a Sentinel's password out of the pod's args is
    OPGATE_REDIS_URL from a Secret: a typo in it printed the whole URL, password included."""
    monkeypatch.setenv("OPGATE_REDIS_URL",
                       "redis+sentinel://:hunter2@s1:26379?sentinel_password=hunter3")
    line = _usage_error(["serve"], capsys)
    assert "environment variable OPGATE_REDIS_URL=" in line
    assert "hunter2" not in line and "hunter3" not in line, line


def test_bad_boolean_environment_value_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPGATE_UPSTREAM_INSECURE", "maybe")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "OPGATE_UPSTREAM_INSECURE='maybe'" in err


def test_a_flag_overrides_a_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPGATE_HEADER_TIMEOUT", "30s")
    args = build_parser().parse_args(["serve", "--header-timeout", "5"])
    assert args.header_timeout == 5.0


def _opgate(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "proxy", *argv], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_bad_serve_variable_does_not_break_other_commands() -> None:
    """``OPGATE_REPLICAS=two opgate check …`` crashed with a ValueError traceback."""
    done = _opgate("check", "policies/demo", env={"OPGATE_REPLICAS": "two"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    done = _opgate("serve", "--help", env={"OPGATE_HEADER_TIMEOUT": "30s"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_serve_with_a_bad_variable_is_one_line() -> None:
    done = _opgate("serve", env={"OPGATE_HEADER_TIMEOUT": "30s"})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "OPGATE_HEADER_TIMEOUT" in done.stderr


def test_help_names_every_redis_scheme() -> None:
    out = _opgate("serve", "--help", env={}).stdout
    flat = "".join(out.split())
    for scheme in ("redis://", "rediss://", "redis+sentinel://", "redis+cluster://"):
        assert scheme in flat


def test_missing_upstream_ca_names_the_real_flag(tmp_path: Path) -> None:
    with pytest.raises(UpstreamConfigError) as err:
        resolve_upstream(url="https://127.0.0.1:6443", ca_file=str(tmp_path / "nope.crt"))
    assert "--upstream-ca" in str(err.value)
    assert "--ca-file" not in str(err.value)


def test_workers_without_a_writable_temporary_directory(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """A read-only root filesystem: one line, not a FileNotFoundError traceback."""
    from proxy.workers import supervise

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "read-only" / "tmp"))
    settings = Settings(runtime=RuntimeSettings(workers=2),
                        ratelimit=RateLimitSettings(redis_url="redis://127.0.0.1:1/0"))
    assert supervise(settings) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--workers 2 needs a writable directory" in err and "TMPDIR" in err


@pytest.mark.parametrize(("level", "watchfiles"), [("info", logging.WARNING),
                                                    ("debug", logging.WARNING)])
def test_watchfiles_logs_only_its_warnings(level: str, watchfiles: int) -> None:
    """Its per-change lines would feed back into the watcher when opgate's log file is in a
    directory it watches (the policy directory's parent), at debug level too."""
    from proxy.app import configure_logging
    from proxy.settings import LogSettings

    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    try:
        configure_logging(Settings(log=LogSettings(level=level)))
        assert logging.getLogger("watchfiles").getEffectiveLevel() == watchfiles
        assert not logging.getLogger("watchfiles.main").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = handlers
        root.setLevel(root_level)
        logging.getLogger("watchfiles").setLevel(logging.NOTSET)


def test_no_created_series() -> None:
    from prometheus_client import generate_latest

    from proxy.engine import telemetry

    telemetry.POLICY_RELOADS.labels(result="ok").inc(0)
    text = generate_latest(telemetry.REGISTRY).decode()
    assert "opgate_policy_reloads_total" in text
    assert "_created" not in text


def test_demo_without_its_policies_says_what_to_do(tmp_path: Path) -> None:
    import os

    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--policies",
                           str(tmp_path / "policies" / "demo")], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "make demo" in done.stderr and "--policies" in done.stderr


def test_demo_files_are_package_data() -> None:
    """``opgate demo`` applies examples/reconciler/*.yaml: a pip install must carry them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]
    assert "*.yaml" in data["examples.reconciler"]
    assert (ROOT / "examples" / "reconciler" / "__init__.py").exists()
    from proxy.demo import EXAMPLE

    for name in ("rbac.yaml", "widget-crd.yaml"):
        assert (EXAMPLE / name).exists()


@pytest.fixture
def no_opgate_variables(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test's own ``OPGATE_*`` variables only (none the runner's environment may hold)."""
    import os

    for name in [n for n in os.environ if n.startswith("OPGATE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(("env", "warnings"), [
    ({"OPGATE_WORKER": "4"}, ["OPGATE_WORKER (did you mean OPGATE_WORKERS?)"]),
    ({"OPGATE_REDIS_ULR": "redis://r:6379/0"},
     ["OPGATE_REDIS_ULR (did you mean OPGATE_REDIS_URL?)"]),
    ({"OPGATE_POLICY": "/etc/opgate"}, ["OPGATE_POLICY (did you mean OPGATE_POLICIES?)"]),
    ({"OPGATE_ZZZ": "1"}, ["OPGATE_ZZZ (see opgate serve --help)"]),
    ({"OPGATE_WORKER": "4", "OPGATE_LOGLEVEL": "debug"},
     ["OPGATE_LOGLEVEL (did you mean OPGATE_LOG_LEVEL?)",
      "OPGATE_WORKER (did you mean OPGATE_WORKERS?)"]),
    # every flag's variable, and those read elsewhere: the Redis password (proxy.stores), the
    # test harness's (proxy.envtest, tests/) and the benchmarks'
    ({"OPGATE_WORKERS": "1", "OPGATE_NO_ACCESS_LOG": "1", "OPGATE_AUDIT_LOG_MAXSIZE": "10",
      "OPGATE_REDIS_PASSWORD": "pw", "OPGATE_REDIS_PASSWORD_FILE": "/run/pw",
      "OPGATE_CACHE_DIR": "/tmp/c", "OPGATE_KEEP_CLUSTER_DIR": "1", "OPGATE_KUBECTL": "kubectl",
      "OPGATE_HELM": "helm", "OPGATE_E2E_SERVE_CMD": "opgate serve",
      "OPGATE_TEST_REDIS_SERVER": "redis-server", "OPGATE_BENCH_PYTHON": "python3"}, []),
])
def test_an_unknown_variable_is_warned_about_with_the_closest_name(
        no_opgate_variables: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        env: dict[str, str], warnings: list[str]) -> None:
    """A misspelt ``OPGATE_WORKER=4`` (for ``OPGATE_WORKERS``) was ignored without a word: the
    sidecar ran one worker and nothing said why."""
    import proxy.app

    for name, value in env.items():
        no_opgate_variables.setenv(name, value)
    no_opgate_variables.setattr(proxy.app, "serve", lambda settings: 0)
    assert main(["serve"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"opgate: warning: environment variable {w.split()[0]} is not one opgate reads, "
        f"ignored {w.split(maxsplit=1)[1]}" for w in warnings]


def test_an_unknown_variable_is_warned_about_before_an_error(
        no_opgate_variables: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The misspelt variable may be why the start fails (``OPGATE_TLS_CRT``: the key alone)."""
    no_opgate_variables.setenv("OPGATE_TLS_CRT", "/tls/tls.crt")
    no_opgate_variables.setenv("OPGATE_TLS_KEY", "/tls/tls.key")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("opgate: warning: environment variable OPGATE_TLS_CRT ")
    assert "(did you mean OPGATE_TLS_CERT?)" in err[0]
    assert "--tls-cert and --tls-key go together" in err[1]


def test_other_commands_do_not_warn_about_serve_variables() -> None:
    done = _opgate("check", "policies/demo", env={"OPGATE_WORKER": "4"})
    assert done.returncode == 0, done.stderr
    assert "OPGATE_WORKER" not in done.stderr


def test_serve_warns_once_at_start_about_an_unknown_variable() -> None:
    """The real ``python -m proxy serve``: one warning line, then it serves as without it."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "https://127.0.0.1:1",
         "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "OPGATE_WORKER": "4", "OPGATE_WORKERS": "1"})
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        for line in proc.stderr:  # until it serves (or exits)
            lines.append(line)
            if "serving the Kubernetes API" in line:
                break
        assert "serving the Kubernetes API" in lines[-1], lines
        warned = [line for line in lines if "OPGATE_WORKER " in line]
        assert warned == ["opgate: warning: environment variable OPGATE_WORKER is not one opgate "
                          "reads, ignored (did you mean OPGATE_WORKERS?)\n"], lines
        assert lines[0] == warned[0]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_request_cannot_forge_lines_of_opgates_log(capsys: pytest.CaptureFixture[str]) -> None:
    """Lines quote what a request sent, percent-decoded (a path with ``%0A``, a user name):
    its line breaks and other control characters are escaped, so they cannot start a line of
    their own; a traceback after a message keeps its lines."""
    from proxy.app import configure_logging
    from proxy.settings import LogSettings

    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    try:
        configure_logging(Settings(log=LogSettings()))
        log = logging.getLogger("opgate.faults")
        log.info("fault fired (%s %s)", "DELETE",
                 "/x\n2026-12-02 02:18:16,862 ERROR forged\r\x1b[2K\u2028\x85end\tok")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed on %s", "/y\nforged")
    finally:
        root.handlers[:] = handlers
        root.setLevel(root_level)
    first, second, *traceback = capsys.readouterr().err.splitlines()
    assert first.endswith("INFO opgate.faults: fault fired (DELETE /x\\n2026-12-02 02:18:16,862 "
                          "ERROR forged\\r\\x1b[2K\\u2028\\x85end\tok)"), first
    assert second.endswith("ERROR opgate.faults: failed on /y\\nforged"), second
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: boom"
