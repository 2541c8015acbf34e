"""mlx-lm 0.32.2's own tests of its caches, generation and server, on plain `turboquant_mse:4` caches (adapter.py)."""
from .adapter import suite

SPEC = "turboquant_mse:4"
globals().update(suite(SPEC))
