#!/usr/bin/env bash
# Create the project's virtual environment (.venv) with the pinned packages of requirements.lock, then the project
# itself, editable (`pip install -e .`: the `rtp` command, imports from any directory).
# Idempotent: when the pins and pyproject.toml have not changed since the last successful run, it returns at once.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup: Python 3.11 is required (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi

stamp=".venv/.installed-$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

echo "setup: installing the pinned environment into .venv (first run: a few minutes)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade "pip==26.3"
# torch==2.13.0 is pinned exactly: a range would pull a multi-GB CUDA build on CPU-only machines.
.venv/bin/python -m pip install --quiet -r requirements.lock
# Its dependencies are the lock's (--no-deps); built with these pinned tools rather than downloaded ones.
.venv/bin/python -m pip install --quiet setuptools==84.2.1 wheel==0.48.0
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
rm -f .venv/.installed-*
touch "$stamp"
echo "setup: done"
