"""The evaluation's text helpers, where scripts have imported them (`veloxquant_mlx/texts.py`)."""

from ..texts import DATASETS, SAMPLE_TEXT, load_text, sample_text_path, tokenize_prefix  # noqa: F401
