"""``tune_malloc``: opgate keeps its heap between body chunks (glibc), unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = "from proxy.app import tune_malloc; print(tune_malloc())"
GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")


def run(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's; elsewhere tune_malloc does nothing")
def test_applied_on_glibc() -> None:
    assert run({}) == "True"


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_glibc_variables_set_by_the_user_win(name: str) -> None:
    assert run({name: "131072"}) == "False"
