#!/usr/bin/env bash
# Create the project's virtualenv with everything the demo and the tests need.
# On Debian/Ubuntu as root it also installs OpenBLAS, which the Makefile preloads
# for ~10x faster float32 matmuls on MLX's CPU backend (the library never needs it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# It also installs cmake and g++ if missing, to build the CPU kernels (scripts/build_native.sh).
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
APT=()
[ -e "$OPENBLAS" ] || APT+=(libopenblas0-pthread)
command -v cmake >/dev/null || APT+=(cmake)
command -v g++ >/dev/null || APT+=(g++)
if [ "$(uname -s)" = Linux ] && [ ${#APT[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${APT[@]}"
  else
    echo "note: install ${APT[*]} (faster CPU runs, CPU kernels; not required)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test]"
if command -v cmake >/dev/null && command -v c++ >/dev/null; then
  PYTHON="$VENV/bin/python" bash scripts/build_native.sh \
    || echo "note: the CPU kernel did not build (see above); the CPU uses the portable path" >&2
else
  echo "note: no cmake / C++ compiler: the CPU uses the portable path (slower decode)" >&2
fi
