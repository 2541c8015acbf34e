"""Decode-step time of a ragged batch of compressed caches: one attention call per layer over shared code buffers
(`batch_decode.py`) against one call per sequence, steps alternated in one process.

Each sequence is prefilled alone, the caches are merged twice into two identical batches (mlx-lm's
`BatchGenerator` does the same), and every step feeds both batches one token per sequence, first one then the
other; the per-sequence batch has the shared buffers turned off. mlx-lm's `BatchKVCache` of the same prompts
takes its turn too, as the fp16 reference. Wall time, the process's CPU time (all its threads; on a machine shared
with other jobs the steadier of the two) and the host's time to build the step's graph (the model call before
its evaluation, which the GPU does not overlap when it is the longer part) are recorded.

    PYTHONPATH=. python benchmarks/batch_decode_step.py --preset vq4 --lengths 120,300,180,520,90,400,250,150 \
        --steps 24 --out benchmarks/results/batch-decode-step-smollm2-cpu
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, batch_decode
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.evaluation.results import write_json_and_markdown
from veloxquant_mlx.models import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    parser.add_argument("--preset", default="vq4", help="cache preset (default: vq4)")
    parser.add_argument("--lengths", default="120,300,180,520,90,400,250,150", help="prompt length of each sequence")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch, after 4 warm-up steps")
    parser.add_argument("--out", required=True, help="results folder (required)")
    args = parser.parse_args()

    model, _ = load_model(args.model)
    config = KVCacheConfig.preset(args.preset)
    lengths = [int(n) for n in args.lengths.split(",")]
    mx.random.seed(0)
    rows, fp16_rows = [], []
    for n in lengths:
        prompt = mx.random.randint(0, 1000, (1, n))
        for made, kept in ((KVCacheBuilder(config).for_model(model).build(), rows),
                           (make_prompt_cache(model), fp16_rows)):
            model(prompt, cache=made)
            mx.eval([c.state for c in made])
            kept.append(made)
    batches = {name: [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
               for name in ("batched", "per-sequence")}
    batches["mlx-lm fp16"] = [fp16_rows[0][i].merge([r[i] for r in fp16_rows]) for i in range(len(fp16_rows[0]))]
    compatible = batch_decode._compatible
    times = {name: [] for name in batches}
    cpu = {name: [] for name in batches}
    build = {name: [] for name in batches}
    token = mx.array([[5]] * len(lengths))
    try:
        for step in range(args.steps + 4):
            for name, caches in batches.items():
                batch_decode._compatible = compatible if name == "batched" else (lambda rows, first=None: False)
                start, start_cpu = time.perf_counter(), time.process_time()
                logits = model(token, cache=caches)
                built = time.perf_counter()
                mx.eval(logits)
                if step >= 4:
                    build[name].append(built - start)
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
    finally:
        batch_decode._compatible = compatible
    decoder = batches["batched"][0]._decoder
    if not decoder.active or batches["per-sequence"][0]._decoder.active:
        raise RuntimeError("the batched run did not use the shared buffers, or the per-sequence one did")
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    median_cpu = {name: statistics.median(t) * 1e3 for name, t in cpu.items()}
    median_build = {name: statistics.median(t) * 1e3 for name, t in build.items()}
    meta = {"model": args.model, "preset": args.preset, "lengths": lengths, "steps": args.steps,
            "path": decoder.last_path, "device": str(mx.default_device()), "machine": platform.processor(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows_out = [{"run": name, "median_ms": median[name], "median_cpu_ms": median_cpu[name],
                 "median_build_ms": median_build[name], "build_ms": [t * 1e3 for t in build[name]],
                 "step_ms": [t * 1e3 for t in times[name]], "step_cpu_ms": [t * 1e3 for t in cpu[name]]}
                for name in times]
    lines = [f"Decode-step time of a batch of {len(lengths)} sequences of {args.lengths} tokens, `{args.preset}` on "
             f"`{args.model}`, {args.steps} steps each, alternated in one process ({meta['device']}, batched path "
             f"`{meta['path']}`, mlx {meta['mlx']}, {meta['when']}).", "",
             "| attention | median step ms | vs per-sequence | median step CPU ms | vs per-sequence "
             "| median graph build ms |", "|---|---|---|---|---|---|"]
    for name in times:
        lines.append(f"| {name} | {median[name]:.1f} | {median['per-sequence'] / median[name]:.2f}x | "
                     f"{median_cpu[name]:.1f} | {median_cpu['per-sequence'] / median_cpu[name]:.2f}x | "
                     f"{median_build[name]:.2f} |")
    write_json_and_markdown(args.out, {"meta": meta, "rows": rows_out}, lines)


if __name__ == "__main__":
    main()
