"""Where a decode step's host time goes, part by part: MLX affine 4-bit against our 4-bit
codebook weights, on one layer of a shape (Llama-3.1-8B by default, random weights, fp16).

    python benchmarks/dispatch_breakdown.py --out benchmarks/results/gpu/dispatch-breakdown

`weights_gpu_model_decode.py` times a whole step's build (Python) and dispatch (`mx.async_eval`,
which issues every kernel from the calling thread). This splits both by part of a block:
the attention's projections (q, k, v, o as the attention calls them), the MLP, the whole
block with an fp16 KV cache of `--context` tokens, and the whole model's step. For each part:
the build in us, the dispatch in us (the device idle before it), and the graph's nodes by
primitive (`mx.export_to_dot`), since each node costs the dispatch something.
Medians over `--rounds`. Our model is quantized as the library does by default
(`quantize_model`: linked siblings, compiled routes, compiled MLPs).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.evaluation.shapes import build_shape_model, quantize_weights
from veloxquant_mlx.weights import quantize_model


def node_counts(outputs) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        labels = re.findall(r'label\s*="([A-Za-z_]+)', Path(f.name).read_text())
    return dict(collections.Counter(labels).most_common())


def timed(make, rounds: int) -> dict:
    """Build and dispatch us of `make()` -> list of arrays, and its graph's nodes."""
    builds, dispatches = [], []
    for _ in range(rounds + 2):
        mx.synchronize()
        start = time.perf_counter()
        outputs = make()
        built = time.perf_counter()
        mx.async_eval(outputs)
        dispatched = time.perf_counter()
        mx.eval(outputs)
        builds.append(built - start)
        dispatches.append(dispatched - built)
    nodes = node_counts(make())
    return {"build_us": 1e6 * statistics.median(builds[2:]), "dispatch_us": 1e6 * statistics.median(dispatches[2:]),
            "nodes": sum(nodes.values()), "nodes_by_primitive": nodes}


def parts(model, context: int, vocab: int, rounds: int, api_trace: bool) -> dict:
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(0)).astype(mx.float16)
    attended = mx.random.normal((1, 1, attn.n_heads * attn.head_dim), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(x, attended)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (1, context), key=mx.random.key(2)), cache=cache))
    token = mx.array([[1]])

    def rewind():
        for c in cache:
            if c.offset > context:
                c.trim(c.offset - context)

    record = {}
    for name, make in (("q,k,v projections", lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]),
                       ("o projection", lambda: [attn.o_proj(attended)]),
                       ("mlp", lambda: [mlp(x)]),
                       ("block (fp16 KV cache)", lambda: [layer(x, mask=None, cache=cache[0])]),
                       ("model step", lambda: [model(token, cache=cache)])):
        for _ in range(3):  # the first calls make the routes and the compiled traces
            mx.eval(make())
        record[name] = timed(make, rounds)
        rewind()
    if api_trace:
        record["model step"]["cuda_api"] = cuda_api_calls(lambda: [model(token, cache=cache)])
        rewind()
    return record


def quantized(variant: str, shape: str, overrides: dict):
    """The shape's random-weight model with MLX affine 4-bit weights, or ours ("codebook")."""
    model = build_shape_model(shape, "float16", None, seed=0, overrides=overrides)
    if variant == "affine":
        quantize_weights(model, 4)
    else:
        quantize_model(model, 4, seed=0, skip=("lm_head",), progress=False)
        nn.quantize(model, group_size=64, bits=4,
                    class_predicate=lambda path, m: path in ("lm_head", "model.embed_tokens"))
    mx.eval(model.parameters())
    return model


def cuda_api_calls(make, steps: int = 5) -> dict:
    """The CUDA runtime and driver calls the host makes while dispatching `steps` steps
    (PyTorch's profiler, which records them through CUPTI): count and us per step, by name."""
    from step_timeline import cuda_trace

    mx.synchronize()
    events = []
    with cuda_trace(events):
        for _ in range(steps):
            outputs = make()
            mx.async_eval(outputs)
            mx.eval(outputs)
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e.get("dur", 0.0)
    return {name: {"per_step": n / steps, "us_per_step": us / steps}
            for name, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--api-trace", action="store_true",
                        help="also record the CUDA API calls of the model's step (needs PyTorch)")
    parser.add_argument("--share-layers", action="store_true",
                        help="make every layer the first one (one set of modules called --layers times), to "
                             "see what distinct layers cost the host")
    parser.add_argument("--out", default="benchmarks/results/gpu/dispatch-breakdown")
    args = parser.parse_args()
    overrides = {"num_hidden_layers": args.layers}
    results = {}
    for variant in ("affine", "codebook"):
        model = quantized(variant, args.shape, overrides)
        if args.share_layers:
            model.model.layers = [model.model.layers[0]] * args.layers
        results[variant] = parts(model, args.context, model.args.vocab_size, args.rounds, args.api_trace)
        print(json.dumps({variant: {k: (v["build_us"], v["dispatch_us"], v["nodes"]) for k, v in results[variant].items()}}),
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(mx.default_device()), "args": vars(args),
                                                  "parts": results}, indent=2))
    shared = ", one layer's modules shared" if args.share_layers else ""
    lines = [f"| {args.shape} ({args.layers} layers{shared}), fp16, context {args.context} | affine build us | ours build us "
             "| affine dispatch us | ours dispatch us | affine nodes | ours nodes |", "|---|---:|---:|---:|---:|---:|---:|"]
    for part in results["affine"]:
        a, o = results["affine"][part], results["codebook"][part]
        lines.append(f"| {part} | {a['build_us']:.1f} | {o['build_us']:.1f} | {a['dispatch_us']:.1f} | "
                     f"{o['dispatch_us']:.1f} | {a['nodes']} | {o['nodes']} |")
    lines.append("")
    for part in results["affine"]:
        for variant in results:
            lines.append(f"* {variant}, {part}: " + ", ".join(f"{k} {v}" for k, v in
                                                            results[variant][part]["nodes_by_primitive"].items()))
    for variant in results:
        api = results[variant]["model step"].get("cuda_api")
        if api:
            lines.append(f"\n{variant}, the model's step, CUDA API calls on the host (per step):\n")
            lines.append("| call | count | us |")
            lines.append("|---|---:|---:|")
            lines += [f"| {name} | {v['per_step']:.1f} | {v['us_per_step']:.1f} |" for name, v in list(api.items())[:15]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
