"""results.json: what was run, where, and the per-method records (docs/results-schema.md)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from ..footprint import Footprint
from ..settings import cuda_available

SCHEMA_VERSION = 1
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def backend_name() -> str:
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if cuda_available():
        return "cuda"
    return "gpu"


def _total_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_info() -> Dict[str, Any]:
    try:
        info = mx.device_info()
    except Exception:
        return {}
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in info.items()}


def environment() -> Dict[str, Any]:
    import mlx_lm

    from .. import __version__, kernels

    return {
        "veloxquant_mlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": _total_memory_bytes(),
        "device": str(mx.default_device()),
        "backend": backend_name(),
        "kernels": kernels.backend(),  # which turboquant_mse decode path ran (native, portable, cuda, ...)
        "device_info": _device_info(),
        "argv": sys.argv,
    }


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return str(value)


def args_record(args) -> Dict[str, Any]:
    return {k: _jsonable(v) for k, v in vars(args).items() if not callable(v)}


def new_results(command: str, args, model_info: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "args": args_record(args) if args is not None else {},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        "model": model_info or {},
        "settings": {},
        "records": [],
        "figures": [],
        "complete": False,
    }


def load_results(path) -> Dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_JSON
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}")
    return json.loads(path.read_text())


def finite(value: Optional[float]) -> Optional[float]:
    """JSON has no NaN/inf: record them as null."""
    if value is None:
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()


def model_record(model, name: str, layout=None, **extra) -> Dict[str, Any]:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    dtypes = sorted({str(p.dtype).split(".")[-1] for _, p in params})
    args = getattr(model, "args", None)
    record = {
        "name": name,
        "model_type": getattr(args, "model_type", type(model).__module__.split(".")[-1]),
        "parameter_bytes": sum(p.nbytes for _, p in params),
        "parameter_dtypes": dtypes,
    }
    if layout is not None:
        record.update(layout.describe())
    record.update(extra)
    return record


def kv_fields(kv: Footprint) -> Dict[str, Any]:
    """A record's cache size fields, as `footprint` defines them (every command's records alike)."""
    return dict(kv_bytes=kv.held, kv_allocated_bytes=kv.allocated, kv_tokens=kv.tokens, fp16_kv_bytes=kv.fp16_bytes,
                bits_per_coord=finite(kv.bits), compression_vs_fp16=finite(kv.smaller), state_bytes=kv.state,
                whole_cache_compression_vs_fp16=finite(kv.whole_smaller))


def write_json_and_markdown(out, record: Dict[str, Any], lines: List[str]) -> None:
    """A benchmark's results folder: `record` as results.json, `lines` as results.md, and the lines printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_JSON).write_text(json.dumps(record, indent=2) + "\n")
    (out / RESULTS_MD).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
