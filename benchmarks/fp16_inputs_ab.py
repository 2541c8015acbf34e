"""A/B: compiled decode steps taking the fp16 sinks/window as held (fp16_inputs, now) against
joined and centred outside the graph (before), one layer of the Llama-3.1-8B shape."""
import json, statistics, sys, time
import mlx.core as mx
from veloxquant_mlx import EngineSettings, engine
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.evaluation.specs import parse_method_spec

KV, QH, D = 8, 32, 128
ORIG = engine.History.fp16_inputs
def joined(self):
    fp16 = self.fp16
    return (0, []) if fp16 is None else (-1, list(fp16))

def run(spec, context, variant, steps=64):
    engine.History.fp16_inputs = ORIG if variant == "held" else joined
    cache = CompressedKVCache(parse_method_spec(spec).config, settings=EngineSettings.resolve())
    k = (mx.random.normal((1, KV, context + steps + 8, D), key=mx.random.key(1))).astype(mx.float16)
    v = mx.random.normal((1, KV, context + steps + 8, D), key=mx.random.key(2)).astype(mx.float16)
    for s in range(0, context, 2048):
        cache.update_and_fetch(k[..., s:min(s+2048, context), :], v[..., s:min(s+2048, context), :])
        mx.eval(cache.attend(mx.zeros((1, QH, min(2048, context - s), D), mx.float16), D ** -0.5, "causal"))
    q = mx.random.normal((1, QH, 1, D), key=mx.random.key(3)).astype(mx.float16)
    times = []
    for i in range(steps):
        t = context + i
        mx.synchronize(); t0 = time.perf_counter()
        cache.update_and_fetch(k[..., t:t+1, :], v[..., t:t+1, :])
        mx.eval(cache.attend(q, D ** -0.5))
        mx.synchronize(); times.append(time.perf_counter() - t0)
    return {"spec": spec, "context": context, "variant": variant, "path": cache.last_path,
            "step_ms": statistics.median(times[8:]) * 1e3}

out = []
for context in (4096, 32768):
    for rnd in range(3):
        for spec in ("turboquant_mse:3:vbits=4,sinks=4,window=64,center=true,renorm=true", "turboquant_mse:3:vbits=4"):
            for variant in ("held", "joined"):
                r = run(spec, context, variant); r["round"] = rnd; out.append(r); print(json.dumps(r), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
