"""Text to measure or calibrate on: a local file, the packaged sample, or WikiText-2 through `datasets`,
tokenized without BOS."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

DATASETS = {"wikitext2": ("wikitext", "wikitext-2-raw-v1", "test")}
# Python Language Reference text (PSF License), see veloxquant_mlx/data/README.md.
SAMPLE_TEXT = Path(__file__).resolve().parent / "data" / "python-reference.txt"


def sample_text_path() -> Path:
    """The text shipped inside the package (the demo's default), checked to be there."""
    if not SAMPLE_TEXT.is_file():
        raise FileNotFoundError(
            f"the packaged sample text {SAMPLE_TEXT} is missing (a broken install?); reinstall "
            "veloxquant-mlx or pass a text file with --text FILE"
        )
    return SAMPLE_TEXT


def load_text(text_path: Optional[str] = None, dataset: Optional[str] = None) -> str:
    if text_path is not None:
        path = Path(text_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        return path.read_text(encoding="utf-8", errors="replace")
    name = dataset or "wikitext2"
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or pass --text FILE)")
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"the {name} data set needs the `datasets` package (pip install datasets) and network "
            "access; or pass a local text file with --text FILE"
        ) from None
    path, config, split = DATASETS[name]
    try:
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as error:
        raise ValueError(
            f"could not load {path}/{config} ({split}): {error}; pass a local file with --text FILE"
        ) from None
    # rows are the raw file's lines, newline included: joining them restores the file
    return "".join(rows["text"])


def tokenize_prefix(tokenizer, text: str, n_tokens: int) -> List[int]:
    """The first `n_tokens` tokens of `text` (no BOS), tokenizing only as much text as needed.

    Raises ValueError when the whole text is shorter.
    """
    chars = max(1024, 8 * n_tokens)
    while True:
        piece = text[:chars]
        ids = tokenizer.encode(piece, add_special_tokens=False)
        # tokens near the cut may change once more text follows: keep a margin
        if len(ids) >= n_tokens + 16 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, {n_tokens} are needed")
    return ids[:n_tokens]
