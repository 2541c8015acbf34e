"""Run the GPU kernel text on the CPU: each thread of a block is a std::thread.

The C++ dialect of `templates` maps shared memory to function-static arrays,
barriers to one `std::barrier` per block and warp reductions to a shared
scratch array, so the exact kernel body that CUDA and Metal compile runs here,
block after block, with real concurrency between the threads of a block (a
missing barrier shows up as a wrong or varying result). Slow: for tests on
small shapes only. Needs a C++20 compiler (g++ or clang++).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from . import templates

_NP = {"float32": np.float32, "float16": np.float16, "uint32": np.uint32, "int32": np.int32}


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"veloxquant-emulator-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


_LOADED: Dict[str, ctypes.CDLL] = {}


def _library(kernel: str, template, in_dtypes: Dict[str, str], out_dtypes: Dict[str, str]):
    spec = templates.KERNELS[kernel]
    body = templates.render_cpp(kernel, template, in_dtypes, out_dtypes, "vq_kernel_thread")
    names = list(spec["inputs"]) + list(spec["outputs"])
    ctype = templates.C_TYPES["cpp"]
    casts = []
    for i, n in enumerate(names):
        dtype = in_dtypes[n] if n in in_dtypes else out_dtypes[n]
        const = "const " if n in in_dtypes else ""
        casts.append(f"({const}{ctype[dtype]}*)ptrs[{i}]")
    launcher = f"""
#include <thread>
#include <vector>
extern "C" void vq_launch(void** ptrs, int blocks_x, int blocks_y, int threads) {{
  std::vector<float> scratch(threads * 8);  // warp exchanges: 8 words per thread
  for (int by = 0; by < blocks_y; ++by) {{
    for (int bx = 0; bx < blocks_x; ++bx) {{
      std::barrier<> bar(threads);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {{
        pool.emplace_back([&, t]() {{
          vq_emu::ctx = vq_emu::Ctx{{&bar, scratch.data(), t, bx, by}};
          vq_kernel_thread({", ".join(casts)});
        }});
      }}
      for (auto& th : pool) th.join();
    }}
  }}
}}
"""
    text = templates.header("cpp") + body + launcher
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    if key in _LOADED:
        return _LOADED[key]
    out = _build_dir() / f"vq_{key}.so"
    if not out.exists():
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("the kernel emulator needs a C++20 compiler (g++ or clang++)")
        src = _build_dir() / f"vq_{key}.cpp"
        src.write_text(text)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(src)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    lib.vq_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    _LOADED[key] = lib
    return lib


def run(kernel: str, inputs: Sequence[np.ndarray], template, grid, threadgroup,
        output_shapes: Sequence[tuple], output_dtypes: Sequence[str], poison: bool = True) -> List[np.ndarray]:
    """Like `mx.fast.cuda_kernel(...)(...)`: `grid` counts threads, as in MLX."""
    spec = templates.KERNELS[kernel]
    inputs = [np.ascontiguousarray(a) for a in inputs]
    in_dtypes = {n: str(a.dtype) for n, a in zip(spec["inputs"], inputs)}
    out_dtypes = dict(zip(spec["outputs"], output_dtypes))
    lib = _library(kernel, template, in_dtypes, out_dtypes)
    outputs = []
    for shape, dtype in zip(output_shapes, output_dtypes):
        arr = np.empty(shape, dtype=_NP[dtype])
        if poison:  # every element must be written
            arr.fill(np.nan if arr.dtype.kind == "f" else 0xDEADBEEF & np.iinfo(arr.dtype).max)
        outputs.append(arr)
    ptrs = (ctypes.c_void_p * (len(inputs) + len(outputs)))(
        *[a.ctypes.data_as(ctypes.c_void_p) for a in list(inputs) + outputs]
    )
    tx = threadgroup[0]
    blocks_x = -(-grid[0] // tx)
    blocks_y = grid[1]
    if threadgroup[1] != 1 or len(grid) > 2 and grid[2] != 1:
        raise ValueError("the emulator runs 1-D thread blocks on a 2-D grid")
    lib.vq_launch(ptrs, blocks_x, blocks_y, tx)
    return outputs
