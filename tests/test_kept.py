"""`keep_attended`: tokens kept in fp16 past the window by the attention they got there (`kept.py`)."""

import copy
import math
import warnings

import mlx.core as mx
import pytest

from veloxquant_mlx import CacheFormatError, CompressedKVCache, EngineSettings, KVCacheConfig
from veloxquant_mlx import engine
from veloxquant_mlx.batch import BatchCompressedKVCache
from veloxquant_mlx.cache import CacheInputError
from veloxquant_mlx.cache_integrity import split_state
from veloxquant_mlx.kept import EMPTY, MIN_TOKENS, KeptTokens
from veloxquant_mlx.rotating import CompressedRotatingKVCache

SINKS, WINDOW, HEADS, QUERY_HEADS, DIM, N = 4, 8, 2, 4, 64, 160
DECODE_RULE = EngineSettings.resolve(prefill_rule="decode")


def config(threshold=1.5, center=False, **options):
    return KVCacheConfig(method="turboquant_mse", bits=3, value_bits=2, sink_tokens=SINKS, residual_length=WINDOW,
                         center=center, options={"renorm": True, "keep_attended": threshold, **options})


def inputs(seed=0, liked=(50, 97)):
    """Keys, values and queries where the tokens at `liked` get much of every later query's attention."""
    mx.random.seed(seed)
    k = mx.random.normal((1, HEADS, N, DIM))
    v = mx.random.normal((1, HEADS, N, DIM))
    direction = mx.random.normal((DIM,))
    direction = direction / mx.linalg.norm(direction)
    for position in liked:
        k[:, :, position] = 8 * direction
    q = mx.random.normal((1, QUERY_HEADS, N, DIM)) + 3 * direction
    return k, v, q


def run(cfg, chunks, data, settings=DECODE_RULE):
    k, v, q = data
    cache = CompressedKVCache(cfg, settings=settings)
    outs, start = [], 0
    for size in chunks:
        cache.update_and_fetch(k[..., start : start + size, :], v[..., start : start + size, :])
        outs.append(cache.attend(q[..., start : start + size, :], 1 / 8, mask="causal"))
        start += size
    return cache, mx.concatenate(outs, axis=2)


def kept_positions(cache):
    return sorted(p for p in cache.kept.held()[2].tolist() if p != EMPTY)


def dense_shares(k, q, scale=1 / 8):
    """Each token's window share, computed densely: query i's softmax over the sinks and positions
    (i - WINDOW, i], the part on token j summed over the queries that see j in the window and over
    query heads, divided by the query heads."""
    repeats = QUERY_HEADS // HEADS
    keys = mx.repeat(k, repeats, axis=1)
    scores = (q * scale) @ keys.swapaxes(-1, -2)  # (1, Hq, N, N)
    i, j = mx.arange(N)[:, None], mx.arange(N)[None]
    band = (j <= i) & (j > i - WINDOW) & (j >= SINKS)
    seen = band | ((j < SINKS) & (j <= i))
    probs = mx.softmax(mx.where(seen, scores, -mx.inf), axis=-1)
    return mx.sum(mx.where(band, probs, 0.0), axis=(0, 1, 2)) / QUERY_HEADS


def test_kept_tokens_are_the_threshold_rule_applied_as_each_token_leaves_the_window():
    data = inputs()
    cache, _ = run(config(1.5), [N], data)
    shares = dense_shares(data[0], data[2])
    settled = range(SINKS, cache.sinks + cache.encoded)  # every token that left the window
    want = [j for j in settled if shares[j].item() >= 1.5]
    assert 50 in want and 97 in want and len(want) < cache.kept.budget(cache.kept.settled)
    assert kept_positions(cache) == want
    shares_held = cache.kept.shares  # the window's tokens: what their queries gave them so far
    assert mx.allclose(shares_held, shares[cache.sinks + cache.encoded :], atol=1e-4).item()


@pytest.mark.parametrize("chunks", [[1] * N, [37, 63, 1, 1, 58], [5, 150, 5]])
def test_kept_tokens_and_outputs_do_not_depend_on_the_chunks(chunks):
    data = inputs()
    whole, out = run(config(1.5), [N], data)
    split, out_split = run(config(1.5), chunks, data)
    assert kept_positions(split) == kept_positions(whole) != []
    assert mx.allclose(out_split, out, atol=1e-4).item(), float(mx.abs(out_split - out).max())


def test_attention_sees_kept_tokens_in_fp16_and_the_rest_from_codes():
    """A decode step's output is attention over the cache's decoded history with each kept token's
    fp16 key and value in place of its codes (and no other change)."""
    data = inputs()
    k, v, q = data
    kept, _ = run(config(1.5), [N - 1], data)
    plain, _ = run(config(1.5).replace(options={"renorm": True}), [N - 1], data)
    for cache in (kept, plain):
        cache.update_and_fetch(k[..., N - 1 :, :], v[..., N - 1 :, :])
    positions = kept_positions(kept)
    assert positions
    keys, values = plain.dequantized()
    at = mx.array(positions)
    keys[:, :, at], values[:, :, at] = k[:, :, at], v[:, :, at]
    want = mx.fast.scaled_dot_product_attention(q[..., N - 1 :, :], keys, values, scale=1 / 8)
    got = kept.attend(q[..., N - 1 :, :], 1 / 8)
    assert mx.allclose(got, want, atol=1e-4).item()
    without = plain.attend(q[..., N - 1 :, :], 1 / 8)
    assert not mx.allclose(without, want, atol=1e-3).item()  # the kept tokens changed the output
    dk, dv = kept.dequantized()
    assert mx.allclose(dk, keys, atol=1e-3).item() and mx.allclose(dv, values, atol=1e-3).item()


def test_keep_most_bounds_the_kept_tokens_and_their_bytes():
    data = inputs()
    everything, _ = run(config(0.0001, keep_most=1 / 64), [N], data)  # every token qualifies
    budget = math.ceil(MIN_TOKENS / 64)
    assert everything.kept.capacity == budget
    assert kept_positions(everything) == list(range(SINKS, SINKS + budget))  # the first ones, then none
    plain, _ = run(config(0.0001).replace(options={"renorm": True}), [N], data)
    kept_bytes = everything.nbytes - plain.nbytes
    slot = 2 * HEADS * DIM * data[0].itemsize + 4  # the key and value of each kv head as given, and the position
    assert slot * (budget + 1) <= kept_bytes <= slot * (budget + 1) + 4 + 4 * WINDOW
    # The slots are the budget whatever is kept: the bytes do not depend on the text (nor need a count read back).
    none_kept, _ = run(config(1e9, keep_most=1 / 64), [N], data)
    assert not kept_positions(none_kept) and none_kept.kept.capacity == budget
    assert none_kept.nbytes == everything.nbytes


def test_state_round_trip_and_refusals():
    data = inputs()
    k, v, q = data
    cache, _ = run(config(1.5), [N - 1], data)
    restored = CompressedKVCache.from_state(cache.state)
    assert kept_positions(restored) == kept_positions(cache)
    copied = copy.deepcopy(cache)
    outs = []
    for c in (cache, restored, copied):
        c.settings = DECODE_RULE
        c.update_and_fetch(k[..., N - 1 :, :], v[..., N - 1 :, :])
        outs.append(c.attend(q[..., N - 1 :, :], 1 / 8))
    assert mx.array_equal(outs[0], outs[1]).item() and mx.array_equal(outs[0], outs[2]).item()
    header, arrays = split_state(cache.state)
    arrays = dict(arrays, kept_keys=arrays["kept_keys"][:, :, :-1])
    with pytest.raises(CacheFormatError, match="kept.keys"):  # the header check or the checksums' shape check
        CompressedKVCache.from_state([header, arrays])


def test_trim_drops_kept_tokens_that_were_trimmed():
    data = inputs()
    k, v, q = data
    cache, _ = run(config(1.5), [N], data)
    assert 97 in kept_positions(cache)
    cache.trim(N - 90)  # into the codes: positions 90.. are gone
    assert cache.offset == 90 and kept_positions(cache) == [p for p in kept_positions(cache) if p < 90]
    assert 97 not in kept_positions(cache) and 50 in kept_positions(cache)
    cache.update_and_fetch(k[..., 90:91, :], v[..., 90:91, :])
    assert cache.attend(q[..., 90:91, :], 1 / 8).shape == (1, QUERY_HEADS, 1, DIM)


def test_batches_keep_tokens_per_sequence():
    data = inputs()
    k, v, q = data
    rows = [run(config(1.5), [N - 1], inputs(seed))[0] for seed in (0, 1)]
    batch = BatchCompressedKVCache.merge(rows)
    batch.update_and_fetch(mx.concatenate([k[..., N - 1 :, :]] * 2), mx.concatenate([v[..., N - 1 :, :]] * 2))
    out = batch.attend(mx.concatenate([q[..., N - 1 :, :]] * 2), 1 / 8, mask=None)
    for row, cache in enumerate(rows):
        cache.update_and_fetch(k[..., N - 1 :, :], v[..., N - 1 :, :])
        assert mx.allclose(out[row : row + 1], cache.attend(q[..., N - 1 :, :], 1 / 8), atol=1e-5).item()


@pytest.mark.parametrize("backend", ["default", "emulator"])
@pytest.mark.parametrize("center", [False, True])
def test_decode_paths_that_read_kept_tokens_match_the_generic_path_and_others_warn(center, backend):
    """A decode step with kept tokens runs on a path registered with `takes_kept` with the generic
    path's result (and so does every other such path that takes the call); a path above it that
    would have taken the call is named in a warning. The emulator runs the GPU kernels' decode steps
    (`mse_kernel_step`, `mse_kernel_ops`) in numpy."""
    data = inputs()
    k, v, q = data
    settings = DECODE_RULE if backend == "default" else EngineSettings.resolve(prefill_rule="decode", backend=backend)
    cache, _ = run(config(1.5, center), [N - 1], data, settings)
    cache.update_and_fetch(k[..., N - 1 :, :], v[..., N - 1 :, :])
    cache.flush()  # on the kernels the window slides op by op here: the fused step has its own test (below)
    history = cache._history()
    assert history.kept and kept_positions(cache)
    skipped = [p.name for p in engine.paths("decode") if p.supports(history, q[..., N - 1 :, :], None)
               and not p.takes_kept]
    ranked = [p.name for p in engine.paths("decode")]
    used = engine.choose("decode", history, q[..., N - 1 :, :])
    assert used is not None and used.takes_kept
    if backend == "emulator":
        assert used.name == "mse_kernel_step"
    engine._warn_kept.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cache.attend(q[..., N - 1 :, :], 1 / 8)
    assert cache.last_path == used.name
    said = [str(w.message) for w in caught if "keep_attended" in str(w.message)]
    above = [name for name in skipped if ranked.index(name) < ranked.index(used.name)]
    assert len(said) == (1 if above else 0) and all(above[0] in text and used.name in text for text in said)
    want = engine.generic(cache._history(), q[..., N - 1 :, :], 1 / 8)
    # The emulated kernels differ from MLX's ops by about 2e-4 here with or without kept tokens (their
    # fp16 operands); a kept token's codes scored as well as its fp16 would be off by about 0.5.
    atol = 1e-5 if backend == "default" else 5e-4
    assert mx.allclose(got, want, atol=atol).item(), float(mx.abs(got - want).max())
    for path in engine.paths("decode"):  # every path that says it takes this call, not only the first
        if path.takes_kept and path.supports(history, q[..., N - 1 :, :], None):
            out = path.run(cache._history(), q[..., N - 1 :, :], 1 / 8)
            assert mx.allclose(out, want, atol=atol).item(), (path.name, float(mx.abs(out - want).max()))
    if backend == "emulator":  # the kernels op by op (VELOXQUANT_COMPILE_STEP=0), with a split per 32 tokens
        from veloxquant_mlx import kernels

        out = kernels.kernel_ops(cache._history(), q[..., N - 1 :, :], 1 / 8, chunk=32)
        assert mx.allclose(out, want, atol=atol).item(), float(mx.abs(out - want).max())


@pytest.mark.parametrize("center", [False, True])
def test_fused_decode_steps_slide_the_window_and_keep_tokens_as_the_other_paths_do(center):
    """Token by token on the kernel back end (the emulator), the fused step ("decode_store":
    `mse_fused_step`) slides the window, and the settling ran before it, in one compiled graph over
    the ring (`KeptTokens.decode_step_sliding`). It keeps the tokens the CPU's paths keep, and its
    outputs agree with theirs, also at the steps where the token it encodes is kept (its codes not
    attended to, its fp16 in a split)."""
    data = inputs(liked=(50, 97, 121, 122, 140))
    k, v, q = data
    emulated = EngineSettings.resolve(prefill_rule="decode", backend="emulator")
    chunks = [100] + [1] * (N - 100)
    reference, want = run(config(1.5, center), chunks, data)
    fused, got = run(config(1.5, center), chunks[:-1], data, emulated)
    fused.update_and_fetch(k[..., N - 1 :, :], v[..., N - 1 :, :])
    assert fused.incoming is not None  # the step waits for the kernel to slide the window
    got = mx.concatenate([got, fused.attend(q[..., N - 1 :, :], 1 / 8)], axis=2)
    assert fused.last_path == "mse_fused_step"
    assert kept_positions(fused) == kept_positions(reference)
    assert {121, 122, 140} <= set(kept_positions(fused))  # kept as they left the window in a fused step
    # The emulated fused steps differ from the CPU's paths by up to about 6e-4 here with or without kept
    # tokens (fp16 operands, the new token encoded in the kernel); a kept token that the kernel also
    # attended to from its codes made the error 0.57 (checked).
    assert mx.allclose(got[..., 100:, :], want[..., 100:, :], atol=1e-3).item(), \
        float(mx.abs(got[..., 100:, :] - want[..., 100:, :]).max())


@pytest.mark.parametrize("rule", ["decode", "chunk"])
def test_prefill_over_decoded_codes_sees_kept_tokens_in_fp16(rule):
    """The GPU's prefill paths (the history decoded, then MLX's fused attention) write the kept
    tokens' fp16 over their decoded codes and agree with the generic path; the emulator runs the
    dequant kernels of `mse_kernel_prefill` and `format_kernel_prefill`."""
    from veloxquant_mlx import kernels

    data = inputs()
    k, v, q = data
    cache, _ = run(config(1.5), [100], data, EngineSettings.resolve(prefill_rule=rule, backend="emulator"))
    cache.update_and_fetch(k[..., 100:140, :], v[..., 100:140, :])
    cache._keep_attended(q[..., 100:140, :], 1 / 8)  # what attend() does before any path
    assert len(kept_positions(cache)) >= 2
    chunk = q[..., 100:140, :]
    want = engine.generic(cache._history(), chunk, 1 / 8, "causal")
    for name, path in (("sdpa_prefill", engine.sdpa_prefill), ("mse_kernel_prefill", kernels.kernel_prefill),
                       ("format_kernel_prefill", kernels.format_kernel_prefill)):
        got = path(cache._history(), chunk, 1 / 8, "causal")
        assert mx.allclose(got, want, atol=5e-4).item(), (name, float(mx.abs(got - want).max()))
    assert all(p.takes_kept for p in engine.paths("prefill")
               if p.name in ("sdpa_prefill", "mse_kernel_prefill", "format_kernel_prefill"))


def test_what_keep_attended_refuses():
    with pytest.raises(ValueError, match="residual_length"):
        KVCacheConfig(method="turboquant_mse", options={"keep_attended": 1.0})
    with pytest.raises(ValueError, match="keep_most"):
        KVCacheConfig(method="turboquant_mse", residual_length=8, options={"keep_most": 0.01})
    with pytest.raises(ValueError, match="keep_most"):
        config(1.5, keep_most=0.0)
    kivi = KVCacheConfig(method="kivi", bits=4, residual_length=32, options={"keep_attended": 1.0})
    k, v, _ = inputs()
    with pytest.raises(CacheInputError, match="blocks"):
        CompressedKVCache(kivi).update_and_fetch(k, v)
    with pytest.raises(CacheInputError, match="batch 1"):
        CompressedKVCache(config()).update_and_fetch(mx.concatenate([k, k]), mx.concatenate([v, v]))
    with pytest.raises(ValueError, match="rotating"):
        CompressedRotatingKVCache(config(), max_size=64)
    # not part of the codecs: the same codebooks and artifacts with or without it
    assert config(1.5).codec_key() == config(1.5).replace(options={"renorm": True}).codec_key()
    # a whole number for the threshold, as a spec gives "keep_attended=2", is a threshold like 2.0
    assert KeptTokens.for_config(config(2)).threshold == 2.0
    with pytest.raises(TypeError, match="keep_attended"):
        config("2")
