import time, sys
import mlx.core as mx
from veloxquant_mlx.models import load_model
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.integration import make_prompt_cache
from veloxquant_mlx import attention, engine

model, tok = load_model()[:2]
tokens = mx.random.randint(0, 40000, (1, 4096), key=mx.random.key(0))
specs = {"plain": dict(method="turboquant_mse", bits=3, value_bits=2),
         "window": dict(method="turboquant_mse", bits=3, value_bits=2, sink_tokens=4, residual_length=32),
         "sinks": dict(method="turboquant_mse", bits=3, value_bits=2, sink_tokens=4),
         "win_only": dict(method="turboquant_mse", bits=3, value_bits=2, residual_length=32)}
calls = {}
orig = attention.attend
def counted(*a, **k):
    t = time.perf_counter(); out = orig(*a, **k); mx.eval(out); calls.setdefault("attend", []).append(time.perf_counter() - t); return out
engine.generic_attend = counted
from veloxquant_mlx.cache import CompressedKVCache as C
orig_update = C.update_and_fetch
def timed_update(self, k, v):
    mx.eval(k, v)
    t = time.perf_counter(); out = orig_update(self, k, v)
    mx.eval([a for a in self.state if isinstance(a, mx.array)] if isinstance(self.state, (list, tuple)) else self.state)
    calls.setdefault("update", []).append(time.perf_counter() - t); return out
C.update_and_fetch = timed_update
from veloxquant_mlx.cache import CompressedKVCache
for arg in sys.argv[1:]:
    name, _, band = arg.partition("@")
    if band:
        CompressedKVCache.band_queries = int(band)
    cache = make_prompt_cache(model, KVCacheConfig(**specs[name]))
    calls.clear()
    t = time.perf_counter()
    for s in range(0, 4096, 2048):
        mx.eval(model(tokens[:, s:s + 2048], cache=cache))
    total = time.perf_counter() - t
    print(arg, f"total {total:.1f}s", {k: (len(v), round(sum(v), 1)) for k, v in calls.items()}, flush=True)
