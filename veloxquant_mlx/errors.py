"""Errors that several layers raise and callers catch by type."""


class UnsupportedModelError(ValueError):
    """A model whose attention layers a cache or method cannot serve."""
