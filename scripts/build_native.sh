#!/usr/bin/env bash
# Build the optional CPU kernels (veloxquant_mlx._native, from csrc/) into the package
# folder. Needs cmake >= 3.25 and a C++20 compiler; the library runs without them
# (portable path). nanobind must match the ABI MLX's Python module was built with
# (MLX 0.32: nanobind 3.1.0); `python -m veloxquant_mlx.kernels.selftest --backend native`
# checks the result.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, but still the venv's
"$PY" -m pip install -q "nanobind==3.1.0"
cmake -S csrc -B build/native -DPython_EXECUTABLE="$PY" -DVELOXQUANT_OUTPUT_DIR="$PWD/veloxquant_mlx" >/dev/null
cmake --build build/native -j "$(nproc 2>/dev/null || echo 2)"
"$PY" -c "from veloxquant_mlx.kernels import native; assert native.available(); print('built', native.module().__file__)"
