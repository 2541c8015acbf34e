"""`veloxquant` command line: generate, chat, serve, cache-prompt, methods, precompute, convert-gguf, demo, eval, benchmark."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_cache_arguments(parser: argparse.ArgumentParser, default_method: str = "turboquant_mse") -> None:
    """The cache flags. Unset ones come from `--kv PRESET` if given, else from the defaults shown."""
    from .config import KVCacheConfig
    from .presets import KV_PRESETS, describe_presets

    base = KVCacheConfig(method=default_method)
    group = parser.add_argument_group(
        "KV cache", "Flags left unset take the --kv preset's value, or else the default shown."
    )
    group.add_argument("--kv", choices=sorted(KV_PRESETS), default=None, metavar="PRESET",
                       help=f"a recommended configuration: {describe_presets()} "
                            "(default: none; the flags below)")
    group.add_argument("--method", default=None,
                       help=f"compression method, see `veloxquant methods` (default: {default_method})")
    group.add_argument("--bits", type=int, default=None, help=f"key bits per coordinate (default: {base.bits})")
    group.add_argument("--value-bits", type=int, default=None, help="value bits per coordinate (default: --bits)")
    group.add_argument("--group-size", type=int, default=None,
                       help=f"group size of grouped methods (kivi, qjl values) (default: {base.group_size})")
    group.add_argument("--residual-length", type=int, default=None,
                       help=f"most recent tokens kept in fp16 (default: {base.residual_length})")
    group.add_argument("--sink-tokens", type=int, default=None,
                       help=f"first tokens kept in fp16 (default: {base.sink_tokens})")
    group.add_argument("--center", action=argparse.BooleanOptionalAction, default=None,
                       help="subtract each head's mean key/value before encoding (default: off)")
    group.add_argument("--kv-seed", type=int, default=None, help=f"seed of rotations and sketches (default: {base.seed})")
    group.add_argument("--artifact-dir", default=None,
                       help="precomputed codebooks/rotations from `veloxquant precompute` (default: none)")
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="method option, repeatable, e.g. renorm=true (default: none)")


_CACHE_FLAGS = {"method": "method", "bits": "bits", "value_bits": "value_bits", "group_size": "group_size",
                "residual_length": "residual_length", "sink_tokens": "sink_tokens", "center": "center",
                "kv_seed": "seed", "artifact_dir": "artifact_dir"}


def config_from_args(args, default_method: str = "turboquant_mse"):
    from .config import KVCacheConfig, parse_option_value
    from .presets import preset_config

    from .methods import get_method

    kv = getattr(args, "kv", None)
    method = get_method(getattr(args, "method", None) or (preset_config(kv).method if kv else default_method))
    declared = {**method.generic_options, **method.options}
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        options[key] = parse_option_value(value, declared.get(key))
    fields = {field: getattr(args, flag) for flag, field in _CACHE_FLAGS.items() if getattr(args, flag, None) is not None}
    if options:
        fields["options"] = options
    if kv:
        return preset_config(kv, **fields)
    fields.setdefault("method", default_method)
    return KVCacheConfig(**fields)


def config_for_model(args, config, model, tokenizer):
    """`config` resolved for the loaded `model`: a first-use calibration where it asks for one, and a hint on
    stderr where a `--kv` preset leaves out smoothed keys on a QK-norm model (`presets.qk_norm_hint`)."""
    from .calibration import ensure_calibrated
    from .presets import qk_norm_hint

    hint = qk_norm_hint(getattr(args, "kv", None), config, model)
    if hint:
        print(hint, file=sys.stderr, flush=True)
    return ensure_calibrated(config, model, tokenizer)


def fp16_bytes(caches) -> int:
    """What mlx-lm's fp16 KVCache would hold for the same tokens (2 bytes per element)."""
    total = 0
    for cache in caches:
        inner = getattr(cache, "inner", cache)  # a rotating cache: mlx-lm's holds its last size() tokens
        if getattr(inner, "key_codec", None) is not None:
            total += 2 * inner.batch * inner.kv_heads * cache.size() * (inner.key_dim + inner.value_dim)
    return total


def memory_report(caches) -> str:
    """The cache's memory in words: bytes the tokens use, bytes allocated, and fp16's bytes.

    The store grows in 256-token steps, so on a short prompt most allocated bytes are spare
    capacity: comparing those with fp16 would understate the compression."""
    used = sum(getattr(c, "used_nbytes", c.nbytes) for c in caches)
    allocated = sum(c.nbytes for c in caches)
    fp16 = fp16_bytes(caches)
    tokens = max((getattr(c, "offset", 0) for c in caches), default=0)
    return (f"{tokens} tokens, {used / 1e6:.3f} MB used ({allocated / 1e6:.3f} MB allocated) vs "
            f"{fp16 / 1e6:.3f} MB fp16: {fp16 / max(used, 1):.2f}x smaller")


def add_model_arguments(parser: argparse.ArgumentParser, max_tokens: int = 100, system_prompt: bool = True):
    """The generation flags, named as mlx_lm.generate's."""
    from .models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"local folder, .gguf file, hub id or 'smollm2' (default: {DEFAULT_MODEL})")
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                        help=f"most tokens to generate (default: {max_tokens})")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p (default: 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="random seed of the sampler (default: none)")
    if system_prompt:
        parser.add_argument("--system-prompt", default=None, help="system message (default: none)")
    parser.add_argument("--chat-template-config", default=None,
                        help="JSON of extra arguments for the chat template, as in mlx_lm.generate (default: none)")
    parser.add_argument("--max-kv-size", type=int, default=None,
                        help="keep only the last N tokens (and the first 4) in a rotating compressed cache, as "
                             "mlx_lm.generate does; `generate` only (default: every token)")


def _check_max_kv_size(args, why: str):
    if getattr(args, "max_kv_size", None) is not None:
        raise ValueError(f"--max-kv-size is not supported by this command: {why}")


def _template_kwargs(args) -> dict:
    import json

    if not getattr(args, "chat_template_config", None):
        return {}
    try:
        kwargs = json.loads(args.chat_template_config)
    except json.JSONDecodeError as error:
        raise ValueError(f"--chat-template-config is not JSON: {error}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-config must be a JSON object")
    return kwargs


def _cache_flags_given(args) -> bool:
    return bool(args.kv or args.option) or any(getattr(args, flag) is not None for flag in _CACHE_FLAGS)


def run_generate(args) -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .integration import KVCacheBuilder
    from .models import load_model

    if args.max_kv_size is not None and (args.max_kv_size < 5 or args.prompt_cache_file is not None):
        raise ValueError("--max-kv-size needs N >= 5 (4 first tokens are kept) and no --prompt-cache-file")
    template_kwargs = _template_kwargs(args)
    config = config_from_args(args)
    if args.prompt_cache_file is not None and not os.path.isfile(args.prompt_cache_file):
        raise FileNotFoundError(f"no prompt-cache file {args.prompt_cache_file}")  # before loading the model
    model, tokenizer = load_model(args.model)
    config = config_for_model(args, config, model, tokenizer)
    prompt = args.prompt.replace("\\n", "\n")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_template = not args.ignore_chat_template and tokenizer.chat_template is not None
    if args.prompt_cache_file is not None:
        from .prompt_cache import load_document_cache, question_suffix

        caches, metadata = load_document_cache(args.prompt_cache_file, args.model,
                                               config if _cache_flags_given(args) else None, model=model)
        config = caches[0].config
        if use_template:
            prompt = question_suffix(tokenizer, prompt, args.system_prompt, template_kwargs)
        else:
            prompt = tokenizer.encode(prompt, add_special_tokens=False)
        print(f"[prompt cache {args.prompt_cache_file}: {caches[0].offset} tokens, {config.describe()}]")
    else:
        caches = KVCacheBuilder(config).for_model(model, tokenizer).build(max_kv_size=args.max_kv_size)
        if use_template:
            messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            messages.append({"role": "user", "content": prompt})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   **template_kwargs)
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
    print("=" * 10)
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec")
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec")
    print(f"Peak memory: {response.peak_memory:.3f} GB")
    print(f"KV cache ({config.describe()}): {memory_report(caches)}")


def run_chat(args) -> None:
    from mlx_lm.sample_utils import make_sampler
    import mlx.core as mx

    from .chat import ChatSession, run_chat as chat_loop
    from .models import load_model

    _check_max_kv_size(args, "a chat reuses its cache across turns by trimming it to the shared prefix, "
                             "which a cache that has dropped tokens cannot do")
    template_kwargs = _template_kwargs(args)
    config = config_from_args(args)
    model, tokenizer = load_model(args.model)
    config = config_for_model(args, config, model, tokenizer)
    if args.seed is not None:
        mx.random.seed(args.seed)
    session = ChatSession(model, tokenizer, config, args.system_prompt, template_kwargs, model_name=args.model)
    chat_loop(session, args.max_tokens, make_sampler(args.temp, args.top_p))


def run_cache_prompt(args) -> None:
    from pathlib import Path

    from .models import load_model, model_source
    from .outputs import check_out_file, replacing_file
    from .prompt_cache import cache_prompt

    _check_max_kv_size(args, "a document cache keeps the whole document")
    out = check_out_file(args.out, args.force, suffix=".safetensors")  # before the long prefill
    text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text()
    config = config_from_args(args)
    model, tokenizer = load_model(args.model)
    config = config_for_model(args, config, model, tokenizer)

    def progress(done, total):
        print(f"\rprefilled {done}/{total} tokens", end="", file=sys.stderr, flush=True)

    for_mlx_lm = model_source(args.model) if args.for_mlx_lm else None
    with replacing_file(out, args.force) as temp:
        written = cache_prompt(model, tokenizer, text, config, temp, args.model, args.prefill_step_size, progress,
                               for_mlx_lm=for_mlx_lm)
    print(file=sys.stderr)
    size = out.stat().st_size
    kind = "mlx-lm KVCache file (decoded, uncompressed)" if for_mlx_lm else "file"
    print(f"wrote {out}: {written['tokens']} tokens in {written['seconds']:.1f} s, {size / 1e6:.3f} MB {kind}; "
          f"cache {memory_report(written['caches'])} ({config.describe()})")


def run_serve(args) -> None:
    from .server import serve, server_arguments

    _check_max_kv_size(args, "the server batches its caches, and rotating compressed caches have no batch "
                             "merge yet")
    config = config_from_args(args)
    from .models import model_source

    model_source(args.model)  # a missing model is a one-line error here, not a traceback in the server's thread
    serve(server_arguments(args, config), config)


def run_methods(args) -> None:
    from .config import KVCacheConfig
    from .methods import available_methods
    from .storage import stored_bits_per_token

    rows = [("method", "key bits/token", "value bits/token", "bits/coord", "calibration", "status", "keys", "values")]
    for name, method in available_methods().items():
        bits = 16 if name == "fp16" else args.bits
        try:
            config = KVCacheConfig(method=name, bits=bits, group_size=min(args.group_size, args.head_dim))
            key_codec, value_codec = method.key_codec(config, args.head_dim), method.value_codec(config, args.head_dim)
            key, value = key_codec.bits_per_token(), value_codec.bits_per_token()
            # As stored: a row of both roles takes whole words (`storage.row_layout`).
            per_coord = f"{stored_bits_per_token(key_codec, value_codec) / (2 * args.head_dim):.3f}"
            key, value = f"{key:g}", f"{value:g}"
        except ValueError as error:
            # Calibrated methods' widths come from their artifact; other errors are shown whole.
            key = value = per_coord = "per artifact" if method.calibrated else f"n/a ({error})"
        rows.append(
            (name, key, value, per_coord, "yes" if method.calibrated else "no", method.status,
             method.summary, method.values_summary)
        )
    print(f"bits at b={args.bits}, head dim {args.head_dim} (fp16 shown at 16 bits; bits/coord as stored, "
          "a token's key and value in one row of whole 32-bit words where the formats are per token):")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print("status (measured on SmolLM2, see the README's results):")
    for name, method in available_methods().items():
        print(f"  {name} ({method.status}): {method.status_note}")


def run_precompute(args) -> None:
    from .artifacts import precompute
    from .models import load_model
    from .outputs import check_out_dir, replacing_dir

    config = config_from_args(args)
    if config.artifact_dir is not None:
        raise SystemExit("precompute writes an artifact dir; pass it as --out, not --artifact-dir")
    out = check_out_dir(args.out, args.force)
    model, _ = load_model(args.model)
    with replacing_dir(out, args.force) as temp:
        precompute(model, config, temp)
    print(f"wrote {config.describe()} codebooks and rotations for {args.model} to {out}")


def run_demo(args) -> None:
    from .demo import run_demo as demo

    demo(args)


def _chat_help() -> str:
    from .chat import HELP

    return HELP[0].upper() + HELP[1:] + "."


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="veloxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a compressed KV cache")
    add_model_arguments(gen)
    gen.add_argument("--prompt", "-p", default="Write a short story about a lighthouse keeper.",
                     help="the message; '-' reads it from stdin (default: a short-story request)")
    gen.add_argument("--ignore-chat-template", action="store_true", help="send the prompt as plain text (default: off)")
    gen.add_argument("--prompt-cache-file", default=None,
                     help="a file from `veloxquant cache-prompt`: --prompt is asked about the cached document, "
                          "which is not prefilled again; its cache settings are the file's (default: none)")
    add_cache_arguments(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="multi-turn chat over one compressed cache (reads a script from stdin too)",
                          description="Type a message per line. " + _chat_help())
    add_model_arguments(chat, max_tokens=256)
    add_cache_arguments(chat)
    chat.set_defaults(func=run_chat)

    cache = sub.add_parser("cache-prompt", help="write a compressed prompt-cache file for a long document")
    cache.add_argument("--model", default=DEFAULT_MODEL, help=f"local folder, .gguf file, hub id or 'smollm2' (default: {DEFAULT_MODEL})")
    cache.add_argument("--prompt-file", required=True, help="the document; '-' reads stdin (required)")
    cache.add_argument("--out", required=True,
                       help="the prompt-cache file to write, ending in .safetensors (required)")
    cache.add_argument("--force", action="store_true", help="replace an existing --out file (default: refuse)")
    cache.add_argument("--for-mlx-lm", action="store_true",
                       help="write mlx-lm's own KVCache classes holding the decoded keys and values, for "
                            "`python -m mlx_lm generate --prompt-cache-file`, which cannot read compressed caches: "
                            "this gives up the compression (an fp16-sized file) (default: off)")
    cache.add_argument("--prefill-step-size", type=int, default=512, help="prefill chunk in tokens (default: 512)")
    cache.add_argument("--max-kv-size", type=int, default=None,
                       help="mlx-lm's rotating-cache size: refused, a document cache keeps every token (default: none)")
    add_cache_arguments(cache)
    cache.set_defaults(func=run_cache_prompt)

    from .server import add_server_arguments

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (mlx-lm's) with compressed caches")
    serve.add_argument("--model", default=DEFAULT_MODEL, help=f"local folder, .gguf file, hub id or 'smollm2' (default: {DEFAULT_MODEL})")
    serve.add_argument("--max-kv-size", type=int, default=None,
                       help="mlx-lm's rotating-cache size: refused, rotating compressed caches cannot be batched yet "
                            "(default: none)")
    add_server_arguments(serve)
    add_cache_arguments(serve)
    serve.set_defaults(func=run_serve)

    methods = sub.add_parser("methods", help="list compression methods")
    methods.add_argument("--bits", type=int, default=4)
    methods.add_argument("--head-dim", type=int, default=128)
    methods.add_argument("--group-size", type=int, default=64)
    methods.set_defaults(func=run_methods)

    pre = sub.add_parser("precompute", help="write codebooks and rotations for a model")
    pre.add_argument("--model", default=DEFAULT_MODEL)
    pre.add_argument("--out", required=True, help="artifact directory to write")
    pre.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    add_cache_arguments(pre)
    pre.set_defaults(func=run_precompute)

    demo = sub.add_parser("demo", help="the main job: compress SmolLM2's cache, report memory and quality")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--text", default=None, help="text file to score (default: the packaged sample, Python Language Reference text, PSF License)")
    demo.add_argument("--ctx", type=int, default=2048)
    add_cache_arguments(demo)
    demo.set_defaults(func=run_demo)

    from . import calibration, gguf, planning
    from .evaluation import register_cli as register_evaluation

    calibration.register_cli(sub, add_cache_arguments, DEFAULT_MODEL)
    planning.register_cli(sub, DEFAULT_MODEL)
    from .weights.cli import register_cli as register_weights

    gguf.register_cli(sub)
    register_evaluation(sub)
    register_weights(sub)
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
