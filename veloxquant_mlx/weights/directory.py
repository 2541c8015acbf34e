"""A quantized-model folder: `weights.json` (what was done, to which model) and the reservoir.

`veloxquant quantize-weights --model M --bits 3 --out DIR` writes one; `load_model(DIR)`
(so `veloxquant generate --model DIR`, `veloxquant eval ppl --model DIR`) loads the base
model M as usual and grafts the reservoir onto it, whatever KV cache runs on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from .folder import (CONFIG_NAME, FORMAT, RESERVOIR_NAME, is_quantized_dir, load_folder,  # noqa: F401
                     read_config, reservoir_path)


def quantize_to_dir(model_name: str, out, bits: int, seed: int = 0, skip: Iterable[str] = (),
                    group_size: Optional[int] = None, column_alpha: float = 0.5, embeddings: bool = False,
                    calibration_tokens: int = 0, calibration_text: Optional[str] = None,
                    share_rotations: bool = False, progress: bool = True, format: str = "rotated",
                    scale_bits: Optional[int] = None, center_bits: Optional[int] = None) -> dict:
    """Load `model_name`, quantize its linear layers (and with `embeddings` its embedding
    tables) and write `out/weights.json` + the reservoir. `calibration_tokens` > 0: GPTQ codes
    calibrated on that many tokens of `calibration_text` (default: the packaged sample text).
    `format`, `scale_bits`, `center_bits`: as `quantize_model`'s."""
    import time

    import mlx.core as mx

    from ..models import load_model, model_source
    from .model import quantize_model
    from .reservoir import save_reservoir

    # The default model and hub ids are kept by name (the folder then works on another
    # machine); local folders and GGUF files by absolute path.
    source = str(model_name)
    local = Path(source).expanduser()
    if local.exists():
        source = str(local.resolve())
    model_source(model_name)  # fails early for a missing model
    model, tokenizer = load_model(model_name)
    mx.eval(model.parameters())
    calibration = None
    if calibration_tokens:
        from .gptq import calibration_tokens as read_calibration

        calibration = read_calibration(tokenizer, calibration_tokens, calibration_text)
    start = time.perf_counter()
    extra = {"scale_bits": scale_bits, "center_bits": center_bits} if format == "group_affine" else {}
    quantize_model(model, bits, seed=seed, skip=skip, group_size=group_size, column_alpha=column_alpha,
                   embeddings=embeddings, calibration=calibration, share_rotations=share_rotations,
                   progress=progress, format=format, **extra)
    seconds = time.perf_counter() - start
    config = {"format": FORMAT, "weight_format": format, **extra, "base_model": source, "reservoir": RESERVOIR_NAME,
              "bits": bits, "seed": seed,
              "skip": list(skip), "group_size": group_size, "column_alpha": column_alpha,
              "embeddings": embeddings, "share_rotations": share_rotations, "calibration_tokens": calibration_tokens,
              "calibration_text": str(calibration_text) if calibration_text else ("packaged sample" if calibration_tokens else None),
              "quantize_seconds": round(seconds, 3)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_reservoir(model, out / RESERVOIR_NAME, meta=config)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return config


def load_quantized_dir(path, dequantize: Optional[bool] = None):
    """(model, tokenizer): the base model named in `weights.json` with the reservoir grafted on."""
    from ..models import load_model

    return load_folder(path, load_model, dequantize)
