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


def load_folder(path, load_base, dequantize=None):
    """(model, tokenizer): `load_base(base model, dequantize=...)` (`models.load_model`) with the
    reservoir of the folder at `path` grafted on."""
    from .reservoir import graft_reservoir

    config = read_config(path)
    reservoir = reservoir_path(path, config)
    model, tokenizer = load_base(config["base_model"], dequantize=dequantize)
    graft_reservoir(model, reservoir)
    return model, tokenizer
