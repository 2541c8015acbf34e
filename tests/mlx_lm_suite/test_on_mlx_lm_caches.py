"""mlx-lm 0.32.2's own tests on mlx-lm's own caches, SmolLM2 in place of their online model: the reference
that every failure on the library's caches is compared with (adapter.py, README.md)."""
from .adapter import suite

SPEC = None
globals().update(suite(SPEC))
