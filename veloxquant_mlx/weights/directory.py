"""A quantized-model folder: `weights.json` (what was done, to which model) and the reservoir.

`veloxquant quantize-weights --model M --bits 3 --out DIR` writes one; `load_model(DIR)`
(so `veloxquant generate --model DIR`, `veloxquant eval ppl --model DIR`) loads the base
model M as usual and grafts the reservoir onto it, whatever KV cache runs on top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

CONFIG_NAME = "weights.json"
RESERVOIR_NAME = "reservoir.vqw"
FORMAT = "veloxquant-weights"


def is_quantized_dir(path) -> bool:
    try:
        return (Path(path).expanduser() / CONFIG_NAME).is_file()
    except (TypeError, OSError):
        return False


def read_config(path) -> dict:
    from .reservoir import ReservoirError

    try:
        config = json.loads((Path(path).expanduser() / CONFIG_NAME).read_text())
    except ValueError as error:
        raise ReservoirError(f"{path}/{CONFIG_NAME} is not JSON ({error})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ReservoirError(f"{path}/{CONFIG_NAME} is not a {FORMAT} config")
    return config


def reservoir_path(path, config: dict) -> Path:
    """The folder's reservoir, which must lie inside the folder (no "..", no absolute path, no
    symbolic link leading out of it), and whose header must hold the folder's `weights.json`
    as written (so a reservoir of other bits copied in, or an edited `weights.json`, is refused)."""
    from .reservoir import ReservoirError, read_header

    folder = Path(path).expanduser().resolve()
    name = config.get("reservoir")
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ReservoirError(f"{path}/{CONFIG_NAME}: reservoir {name!r} is not a file name inside the folder")
    reservoir = (folder / name).resolve()
    if reservoir.parent != folder and folder not in reservoir.parents:
        raise ReservoirError(f"{path}/{CONFIG_NAME}: reservoir {name!r} leads out of the folder (to {reservoir})")
    if not reservoir.is_file():
        raise ReservoirError(f"{path}/{CONFIG_NAME}: its reservoir {name!r} is not in the folder")
    header, _ = read_header(reservoir)
    if header.get("meta") != config:
        stated, held = config.get("bits"), (header.get("meta") or {}).get("bits")
        raise ReservoirError(f"{path}: {CONFIG_NAME} (bits {stated}) does not describe its reservoir (bits {held}): "
                             "the reservoir was copied from another folder, or the file edited")
    return reservoir


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
    from .reservoir import graft_reservoir

    config = read_config(path)
    reservoir = reservoir_path(path, config)
    model, tokenizer = load_model(config["base_model"], dequantize=dequantize)
    graft_reservoir(model, reservoir)
    return model, tokenizer
