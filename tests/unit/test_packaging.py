"""The Dockerfile and docker-compose.yml, checked by parsing (no Docker engine runs here).

What can be checked without running them is checked: every opgate command line in the compose
file parses with opgate's own CLI, every file they mount or copy exists, published ports stay
on the host's loopback, the image runs as non-root (compose's opgate as root, to read the
host's 0600 kubeconfig), and the demo policies are valid.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from proxy.cli_parser import build_parser

ROOT = Path(__file__).resolve().parents[2]


# what Compose interpolates: $$ (a literal $), ${NAME}, ${NAME:-default} …, $NAME
_INTERPOLATION = re.compile(
    r"\$(\$|\{[A-Za-z_][A-Za-z0-9_]*(?:[:?-][^}]*)?\}|[A-Za-z_][A-Za-z0-9_]*)")


def _compose() -> dict[str, object]:
    """docker-compose.yml as Compose reads it: with $$ a literal $ (variables kept)."""
    doc = yaml.safe_load(_INTERPOLATION.sub(
        lambda m: "$" if m.group(1) == "$" else m.group(0),
        (ROOT / "docker-compose.yml").read_text()))
    assert isinstance(doc, dict)
    return doc


def test_compose_has_no_lone_dollar() -> None:
    """Compose interpolates every value: a $ that starts no variable (the regexes' ^opgate$)
    is an 'invalid interpolation format' to older Compose and docker-compose v1; $$ is a $ to
    every version."""
    for number, line in enumerate((ROOT / "docker-compose.yml").read_text().splitlines(), 1):
        text = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        assert "$" not in _INTERPOLATION.sub("", text), f"docker-compose.yml:{number}: {line}"


def test_compose_services_and_dependencies() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    assert set(services) == {"redis", "opgate", "reconciler"}
    assert services["opgate"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["reconciler"]["depends_on"]["opgate"]["condition"] == "service_healthy"


def test_compose_opgate_command_parses() -> None:
    opgate = _compose()["services"]["opgate"]  # type: ignore[index]
    args = build_parser().parse_args(opgate["command"])
    assert args.command == "serve"
    assert args.redis_url == "redis://redis:6379/0"
    assert args.accept_hosts.split(",")[0] == "^opgate$"  # $$ read as Compose reads it
    policies = args.policies.replace("/etc/opgate/policies", str(ROOT / "policies"))
    assert Path(policies).is_dir()


def test_compose_publishes_on_loopback_only() -> None:
    for name, service in _compose()["services"].items():  # type: ignore[union-attr]
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_compose_opgate_can_read_the_host_kubeconfig() -> None:
    """kubectl (and kind, minikube) write a kubeconfig 0600, owner only: the image's user 65532
    cannot read the bind-mounted file, and opgate would stop at start ("cannot read it").
    The compose opgate service runs as root for that file (the image stays non-root)."""
    opgate = _compose()["services"]["opgate"]  # type: ignore[index]
    mounts = [v for v in opgate["volumes"] if v.rsplit(":", 2)[1] == "/kube/config"]
    assert mounts, "compose mounts no kubeconfig at /kube/config"
    assert str(opgate.get("user", "")).split(":")[0] in {"0", "root"}


def test_compose_mounts_exist() -> None:
    for service in _compose()["services"].values():  # type: ignore[union-attr]
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_dockerfile_copies_what_exists_and_runs_unprivileged() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    froms = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert froms and all(f.startswith("python:3.1") for f in froms)
    for ln in lines:
        if ln.startswith("COPY ") and "--from" not in ln:
            for source in shlex.split(ln)[1:-1]:
                assert (ROOT / source).exists(), ln
    [user] = [ln for ln in lines if ln.startswith("USER ")]
    assert not user.split()[1].startswith("0") and "root" not in user
    [entry] = [ln for ln in lines if ln.startswith("ENTRYPOINT ")]
    assert "opgate" in entry
    [cmd] = [ln for ln in lines if ln.startswith("CMD ")]
    args = build_parser().parse_args(yaml.safe_load(cmd[4:]))
    assert args.command == "serve"
    assert args.policies is None  # a default that admits every call (no identity allow-list)


def test_the_image_and_the_test_extra_have_mitmproxy_for_capture() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("mitmproxy>=") for req in extras["capture"])
    assert any(req.startswith("mitmproxy>=") for req in extras["test"])  # bootstrap: .[test]
    [wheel] = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines()
               if "pip wheel" in ln]
    assert ".[capture]" in wheel


def test_compose_operator_presents_the_token_the_demo_policy_admits(tmp_path: Path) -> None:
    """compose serves the demo policies, whose identity section admits only the sample
    operator's ServiceAccount: the operator's kubeconfig must carry that token (a file the
    header's `kubectl create token` writes), or every call it makes is a 401."""
    from examples.reconciler.config import load_kubeconfig

    services = _compose()["services"]
    reconciler = services["reconciler"]  # type: ignore[index]
    command = reconciler["command"]
    container_path = command[command.index("--kubeconfig") + 1]
    mounts = dict(reversed(v.split(":")[:2]) for v in reconciler["volumes"])
    [(inside, source)] = [(i, s) for i, s in mounts.items() if container_path.startswith(i + "/")]
    host = ROOT / source / container_path[len(inside) + 1:]
    copy = tmp_path / host.name
    copy.write_text(host.read_text())
    user = yaml.safe_load(copy.read_text())["users"][0]["user"]
    (tmp_path / user["tokenFile"]).write_text("the-operator-token\n")
    assert load_kubeconfig(copy).tokens.get() == "the-operator-token"

    header = (ROOT / "docker-compose.yml").read_text()
    written = f"create token sample-operator --duration=24h > {source[2:]}/{user['tokenFile']}"
    assert written in header
    assert f"{source[2:]}/{user['tokenFile']}" in (ROOT / ".gitignore").read_text()
    opgate = build_parser().parse_args(services["opgate"]["command"])  # type: ignore[index]
    policies = Path(opgate.policies.replace("/etc/opgate/policies", str(ROOT / "policies")))
    text = "".join(p.read_text() for p in sorted(policies.glob("*.yaml")))
    assert "serviceAccount: opgate-demo/sample-operator" in text


def test_the_compose_opgate_answers_the_host_names_its_callers_use() -> None:
    """opgate answers only the Host names of --accept-hosts (DNS rebinding): the reconciler's
    kubeconfig (http://opgate:8001) and a host's curl to the published 127.0.0.1:8001 must be
    among them, and a page's own name must not."""
    from urllib.parse import urlsplit

    from proxy.relay.hostguard import HostGuard, parse_accept_hosts

    services = _compose()["services"]
    opgate = build_parser().parse_args(services["opgate"]["command"])  # type: ignore[index]
    guard = HostGuard(parse_accept_hosts(opgate.accept_hosts))
    kubeconfig = yaml.safe_load((ROOT / "deploy/compose/reconciler.kubeconfig").read_text())
    server = urlsplit(kubeconfig["clusters"][0]["cluster"]["server"])
    assert guard.accepts(server.netloc.encode())
    assert guard.accepts(b"127.0.0.1:8001") and guard.accepts(b"localhost:8001")
    assert not guard.accepts(b"evil.example:8001")


def test_the_build_context_leaves_out_the_checkout_s_venv() -> None:
    """`make` keeps a .venv in the checkout where the distribution manages its Python
    (scripts/python.sh): hundreds of MB that `docker build .` would send to the engine as
    context for nothing, as the Dockerfile copies only named paths."""
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored
    assert ".venv/" in (ROOT / ".gitignore").read_text().split()


def test_the_license_is_an_spdx_expression() -> None:
    """`project.license` as a TOML table ({text = ...}) is deprecated by setuptools 77, which
    warns at every build that after 2027-02-18 such a project no longer builds: `pip install .`
    and the image's `pip wheel` (build-system pins only a floor) would then fail. An SPDX
    expression, as the packaging guide says, needs setuptools 77 or later."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    [setuptools] = [r for r in pyproject["build-system"]["requires"]
                    if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"
