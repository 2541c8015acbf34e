#!/usr/bin/env bash
# Create the project's virtualenv with everything the demo and the tests need.
# On Debian/Ubuntu as root it also installs OpenBLAS, which the Makefile preloads
# for ~10x faster float32 matmuls on MLX's CPU backend (the library never needs it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ "$(uname -s)" = Linux ] && [ ! -e "$OPENBLAS" ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread
  else
    echo "note: install libopenblas0-pthread for faster CPU runs (not required)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test]"
