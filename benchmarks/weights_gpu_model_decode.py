"""Whole-model decode of the Llama-3.1-8B shape (random weights, fp16 activations, mlx-lm's
fp16 KV cache): our 4-bit codebook weights against MLX's affine 4-bit (group 64), in one run.

    python benchmarks/weights_gpu_model_decode.py --out benchmarks/results/gpu/weights-model-decode-fused
    python benchmarks/weights_gpu_model_decode.py --shape tiny --layers 2 --prompt 16 --tokens 4 --rounds 1 \\
        --out /tmp/dry        # a quick dry run (CPU too)

Variants (`--variants`; default: all but shared-compiled), all from the same fp16 weights (seed 0):
  affine           MLX `nn.quantize`, 4-bit group 64, its quantized matmul;
  per-layer        ours, `quantize_model(share_rotations=False)` (the default), with the rotating
                   matmul off: every layer rotates its own input with MLX ops (a multiply by
                   signs x column scale, then mx.hadamard_transform: two launches), then the LUT matmul;
  per-layer-rotating  the same model as the library runs it by default: decode at batch 1 takes
                   the LUT matmul with the rotation in its prologue (`weights/rotating_matmul.py`)
                   for the 4096-wide inputs, q/k/v in one launch and gate/up in another
                   (`weights/siblings.py`), o_proj in its own; down_proj (14336) as per-layer;
                   each route's launches under mx.compile (the GPU default, `kernel.COMPILE_ROUTES`),
                   each MLP one compiled call and each block's halves around its attention two
                   (`compiled_mlp.py`, `compiled_block.py`);
  per-layer-rotating-single  the same with one launch per layer (VELOXQUANT_WEIGHT_SIBLING_LAUNCH=0);
  per-layer-rotating-fused  per-layer-rotating with down_proj's rotation (the one layer the rotating
                   matmul does not take) one launch of the fused kernel (`rotation_kernel.FUSED_ROTATION`)
                   instead of a multiply and mx.hadamard_transform;
  per-layer-rotating-rpw2  per-layer-rotating with two output rows per warp in the plain LUT
                   kernel (down_proj; `kernel.ROWS_PER_WARP`);
  per-layer-rotating-compiled  per-layer-rotating with every kept route wrapped in mx.compile (the
                   same as the default: `kernel.COMPILE_ROUTES`);
  per-layer-rotating-rpw2-compiled  both;
  per-layer-rotating-uncompiled  per-layer-rotating with no route compiled (VELOXQUANT_WEIGHT_COMPILE=0);
  per-layer-rotating-unfused-mlp  per-layer-rotating with each MLP as its layers' calls, not one compiled
                   call (`compiled_mlp.COMPILE_MLPS` off; on by default);
  per-layer-rotating-uncompiled-blocks  per-layer-rotating with each block's halves around its attention as
                   their modules' calls, not two compiled calls (`compiled_block.COMPILE_BLOCKS` off; on by
                   default);
  shared           ours, `share_rotations=True`: q/k/v and gate/up read one rotated input, made by
                   their norm with MLX ops (mx.fast.rms_norm, then mx.hadamard_transform,
                   `weights/shared.py`); o_proj and down_proj rotate their own as per-layer does;
  per-layer-fused  per-layer with each rotation one launch of the fused kernel
                   (`weights/rotation_kernel.py`, `rotation_kernel.FUSED_ROTATION`, opt-in);
  shared-fused     shared with the norms' rms_norm + transform and o_proj's / down_proj's rotations
                   each one launch of that kernel;
  shared-rotating  shared with o_proj's rotation in its matmul's launch (rotating matmul on);
  shared-compiled  shared (ops), each layer's kernel call wrapped in mx.compile (`kernel.COMPILE_ROUTES`).
Every variant but the -rotating ones runs with the rotating matmul off.
Our models keep the output head and the embeddings MLX affine, so the comparison is the
blocks' linear layers. Each round decodes `--tokens` tokens after a `--prompt`-token prompt
with each variant in turn (mlx-lm's `generate_step`), so they alternate; the table reports
the median tokens per second over `--rounds` rounds, the ratio to affine, the host time to
build one decode step's graph, and the relative RMS error of the prompt's last logits against
the fp16 model (a check that each path computes the model). A variant that fails is reported
with its error and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from veloxquant_mlx.evaluation.shapes import build_shape_model, quantize_weights, resolve_dtype, shape_config
from veloxquant_mlx.weights import compiled_block, compiled_mlp, kernel, quantize_model, rotating_matmul, rotation_kernel

VARIANTS = ("affine", "per-layer", "per-layer-rotating", "per-layer-rotating-single", "per-layer-rotating-fused",
            "per-layer-rotating-rpw2",
            "per-layer-rotating-compiled", "per-layer-rotating-rpw2-compiled", "per-layer-rotating-uncompiled",
            "per-layer-rotating-unfused-mlp", "per-layer-rotating-uncompiled-blocks", "shared", "shared-rotating",
            "per-layer-fused", "shared-fused", "shared-compiled")
DEFAULT_VARIANTS = ("affine", "per-layer", "per-layer-rotating", "per-layer-rotating-single", "shared",
                    "shared-rotating")


def decode_rate(model, prompt: mx.array, tokens: int) -> float:
    steps = generate_step(prompt, model, max_tokens=tokens + 1)
    next(steps)  # the prompt and the first token
    mx.synchronize()
    start = time.perf_counter()
    for _ in steps:
        pass
    mx.synchronize()
    return tokens / (time.perf_counter() - start)


def host_ms(model, rounds: int = 20, prompt: int = 8, profile: str = "") -> tuple:
    """(host ms to build one decode step's graph, not evaluated: what mlx-lm's pipelined decode
    overlaps with the GPU, so the GPU waits when it exceeds the step's GPU time; ms to build and
    evaluate one step alone). With `profile`, cProfile's top functions of the builds go there."""
    import cProfile
    import io
    import pstats

    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, prompt), dtype=mx.int32), cache=cache))
    token = mx.zeros((1, 1), dtype=mx.int32)
    builds, dispatches, steps = [], [], []
    profiler = cProfile.Profile() if profile else None
    for _ in range(rounds):
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        logits = model(token, cache=cache)
        if profiler:
            profiler.disable()
        built = time.perf_counter()
        mx.async_eval(logits)
        dispatches.append(time.perf_counter() - built)
        builds.append(built - start)
        mx.eval(logits)
        steps.append(time.perf_counter() - start)
        for c in cache:
            c.trim(1)
    if profiler:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        Path(profile).write_text(text.getvalue())
    return tuple(1e3 * statistics.median(t) for t in (builds, steps, dispatches))


def last_logits(model, prompt: mx.array) -> mx.array:
    logits = model(prompt[None])[0, -1].astype(mx.float32)
    mx.eval(logits)
    return logits


def build(variant: str, args, overrides) -> tuple:
    """(model, seconds to quantize) of one variant."""
    model = build_shape_model(args.shape, args.dtype, None, seed=0, overrides=overrides)
    start = time.perf_counter()
    if variant == "affine":
        quantize_weights(model, args.bits)
    else:
        quantize_model(model, args.bits, seed=0, skip=("lm_head",), share_rotations=variant.startswith("shared"),
                       progress=False)
        nn.quantize(model, group_size=64, bits=args.bits,
                    class_predicate=lambda path, m: path in ("lm_head", "model.embed_tokens"))
    mx.eval(model.parameters())
    return model, time.perf_counter() - start


def use(variant: str) -> None:
    """Settings a variant runs under (read when a layer first meets an input shape)."""
    # "-uncompiled": no route compiled; else the library's default (compiled; "-compiled" names it)
    kernel.COMPILE_ROUTES = not variant.endswith("-uncompiled")
    rotation_kernel.FUSED_ROTATION = variant.endswith("-fused")
    rotating_matmul.ROTATING_MATMUL = "-rotating" in variant
    rotating_matmul.SIBLING_LAUNCH = not variant.endswith("-single")
    kernel.ROWS_PER_WARP = 2 if "-rpw2" in variant else None
    compiled_mlp.COMPILE_MLPS = not variant.endswith("-unfused-mlp")
    compiled_block.COMPILE_BLOCKS = not variant.endswith("-uncompiled-blocks")


def fused_rotation(variant: str) -> str:
    """Which kernel the variant's rotations ran in, by its first-use check's verdict."""
    module, name = {"-fused": (rotation_kernel, "rotate_input"),
                    "-rotating": (rotating_matmul, "in the matmul")}.get(
        "-rotating" if "-rotating" in variant else "-" + variant.rsplit("-", 1)[-1], (None, ""))
    if module is None:
        return "no (ops)"
    dialect = kernel._gpu_dialect()
    verdict = module.checked(dialect) if dialect else None
    said = {True: name, False: f"no: {name} failed its first-use check"}.get(verdict, "no: no GPU back end")
    if "-rotating" in variant and variant.endswith("-fused"):  # down_proj through the fused kernel
        verdict = rotation_kernel.checked(dialect) if dialect else None
        said += "; down_proj: " + {True: "rotate_input", False: "ops (rotate_input failed its check)"}.get(
            verdict, "ops")
    return said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep it)")
    parser.add_argument("--dtype", default="auto", help="activations: auto (fp16 on a GPU, fp32 on the CPU), "
                                                        "float16, bfloat16, float32")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", default="", help="comma-separated variants whose graph builds are cProfiled "
                                                          "(host-profile-VARIANT.txt)")
    parser.add_argument("--out", default="benchmarks/results/gpu/weights-model-decode-fused")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    args.dtype, _ = resolve_dtype(args.dtype)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    vocab = shape_config(args.shape)["vocab_size"]
    prompt = mx.random.randint(0, vocab, (args.prompt,), key=mx.random.key(1))

    reference = build_shape_model(args.shape, args.dtype, None, seed=0, overrides=overrides)
    ref_logits = last_logits(reference, prompt)
    del reference
    gc.collect()

    models, record, errors = {}, {}, {}
    for variant in variants:
        try:
            use(variant)
            model, seconds = build(variant, args, overrides)
            gc.collect()
            logits = last_logits(model, prompt)
            error = float(mx.sqrt(mx.mean(mx.square(logits - ref_logits))) / mx.sqrt(mx.mean(mx.square(ref_logits))))
            decode_rate(model, prompt, 8)  # warm-up: compile the kernels
            profile = str(Path(args.out) / f"host-profile-{variant}.txt") if variant in args.profile.split(",") else ""
            Path(args.out).mkdir(parents=True, exist_ok=True)
            build_ms, step_ms, dispatch_ms = host_ms(model, profile=profile)
            record[variant] = {"quantize_s": seconds, "logits_rel_rms_error_vs_fp16": error,
                               "host_ms_per_step": build_ms, "dispatch_ms_per_step": dispatch_ms,
                               "step_alone_ms": step_ms,
                               "fused_rotation": fused_rotation(variant), "tok_s": []}
            models[variant] = model
            print(json.dumps({"variant": variant, **record[variant]}), flush=True)
        except Exception as exc:  # reported in the table; the other variants still run
            errors[variant] = f"{type(exc).__name__}: {exc}"
            print(json.dumps({"variant": variant, "error": errors[variant]}), flush=True)
            traceback.print_exc()
        write(args, variants, record, errors)
    for _ in range(args.rounds):
        for variant, model in list(models.items()):
            try:
                use(variant)
                record[variant]["tok_s"].append(decode_rate(model, prompt, args.tokens))
                print(json.dumps({"variant": variant, "tok_s": record[variant]["tok_s"][-1]}), flush=True)
            except Exception as exc:
                errors[variant] = f"{type(exc).__name__}: {exc}"
                del models[variant]
                traceback.print_exc()
        write(args, variants, record, errors)
    use("affine")
    print((Path(args.out) / "results.md").read_text())


def write(args, variants, record, errors) -> None:
    """results.json and results.md of what has been measured so far (rewritten after each phase,
    so that a run stopped by a time limit keeps its rows)."""
    for r in record.values():
        r["median_tok_s"] = statistics.median(r["tok_s"]) if r["tok_s"] else None
    base = record.get("affine", {}).get("median_tok_s")
    affine_rounds = record.get("affine", {}).get("tok_s", [])
    for r in record.values():
        r["vs_affine"] = r["median_tok_s"] / base if base and r["median_tok_s"] else None
        # each round's rate over affine's in the same round: the machine's speed drifts between
        # rounds, so this pairs measurements taken seconds apart
        per_round = [t / a for t, a in zip(r["tok_s"], affine_rounds)]
        r["vs_affine_per_round"] = per_round
        r["median_round_ratio"] = statistics.median(per_round) if per_round else None
    rounds = max((len(r["tok_s"]) for r in record.values()), default=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"device": str(mx.default_device()), "args": vars(args), "variants": record, "errors": errors,
         "rounds_done": rounds, "note": "lm_head and embeddings are MLX affine in every variant"}, indent=2))
    shape = args.shape + (f" ({args.layers} layers)" if args.layers else "")
    lines = [f"| {shape}, {args.bits}-bit weights, {args.dtype} | decode tok/s (median of {rounds}) | vs affine "
             "| median of per-round ratios "
             "| host ms to build a step's graph | host ms to dispatch it | ms to build and run a step alone | logits rel. RMS error vs fp16 "
             "| quantize s | rotation kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for variant in variants:
        r = record.get(variant)
        if r is None or (variant in errors and not r["tok_s"]):
            if variant in errors:
                lines.append(f"| {variant} | failed: {errors[variant][:120]} | | | | | | | | |")
            continue
        rate = f"{r['median_tok_s']:.1f}" if r["median_tok_s"] else "n/m"
        ratio = f"{r['vs_affine']:.2f}x" if r["vs_affine"] else "n/a"
        paired = f"{r['median_round_ratio']:.2f}x" if r["median_round_ratio"] else "n/a"
        lines.append(f"| {variant} | {rate} | {ratio} | {paired} | {r['host_ms_per_step']:.2f} | "
                     f"{r['dispatch_ms_per_step']:.2f} | {r['step_alone_ms']:.2f} | "
                     f"{r['logits_rel_rms_error_vs_fp16']:.4f} | {r['quantize_s']:.1f} | "
                     f"{r['fused_rotation'] if variant != 'affine' else '-'} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
