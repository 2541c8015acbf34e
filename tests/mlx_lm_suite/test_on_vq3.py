"""mlx-lm 0.32.2's own tests of its caches, generation and server, on `vq3` caches (adapter.py)."""
from .adapter import suite

SPEC = "vq3"
globals().update(suite(SPEC))
