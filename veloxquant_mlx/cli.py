"""`veloxquant` command line: generate, methods, precompute, convert-gguf, demo, eval, benchmark."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_cache_arguments(parser: argparse.ArgumentParser, default_method: str = "turboquant_mse") -> None:
    group = parser.add_argument_group("KV cache")
    group.add_argument("--method", default=default_method, help="compression method (see `veloxquant methods`)")
    group.add_argument("--bits", type=int, default=4, help="key bits per coordinate")
    group.add_argument("--value-bits", type=int, default=None, help="value bits (default: --bits)")
    group.add_argument("--group-size", type=int, default=64)
    group.add_argument("--residual-length", type=int, default=0, help="recent tokens kept in fp16")
    group.add_argument("--sink-tokens", type=int, default=0, help="first tokens kept in fp16")
    group.add_argument("--center", action="store_true", help="subtract each head's mean key/value first")
    group.add_argument("--kv-seed", type=int, default=0, help="seed of rotations and sketches")
    group.add_argument("--artifact-dir", default=None, help="precomputed codebooks/rotations")
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="method option")


def config_from_args(args):
    from .config import KVCacheConfig, parse_option_value

    from .methods import get_method

    declared = get_method(args.method).options
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        options[key] = parse_option_value(value, declared.get(key))
    return KVCacheConfig(
        method=args.method,
        bits=args.bits,
        value_bits=args.value_bits,
        group_size=args.group_size,
        residual_length=args.residual_length,
        sink_tokens=args.sink_tokens,
        center=args.center,
        seed=args.kv_seed,
        artifact_dir=args.artifact_dir,
        options=options,
    )


def fp16_bytes(caches) -> int:
    """What mlx-lm's fp16 KVCache would hold for the same tokens (2 bytes per element)."""
    total = 0
    for cache in caches:
        if getattr(cache, "key_codec", None) is not None:
            total += 2 * cache.batch * cache.kv_heads * cache.offset * (cache.key_dim + cache.value_dim)
    return total


def run_generate(args) -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .integration import KVCacheBuilder
    from .models import load_model

    config = config_from_args(args)
    model, tokenizer = load_model(args.model)
    caches = KVCacheBuilder(config).for_model(model).build()
    prompt = args.prompt.replace("\\n", "\n")
    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p)
    response = None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler, prompt_cache=caches
    ):
        print(response.text, end="", flush=True)
    print()
    if response is None:
        return
    kv = sum(c.nbytes for c in caches)
    fp16 = fp16_bytes(caches)
    print("=" * 10)
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec")
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec")
    print(f"Peak memory: {response.peak_memory:.3f} GB")
    print(
        f"KV cache ({config.describe()}): {kv / 1e6:.3f} MB live buffers vs {fp16 / 1e6:.3f} MB fp16 "
        f"({fp16 / max(kv, 1):.2f}x smaller)"
    )


def run_methods(args) -> None:
    from .config import KVCacheConfig
    from .methods import available_methods

    rows = [("method", "key bits/token", "value bits/token", "bits/coord", "calibration", "status", "keys", "values")]
    for name, method in available_methods().items():
        bits = 16 if name == "fp16" else args.bits
        try:
            config = KVCacheConfig(method=name, bits=bits, group_size=min(args.group_size, args.head_dim))
            key = method.key_codec(config, args.head_dim).bits_per_token()
            value = method.value_codec(config, args.head_dim).bits_per_token()
            per_coord = f"{(key + value) / (2 * args.head_dim):.3f}"
            key, value = f"{key:g}", f"{value:g}"
        except ValueError as error:
            key = value = per_coord = f"n/a ({error})"
        rows.append(
            (name, key, value, per_coord, "yes" if method.calibrated else "no", method.status,
             method.summary, method.values_summary)
        )
    print(f"bits at b={args.bits}, head dim {args.head_dim} (fp16 shown at 16 bits):")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def run_precompute(args) -> None:
    from .artifacts import precompute
    from .models import load_model

    config = config_from_args(args)
    if config.artifact_dir is not None:
        raise SystemExit("precompute writes an artifact dir; pass it as --out, not --artifact-dir")
    model, _ = load_model(args.model)
    out = precompute(model, config, args.out)
    print(f"wrote {config.describe()} codebooks and rotations for {args.model} to {out}")


def run_demo(args) -> None:
    from .demo import run_demo as demo

    demo(args)


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="veloxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a compressed KV cache")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="local path, .gguf file, hub id or 'smollm2'")
    gen.add_argument("--prompt", "-p", default="Write a short story about a lighthouse keeper.")
    gen.add_argument("--max-tokens", "-m", type=int, default=100)
    gen.add_argument("--temp", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system-prompt", default=None)
    gen.add_argument("--ignore-chat-template", action="store_true")
    add_cache_arguments(gen)
    gen.set_defaults(func=run_generate)

    methods = sub.add_parser("methods", help="list compression methods")
    methods.add_argument("--bits", type=int, default=4)
    methods.add_argument("--head-dim", type=int, default=128)
    methods.add_argument("--group-size", type=int, default=64)
    methods.set_defaults(func=run_methods)

    pre = sub.add_parser("precompute", help="write codebooks and rotations for a model")
    pre.add_argument("--model", default=DEFAULT_MODEL)
    pre.add_argument("--out", required=True, help="artifact directory to write")
    add_cache_arguments(pre)
    pre.set_defaults(func=run_precompute)

    demo = sub.add_parser("demo", help="the main job: compress SmolLM2's cache, report memory and quality")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--text", default=None, help="text file for quality (default: WikiText-2 test)")
    demo.add_argument("--ctx", type=int, default=2048)
    add_cache_arguments(demo)
    # The recommended protections (the demo also turns on `renorm` where the method has it).
    demo.set_defaults(func=run_demo, sink_tokens=4, residual_length=64, center=True)

    from . import gguf
    from .evaluation import register_cli as register_evaluation

    gguf.register_cli(sub)
    register_evaluation(sub)
    return parser


# What a user's input can raise (bad values, files missing, unreadable or in the way): reported
# in one line, exit 2. VELOXQUANT_TRACEBACK=1 shows the traceback instead.
USER_ERRORS = (ValueError, TypeError, OSError)


def failed_methods(outcome) -> list:
    """Labels of the records of an eval/benchmark run whose method raised an error."""
    if not isinstance(outcome, dict):
        return []
    return [str(r.get("label") or r.get("method")) for r in outcome.get("records") or []
            if isinstance(r, dict) and r.get("status") == "error"]


def run_command(args) -> int:
    """Run a parsed command: 0 on success, 1 when a requested method failed, 2 on a user error."""
    start = time.perf_counter()
    try:
        outcome = args.func(args)
    except USER_ERRORS as error:
        if os.environ.get("VELOXQUANT_TRACEBACK"):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "verbose", False):
        print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    failed = failed_methods(outcome)
    if failed:
        print(f"error: {len(failed)} requested method(s) failed: {', '.join(dict.fromkeys(failed))}",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
