"""Runs mlx-lm's own test files (`upstream/`, verbatim from the mlx-lm 0.32.2 sdist) on this library's caches.

`suite(spec)` imports each upstream file as a module of its own and returns its test classes. In that
module's globals:
- `load` (the tests' online model, "mlx-community/Qwen1.5-0.5B-Chat-4bit") gives the local SmolLM2,
  loaded once per process (`veloxquant_mlx.models.load_model`);
- with a library spec, every cache class the tests build (`KVCache`, `QuantizedKVCache`, `RotatingKVCache`,
  `BatchKVCache`, `BatchRotatingKVCache`) builds the library's cache of that spec instead, and an
  `isinstance` check against the name accepts the library's counterpart.
`patched_mlx_lm(spec)` makes mlx-lm's `make_prompt_cache` (what `generate_step`, `BatchGenerator` and the
server call) build the library's caches of the spec (`compressed_caches`). Spec None: mlx-lm's own caches,
the reference every failure is compared with (README.md here lists the results).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import unittest
from pathlib import Path

import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the module, in sys.modules)

UPSTREAM = Path(__file__).resolve().parent / "upstream"
FILES = ("test_prompt_cache", "test_generate", "test_server")
_MODEL = {}


def config_for(spec):
    """The library config a spec names: a preset ("vq3") or "method:bits" ("turboquant_mse:4")."""
    from veloxquant_mlx import KVCacheConfig

    if spec is None:
        return None
    if ":" in spec:
        method, bits = spec.split(":")
        return KVCacheConfig(method=method, bits=int(bits))
    return KVCacheConfig.preset(spec)


def local_model(path=None, *args, **kwargs):
    """SmolLM2 in place of the tests' online model: one copy per process (the tests only read it,
    but for `set_dtype(float32)`, which it already is on the CPU)."""
    from veloxquant_mlx.models import load_model

    if "smollm2" not in _MODEL:
        _MODEL["smollm2"] = load_model("smollm2")
    return _MODEL["smollm2"]


class _Replacing(type):
    """A stand-in for an mlx-lm cache class: calling it builds the library's cache, class attributes
    (`merge`) come from the library's class, and `isinstance` accepts the library's caches."""

    def __call__(cls, *args, **kwargs):
        return cls.build(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.accepts())

    def __getattr__(cls, name):
        return getattr(cls.target(), name)


def _stand_ins(config):
    from veloxquant_mlx import batch
    from veloxquant_mlx.cache import CompressedKVCache
    from veloxquant_mlx.rotating import CompressedRotatingKVCache

    def plain(*args, **kwargs):  # KVCache(), QuantizedKVCache(group_size=, bits=): the spec's cache
        return CompressedKVCache(config)

    def rotating(max_size, keep=0, **kwargs):
        return CompressedRotatingKVCache(config, max_size, keep)

    def batch_of(cls, make_row, left_padding, **kwargs):
        if "left_padding" in inspect.signature(cls.__init__).parameters:
            return cls(**kwargs, left_padding=left_padding) if kwargs else cls(left_padding=left_padding)
        rows = [make_row(**kwargs) for _ in left_padding]
        cache = cls.merge(rows)
        cache.prepare(left_padding=list(left_padding))
        return cache

    def batch_plain(left_padding):
        return batch_of(batch.BatchCompressedKVCache, plain, left_padding)

    def batch_rotating_of(max_size, left_padding, keep=0):  # a batch of sliding-window rows
        cache = batch.BatchCompressedKVCache.merge([rotating(max_size, keep) for _ in left_padding])
        cache.prepare(left_padding=list(left_padding))
        return cache

    def stand_in(name, build, target):
        targets = target if isinstance(target, tuple) else (target,)
        return _Replacing(name, (), {"build": staticmethod(build), "target": staticmethod(lambda: targets[0]),
                                     "accepts": staticmethod(lambda: targets)})

    return {
        "KVCache": stand_in("KVCache", plain, CompressedKVCache),
        "QuantizedKVCache": stand_in("QuantizedKVCache", plain, CompressedKVCache),
        "RotatingKVCache": stand_in("RotatingKVCache", rotating, CompressedRotatingKVCache),
        "BatchKVCache": stand_in("BatchKVCache", batch_plain, batch.BatchCompressedKVCache),
        "BatchRotatingKVCache": stand_in("BatchRotatingKVCache", batch_rotating_of, batch.BatchCompressedKVCache),
    }


# The tolerance of the upstream tests' `mx.allclose` on the library's caches, per spec: (rtol, atol). Their
# exact comparisons are of logits and log-probabilities computed twice on compressed caches through different
# calls (one generate_step against two, a batch against single runs, before and after a trim); README.md lists
# each and why the tolerance is what the method's error justifies. mlx-lm's own caches keep the tests' own.
# Per spec: the default, and per test where a test's comparison holds more than float noise.
TOLERANCE = {
    # test_cache_copying compares decoded keys with the fp16 tokens fed: 4-bit codes of head dim 4 decode within
    # 0.23 of them (200 seeds), while another of its random tokens lies at least 0.53 away.
    "turboquant_mse:4": {None: (1e-5, 1e-2), "test_cache_copying": (1e-5, 0.3)},
    "vq3": {None: (1e-5, 1e-2)},
}


class _TolerantMx:
    """`mlx.core` for an upstream module, with `allclose` at least as loose as `TOLERANCE` for the spec; the
    largest difference each comparison saw is recorded in `seen` (test name, max |a - b|, max |b|). Both
    comparisons take the library's histories (what `update_and_fetch` and `keys_and_values` return) as their
    decoded arrays (`mx.array(history)`)."""

    def __init__(self, tolerances: dict):
        self.tolerances, self.test, self.seen = tolerances, None, []

    def __getattr__(self, name):
        return getattr(mx, name)

    def array_equal(self, a, b, equal_nan: bool = False):
        """Exact, as upstream's; a history (`update_and_fetch`'s result) compares as its decoded arrays."""
        return mx.array_equal(_decoded(a), _decoded(b), equal_nan=equal_nan)

    def allclose(self, a, b, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False):
        a, b = mx.array(a), mx.array(b)
        self.seen.append((float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)))),
                          float(mx.max(mx.abs(b.astype(mx.float32))))))
        own_rtol, own_atol = self.tolerances.get(self.test, self.tolerances[None])
        return mx.allclose(a, b, rtol=max(rtol, own_rtol), atol=max(atol, own_atol), equal_nan=equal_nan)


def _decoded(x):
    """`x`, or where it is one of the library's histories (which hold no arrays), `mx.array(x)`: its decoded tokens."""
    return mx.array(x) if hasattr(x, "__mlx_array__") else x


def suite(spec):
    """{class name: TestCase class} of the three upstream files, run on `spec`'s caches (None: mlx-lm's)."""
    config = config_for(spec)
    tag = "mlx_lm" if spec is None else spec.replace(":", "_")
    classes = {}
    for name in FILES:
        module_name = f"mlx_lm_suite_{tag}_{name}"
        loaded = importlib.util.spec_from_file_location(module_name, UPSTREAM / f"{name}.py")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[module_name] = module
        loaded.loader.exec_module(module)
        module.load = local_model
        if config is not None:
            module.mx = _TolerantMx(TOLERANCE.get(spec, {None: (1e-5, 1e-8)}))
            for cls_name, stand_in in _stand_ins(config).items():
                if hasattr(module, cls_name):
                    setattr(module, cls_name, stand_in)
            if hasattr(module, "make_prompt_cache"):
                module.make_prompt_cache = _make_prompt_cache(config)
        for cls_name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, unittest.TestCase) and value.__module__ == module_name:
                classes[cls_name] = value
    return classes


def _make_prompt_cache(config):
    from veloxquant_mlx.integration import compressed_caches

    def make_prompt_cache(model, max_kv_size=None):
        if "make_cache" in vars(model):  # a test's own caches (built by the stand-ins)
            return model.make_cache()
        return compressed_caches(model, config, max_kv_size=max_kv_size)

    return make_prompt_cache


@contextlib.contextmanager
def patched_mlx_lm(spec):
    """mlx-lm's `make_prompt_cache`, wherever its modules call it, builds `spec`'s caches."""
    config = config_for(spec)
    if config is None:
        yield
        return
    import mlx_lm.server  # noqa: F401

    make = _make_prompt_cache(config)
    # The modules themselves: the attribute `mlx_lm.generate` is the function mlx_lm/__init__.py imports.
    modules = [sys.modules[name] for name in ("mlx_lm.models.cache", "mlx_lm.generate", "mlx_lm.server")]
    targets = [m for m in modules if hasattr(m, "make_prompt_cache")]
    saved = [(m, m.make_prompt_cache) for m in targets]
    try:
        for m in targets:
            m.make_prompt_cache = make
        yield
    finally:
        for m, original in saved:
            m.make_prompt_cache = original
