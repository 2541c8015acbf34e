"""Learned attention sinks (mlx-lm's `sinks=`: GPT-OSS, MiMo-V2-Flash), one logit per query head that joins
the softmax's denominator and adds no value: the generic path adds them as float attention over the
dequantized history does (`mx.fast.scaled_dot_product_attention(..., sinks=)`), and every other path, the CPU
and GPU kernels' included, as the generic path does. CUDA and Metal run in `test_gpu_paths_add_sinks` on a
machine that has one (it skips elsewhere); the kernels' text runs here through the C++ emulator."""

import copy

import mlx.core as mx
import pytest

from veloxquant_mlx import EngineSettings, KVCacheConfig, engine, kernels
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.cache.errors import CacheInputError
from veloxquant_mlx.kernels import emulator, native, partial

needs_cxx = pytest.mark.skipif(emulator.compiler() is None, reason="no C++20 compiler for the kernel emulator")
needs_native = pytest.mark.skipif(not native.available(), reason="veloxquant_mlx._native not built")

# 6 query heads over 2 KV heads; the large logits take most of their heads' softmax.
SINKS = mx.array([0.5, 3.0, -1.0, 6.0, 2.0, 0.0])
PROTECTED = dict(sink_tokens=4, residual_length=16, center=True)
SCALE = 0.125


def _config(method, protected, **changes):
    return KVCacheConfig(method=method, bits=4, group_size=32, **(PROTECTED if protected else {}), **changes)


def _filled(config, settings, tokens=300, decode=3, batch=1):
    cache = CompressedKVCache(config, settings=settings)
    k = mx.random.normal((batch, 2, tokens + decode, 64), key=mx.random.key(1)) * 2
    v = mx.random.normal((batch, 2, tokens + decode, 64), key=mx.random.key(2)) + 0.5  # a mean to centre
    cache.update_and_fetch(k[..., :tokens, :], v[..., :tokens, :])
    for i in range(tokens, tokens + decode):
        cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    return cache


def _generic(cache, queries, mask=None, sinks=SINKS):
    """The generic path's output on a copy of `cache` (the same state: a prefill's band included)."""
    other = copy.deepcopy(cache)
    other.settings = other.settings.replace(kernels=False)
    out = other.attend(queries, SCALE, mask=mask, sinks=sinks)
    assert other.last_path == "generic"
    return out


def _close(out, ref, tol=2e-5):
    err = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
    assert err <= tol * max(1.0, float(mx.max(mx.abs(ref)))), err


def _device_noise(compute):
    """How far `compute()` on the default device lands from the same computation on the CPU, relative to
    its size: 0 on the CPU; on a GPU its kernels' own summation order and matmul precision."""
    on_device = compute()
    with mx.stream(mx.cpu):
        on_cpu = compute()
    return float(mx.max(mx.abs(on_device - on_cpu))) / max(1.0, float(mx.max(mx.abs(on_cpu))))


@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
@pytest.mark.parametrize("method", ["turboquant_mse", "kivi", "turboquant_rvq"])
def test_generic_path_adds_sinks_as_float_attention_does(method, protected):
    cache = _filled(_config(method, protected), EngineSettings.resolve(backend="portable", kernels=False))
    q1 = mx.random.normal((1, 6, 1, 64), key=mx.random.key(3))
    cache.attend(q1, SCALE)  # a decode call: the prefill's band (fp16 for its own queries) is over
    keys, values = cache.dequantized()
    for queries, mask in ((q1, None), (mx.random.normal((1, 6, 5, 64), key=mx.random.key(4)), "causal")):
        ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask=mask, sinks=SINKS)
        out = cache.attend(queries, SCALE, mask=mask, sinks=SINKS)
        _close(out, ref)
        without = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask=mask)
        assert float(mx.max(mx.abs(ref - without))) > 0.05  # the sinks weigh: the check above can fail


def _decode_cases():
    native_mark = [needs_native]
    slow_cxx = [needs_cxx, pytest.mark.slow]  # the emulator compiles each kernel: seconds a case
    return [
        pytest.param("portable", {}, "turboquant_mse", "mse_portable", id="mse-portable"),
        pytest.param("portable", {}, "kivi", "compiled_decode", id="kivi-compiled"),
        pytest.param("portable", {"gpu_device": True}, "kivi", "sdpa_decode", id="kivi-sdpa"),
        pytest.param("portable", {"gpu_device": True}, "turboquant_rvq", "sdpa_decode", id="rvq-sdpa"),
        pytest.param("native", {}, "turboquant_mse", "mse_native", marks=native_mark, id="mse-native"),
        pytest.param("native", {}, "kivi", "kivi_native", marks=native_mark, id="kivi-native"),
        pytest.param("emulator", {}, "turboquant_mse", "mse_kernel_step", marks=slow_cxx, id="mse-kernel-step"),
        pytest.param("emulator", {"compile_step": False}, "turboquant_mse", "mse_kernel_ops", marks=slow_cxx,
                     id="mse-kernel-ops"),
    ]


@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
@pytest.mark.parametrize("backend,settings,method,path", _decode_cases())
def test_every_decode_path_adds_sinks_as_the_generic_path(backend, settings, method, path, protected):
    cache = _filled(_config(method, protected), EngineSettings.resolve(backend=backend, **settings))
    if backend == "emulator":
        cache.flush()  # the emulator's decode token would wait for the fused step (its own test below)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(3))
    ref = _generic(cache, q)
    out = cache.attend(q, SCALE, sinks=SINKS)
    assert cache.last_path == path
    _close(out, ref, 2e-3 if backend == "emulator" else 2e-5)  # the emulator's kernels sum in another order


@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
@pytest.mark.parametrize("method", ["turboquant_mse", "kivi"])
def test_gpu_style_prefill_adds_sinks_as_the_generic_path(method, protected):
    """MLX's fused attention takes the sinks; centred keys and values get their means back first."""
    cache = _filled(_config(method, protected), EngineSettings.resolve(backend="portable", gpu_device=True))
    chunk = mx.random.normal((1, 2, 7, 64), key=mx.random.key(5))
    cache.update_and_fetch(chunk, chunk + 0.5)  # a prefill chunk: its queries see it in fp16 (a band)
    q = mx.random.normal((1, 6, 7, 64), key=mx.random.key(6))
    ref = _generic(cache, q, "causal")
    out = cache.attend(q, SCALE, mask="causal", sinks=SINKS)
    assert cache.last_path == "sdpa_prefill"
    # On a GPU the generic path itself moves from its CPU result by the device's arithmetic: that sets the floor
    # (3x for headroom).
    _close(out, ref, max(2e-5, 3 * _device_noise(lambda: _generic(cache, q, "causal"))))


@needs_cxx
@pytest.mark.slow  # the emulator compiles each kernel: seconds a case
@pytest.mark.parametrize("sink_tokens,window,center", [(2, 8, True), (0, 0, False)])
def test_fused_decode_step_adds_sinks(sink_tokens, window, center):
    """The "decode_store" kernels (encode, attend, store and slide the window in one step) with the sinks'
    split among the partials: the merge kernel's split count includes it."""
    config = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, center=center, sink_tokens=sink_tokens,
                           residual_length=window)
    k = mx.random.normal((1, 2, 306, 64), key=mx.random.key(1)).astype(mx.float16)
    v = mx.random.normal((1, 2, 306, 64), key=mx.random.key(2)).astype(mx.float16)
    ref = CompressedKVCache(config, settings=EngineSettings.resolve(backend="portable"))
    fused = CompressedKVCache(config, settings=EngineSettings.resolve(backend="emulator"))
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., :300, :], v[..., :300, :])
    for t in range(300, 306):
        q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(t)).astype(mx.float16)
        for cache in (ref, fused):
            cache.update_and_fetch(k[..., t : t + 1, :], v[..., t : t + 1, :])
        expected = ref.attend(q, SCALE, sinks=SINKS)
        out = fused.attend(q, SCALE, sinks=SINKS)
        assert fused.last_path == "mse_fused_step"
        _close(out, expected, 2e-3)


@needs_cxx
@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
def test_formats_partial_kernel_adds_sinks(protected):
    """Every format's partial + merge kernels (`partial.decode`, emulated), the fp16 window held in the merge."""
    cache = _filled(_config("kivi", protected), EngineSettings.resolve(backend="portable"))
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(3))
    ref = _generic(cache, q)
    h = cache.attention_history()
    h.sink_logits = SINKS
    h.settings = h.settings.replace(backend="emulator")
    _close(partial.decode(h, q, SCALE, chunk=partial.THREADS), ref)
    _close(engine.compiled_decode(h, q, SCALE, compiled=False), ref)


def test_sinks_of_the_wrong_shape_are_refused():
    cache = _filled(_config("kivi", False), EngineSettings.resolve(backend="portable"))
    with pytest.raises(CacheInputError, match="one logit per query head"):
        cache.attend(mx.zeros((1, 6, 1, 64)), SCALE, sinks=mx.zeros((2,)))


GPU = EngineSettings.resolve().backend if EngineSettings.resolve().backend in ("cuda", "metal") else None


@pytest.mark.skipif(GPU is None, reason="no CUDA or Metal GPU: the kernels run emulated in the tests above")
@pytest.mark.parametrize("protected", [False, True], ids=["plain", "protected"])
@pytest.mark.parametrize("method", ["turboquant_mse", "kivi", "turboquant_rvq"])
def test_gpu_paths_add_sinks(method, protected):
    """On the GPU machine: the kernel back end's decode (the fused decode_store step for turboquant_mse, the
    formats' kernels for the others) and prefill paths, step after step, against the generic path."""
    cache = CompressedKVCache(_config(method, protected), settings=EngineSettings.resolve())
    k = mx.random.normal((1, 2, 320, 64), key=mx.random.key(1)).astype(mx.float16) * 2
    v = mx.random.normal((1, 2, 320, 64), key=mx.random.key(2)).astype(mx.float16) + 0.5
    cache.update_and_fetch(k[..., :300, :], v[..., :300, :])
    q = mx.random.normal((1, 6, 300, 64), key=mx.random.key(3)).astype(mx.float16)
    paths = set()
    ref = _generic(cache, q[..., -16:, :], "causal")
    _close(cache.attend(q[..., -16:, :], SCALE, mask="causal", sinks=SINKS), ref, 2e-2)
    paths.add(cache.last_path)
    for t in range(300, 320):
        cache.update_and_fetch(k[..., t : t + 1, :], v[..., t : t + 1, :])
        q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(t)).astype(mx.float16)
        ref = _generic(cache, q)
        _close(cache.attend(q, SCALE, sinks=SINKS), ref, 2e-2)  # fp16 queries and histories
        paths.add(cache.last_path)
    assert "generic" not in paths, paths
    if method == "turboquant_mse":  # the decode token waits for the kernels that encode, attend and store it
        assert "mse_fused_step" in paths, paths


def test_gpt_oss_with_sinks_follows_mlx_lm_through_its_rotating_layers():
    """A tiny random GPT-OSS (alternating sliding-window and full layers, learned sinks made to weigh) with
    VeloxQuant's caches follows mlx-lm's: its sliding layers wrap their compressed rotating caches."""
    from mlx_lm.models import cache as mlx_cache

    from veloxquant_mlx.evaluation import models_matrix as matrix
    from veloxquant_mlx.rotating import CompressedRotatingKVCache

    model, config = matrix.build_model("gpt_oss")
    for layer in model.layers:
        heads = layer.self_attn.sinks.shape[0]
        layer.self_attn.sinks = mx.linspace(1.0, 6.0, heads)
    tokens = mx.random.randint(0, config["vocab_size"], (model.args.sliding_window + 40,), key=mx.random.key(1))
    prefill = tokens.shape[0] - 4
    reference = matrix.run_caches(model, mlx_cache.make_prompt_cache(model), tokens, prefill)
    caches = matrix.parse_method_spec("vq4").make_caches(model)
    assert any(isinstance(c, CompressedRotatingKVCache) for c in caches)
    ours = matrix.run_caches(model, caches, tokens, prefill)
    kl, _ = matrix.kl_and_max(reference, ours)
    for layer in model.layers:  # the same caches' logits without the sinks: far from mlx-lm's
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e4)
    unsunk, _ = matrix.kl_and_max(reference, matrix.run_caches(model, matrix.parse_method_spec("vq4").make_caches(model),
                                                             tokens, prefill))
    assert kl < 0.03 and unsunk > 10 * kl, (kl, unsunk)
