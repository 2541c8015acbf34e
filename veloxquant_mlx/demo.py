"""The main job: compress the default model's KV cache and report memory saved and quality.

Everything printed is measured in this run: perplexity, KL divergence and top-1
agreement against mlx-lm's own fp16 cache on real text (the package's own sample,
Python Language Reference text under the PSF License, unless `--text FILE` names
another), and the caches' bytes and bits per coordinate as `footprint` defines them.
"""

from __future__ import annotations

import time
from pathlib import Path


def demo_text_path(text=None) -> Path:
    """The text the demo scores: `--text FILE` or the packaged sample; checked before the model loads."""
    from .texts import sample_text_path

    if text is None:
        return sample_text_path()
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--text: no such file {path}")
    return path


DEMO_PROTECTIONS = {"sink_tokens": 4, "residual_length": 64, "center": True}


def run_demo(args) -> None:
    from mlx_lm import stream_generate

    from .cli_shared import config_for_model, config_from_args
    from .texts import load_text, tokenize_prefix
    from .kvlayout import kv_layout
    from .evaluation.perplexity import evaluate_perplexity, make_windows
    from .evaluation.specs import VELOXQUANT, MethodSpec, parse_method_spec
    from .integration import KVCacheBuilder
    from .methods import get_method
    from .models import load_model

    text_path = demo_text_path(args.text)
    if not getattr(args, "kv", None):
        # Without a preset, the recommended protections fill the flags left unset (and `renorm` below).
        for flag, value in DEMO_PROTECTIONS.items():
            if getattr(args, flag, None) is None:
                setattr(args, flag, value)
    config = config_from_args(args)
    if not getattr(args, "kv", None) and "renorm" in get_method(config.method).options \
            and "renorm" not in config.options:
        config = config.replace(options={**config.options, "renorm": True})
    started = time.perf_counter()
    model, tokenizer = load_model(args.model)
    config = config_for_model(args, config, model, tokenizer)  # artifact_dir="auto": once per model
    layout = kv_layout(model)
    text = load_text(str(text_path))
    windows = make_windows(tokenize_prefix(tokenizer, text, args.ctx), args.ctx, 1)
    ours = MethodSpec(
        config.describe(), config.describe(), VELOXQUANT, config.method, config.bits, config.value_bits,
        group_size=config.group_size, config=config,
    )
    fp16, ours_record = evaluate_perplexity(model, windows, [parse_method_spec("fp16"), ours])
    if ours_record["status"] != "ok":
        raise ValueError(f"{config.describe()} failed: {ours_record['error']}")

    print()
    shape = layout.describe()
    print(
        f"VeloxQuant-MLX demo — model {args.model}: {shape['kv_layers']} attention layers, "
        f"{shape['kv_heads']} KV heads, head dim {shape['key_dim']}"
    )
    print(f"text: {text_path}, {args.ctx} tokens, second half scored, 512-token chunks")
    print()
    header = f"{'cache':58s} {'perplexity':>10s} {'KL mean':>9s} {'KL p99':>8s} {'top-1':>7s} {'KV bytes held':>13s} {'bits/coord':>10s}"
    print(header)
    print("-" * len(header))
    for label, record in (("fp16 (mlx-lm KVCache)", fp16), (config.describe(), ours_record)):
        kl_mean = record.get("kl_mean") or 0.0
        kl_p99 = record.get("kl_p99") or 0.0
        agree = record.get("top1_agreement") or 1.0
        print(
            f"{label:58s} {record['perplexity']:10.3f} {kl_mean:9.4f} {kl_p99:8.4f} {agree:7.1%} "
            f"{record['kv_bytes']:13,d} {record['bits_per_coord']:10.2f}"
        )
    fp16_bytes = ours_record["fp16_kv_bytes"]
    ours_bytes = ours_record["kv_bytes"]
    change = 100 * (ours_record["perplexity"] / fp16["perplexity"] - 1)
    print()
    print(
        f"memory: {ours_bytes / 1e6:.2f} MB held vs {fp16_bytes / 1e6:.2f} MB for an fp16 cache of the same "
        f"{ours_record['kv_tokens']} tokens: {ours_record['compression_vs_fp16']:.2f}x smaller, "
        f"{100 * (1 - ours_bytes / fp16_bytes):.1f}% saved ({ours_record['kv_allocated_bytes'] / 1e6:.2f} MB "
        "allocated, the spare capacity of 256-token steps included)"
    )
    print(f"quality: perplexity {change:+.2f}% vs fp16, mean KL {ours_record['kl_mean']:.4f} nats")
    if fp16.get("kv_dtype") and fp16["kv_dtype"] != "float16":
        print(
            f"(mlx-lm's KVCache holds {fp16['kv_dtype']} here, as the model runs in float32 on the CPU: "
            f"{fp16['kv_allocated_bytes']:,d} bytes allocated; bits and bytes above count 2 bytes per element)"
        )

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    caches = KVCacheBuilder(config).for_model(model, tokenizer).build()
    answer = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=30, prompt_cache=caches))
    print(f"sample answer with the compressed cache: {answer.strip()!r}")
    layer = caches[0]
    if layer.encoded:
        print(f"decode attention on the codes: the {layer.last_path!r} path on the {layer.settings.backend!r} "
              "back end (veloxquant_mlx.engine)")
    else:
        print(f"decode attention: the sample's {layer.offset} tokens all fit the fp16 sinks and window, so it "
              f"attended no codes ({layer.last_path!r} path); the perplexity run above did")
    print(f"done in {time.perf_counter() - started:.0f} s")
