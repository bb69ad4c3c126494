"""The README's two commands on the machine it names: a fresh Debian, whose python3 marks itself
externally managed (PEP 668) and refuses ``pip install``. ``make`` then runs everything in the
``.venv`` that ``scripts/bootstrap.sh`` makes from that Python (``scripts/python.sh``); a Python
pip may install into (a venv, pyenv's, the image's) is used as it is.

A managed Python is made here from the one running the tests: its standard library, linked,
plus the ``EXTERNALLY-MANAGED`` marker, as its home (``PYTHONHOME``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = "import sys, sysconfig; print(sysconfig.get_path('stdlib'), sys.prefix != sys.base_prefix)"


@pytest.fixture
def managed_python(tmp_path: Path) -> Path:
    """A ``python3`` that pip refuses to install into, as Debian 12's does."""
    real = Path(sysconfig.get_path("stdlib"))
    home = tmp_path / "managed"
    stdlib = home / "lib" / real.name
    stdlib.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "EXTERNALLY-MANAGED":  # a distribution's own: never written through
            (stdlib / entry.name).symlink_to(entry)
    (stdlib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=managed by the distribution\n")
    python = home / "bin" / "python3"
    python.parent.mkdir()
    base = getattr(sys, "_base_executable", sys.executable)
    python.write_text(f'#!/bin/sh\nPYTHONHOME="{home}" exec "{base}" "$@"\n')
    python.chmod(0o755)
    stdlib_seen, in_venv = subprocess.run([str(python), "-c", CHECK], capture_output=True,
                                          text=True, check=True).stdout.split()
    assert (stdlib_seen, in_venv) == (str(stdlib), "False")
    refused = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--no-index",
                              "opgate"], capture_output=True, text=True)
    if "No module named pip" not in refused.stderr:  # Debian's pip lives outside the stdlib
        assert "externally-managed-environment" in refused.stdout + refused.stderr, refused
    return python


def _make_n(target: str, python: Path) -> list[str]:
    out = subprocess.run(["make", "-n", target, f"PYTHON={python}"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.splitlines()


@pytest.mark.parametrize(("target", "command"), [
    ("demo", "-m proxy demo"), ("test", "-m pytest"), ("bench", "-m bench")])
def test_make_runs_a_managed_python_s_venv(target: str, command: str,
                                           managed_python: Path) -> None:
    """`make demo` stopped at `pip install -e .[test]`: error: externally-managed-environment."""
    lines = _make_n(target, managed_python)
    assert any(line.startswith(f"{ROOT / '.venv/bin/python'} {command}") for line in lines), lines
    assert not [line for line in lines if line.startswith(str(managed_python))], lines


def test_make_runs_a_python_pip_may_install_into_as_it_is() -> None:
    lines = _make_n("demo", Path(sys.executable))
    assert f"{sys.executable} -m proxy demo" in lines, lines
    assert not [line for line in lines if str(ROOT / ".venv") in line], lines


def _copy_of_scripts(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    return checkout


def test_python_sh_makes_the_venv_of_a_managed_python(tmp_path: Path,
                                                      managed_python: Path) -> None:
    checkout = _copy_of_scripts(tmp_path)
    env = {**os.environ, "PYTHON": str(managed_python)}
    script = str(checkout / "scripts" / "python.sh")
    printed = subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
    venv_python = checkout / ".venv" / "bin" / "python"
    assert printed == str(venv_python)
    assert not venv_python.exists()  # only --create (bootstrap) makes it
    created = subprocess.run(["bash", script, "--create"], env=env, capture_output=True,
                             text=True, check=True, timeout=120).stdout.strip()
    assert created == str(venv_python)
    inside = subprocess.run([created, "-c", CHECK], capture_output=True, text=True,
                            check=True).stdout.split()
    assert inside[1] == "True"  # a venv: pip installs there
    assert subprocess.run([created, "-m", "pip", "--version"], capture_output=True).returncode == 0


def test_python_sh_keeps_a_python_pip_may_install_into(tmp_path: Path) -> None:
    checkout = _copy_of_scripts(tmp_path)
    printed = subprocess.run(["bash", str(checkout / "scripts" / "python.sh"), "--create"],
                             env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == sys.executable
    assert not (checkout / ".venv").exists()
