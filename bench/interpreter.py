"""The Python interpreter the bench runs opgate on.

opgate ships in an image built on ``python:3.11-slim``, whose CPython is compiled with
profile-guided optimisation and link-time optimisation (``--enable-optimizations --with-lto``);
so are the distributions' own Pythons (Debian's ``python3.11``). A pyenv build made without
``PYTHON_CONFIGURE_OPTS`` has neither, and costs opgate ~15-25% more CPU per call on the
project's machines (bench/README.md, "Which Python"). The bench measures opgate as users run it:

1. ``$OPGATE_BENCH_PYTHON``, if set;
2. else the virtualenv ``scripts/bootstrap.sh --bench`` makes from Debian's ``python3.11``, with
   opgate's dependencies (``~/.cache/opgate/bench-python``);
3. else the interpreter running the bench.

opgate's code always comes from the checkout the bench runs in (``-m proxy`` with that as its
working directory), whatever the interpreter.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["BENCH_VENV", "describe", "opgate_python"]

BENCH_VENV = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
              / "opgate" / "bench-python")

_PROBE = """
import json, sys, sysconfig
args = sysconfig.get_config_var("CONFIG_ARGS") or ""
print(json.dumps({"version": sys.version.split()[0], "base": sys.base_prefix,
                  "pgo": "--enable-optimizations" in args, "lto": "--with-lto" in args}))
"""


@functools.cache
def opgate_python() -> str:
    chosen = os.environ.get("OPGATE_BENCH_PYTHON")
    if chosen:
        return chosen
    venv = BENCH_VENV / "bin" / "python"
    if venv.exists():
        return str(venv)
    return sys.executable


@functools.cache
def describe(python: str | None = None) -> str:
    """``"3.11.2 (Debian's build: PGO + LTO; /path/to/python)"``: what the report states."""
    python = python or opgate_python()
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                             timeout=30, check=True)
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return f"? ({python}: {e})"
    if info["base"] == "/usr" and Path("/etc/debian_version").exists():
        build = "Debian's build: PGO + LTO"  # Debian keeps those flags out of sysconfig
    elif info["base"] == "/usr":
        build = "the distribution's build"
    else:
        build = " + ".join(n for n, on in (("PGO", info["pgo"]), ("LTO", info["lto"])) if on)
        build = f"built with {build}" if build else "built without PGO or LTO"
    return f"{info['version']} ({build}; {python})"
