#!/usr/bin/env bash
# Rebuild the optional CPU kernel (veloxquant_mlx._native, from csrc/) in place, the way MLX's
# docs build extensions (`setup.py build_ext --inplace`, mlx.extension.CMakeBuild); `make setup`
# and `pip install` build it the same way through setup.py. Needs cmake >= 3.25, a C++20
# compiler, and nanobind matching the ABI MLX's Python module was built with (MLX 0.32:
# nanobind 3.1.0); `python -m veloxquant_mlx.kernels.selftest --backend native` checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip install -q "nanobind==3.1.0" "setuptools>=77"
"$PY" setup.py -q build_ext --inplace
"$PY" -c "from veloxquant_mlx.kernels import native; assert native.available(); print('built', native.module().__file__)"
