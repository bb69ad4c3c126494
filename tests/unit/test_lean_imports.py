"""What a sidecar loads at start: only what its configuration uses.

The default relay core and the admin listener are served by httptools over asyncio protocols;
aiohttp (the ``--relay aiohttp`` core, the informers' and the authenticator's HTTP client),
PyJWT/cryptography (identity with JWTs), redis (``--redis-url``) and mitmproxy (``--capture``)
are loaded when a feature that needs them is used. Each costs megabytes of resident memory in
every pod (issue #5, idle RSS), so a regression here is a behaviour change, not a style one.
And what each layer may import at all (DESIGN.md's layout): engine, middlewares and stores no
transport, the relay no middleware, a middleware no other one.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("aiohttp", "jwt", "cryptography", "redis", "watchfiles", "mitmproxy")


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return {name.partition(".")[0] for name in json.loads(out.splitlines()[-1])}


def test_the_sidecar_starts_without_the_heavy_libraries() -> None:
    loaded = loaded_after("import proxy.app, proxy.cli, proxy.admin, proxy.relay")
    assert sorted(loaded & set(HEAVY)) == []
    assert "httptools" in loaded  # the relay core itself


@pytest.mark.parametrize(("code", "library"), [
    ("from proxy.relay import relay_core; relay_core('aiohttp')", "aiohttp"),
    ("import proxy.relay; proxy.relay.Relay", "aiohttp"),
    ("from proxy.stores import build_store; build_store(redis_url='redis://127.0.0.1:1',"
     " password_file=None, timeout=0.05, replicas=1)", "redis"),
    ("from proxy.capture import load_mitmproxy; load_mitmproxy()", "mitmproxy"),
])
def test_a_feature_loads_its_library_when_used(code: str, library: str) -> None:
    assert library in loaded_after(code)


def _imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports, anywhere (top level, functions,
    TYPE_CHECKING); ``from a import b`` gives ``a`` and ``a.b`` (b may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# DESIGN.md's layers: what each package may never import
FORBIDDEN = {
    "engine": ("aiohttp", "socket", "proxy.relay", "proxy.middlewares", "proxy.stores.redis"),
    "middlewares": ("aiohttp", "socket", "proxy.relay"),
    "stores": ("aiohttp", "proxy.relay", "proxy.middlewares"),
    "relay": ("proxy.middlewares",),
}
# helper modules of one middleware (no hooks of their own), which it alone imports
HELPERS = {"instance": "ratelimit"}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_the_layers_import_only_what_design_md_allows(layer: str) -> None:
    """engine knows no transport; middlewares import engine and stores, never relay nor each
    other; the relay never knows which middlewares exist. A middleware's own modules
    (``quota_spec`` of ``quota``) and its helpers (``HELPERS``) are its own."""
    root = Path(__file__).resolve().parents[2] / "proxy" / layer
    wrong = []
    for path in sorted(root.rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                wrong.append(f"{path.relative_to(root.parent)}: {name}")
            elif layer == "middlewares" and name.startswith("proxy.middlewares."):
                own, other = path.stem.split("_")[0], name.split(".")[2].split("_")[0]
                if other != own and HELPERS.get(other) != own:
                    wrong.append(f"{path.relative_to(root.parent)}: {name}")
    assert not wrong, wrong
