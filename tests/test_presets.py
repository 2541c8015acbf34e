"""The `vq4` / `vq3` / `vq2` presets: their bits from the caches' bytes, and every way to name them."""

import mlx.core as mx
import pytest

from conftest import tiny_gemma3, tiny_llama
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cli import build_parser, config_from_args
from veloxquant_mlx.evaluation.specs import MethodSpecError, parse_method_list, parse_method_spec
from veloxquant_mlx.presets import KV_PRESETS, MIN_CONTEXT, PRESET_BITS, measured_bits, preset_config, qk_norm_hint


@pytest.fixture(scope="module")
def head64():
    """A tiny llama with SmolLM2's head dim (64): per-vector overheads (norms) cost what they cost there."""
    return tiny_llama(hidden=512, heads=8, kv_heads=2)


def test_every_preset_has_stated_bits_and_builds():
    assert set(KV_PRESETS) == set(PRESET_BITS) == {"vq4", "vq3", "vq2", "mlxq4", "mlxq8"}
    for name in KV_PRESETS:
        assert KVCacheConfig.preset(name) == preset_config(name)
    with pytest.raises(ValueError, match="known: vq4"):
        KVCacheConfig.preset("vq9")


@pytest.mark.parametrize("name", sorted(KV_PRESETS))
def test_preset_bits_hold_from_2k_tokens(name, head64):
    """Measured from the caches' bytes at 2K (where the fp16 sinks and window cost most), just past a store
    step, and at 8K: never above the stated bits, and falling as the context grows."""
    contexts = [MIN_CONTEXT, MIN_CONTEXT + 1, MIN_CONTEXT + 300, 4096, 8192]
    bits = measured_bits(KVCacheConfig.preset(name), head64, contexts)
    assert all(b <= PRESET_BITS[name] for b in bits.values()), bits
    assert bits[8192] < bits[MIN_CONTEXT]
    # a stated budget that is not loose: within half a bit of what the caches hold at 2K
    assert bits[MIN_CONTEXT] > PRESET_BITS[name] - 0.5


def test_measured_bits_count_the_fp16_window(head64):
    plain = KVCacheConfig(method="turboquant_mse", bits=3)
    windowed = plain.replace(residual_length=64, sink_tokens=4)
    a = measured_bits(plain, head64, [2048])[2048]
    b = measured_bits(windowed, head64, [2048])[2048]
    # 68 of 2048 tokens in fp16 instead of 3 bits + a 16-bit norm per 64 coordinates
    assert b - a == pytest.approx(68 / 2048 * (16 - 3.25), abs=0.02)
    assert a == pytest.approx(3.25, abs=0.01)


def test_measured_bits_count_the_kept_slots(head64):
    """A `keep_attended` cache allocates its slots as tokens settle, in attention calls: measured like a
    prefill, its bits count them (8 a layer at 2K tokens, and the spare one)."""
    windowed = KVCacheConfig.preset("vq4", residual_length=16)
    kept = windowed.replace(options={**windowed.options, "keep_attended": 2.5})
    a = measured_bits(windowed, head64, [2048])[2048]
    b = measured_bits(kept, head64, [2048])[2048]
    assert b - a == pytest.approx(9 * 16 / 2048, abs=0.005)


def test_flags_take_presets_on_every_command():
    for command in (["generate"], ["chat"], ["serve"], ["cache-prompt", "--prompt-file", "x", "--out", "y.safetensors"],
                    ["precompute", "--out", "d"], ["demo"], ["calibrate", "--text", "t.txt", "--out", "d"]):
        args = build_parser().parse_args(command + ["--kv", "vq3"])
        assert config_from_args(args) == KVCacheConfig.preset("vq3"), command
    args = build_parser().parse_args(["generate", "--kv", "vq2", "--residual-length", "64"])
    assert config_from_args(args) == KVCacheConfig.preset("vq2", residual_length=64)


def test_demo_keeps_the_preset_and_protects_without_one(monkeypatch):
    """Regression: the demo's own protections (window 64) overrode a --kv preset's window."""
    import veloxquant_mlx.demo as demo

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    seen = []
    monkeypatch.setattr("veloxquant_mlx.models.load_model", stop)
    for argv, expected in ((["demo", "--kv", "vq3"], KVCacheConfig.preset("vq3")),
                           (["demo", "--bits", "3"], None)):
        args = build_parser().parse_args(argv)
        monkeypatch.setattr("veloxquant_mlx.cli_shared.config_from_args",
                            lambda a, _real=config_from_args: seen.append(_real(a)) or seen[-1])
        with pytest.raises(Stop):
            demo.run_demo(args)
        if expected is not None:
            assert seen[-1] == expected
        else:
            assert (seen[-1].bits, seen[-1].residual_length, seen[-1].sink_tokens, seen[-1].center) == (3, 64, 4, True)


def test_presets_hint_at_smoothed_keys_on_qk_norm_models(capsys):
    gemma, llama = tiny_gemma3(), tiny_llama()
    hint = qk_norm_hint("vq3", KVCacheConfig.preset("vq3"), gemma)
    assert "smooth_keys=0.5" in hint and "vq3:smooth_keys=0.5,artifacts=auto" in hint
    assert qk_norm_hint("vq3", KVCacheConfig.preset("vq3"), llama) is None  # no QK-norm
    assert qk_norm_hint("vq3", KVCacheConfig.preset("vq3", options={"smooth_keys": 0.5}), gemma) is None
    assert qk_norm_hint(None, KVCacheConfig(method="turboquant_mse", bits=3), gemma) is None  # no preset named
    # the commands print it on stderr as they resolve the config for the loaded model
    from veloxquant_mlx.cli import config_for_model

    args = build_parser().parse_args(["generate", "--kv", "vq2"])
    assert config_for_model(args, config_from_args(args), gemma, None) == KVCacheConfig.preset("vq2")
    assert "[vq2 on a model that normalises its keys" in capsys.readouterr().err


def test_eval_specs_take_presets():
    spec = parse_method_spec("vq3")
    assert spec.config == KVCacheConfig.preset("vq3") and spec.label == "vq3" and not spec.is_baseline
    changed = parse_method_spec("vq3:window=32,vbits=3")
    assert changed.config == KVCacheConfig.preset("vq3", residual_length=32, value_bits=3)
    assert changed.label == "vq3:window=32,vbits=3"
    specs = parse_method_list("fp16,vq4,vq2:sinks=8,mlx-q4")
    assert [s.label for s in specs] == ["fp16", "vq4", "vq2:sinks=8", "mlx-q4"]
    with pytest.raises(MethodSpecError, match="widths are part of it"):
        parse_method_spec("vq3:4")


def test_preset_caches_run_a_model(head64):
    for name in KV_PRESETS:
        caches = KVCacheBuilder(KVCacheConfig.preset(name)).for_model(head64).build()
        logits = head64(mx.arange(80)[None] % 500, cache=caches)
        assert logits.shape == (1, 80, 512) and bool(mx.all(mx.isfinite(logits)))
