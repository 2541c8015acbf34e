"""What the commands share: the cache flags and the config they make, the memory line, and how a
parsed command runs (its errors and exit status). `cli.py` builds the parser; `chat.py`, `demo.py`
and `evaluation/cli.py` use these without importing it."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_cache_arguments(parser: argparse.ArgumentParser, default_method: str = "turboquant_mse",
                        allow_none: bool = False) -> None:
    """The cache flags. Unset ones come from `--kv PRESET` if given, else from the defaults shown. With
    `allow_none`, `--kv none` keeps mlx-lm's own caches (`config_from_args` gives None)."""
    from .config import KVCacheConfig
    from .presets import KV_PRESETS, describe_presets

    base = KVCacheConfig(method=default_method)
    group = parser.add_argument_group(
        "KV cache", "Flags left unset take the --kv preset's value, or else the default shown."
    )
    group.add_argument("--kv", choices=sorted(KV_PRESETS) + (["none"] if allow_none else []), default=None,
                       metavar="PRESET", help=f"a recommended configuration: {describe_presets()}"
                       + ("; none: mlx-lm's own caches, uncompressed" if allow_none else "")
                       + " (default: none given; the flags below)")
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
    group.add_argument("--mean-tokens", type=int, default=None,
                       help="estimate the centring means on at most this many of the first encoded tokens "
                            "(default: a preset's, 256; without a preset, every token of the first flush)")
    group.add_argument("--kv-seed", type=int, default=None, help=f"seed of rotations and sketches (default: {base.seed})")
    group.add_argument("--artifact-dir", default=None,
                       help="precomputed codebooks/rotations from `veloxquant precompute` (default: none)")
    group.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="method option, repeatable, e.g. renorm=true (default: none)")


_CACHE_FLAGS = {"method": "method", "bits": "bits", "value_bits": "value_bits", "group_size": "group_size",
                "residual_length": "residual_length", "sink_tokens": "sink_tokens", "center": "center",
                "mean_tokens": "mean_tokens", "kv_seed": "seed", "artifact_dir": "artifact_dir"}


def config_from_args(args, default_method: str = "turboquant_mse"):
    from .config import KVCacheConfig, parse_option_value
    from .presets import preset_config, resolved_preset

    from .methods import get_method

    kv = getattr(args, "kv", None)
    if kv == "none":
        given = [flag for flag in _CACHE_FLAGS if getattr(args, flag, None) is not None] + (["option"] if args.option else [])
        if given:
            raise ValueError(f"--kv none keeps mlx-lm's own caches; it takes no cache flags (got --{given[0].replace('_', '-')})")
        return None
    kv = resolved_preset(kv) if kv else kv
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


def memory_report(caches) -> str:
    """The caches' size in words, as every command counts it (`footprint`): bytes the tokens hold, bytes
    allocated (the store grows in 256-token steps, as mlx-lm's fp16 cache does), bits per coordinate, and
    how many times smaller than an fp16 cache of the same tokens."""
    from .footprint import footprint

    return footprint(caches).describe()


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
    """Run a parsed command: 0 on success, 1 when a requested method failed, 2 on a user error, 130 when
    interrupted (Ctrl-C)."""
    start = time.perf_counter()
    try:
        outcome = args.func(args)
    except KeyboardInterrupt:
        if os.environ.get("VELOXQUANT_TRACEBACK"):
            raise
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
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
