"""`veloxquant` command line: generate, chat, serve, cache-prompt, methods, precompute, convert-gguf, demo, eval, benchmark."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .cli_shared import (  # noqa: F401  (re-exported: where callers have always imported them)
    _CACHE_FLAGS, USER_ERRORS, add_cache_arguments, config_for_model, config_from_args, failed_methods,
    memory_report, run_command)


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
    parser.add_argument("--pipeline", action="store_true",
                        help="under mlx.launch: split the model by layers over the ranks, not by heads "
                             "(docs/distributed.md) (default: off)")
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


def _on_every_rank(run):
    """`run(args)` on each rank of mlx.launch (one rank otherwise): rank 0 alone prints, and a rank
    that stops makes the others stop with an error saying so (`docs/distributed.md`)."""
    import contextlib
    import functools

    @functools.wraps(run)
    def wrapped(args):
        from .distributed_io import rank_zero_stdout
        from .sharding import rank_loss_is_an_error

        with contextlib.redirect_stdout(rank_zero_stdout()), rank_loss_is_an_error():
            return run(args)

    return wrapped


@_on_every_rank
def run_generate(args) -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .distributed_io import caches_nbytes_per_rank, load_for_args, share_text, world
    from .integration import KVCacheBuilder

    if args.max_kv_size is not None and (args.max_kv_size < 5 or args.prompt_cache_file is not None):
        raise ValueError("--max-kv-size needs N >= 5 (4 first tokens are kept) and no --prompt-cache-file")
    template_kwargs = _template_kwargs(args)
    config = config_from_args(args)
    if args.prompt_cache_file is not None and not os.path.exists(args.prompt_cache_file):
        raise FileNotFoundError(f"no prompt-cache file {args.prompt_cache_file}")  # before loading the model
    model, tokenizer = load_for_args(args)
    config = config_for_model(args, config, model, tokenizer)
    prompt = args.prompt.replace("\\n", "\n")
    if prompt == "-":
        prompt = share_text(sys.stdin.read() if world().rank() == 0 else None)
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
    if world().size() > 1:
        per_rank = caches_nbytes_per_rank(caches)
        print(f"KV cache bytes per rank: {', '.join(f'{n / 1e6:.3f} MB' for n in per_rank)}")


@_on_every_rank
def run_chat(args) -> None:
    from mlx_lm.sample_utils import make_sampler
    import mlx.core as mx

    from .chat import ChatSession, run_chat as chat_loop
    from .distributed_io import SharedStdin, load_for_args, world

    _check_max_kv_size(args, "a chat reuses its cache across turns by trimming it to the shared prefix, "
                             "which a cache that has dropped tokens cannot do")
    template_kwargs = _template_kwargs(args)
    config = config_from_args(args)
    model, tokenizer = load_for_args(args)
    config = config_for_model(args, config, model, tokenizer)
    if args.seed is not None:
        mx.random.seed(args.seed)
    session = ChatSession(model, tokenizer, config, args.system_prompt, template_kwargs, model_name=args.model)
    stdin = SharedStdin() if world().size() > 1 else None
    chat_loop(session, args.max_tokens, make_sampler(args.temp, args.top_p), stdin=stdin)


@_on_every_rank
def run_cache_prompt(args) -> None:
    from pathlib import Path

    from .distributed_io import load_for_args, world
    from .models import model_source
    from .outputs import check_out_file, replacing_file
    from .prompt_cache import cache_prompt

    _check_max_kv_size(args, "a document cache keeps the whole document")
    if world().size() > 1:
        return _cache_prompt_sharded(args)
    out = check_out_file(args.out, args.force, suffix=".safetensors")  # before the long prefill
    text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text()
    config = config_from_args(args)
    model, tokenizer = load_for_args(args)
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


def _cache_prompt_sharded(args) -> None:
    """cache-prompt under mlx.launch: OUT is a folder of one file per rank and a manifest."""
    from pathlib import Path

    from .distributed_io import load_for_args, share_text, world
    from .prompt_cache import cache_prompt

    if args.for_mlx_lm:
        raise ValueError("--for-mlx-lm writes one whole-model file, which sharded ranks do not hold")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    read = (lambda: sys.stdin.read()) if args.prompt_file == "-" else Path(args.prompt_file).read_text
    text = share_text(read() if world().rank() == 0 else None)  # rank 0 reads; hosts need no copy
    config = config_from_args(args)
    model, tokenizer = load_for_args(args)
    config = config_for_model(args, config, model, tokenizer)
    written = cache_prompt(model, tokenizer, text, config, out, args.model, args.prefill_step_size)
    print(f"wrote {out}/ ({world().size()} rank files and manifest.json): {written['tokens']} tokens in "
          f"{written['seconds']:.1f} s; rank 0's cache {memory_report(written['caches'])} ({config.describe()})")


def run_serve(args) -> None:
    from .server import serve, server_arguments

    if args.max_kv_size is not None and args.max_kv_size < 5:
        raise ValueError("--max-kv-size needs N >= 5 (4 first tokens are kept)")
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
    print(f"bits at b={args.bits}, head dim {args.head_dim} (fp16 shown at 16 bits; bits/coord of the codes as "
          "stored, a token's key and value in one row of whole 32-bit words where the formats are per token; "
          "a cache's fp16 sinks and window come on top, as the commands that measure caches count them):")
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


def package_version() -> str:
    """This package's installed version (`importlib.metadata`), or its `__version__` when run from a checkout."""
    from importlib import metadata

    from . import __version__

    for name in metadata.packages_distributions().get(__package__, []):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return __version__


def version_text() -> str:
    from importlib import metadata

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"veloxquant-mlx {package_version()} (mlx {installed('mlx')}, mlx-lm {installed('mlx-lm')})"


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="veloxquant", description=__doc__)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="show the versions of veloxquant-mlx, mlx and mlx-lm, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="`veloxquant COMMAND --help` shows its flags")

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
                       help="keep only the last N tokens (and the first 4) of full-attention layers, in "
                            "sliding-window compressed caches, as mlx-lm's --max-kv-size (default: none)")
    serve.add_argument("--pipeline", action="store_true",
                       help="under mlx.launch: split the model by layers over the ranks, not by heads (default: off)")
    add_server_arguments(serve)
    add_cache_arguments(serve, allow_none=True)
    serve.set_defaults(func=run_serve)

    methods = sub.add_parser("methods", help="list compression methods")
    methods.add_argument("--bits", type=int, default=4,
                         help="bits per coordinate to show each method at (default: 4)")
    methods.add_argument("--head-dim", type=int, default=128,
                         help="head dimension to size the codes for (default: 128)")
    methods.add_argument("--group-size", type=int, default=64,
                         help="group size of grouped methods, capped at --head-dim (default: 64)")
    methods.set_defaults(func=run_methods)

    pre = sub.add_parser("precompute", help="write codebooks and rotations for a model")
    pre.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"local folder, .gguf file, hub id or 'smollm2' (default: {DEFAULT_MODEL})")
    pre.add_argument("--out", required=True, help="artifact directory to write")
    pre.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    add_cache_arguments(pre)
    pre.set_defaults(func=run_precompute)

    demo = sub.add_parser("demo", help="the main job: compress SmolLM2's cache, report memory and quality")
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help=f"local folder, .gguf file, hub id or 'smollm2' (default: {DEFAULT_MODEL})")
    demo.add_argument("--text", default=None, help="text file to score (default: the packaged sample, Python Language Reference text, PSF License)")
    demo.add_argument("--ctx", type=int, default=2048,
                      help="tokens of text in the scored window, an even number; its second half is scored "
                           "(default: 2048)")
    add_cache_arguments(demo)
    demo.set_defaults(func=run_demo)

    from . import gguf, planning
    from .evaluation import register_cli as register_evaluation

    add_calibrate_command(sub, DEFAULT_MODEL)
    planning.register_cli(sub, DEFAULT_MODEL)
    from .weights.cli import register_cli as register_weights

    gguf.register_cli(sub)
    register_evaluation(sub)
    register_weights(sub)
    return parser


def run_calibrate(args) -> None:
    from .calibration import AUTO, calibrate, calibration_tokens
    from .models import load_model
    from .outputs import check_out_dir, replacing_dir

    config = config_from_args(args)
    if config.artifact_dir == AUTO:  # a first-use config: calibrated here into --out instead
        config = config.replace(artifact_dir=None)
    if config.artifact_dir is not None:
        raise SystemExit("calibrate writes an artifact dir; pass it as --out, not --artifact-dir")
    out = check_out_dir(args.out, args.force)  # before the model and the long calibration
    text = Path(args.text).read_text()
    model, tokenizer = load_model(args.model)
    sequences = calibration_tokens(tokenizer, text, args.sequences, args.tokens, args.skip_tokens)
    with replacing_dir(out, args.force) as temp:
        record = calibrate(model, config, sequences, temp, source=str(args.text), progress=not args.no_progress)
    print(f"calibrated {config.describe()} for {args.model} on {record['tokens']} tokens "
          f"({record['sequences']} sequences) in {record['seconds']:.1f} s; wrote {args.out}")
    if args.verbose:
        print(json.dumps(record, indent=2))


def add_calibrate_command(sub, default_model: str) -> None:
    from .calibration import CALIBRATION_SEQUENCES, CALIBRATION_TOKENS

    cal = sub.add_parser("calibrate", help="learn a calibrated method's per-layer params from real text")
    cal.add_argument("--model", default=default_model,
                     help=f"local folder, .gguf file, hub id or 'smollm2' (default: {default_model})")
    cal.add_argument("--text", required=True, help="text file to calibrate on")
    cal.add_argument("--out", required=True, help="artifact directory to write")
    cal.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    cal.add_argument("--sequences", type=int, default=CALIBRATION_SEQUENCES, help="token sequences")
    cal.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS, help="tokens per sequence")
    cal.add_argument("--skip-tokens", type=int, default=0, help="start this many tokens into the text")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    cal.add_argument("--verbose", action="store_true", help="print the calibration record")
    add_cache_arguments(cal)
    cal.set_defaults(func=run_calibrate)


def main(argv=None) -> int:
    """The `veloxquant` command; `argv` None means this process's own command line, which may restart
    itself once with OpenBLAS preloaded (`blas.preload_openblas`)."""
    if argv is None:
        from .blas import preload_openblas

        preload_openblas()
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
