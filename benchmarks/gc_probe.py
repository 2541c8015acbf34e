"""Does Python's garbage collector run during decode steps? (A candidate for the slow rounds of the
GPU benchmark, docs/engine.md, eighteenth session; the nineteenth found them to be every step slower, no stall.)

    PYTHONPATH=. python benchmarks/gc_probe.py --methods fp16,turboquant_mse:3:vbits=4,vq3 --out DIR

Prefills `--prompt` random tokens on the default model, then times `--steps` greedy decode steps per
cache config while `gc.callbacks` records every collection (generation, duration). Writes results.json
and results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import mlx.core as mx


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="fp16,turboquant_mse:3:vbits=4,"
                        "turboquant_mse:3:vbits=4,sinks=4,window=64,center=true,renorm=true,vq3")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/gc-probe")
    args = parser.parse_args()

    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx import KVCacheBuilder, load_model
    from veloxquant_mlx.evaluation.specs import parse_method_list

    model, _ = load_model(args.model)
    events, started = [], {}

    def on_collection(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            events.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(on_collection)
    prompt = mx.random.randint(0, 1000, (1, args.prompt), key=mx.random.key(0))
    records = []
    for spec in parse_method_list(args.methods):
        cache = (make_prompt_cache(model) if spec.kind == "baseline"
                 else KVCacheBuilder(spec.config).for_model(model).build())
        logits = model(prompt, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        events.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        seconds = time.perf_counter() - start
        records.append({"method": spec.label, "steps": args.steps, "seconds": seconds,
                        "collections": {g: sum(1 for e in events if e[0] == g) for g in (0, 1, 2)},
                        "collection_ms": {g: 1e3 * sum(d for e, d in events if e == g) for g in (0, 1, 2)}})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "tracked_objects": len(gc.get_objects()),
                                                  "records": records}, indent=2) + "\n")
    lines = [f"Python garbage collections during {args.steps} decode steps after a {args.prompt}-token prompt, "
             f"model `{args.model}`, {mx.default_device()}.", "",
             "| method | steps ms | gen 0 | gen 1 | gen 2 | collection ms |", "|---|---|---|---|---|---|"]
    for r in records:
        c = r["collections"]
        lines.append(f"| `{r['method']}` | {1e3 * r['seconds']:.0f} | {c[0]} | {c[1]} | {c[2]} | "
                     f"{sum(r['collection_ms'].values()):.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
