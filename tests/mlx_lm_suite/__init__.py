"""mlx-lm 0.32.2's own tests run on the library's caches (README.md)."""
