#!/usr/bin/env bash
# Prints the Python that runs opgate's tests, demo and bench: $PYTHON (default python3) itself,
# or the repository's .venv made from it when pip may not install into it. A distribution's
# own Python that marks itself externally managed (PEP 668: Debian 12, Ubuntu 23.04 and later)
# refuses `pip install`, so on a fresh Debian machine `make demo` stopped at its first step.
# With --create (scripts/bootstrap.sh) the .venv is also made when it is needed and missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# exit 3: pip would refuse (the marker in its stdlib and not a venv), as pip itself decides
rc=0
"$PYTHON" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(3 if os.path.isfile(marker) and sys.prefix == sys.base_prefix else 0)' \
  >/dev/null 2>&1 || rc=$?
if [ "$rc" != 3 ]; then  # usable, or no such Python: the caller's own error says so
  echo "$PYTHON"
  exit 0
fi
if [ "${1:-}" = "--create" ] && [ ! -x .venv/bin/python ]; then
  echo "python.sh: $PYTHON is managed by the distribution (PEP 668): making .venv from it" >&2
  "$PYTHON" -m venv .venv >&2
fi
echo "$PWD/.venv/bin/python"
