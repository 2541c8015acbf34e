"""VeloxQuant-MLX: truly compressed KV caches for mlx-lm."""

from .cache import CacheFormatError, CompressedKVCache
from .config import KVCacheConfig
from .rotating import CompressedRotatingKVCache
from . import attention_hook  # noqa: E402,F401  (registers its installer with the cache: restored caches install the hook)
from .integration import (
    KVCacheBuilder,
    SingleHeadCache,
    UnsupportedModelError,
    load_prompt_cache,
    make_prompt_cache,
    patch_model,
    save_prompt_cache,
    unpatch_model,
)
from .methods import available_methods, get_method, register_method
from .models import load_model
from .settings import EngineSettings
from . import kernels  # noqa: E402,F401  (registers the kernels' attention paths with the engine)
from . import kernel_cases  # noqa: E402,F401  (registers the kernels' first-use checks, which fill caches)
from . import presets  # noqa: E402,F401  (registers the preset names `KVCacheConfig.preset` resolves)

__version__ = "0.1.0"

from .blas import slow_blas_warning  # noqa: E402

slow_blas_warning()

__all__ = [
    "CacheFormatError",
    "CompressedKVCache",
    "CompressedRotatingKVCache",
    "EngineSettings",
    "KVCacheBuilder",
    "KVCacheConfig",
    "SingleHeadCache",
    "UnsupportedModelError",
    "available_methods",
    "get_method",
    "load_model",
    "load_prompt_cache",
    "make_prompt_cache",
    "patch_model",
    "register_method",
    "save_prompt_cache",
    "unpatch_model",
]
