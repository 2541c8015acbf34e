"""How a whole model's batched decode step grows with its rows: what a server gains from admitting more sequences.

A KV budget that admits 4x the sequences gives 4x the tokens per second only if a step of 4x the rows costs no
more than one of the original rows, that is, if the batch shares the weights' reads. This measures the step at
each row count for three caches of equal rows and history: mlx-lm's `KVCache` holding every row (no mask, one
integer offset), mlx-lm's `BatchKVCache` merged from single rows (the server's layout: array offsets and a mask),
and a preset's cache merged the same way. `--matmuls` also times the model's first layer's linear layers alone at
each row count, as the model runs them and, for quantized layers, as `dequantize` followed by a dense matmul, to
show whether the weights' matmul is what grows.

    PYTHONPATH=. python benchmarks/batch_decode_rows.py --model /tmp/llama-8b-q4 --rows 1,8,16,30,32 \\
        --history 64,4096 --matmuls --out results/batch-decode-rows
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.evaluation.benchmark import median_call_ms, prefill
from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.models import load_model

PREFILL_CHUNK = 512


def filled(model, tokens, caches):
    prefill(model, caches, tokens, PREFILL_CHUNK, check=lambda: None)
    return caches


def merged(model, tokens, make, rows: int):
    single = filled(model, tokens[:1], make())
    caches = [layer.merge([layer] * rows) for layer in single]
    mx.eval([c.state for c in caches])
    return caches


def step_times(model, preset: str, rows: int, history: int, repeats: int):
    tokens = mx.random.randint(0, 1000, (rows, history))
    token = mx.zeros((rows, 1), dtype=mx.int32) + 5
    builders = {"fp16 KVCache": lambda: filled(model, tokens, make_prompt_cache(model)),
                "fp16 BatchKVCache": lambda: merged(model, tokens, lambda: make_prompt_cache(model), rows),
                preset: lambda: merged(model, tokens,
                                       lambda: KVCacheBuilder(KVCacheConfig.preset(preset)).for_model(model).build(),
                                       rows)}
    result = {}
    for name, build in builders.items():
        result[name] = decode_step_ms(model, token, build(), repeats)
        mx.clear_cache()
    return result


def decode_step_ms(model, token, caches, repeats: int) -> float:
    return median_call_ms(lambda: model(token, cache=caches), repeats, warmup=3)


def linear_layers(model):
    layer = model.layers[0] if hasattr(model, "layers") else model.model.layers[0]
    return [(path, module) for path, module in layer.named_modules()
            if isinstance(module, (nn.Linear, nn.QuantizedLinear))]


def matmul_times(model, rows: int, repeats: int):
    as_run, dequantized = 0.0, 0.0
    for _, module in linear_layers(model):
        quantized = isinstance(module, nn.QuantizedLinear)
        width = module.weight.shape[-1] * 32 // module.bits if quantized else module.weight.shape[-1]
        x = mx.random.normal((rows, width)).astype(module.scales.dtype if quantized else module.weight.dtype)
        as_run += median_call_ms(lambda: module(x), repeats)
        if quantized:
            dequantized += median_call_ms(lambda: x @ mx.dequantize(module.weight, module.scales, module.biases,
                                                                    module.group_size, module.bits).T, repeats)
    return {"as run": as_run, "dequantize + matmul": dequantized or None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    parser.add_argument("--preset", default="vq4", help="the compressed cache (default: vq4)")
    parser.add_argument("--rows", default="1,8,16,30,32", help="rows per batch")
    parser.add_argument("--history", default="64,4096", help="tokens each row holds before the timed steps")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per cache (median; after 3 warm-up)")
    parser.add_argument("--matmuls", action="store_true", help="also time the first layer's linear layers alone")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()

    model, _ = load_model(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    histories = [int(h) for h in args.history.split(",")]
    mx.random.seed(0)
    records = []
    for history in histories:
        for count in rows:
            times = step_times(model, args.preset, count, history, args.steps)
            records.append({"history": history, "rows": count, "step_ms": times})
    matmuls = [{"rows": count, "first_layer_ms": matmul_times(model, count, args.steps * 3)} for count in rows] \
        if args.matmuls else []
    meta = {"model": args.model, "preset": args.preset, "steps": args.steps, "device": str(mx.default_device()),
            "machine": platform.processor(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    caches = list(records[0]["step_ms"])
    lines = [f"Whole-model decode step of `{args.model}` at each row count, median of {args.steps} steps "
             f"({meta['device']}, mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']}, {meta['when']}). Rows hold equal "
             "histories; tok/s is rows over the step.", "",
             "| history | rows | " + " | ".join(f"{c} ms (tok/s)" for c in caches) + " |",
             "|---:|---:|" + "---:|" * len(caches)]
    for record in records:
        cells = [f"{record['step_ms'][c]:.1f} ({record['rows'] * 1e3 / record['step_ms'][c]:.0f})" for c in caches]
        lines.append(f"| {record['history']} | {record['rows']} | " + " | ".join(cells) + " |")
    for history in histories:
        ends = [r for r in records if r["history"] == history]
        if len(ends) > 1:
            low, high = ends[0], ends[-1]
            slopes = ", ".join(f"{c} {(high['step_ms'][c] - low['step_ms'][c]) / (high['rows'] - low['rows']):.2f}"
                               for c in caches)
            lines.append(f"\nAt {history} tokens, each row from {low['rows']} to {high['rows']} adds (ms per step): "
                         f"{slopes}.")
    if matmuls:
        lines += ["", "The first layer's linear layers alone, summed (ms):", "",
                  "| rows | as run | dequantize + matmul |", "|---:|---:|---:|"]
        for record in matmuls:
            t = record["first_layer_ms"]
            dense = f"{t['dequantize + matmul']:.3f}" if t["dequantize + matmul"] is not None else "-"
            lines.append(f"| {record['rows']} | {t['as run']:.3f} | {dense} |")
    write_json_and_markdown(args.out, {"meta": meta, "rows": records, "matmuls": matmuls}, lines)


if __name__ == "__main__":
    main()
