"""Compression methods, one file each, registered by name."""

from .base import Codec, Method, available_methods, get_method, register_method

from . import fp16, kivi, mlxq, polarquant, qjl, rabitq, turboquant_mse, turboquant_prod, turboquant_rvq  # noqa: E402,F401  (registration)
from . import commvq, ratequant, spectralquant, vecinfer  # noqa: E402,F401  (calibrated methods: docs/methods.md)

__all__ = ["Codec", "Method", "available_methods", "get_method", "register_method"]
