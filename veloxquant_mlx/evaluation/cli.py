"""`veloxquant eval ppl|needle`, `veloxquant benchmark`, `veloxquant report`."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

DEFAULT_PPL_METHODS = "fp16,mlx-q8,mlx-q4,turboquant_mse:4,turboquant_mse:3"
DEFAULT_NEEDLE_METHODS = "fp16,mlx-q4,turboquant_mse:4"
DEFAULT_BENCHMARK_METHODS = "fp16,mlx-q8,mlx-q4,turboquant_mse:4"


def _methods(args):
    """The requested method specs, after checking (before any model is loaded) that --out can be a folder."""
    from .specs import parse_method_list

    from ..outputs import check_results_dir

    if getattr(args, "out", None) is not None:
        check_results_dir(args.out)
    return parse_method_list(",".join(args.methods))


def _load(args):
    from ..models import load_model

    return load_model(args.model)


def _finish(out_dir, results, draw: bool) -> dict:
    from .figures import draw_figures
    from .report import save_results

    if draw:
        try:
            results["figures"] = draw_figures(results, out_dir)
        except ImportError as error:  # the measurements are still worth saving
            print(f"warning: no figures: {error}", file=sys.stderr)
    results["complete"] = True
    path = save_results(out_dir, results)
    print(f"wrote {path}, {Path(out_dir) / 'results.md'}"
          + (f" and {len(results['figures'])} figure(s)" if results["figures"] else ""), file=sys.stderr)
    print((Path(out_dir) / "results.md").read_text())
    return results


def _saver(out_dir, results):
    from .report import save_results

    def on_update(records):
        results["records"] = records
        save_results(out_dir, results)

    return on_update


def run_ppl(args) -> None:
    from ..texts import load_text, tokenize_prefix
    from ..kvlayout import kv_layout
    from .perplexity import evaluate_perplexity, make_windows
    from .results import model_record, new_results
    from .specs import calibrated_for
    from .watchdog import MemoryGuard

    specs = _methods(args)
    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")
    text = load_text(args.text, args.dataset)
    model, tokenizer = _load(args)
    specs = calibrated_for(specs, model, tokenizer)
    skip = getattr(args, "skip_tokens", 0)
    if skip < 0:
        raise ValueError(f"--skip-tokens must be >= 0, got {skip}")
    ids = tokenize_prefix(tokenizer, text, skip + args.ctx * args.windows)[skip:]
    windows = make_windows(ids, args.ctx, args.windows)
    layout = kv_layout(model)
    results = new_results("eval ppl", args, model_record(model, str(args.model), layout))
    results["settings"] = {
        "text_source": Path(args.text).name if args.text else args.dataset,
        "ctx": args.ctx, "windows": args.windows, "chunk": args.chunk, "skip_tokens": skip,
        "scored_tokens": args.windows * (args.ctx - 1 - args.ctx // 2),
        "min_free_gb": args.min_free_gb,
    }
    start = time.perf_counter()
    results["records"] = evaluate_perplexity(
        model, windows, specs, chunk=args.chunk, guard=MemoryGuard(args.min_free_gb),
        progress=not args.no_progress, on_update=_saver(args.out, results),
    )
    results["duration_s"] = round(time.perf_counter() - start, 2)
    return _finish(args.out, results, not args.no_figures)


def run_needle(args) -> None:
    from ..texts import load_text, tokenize_prefix
    from ..kvlayout import kv_layout
    from .needle import evaluate_needle, make_cases, parse_depths, parse_lengths
    from .results import model_record, new_results
    from .specs import calibrated_for
    from .watchdog import MemoryGuard

    specs = _methods(args)
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    text = load_text(args.text, args.dataset)
    model, tokenizer = _load(args)
    specs = calibrated_for(specs, model, tokenizer)
    filler = tokenize_prefix(tokenizer, text, max(lengths))
    cases = make_cases(tokenizer, filler, lengths, depths, args.trials, args.seed)
    layout = kv_layout(model)
    results = new_results("eval needle", args, model_record(model, str(args.model), layout))
    results["settings"] = {
        "text_source": Path(args.text).name if args.text else args.dataset,
        "lengths": lengths, "depths": depths, "trials": args.trials,
        "max_tokens": args.max_tokens, "chunk": args.chunk, "min_free_gb": args.min_free_gb,
    }
    start = time.perf_counter()
    results["records"] = evaluate_needle(
        model, tokenizer, specs, cases, lengths, depths, max_tokens=args.max_tokens,
        chunk=args.chunk, guard=MemoryGuard(args.min_free_gb), progress=not args.no_progress,
        on_update=_saver(args.out, results),
    )
    results["duration_s"] = round(time.perf_counter() - start, 2)
    return _finish(args.out, results, not args.no_figures)


def _benchmark_model(args):
    """(model, description, dtype, weights description, tokenizer or None) for --shape or --model."""
    import mlx.core as mx

    from .shapes import build_shape_model, quantize_weights, resolve_dtype

    dtype_name, dtype = resolve_dtype(args.dtype)
    weights = "float" if args.weights_bits is None else f"{args.weights_bits}-bit (group 64)"
    if args.shape:
        model = build_shape_model(args.shape, dtype_name, args.weights_bits, seed=args.seed)
        return model, f"random-weight `{args.shape}`", dtype_name, weights, None
    from ..models import load_model

    if args.weights_bits is None and args.dtype in (None, "auto"):
        model, tokenizer = load_model(args.model)
        return model, f"`{args.model}`", "as loaded", "as loaded", tokenizer
    model, tokenizer = load_model(args.model, dequantize=True)
    model.set_dtype(dtype)
    quantize_weights(model, args.weights_bits)
    mx.eval(model.parameters())
    return model, f"`{args.model}`", dtype_name, weights, tokenizer


def _calibrated_on_random_tokens(specs, model, vocab_size: int, seed: int, directory: str):
    """For a random-weight `--shape` model: each spec that calibrates on first use (`artifacts=auto`)
    calibrated now on random token sequences, into `directory`. No text means more than another to
    random weights, and the first-use cache is keyed by the architecture alone, where a real model of
    the same shape would find these artifacts. Returns the specs and each one's calibration record."""
    from dataclasses import replace

    import mlx.core as mx

    from ..calibration import AUTO, CALIBRATION_SEQUENCES, CALIBRATION_TOKENS, calibrate

    tokens = mx.random.randint(0, vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_TOKENS),
                               key=mx.random.key(seed)).astype(mx.uint32)
    resolved, records = [], {}
    for index, spec in enumerate(specs):
        if spec.config is None or spec.config.artifact_dir != AUTO:
            resolved.append(spec)
            continue
        out = Path(directory) / f"spec-{index}"
        print(f"[calibrating {spec.label} on random tokens: the weights are random]", file=sys.stderr, flush=True)
        record = calibrate(model, spec.config.replace(artifact_dir=None), list(tokens), out,
                           source="random tokens", progress=False)
        records[spec.label] = {"seconds": record["seconds"], "tokens": record["tokens"]}
        resolved.append(replace(spec, config=spec.config.replace(artifact_dir=str(out))))
    return resolved, records


def _first_use_check() -> float:
    """Run the kernels' first-use check (`kernels/check.py`) before anything is timed, so that
    its compile and run are not charged to the first configuration; its seconds are recorded."""
    from ..kernels import check
    from ..settings import EngineSettings

    start = time.perf_counter()
    check.usable(EngineSettings.resolve().backend)
    return round(time.perf_counter() - start, 2)


def run_benchmark_command(args) -> None:
    from .benchmark import run_benchmark
    from ..kvlayout import kv_layout
    from .needle import parse_lengths
    from .results import model_record, new_results
    from .specs import calibrated_for
    from .watchdog import MemoryGuard

    specs = _methods(args)
    contexts = parse_lengths(args.contexts)
    if args.shape and args.model:
        raise ValueError("give --model or --shape, not both")
    if not args.shape and not args.model:
        args.model = "smollm2"
    if args.shape:
        from .shapes import cpu_shape_notice

        notice = cpu_shape_notice(args.shape, args.dtype, sum(contexts) + len(contexts) * args.decode_tokens,
                                  len(specs) * (args.warmup + args.repeats))
        if notice:
            print(notice, file=sys.stderr, flush=True)
    model, source, dtype_name, weights, tokenizer = _benchmark_model(args)
    compiled_blocks = 0
    if args.compile_blocks:
        from ..weights.compiled_block import HALVES, compile_blocks

        compiled_blocks = compile_blocks(model)  # the same model serves every method, fp16 included
        if not compiled_blocks:
            warnings.warn(f"--compile-blocks: no block of this model is of {', '.join(sorted(HALVES))}; "
                          "every block runs its own call", stacklevel=2)
    vocab_size = getattr(getattr(model, "args", None), "vocab_size", None) or 1000
    scratch = tempfile.TemporaryDirectory(prefix="veloxquant-benchmark-")
    calibrations = {}
    if args.shape:
        specs, calibrations = _calibrated_on_random_tokens(specs, model, vocab_size, args.seed, scratch.name)
    specs = calibrated_for(specs, model, tokenizer)
    layout = kv_layout(model)
    results = new_results("benchmark", args, model_record(model, args.shape or str(args.model), layout))
    results["settings"] = {
        "model_source": source, "dtype": dtype_name, "weights": weights, "contexts": contexts,
        "decode_tokens": args.decode_tokens, "repeats": args.repeats, "warmup": args.warmup,
        "prefill_chunk": args.chunk, "batch": args.batch, "compiled_blocks": compiled_blocks,
        "max_seconds_per_config": args.max_seconds, "min_free_gb": args.min_free_gb,
    }
    if calibrations:
        results["settings"]["calibration"] = calibrations
    results["settings"]["kernel_check_s"] = _first_use_check()
    start = time.perf_counter()
    results["records"] = run_benchmark(
        model, specs, contexts, vocab_size=vocab_size, decode_tokens=args.decode_tokens,
        repeats=args.repeats, warmup=args.warmup, chunk=args.chunk, max_seconds=args.max_seconds,
        guard=MemoryGuard(args.min_free_gb), progress=not args.no_progress,
        on_update=_saver(args.out, results), seed=args.seed, batch=args.batch,
    )
    scratch.cleanup()
    results["duration_s"] = round(time.perf_counter() - start, 2)
    return _finish(args.out, results, not args.no_figures)


def run_report(args) -> None:
    from .report import report

    print(report(args.results, readme=args.readme, name=args.name))
    if args.readme:
        print(f"updated {args.readme}", file=sys.stderr)


def _common(parser, default_methods: str, default_out: str, model_default="smollm2") -> None:
    parser.add_argument("--model", default=model_default,
                        help="'smollm2' (default), a .gguf file, an mlx-lm folder or a hub id")
    parser.add_argument("--methods", nargs="+", default=[default_methods],
                        help="comma-separated method specs: fp16, mlx-q8/q4/q3/q2[:group=32], "
                             "or NAME[:BITS[:key=value,...]] (keys: group, residual|window, sinks, vbits, "
                             f"seed, or a method option). Default: {default_methods}")
    parser.add_argument("--out", default=default_out, help=f"results folder (default: {default_out})")
    parser.add_argument("--min-free-gb", type=float, default=2.0,
                        help="stop a configuration when free system memory falls below this (0: off)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs (needle cases, benchmark tokens and models) (default: 0)")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _text_source(parser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", default=None, help="local text file")
    source.add_argument("--dataset", default="wikitext2",
                        help="dataset loaded with `datasets` when no --text is given (default: wikitext2)")


def register_eval_cli(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="quality of compressed caches: perplexity, needle in a haystack")
    sub = evaluate.add_subparsers(dest="eval_command", required=True, metavar="EVAL",
                                  help="`veloxquant eval EVAL --help` shows its flags")

    ppl = sub.add_parser("ppl", help="perplexity, KL and top-1 agreement vs fp16, and KV bytes per method")
    _common(ppl, DEFAULT_PPL_METHODS, "results/ppl")
    _text_source(ppl)
    ppl.add_argument("--ctx", type=int, default=2048, help="tokens per window")
    ppl.add_argument("--windows", type=int, default=3, help="consecutive windows to evaluate")
    ppl.add_argument("--chunk", type=int, default=512, help="tokens fed per forward pass")
    ppl.add_argument("--skip-tokens", type=int, default=0,
                     help="start this many tokens into the text, e.g. to tune on a part the reported windows "
                          "never read (default: 0)")
    ppl.set_defaults(func=run_ppl)

    needle = sub.add_parser("needle", help="retrieve a passcode hidden at several depths of a long text")
    _common(needle, DEFAULT_NEEDLE_METHODS, "results/needle")
    _text_source(needle)
    needle.add_argument("--lengths", default="1k,2k,4k", help="prompt lengths in tokens (e.g. 1k,2k,4k)")
    needle.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle positions, 0 = start, 1 = end")
    needle.add_argument("--trials", type=int, default=1, help="passcodes per (length, depth) cell")
    needle.add_argument("--max-tokens", type=int, default=12, help="tokens generated per answer")
    needle.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward pass")
    needle.set_defaults(func=run_needle)


def register_benchmark_cli(subparsers) -> None:
    from .shapes import SHAPES

    bench = subparsers.add_parser("benchmark", help="prefill/decode speed and memory per method and context")
    _common(bench, DEFAULT_BENCHMARK_METHODS, "results/benchmark", model_default=None)
    bench.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="random-weight model of a real architecture (no download)")
    bench.add_argument("--contexts", default="1k,4k,16k,32k", help="prompt lengths in tokens")
    bench.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the prompt")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs per configuration before timing")
    bench.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward pass")
    bench.add_argument("--batch", type=int, default=1,
                       help="prompts of equal length decoded together (tok/s counts every row); default 1")
    bench.add_argument("--weights-bits", type=int, choices=[2, 3, 4, 6, 8], default=None,
                       help="quantize the weights (nn.quantize, group 64); default: float weights")
    bench.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                       help="activation dtype (auto: float16 on GPU, float32 on CPU)")
    bench.add_argument("--compile-blocks", action="store_true",
                       help="run the model's llama, qwen2 or Gemma 3 blocks as two compiled calls around the "
                            "attention at decode shapes (weights/compiled_block.py), for every method alike")
    bench.add_argument("--max-seconds", type=float, default=300.0,
                       help="time budget per configuration; fewer repeats when exceeded")
    bench.set_defaults(func=run_benchmark_command)
    from .serving import register_serve_benchmark

    register_serve_benchmark(bench)


def register_report_cli(subparsers) -> None:
    rep = subparsers.add_parser("report", help="render results folders as Markdown (and into a README)")
    rep.add_argument("results", nargs="+", help="results folder(s) or results.json file(s)")
    rep.add_argument("--readme", default=None,
                     help="also write the Markdown between <!-- results:NAME:start --> and "
                          "<!-- results:NAME:end --> in this file")
    rep.add_argument("--name", default=None, help="marker NAME (default: the command, e.g. ppl)")
    rep.set_defaults(func=run_report)


def register_cli(subparsers) -> None:
    """Add `eval`, `benchmark` and `report` to the `veloxquant` command."""
    register_eval_cli(subparsers)
    register_benchmark_cli(subparsers)
    register_report_cli(subparsers)
    from .models_matrix import register_cli as register_models

    register_models(subparsers)


def main(argv=None) -> int:
    """Standalone entry point (`python -m veloxquant_mlx.evaluation ...`); with `argv` None, restarts with
    OpenBLAS preloaded as the `veloxquant` command does (`blas.preload_openblas`)."""
    if argv is None:
        from ..blas import preload_openblas

        preload_openblas()
    parser = argparse.ArgumentParser(prog="veloxquant", description=__doc__)
    register_cli(parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       help="`COMMAND --help` shows its flags"))
    from ..cli_shared import run_command

    return run_command(parser.parse_args(argv))
