"""The files of a quantized-model folder: `weights.json` (what was done, to which model) and the
reservoir it names. `directory.py` writes such folders; `models.load_model` loads them."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "weights.json"
RESERVOIR_NAME = "reservoir.vqw"
FORMAT = "veloxquant-weights"


def is_quantized_dir(path) -> bool:
    try:
        return (Path(path).expanduser() / CONFIG_NAME).is_file()
    except (TypeError, OSError):
        return False


def read_config(path) -> dict:
    config = json.loads((Path(path).expanduser() / CONFIG_NAME).read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path}/{CONFIG_NAME} is not a {FORMAT} config")
    return config


def load_folder(path, load_base, dequantize=None):
    """(model, tokenizer): `load_base(base model, dequantize=...)` (`models.load_model`) with the
    reservoir of the folder at `path` grafted on."""
    from .reservoir import graft_reservoir

    config = read_config(path)
    model, tokenizer = load_base(config["base_model"], dequantize=dequantize)
    graft_reservoir(model, Path(path).expanduser() / config["reservoir"])
    return model, tokenizer
