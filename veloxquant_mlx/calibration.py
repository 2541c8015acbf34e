"""Calibration: learn a method's per-layer params from a few real token sequences.

`capture` runs the model over sequences with mlx-lm's own fp16 caches and records, per
attention layer, the queries, keys and values that reach attention (keys after RoPE,
as a cache stores them). `calibrate` hands them to the method (`Method.calibrate`) and to
the generic `outliers` option, and writes an artifact dir through `artifacts.precompute`
(safetensors + JSON with the model fingerprint: layer and head shapes are checked on load).

    veloxquant calibrate --model smollm2 --method ratequant --text FILE --out DIR
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from .artifacts import precompute
from .methods import get_method
from .methods.outliers import OUTLIER_PREFIX, top_channels

CALIBRATION_SEQUENCES = 4
CALIBRATION_TOKENS = 512


@contextlib.contextmanager
def _recording(records: Dict[int, list]):
    """Route every loaded mlx-lm model module's attention through a recorder (keyed by cache)."""
    from . import integration

    originals = {}

    def recorder(queries, keys, values, cache, scale, mask, sinks=None):
        if cache is not None and id(cache) in records:
            records[id(cache)].append((queries, keys, values))
        return integration._original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    hooks = (integration._original_sdpa, integration.scaled_dot_product_attention)
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, "scaled_dot_product_attention", None) in hooks:
            originals[module] = module.scaled_dot_product_attention
            module.scaled_dot_product_attention = recorder
    try:
        yield
    finally:
        for module, fn in originals.items():
            module.scaled_dot_product_attention = fn


def calibration_tokens(tokenizer, text: str, sequences: int = CALIBRATION_SEQUENCES,
                       length: int = CALIBRATION_TOKENS, skip: int = 0) -> List[mx.array]:
    """`sequences` consecutive spans of `length` tokens of `text`, after its first `skip` tokens
    (calibrate on a part of a text that an evaluation does not read)."""
    ids = tokenizer.encode(text)[skip:]
    if len(ids) < length:
        raise ValueError(f"calibration text has {len(ids)} tokens after skipping {skip}, "
                         f"fewer than one sequence of {length}")
    count = min(sequences, len(ids) // length)
    return [mx.array(ids[i * length : (i + 1) * length]) for i in range(count)]


def attention_cache(cache) -> bool:
    """Whether a model's own cache belongs to an attention layer that VeloxQuant compresses
    (`integration.compressed_caches`: mlx-lm's KVCache, or RotatingKVCache for a sliding window)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    return type(cache) in (KVCache, RotatingKVCache)


def capture(model, sequences: Sequence[mx.array], progress: bool = True) -> List[Optional[Dict[str, mx.array]]]:
    """Per layer: float32 "queries" (Hq, N, D), "keys" (H, N, D), "values" (H, N, Dv) over all
    sequences (N = their total length) and each token's "positions" (N,) in its sequence; None
    for layers without attention. A sliding-window layer (mlx-lm's RotatingKVCache) is captured
    whole: one forward's attention call gets every key of the sequence, as a full layer's does."""
    from tqdm import tqdm

    from .integration import base_caches

    per_layer: List[List[tuple]] = []
    kinds: List[bool] = []
    for tokens in tqdm(sequences, desc="capture", unit="seq", disable=not progress):
        caches = base_caches(model)
        records = {id(c): [] for c in caches if attention_cache(c)}
        with _recording(records):
            mx.eval(model(tokens[None], cache=caches))
        if not per_layer:
            per_layer = [[] for _ in caches]
            kinds = [attention_cache(c) for c in caches]
        for i, cache in enumerate(caches):
            if kinds[i]:
                calls = records[id(cache)]
                if len(calls) != 1:
                    raise RuntimeError(f"layer {i}: expected one attention call per forward, saw {len(calls)}")
                q, k, v = (a[0].astype(mx.float32) for a in calls[0])
                mx.eval(q, k, v)
                per_layer[i].append((q, k, v))
    layers = []
    for i, parts in enumerate(per_layer):
        if not kinds[i]:
            layers.append(None)
            continue
        q, k, v = (mx.concatenate([p[j] for p in parts], axis=1) for j in range(3))
        positions = mx.concatenate([mx.arange(p[1].shape[1]) for p in parts])
        layers.append({"queries": q, "keys": k, "values": v, "positions": positions})
    return layers


def _without_channels(x: mx.array, channels: mx.array) -> mx.array:
    """x (H, N, D) with each head's outlier channels removed -> (H, N, D - K)."""
    from .methods.outliers import selections

    _, rest = selections(channels, x.shape[-1])
    return x @ rest


def learn(config, layers, progress: bool = True) -> List[Optional[dict]]:
    """Per layer {"keys": params, "values": params}: the key smoothing scales and the outlier
    channels of the generic options, then the method's own params learned on what those leave
    (smoothed keys and queries, the remaining channels)."""
    from .methods.smoothing import SCALE, smoothing_scales

    method = get_method(config.method)
    counts = {"keys": config.options.get("outliers", 0), "values": config.options.get("value_outliers", 0)}
    alpha = config.options.get("smooth_keys", 0)
    learned: List[Optional[dict]] = [None if layer is None else {"keys": {}, "values": {}} for layer in layers]
    inputs = []
    for layer, out in zip(layers, learned):
        if layer is None:
            inputs.append(None)
            continue
        layer = dict(layer)
        if alpha:
            scale = smoothing_scales(layer["keys"], layer["queries"], alpha, config.center)
            out["keys"][SCALE] = scale
            rep = layer["queries"].shape[0] // scale.shape[0]
            layer["keys"] = layer["keys"] / scale[:, None, :]
            layer["queries"] = layer["queries"] * mx.repeat(scale, rep, axis=0)[:, None, :]
        for role, count in counts.items():
            if count:
                channels = top_channels(layer[role], count)
                out[role][OUTLIER_PREFIX + "channels"] = channels
                layer[role] = _without_channels(layer[role], channels)
                if role == "keys":  # queries meet the same channels: the base codec scores the rest
                    rep = layer["queries"].shape[0] // channels.shape[0]
                    layer["queries"] = _without_channels(layer["queries"], mx.repeat(channels, rep, axis=0))
        inputs.append(layer)
    own = method.calibrate(config, inputs, progress=progress)
    for i, layer in enumerate(inputs):
        if layer is None:
            continue
        for role in ("keys", "values"):
            if own is not None:
                learned[i][role].update(own[i][role])
            elif counts[role] or (alpha and role == "keys"):
                # An uncalibrated base codec at the reduced dim: stored so the artifact is self-contained.
                make = method.key_codec if role == "keys" else method.value_codec
                learned[i][role].update(make(config, layer[role].shape[-1]).params())
    if own is None and not any(counts.values()) and not alpha:
        raise ValueError(f"{config.method} learns nothing from calibration (and no outliers or smooth_keys "
                         f"option is set); "
                         f"use `veloxquant precompute` for its codebooks")
    return learned


def calibrate(model, config, sequences: Sequence[mx.array], out_dir, source: str = "",
              progress: bool = True) -> dict:
    """Capture, learn and write an artifact dir; returns the calibration record (also in its JSON)."""
    method = get_method(config.method)
    method.check_model(model)
    start = time.perf_counter()
    extra = method.calibration_inputs(model)
    layers = capture(model, sequences, progress=progress)
    if extra is not None:
        layers = [None if layer is None else {**layer, **more} for layer, more in zip(layers, extra)]
    captured = time.perf_counter()
    learned = learn(config, layers, progress=progress)
    mx.eval([list(entry[r].values()) for entry in learned if entry for r in entry])
    record = {
        "method": config.method,
        "text": source,
        "sequences": len(sequences),
        "tokens": int(sum(s.shape[0] for s in sequences)),
        "capture_seconds": round(captured - start, 3),
        "learn_seconds": round(time.perf_counter() - captured, 3),
    }
    record["seconds"] = round(record["capture_seconds"] + record["learn_seconds"], 3)
    summary = getattr(get_method(config.method), "calibration_summary", None)
    if summary is not None:
        record.update(summary(learned))
    precompute(model, config.replace(artifact_dir=None), out_dir, layers=learned, calibration=record)
    return record


AUTO = "auto"  # KVCacheConfig(artifact_dir="auto"): calibrated once per model on first use (`ensure_calibrated`)
PACKAGED_TEXT = Path(__file__).parent / "data" / "python-reference.txt"


def calibration_cache_dir() -> Path:
    """Where first-use calibrations are kept: $VELOXQUANT_CACHE_DIR, else $XDG_CACHE_HOME/veloxquant,
    else ~/.cache/veloxquant (then `calibrated/<model>/<config>`)."""
    root = os.environ.get("VELOXQUANT_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "veloxquant"
    return Path(root) / "calibrated"


def first_use_dir(config, model) -> Path:
    """The artifact dir a first-use calibration of `config` for `model` is kept in: one per model
    (its type and arguments) and per set of codecs (`codec_key`: sinks or a window do not change it)."""
    from .artifacts import model_identity

    identity = model_identity(model)
    codecs = hashlib.sha256(json.dumps(config.replace(artifact_dir=None).codec_key(), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    return calibration_cache_dir() / f"{identity['model_type']}-{identity['args_sha256'][:16]}" / f"{config.method}-{codecs}"


def ensure_calibrated(config, model, tokenizer=None, progress: bool = True):
    """`config` with `artifact_dir="auto"` resolved for `model`: the kept first-use calibration if
    there is one, else a calibration now on the text shipped in the package (`PACKAGED_TEXT`, so
    that no evaluation text is tuned on), written atomically and kept. Any other config is
    returned as it is. Calibrating needs `tokenizer`; without one a CalibrationRequiredError
    says how to provide it."""
    if config.artifact_dir != AUTO:
        return config
    from .artifacts import ARTIFACT_JSON
    from .methods.outliers import CalibrationRequiredError

    out = first_use_dir(config, model)
    resolved = config.replace(artifact_dir=str(out))
    if (out / ARTIFACT_JSON).exists():
        return resolved  # loading it checks the model's fingerprint and every checksum
    if tokenizer is None:
        raise CalibrationRequiredError(
            f"{config.describe()} calibrates once per model on first use, which needs the tokenizer: "
            f"pass it (KVCacheBuilder(config).for_model(model, tokenizer=tokenizer)), or calibrate with "
            f"`veloxquant calibrate` and pass artifact_dir=DIR")
    print(f"[calibrating {config.describe()} for this model once, on {PACKAGED_TEXT.name}; kept in {out}]",
          file=sys.stderr, flush=True)
    sequences = calibration_tokens(tokenizer, PACKAGED_TEXT.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        written = Path(scratch) / "artifacts"
        calibrate(model, config.replace(artifact_dir=None), sequences, written,
                  source=f"veloxquant_mlx/data/{PACKAGED_TEXT.name}", progress=progress)
        try:
            os.replace(written, out)  # atomic: a concurrent or interrupted run never leaves half a dir
        except OSError:
            if not (out / ARTIFACT_JSON).exists():  # another process kept its own first: use that
                raise
    return resolved


def run_calibrate(args) -> None:
    from .cli import config_from_args
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


def register_cli(sub, add_cache_arguments, default_model: str) -> None:
    cal = sub.add_parser("calibrate", help="learn a calibrated method's per-layer params from real text")
    cal.add_argument("--model", default=default_model)
    cal.add_argument("--text", required=True, help="text file to calibrate on")
    cal.add_argument("--out", required=True, help="artifact directory to write")
    cal.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder (default: refuse)")
    cal.add_argument("--sequences", type=int, default=CALIBRATION_SEQUENCES, help="token sequences")
    cal.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS, help="tokens per sequence")
    cal.add_argument("--skip-tokens", type=int, default=0, help="start this many tokens into the text")
    cal.add_argument("--no-progress", action="store_true")
    cal.add_argument("--verbose", action="store_true", help="print the calibration record")
    add_cache_arguments(cal)
    cal.set_defaults(func=run_calibrate)
