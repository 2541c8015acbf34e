"""The GPU timeline of whole-model decode steps, fp16 cache vs ours (CUDA only).

    python benchmarks/step_timeline.py [--shape llama-3.1-8b] [--contexts 4096,32768] [--steps 3] [--out DIR]

Records every kernel MLX launches during `--steps` decode steps (each built, then
evaluated alone) with PyTorch's profiler (CUPTI activity tracing sees all
kernels of the process, MLX's included), and reports per step: wall time, kernel
count, busy time (sum of kernel durations; one stream, so they do not overlap),
idle time inside the step's span, and the kernels grouped by kind. Where the
device is idle, the step waits on the host (MLX's dispatch); where it is busy,
the kernels' own time is what to cut. Writes timeline.json and timeline.md.

    python benchmarks/step_timeline.py --partial-only --contexts 32768

runs just the decode attention (no model) a few times, for `ncu -k regex:mse_partial`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.evaluation.shapes import build_shape_model  # noqa: E402
from veloxquant_mlx.evaluation.specs import parse_method_list  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import prefilled_caches  # noqa: E402


def kind_of(name: str) -> str:
    low = name.lower()
    if "vq_" in low:
        return "ours: " + next((k for k in ("mse_partial", "merge_encode", "merge", "mse_encode", "mse_dequant",
                                            "lut_matmul_rotating", "lut_matmul", "rotate_input", "partial")
                                 if k in low), low)
    for key, kind in (("hadamard", "hadamard"), ("sdpa", "sdpa"), ("attention", "sdpa"), ("qmv", "quantized matmul"),
                      ("qmm", "quantized matmul"), ("affine", "quantized matmul"), ("gemv", "matmul"),
                      ("gemm", "matmul"), ("matmul", "matmul"), ("copy", "copy"), ("rope", "rope"),
                      ("rms", "rms_norm"), ("reduce", "reduce"), ("softmax", "softmax"), ("arg", "arg")):
        if key in low:
            return kind
    return "other"


def step_record(trace_events, wall_ms: float, build_ms: float) -> dict:
    kernels = sorted((e for e in trace_events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {"wall_ms": wall_ms, "build_ms": build_ms, "kernels": 0}
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    by_kind = defaultdict(lambda: [0, 0.0])
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kind[kind_of(e["name"])][0] += 1
        by_kind[kind_of(e["name"])][1] += e["dur"] / 1e3
        by_name[e["name"][:90]][0] += 1
        by_name[e["name"][:90]][1] += e["dur"] / 1e3
    return {
        "wall_ms": wall_ms, "build_ms": build_ms, "kernels": len(kernels), "busy_ms": busy / 1e3,
        "span_ms": span / 1e3, "idle_in_span_ms": (span - busy) / 1e3,
        "by_kind": {k: {"count": c, "ms": t} for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": n, "count": c, "ms": t} for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]],
        # The first kernels in launch order (two or more layers), with their launch shapes.
        "sequence": [{"name": e["name"][:70], "us": e["dur"], "grid": e.get("args", {}).get("grid"),
                      "block": e.get("args", {}).get("block"), "stream": e.get("args", {}).get("stream")}
                     for e in kernels[:320]],
    }


@contextlib.contextmanager
def cuda_trace(events: list):
    """Append to `events` the trace events (Chrome format) of the CUDA kernels launched
    inside the block, recorded with PyTorch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events.extend(json.load(open(f.name))["traceEvents"])


def profiled_step(fn):
    """(trace events, wall ms, build ms) of fn() -> array, built and evaluated alone."""
    mx.synchronize()
    events = []
    with cuda_trace(events):
        start = time.perf_counter()
        out = fn()
        built = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        end = time.perf_counter()
    return events, (end - start) * 1e3, (built - start) * 1e3


def timeline(model, spec: str, context: int, steps: int, vocab: int, batch: int = 1) -> list:
    caches = prefilled_caches(model, spec, context, vocab, batch)
    y = mx.ones((batch, 1), dtype=mx.int32)
    for _ in range(4):  # warm up: JIT, compiled traces
        mx.eval(model(y, cache=caches))
    records = []
    for _ in range(steps):
        events, wall, build = profiled_step(lambda: model(y, cache=caches))
        records.append(step_record(events, wall, build))
    return records, pipelined(model, caches, 16, batch)


def prefill_timeline(model, spec: str, context: int, chunk: int, vocab: int) -> dict:
    """One `chunk`-token prefill chunk after `context - chunk` prompt tokens (the earlier
    chunks compiled its kernels), evaluated as mlx-lm's generate_step does (`c.state` after
    the chunk); the wall time includes the syncs the cache makes while the chunk is built."""
    caches = prefilled_caches(model, spec, context - chunk, vocab)
    tokens = mx.random.randint(0, vocab, (chunk,), key=mx.random.key(1))
    events, wall, build = profiled_step(lambda: [model(tokens[None], cache=caches)] + [c.state for c in caches])
    return step_record(events, wall, build)


def pipelined(model, caches, n: int, batch: int = 1) -> dict:
    """`n` greedy steps overlapped as mlx-lm's generate_step does (build step i+1 while
    step i runs): ms per token, and how busy the device was over the window."""

    def step(y):
        return mx.argmax(model(y, cache=caches)[:, -1, :], axis=-1)[:, None]

    y = step(mx.ones((batch, 1), dtype=mx.int32))
    mx.async_eval(y)
    mx.eval(y)
    events = []
    with cuda_trace(events):
        start = time.perf_counter()
        for _ in range(n):
            nxt = step(y)
            mx.async_eval(nxt)
            mx.eval(y)  # the step before: its token is what the host waits for
            y = nxt
        mx.eval(y)
        wall = (time.perf_counter() - start) * 1e3
    record = step_record(events, wall, 0.0)
    return {"tokens": n, "ms_per_token": wall / n, "busy_ms_per_token": record.get("busy_ms", 0.0) / n,
            "busy_share_of_span": record.get("busy_ms", 0.0) / max(record.get("span_ms", 0.0), 1e-9)}


def partial_only(context: int, calls: int):
    """Decode attention alone over one K3/V4 cache, for ncu."""
    from veloxquant_mlx.cache import CompressedKVCache
    from veloxquant_mlx.config import KVCacheConfig

    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4)
    k = mx.random.normal((1, 8, context, 128), key=mx.random.key(0)).astype(mx.float16)
    cache = CompressedKVCache(cfg)
    for start in range(0, context, 4096):
        cache.update_and_fetch(k[..., start:start + 4096, :], k[..., start:start + 4096, :])
        mx.eval(cache.store.rows)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(1)).astype(mx.float16)
    for _ in range(calls):
        mx.eval(cache.attend(q, scale=128 ** -0.5))
    mx.synchronize()


def markdown(result: dict) -> str:
    what = (f"one {result['prefill_chunk']}-token prefill chunk" if result.get("prefill_chunk")
            else f"decode steps, median over {result['steps']} steps")
    batch = f", batch {result['batch']}" if result.get("batch", 1) > 1 else ""
    lines = [f"Whole-model {what} on {result['device']} ({result['shape']}{batch}, 4-bit weights, fp16), "
             "each built and evaluated alone.", "",
             "| cache | context | wall ms | build ms | kernels | busy ms | idle in span ms "
             "| pipelined ms/token | pipelined busy ms/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        recs = [r for r in run["steps"] if r.get("kernels")]
        if not recs:
            continue
        med = lambda key: statistics.median(r[key] for r in recs)  # noqa: E731
        lines.append(f"| `{run['spec']}` | {run['context']} | {med('wall_ms'):.2f} | {med('build_ms'):.2f} | "
                     f"{med('kernels'):.0f} | {med('busy_ms'):.2f} | {med('idle_in_span_ms'):.2f} | "
                     f"{run['pipelined'].get('ms_per_token', float('nan')):.2f} | "
                     f"{run['pipelined'].get('busy_ms_per_token', float('nan')):.2f} |")
    for run in result["runs"]:
        recs = [r for r in run["steps"] if r.get("kernels")]
        if not recs:
            continue
        last = recs[-1]
        lines += ["", f"Kernels by kind, `{run['spec']}` at {run['context']} (last step):", "",
                  "| kind | count | ms |", "|---|---:|---:|"]
        lines += [f"| {k} | {v['count']} | {v['ms']:.3f} |" for k, v in last["by_kind"].items()]
    return "\n".join(lines) + "\n"


def weights_model(shape: str, weights: str):
    """The shape's random-weight model with MLX affine 4-bit weights, or ours ("codebook")."""
    if weights == "affine":
        return build_shape_model(shape, dtype="float16", weights_bits=4)
    if weights != "codebook":
        raise SystemExit(f"unknown --weights {weights!r}: affine or codebook")
    import mlx.nn as nn

    from veloxquant_mlx.weights import quantize_model

    model = build_shape_model(shape, dtype="float16", weights_bits=None)
    quantize_model(model, 4, seed=0, skip=("lm_head",), progress=False)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: path in ("lm_head", "model.embed_tokens"))
    mx.eval(model.parameters())
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", default="fp16,turboquant_mse:3:vbits=4")
    parser.add_argument("--out", default=None)
    parser.add_argument("--partial-only", action="store_true")
    parser.add_argument("--weights", default="affine",
                        help="comma list of weight formats, each a model of its own: affine (MLX 4-bit, group 64), "
                             "codebook (ours: quantize_model 4-bit, default settings; head and embeddings affine)")
    parser.add_argument("--batch", type=int, default=1, help="decode this many prompts of each context at once")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="trace one prefill chunk of this many tokens ending at each context, not decode steps")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.partial_only:
        for context in contexts:
            partial_only(context, 6)
        return
    result = {"device": str(mx.default_device()), "shape": args.shape, "steps": args.steps,
              "prefill_chunk": args.prefill_chunk, "batch": args.batch, "runs": []}
    out = Path(args.out) if args.out else None
    runs = [(weights, context, spec) for weights in args.weights.split(",") for context in contexts
            for spec in [m.text for m in parse_method_list(args.methods)]]
    model, built = None, None
    for weights, context, spec in runs:
        if built != weights:
            model, built = None, weights  # one model at a time (the 8B shape's weights)
            model = weights_model(args.shape, weights)
        spec_label = spec if weights == "affine" else f"{spec} (weights: {weights})"
        if args.prefill_chunk:
            steps, overlapped = [prefill_timeline(model, spec, context, args.prefill_chunk,
                                                  model.args.vocab_size)], {}
        else:
            steps, overlapped = timeline(model, spec, context, args.steps, model.args.vocab_size, args.batch)
        result["runs"].append({"spec": spec_label, "context": context, "steps": steps, "pipelined": overlapped})
        print(json.dumps({"spec": spec_label, "context": context, "last": steps[-1], "pipelined": overlapped},
                         indent=1), flush=True)
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "timeline.json").write_text(json.dumps(result, indent=1))
            (out / "timeline.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
