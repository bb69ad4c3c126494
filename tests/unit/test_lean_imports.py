"""What a sidecar loads at start: only what its configuration uses.

The default relay core and the admin listener are served by httptools over asyncio protocols;
aiohttp (the ``--relay aiohttp`` core, the informers' and the authenticator's HTTP client),
PyJWT/cryptography (identity with JWTs), redis (``--redis-url``) and mitmproxy (``--capture``)
are loaded when a feature that needs them is used. Each costs megabytes of resident memory in
every pod (issue #5, idle RSS), so a regression here is a behaviour change, not a style one.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
