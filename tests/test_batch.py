"""Batching compressed caches (mlx-lm's merge/extend/filter/extract protocol)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from conftest import ALL_METHODS, config_for, tiny_llama
from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.batch import BatchCompressedKVCache
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.integration import patch_model, unpatch_model

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 3], [8, 8, 19, 23, 30]]


@pytest.fixture(autouse=True)
def _decode_exact_prefill(monkeypatch):
    """These tests compare a decode step with prefilling the same tokens at once, which agree
    under the "decode" prefill rule (the default "chunk" rule shows a chunk its own tokens in fp16)."""
    monkeypatch.setenv("VELOXQUANT_PREFILL_RULE", "decode")


def _config(method):
    # A window and sinks where the method allows them, so batches mix fp16 spans and codes.
    return config_for(method, residual_length=4, sink_tokens=2) if method != "fp16" else config_for(method)


def _last_logits_one_by_one(model, config, prompts):
    out = []
    for prompt in prompts:
        caches = KVCacheBuilder(config).for_model(model).build()
        logits = model(mx.array([prompt]), cache=caches)
        out.append(logits[0, -1])
    return mx.stack(out)


def _last_logits_batched(model, caches, prompts, history=None):
    """mlx-lm's PromptProcessingBatch.prompt: right-pad, prepare, run, finalize."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padding = [width - n for n in lengths]
    tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
    for c in caches:
        c.prepare(lengths=lengths, right_padding=padding)
    logits = model(tokens, cache=caches)
    for c in caches:
        c.finalize()
    return mx.stack([logits[i, n - 1] for i, n in enumerate(lengths)])


@pytest.mark.parametrize("method", ALL_METHODS)
def test_batched_prefill_matches_one_by_one(model, method):
    config = _config(method)
    single = _last_logits_one_by_one(model, config, PROMPTS)
    rows = [KVCacheBuilder(config).for_model(model).build() for _ in PROMPTS]
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    assert all(isinstance(c, BatchCompressedKVCache) for c in batch)
    batched = _last_logits_batched(model, batch, PROMPTS)
    tol = _prefill_tolerance(model, PROMPTS)
    assert mx.allclose(batched, single, atol=tol, rtol=1e-4).item(), (mx.abs(batched - single).max().item(), tol)
    # One decode step for everyone: each row continues at its own position.
    step = model(mx.array([[4], [4], [4]]), cache=batch)[:, -1]
    for i, prompt in enumerate(PROMPTS):
        caches = KVCacheBuilder(config).for_model(model).build()
        alone = model(mx.array([prompt + [4]]), cache=caches)[0, -1]
        assert mx.allclose(step[i], alone, atol=tol, rtol=1e-4).item(), (i, mx.abs(step[i] - alone).max().item(), tol)
    assert batch[0].offset.tolist() == [len(p) + 1 for p in PROMPTS]


def test_fp16_method_batch_matches_mlx_lm_batch_cache(model):
    """The reference: mlx-lm's own left-padded BatchKVCache with its mask arrays."""
    reference = _last_logits_batched(model, [BatchKVCache([0] * 3) for _ in model.layers], PROMPTS)
    rows = [KVCacheBuilder(config_for("fp16")).for_model(model).build() for _ in PROMPTS]
    ours = _last_logits_batched(model, [CompressedKVCache.merge([r[i] for r in rows]) for i in range(2)], PROMPTS)
    # The fp16 method rounds this float32 model's keys and values to float16; BatchKVCache keeps float32.
    assert mx.allclose(ours, reference, atol=3e-3, rtol=3e-3).item()
    assert not mx.allclose(ours[::-1], reference, atol=3e-3, rtol=3e-3).item()


@pytest.mark.parametrize("method", ["turboquant_mse", "kivi", "polarquant"])
def test_merge_with_history_extend_filter_extract(model, method):
    config = _config(method)
    histories = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13]]
    rows = []
    for prompt in histories:
        caches = KVCacheBuilder(config).for_model(model).build()
        model(mx.array([prompt]), cache=caches)
        rows.append(caches)
    before = [c.nbytes for c in rows[0]]
    first = [CompressedKVCache.merge([rows[0][i]]) for i in range(2)]
    second = [CompressedKVCache.merge([rows[1][i]]) for i in range(2)]
    for a, b in zip(first, second):
        a.extend(b)
    step = model(mx.array([[20], [21]]), cache=first)[:, -1]
    assert [c.nbytes for c in rows[0]] == before  # merge copied: the callers' caches did not grow
    for i, (prompt, token) in enumerate(zip(histories, [20, 21])):
        caches = KVCacheBuilder(config).for_model(model).build()
        alone = model(mx.array([prompt + [token]]), cache=caches)[0, -1]
        assert mx.allclose(step[i], alone, atol=1e-4, rtol=1e-4).item()
    extracted = first[0].extract(1)
    assert isinstance(extracted, CompressedKVCache) and extracted.offset == len(histories[1]) + 1
    assert extracted.key_codec is not None and extracted.store.count + extracted.window + extracted.sinks == 3
    for c in first:
        c.filter([1])
    assert first[0].offset.tolist() == [3]
    assert extracted.offset == 3  # the extracted copy is independent of the batch
    model(mx.array([[22]]), cache=first)
    assert extracted.offset == 3 and first[0].rows[0].offset == 4


def test_left_padding_is_skipped_not_stored(model):
    config = _config("turboquant_mse")
    batch = [CompressedKVCache.merge([c]) for c in KVCacheBuilder(config).for_model(model).build()]
    for c in batch:
        c.prepare(left_padding=[3])
    logits = model(mx.array([[0, 0, 0, 5, 6, 7]]), cache=batch)[0, -1]
    alone = model(mx.array([[5, 6, 7]]), cache=KVCacheBuilder(config).for_model(model).build())[0, -1]
    assert mx.allclose(logits, alone, atol=1e-4, rtol=1e-4).item()
    assert batch[0].rows[0].offset == 3 and batch[0].offset.tolist() == [3]


def test_own_mask_array_is_applied_and_a_foreign_one_refused(model):
    batch = CompressedKVCache.merge(KVCacheBuilder(_config("turboquant_mse")).for_model(model).build()[:2])
    batch.prepare(left_padding=[0, 2])
    mask = batch.make_mask(4, return_array=True)
    assert mask.shape == (2, 1, 4, 4) and batch.left_padding.tolist() == [0, 2]
    assert mask[1, 0, :, :2].sum().item() == 0 and mask[0, 0].tolist()[0] == [True, False, False, False]
    keys = mx.random.normal((2, 2, 4, 32))
    batch.update_and_fetch(keys, keys)
    queries = mx.random.normal((2, 8, 4, 32))
    assert mx.array_equal(batch.attend(queries, scale=1.0, mask=mask), batch.attend(queries, scale=1.0)).item()
    with pytest.raises(ValueError, match="mask array"):
        batch.attend(queries, scale=1.0, mask=mx.ones((2, 1, 4, 4), dtype=mx.bool_))


def test_batch_generate_matches_single_sequence_generation():
    class Tok:
        eos_token_ids = {511}
        eos_token_id = 511

        def decode(self, ids):
            return " ".join(map(str, ids))

    model = tiny_llama()
    patch_model(model, _config("turboquant_mse"))
    try:
        response = batch_generate(model, Tok(), PROMPTS, max_tokens=6, return_token_ids=True)
        for prompt, ids in zip(PROMPTS, response.token_ids):
            caches = model.make_cache()
            steps = generate_step(mx.array(prompt), model, prompt_cache=caches, sampler=make_sampler(0.0))
            alone = [int(token) for (token, _), _ in zip(steps, range(6))]
            assert ids == alone[: len(ids)] and len(ids) == 6
    finally:
        unpatch_model(model)


# ---- ragged decode in one call per layer (batch_decode.py) and sliding-window batches ----------

RAGGED = [40, 9, 23]  # offsets differing by more than the window (4) and the sinks (2)


def _ragged_prompts(seed=0, lengths=RAGGED):
    mx.random.seed(seed)
    return [mx.random.randint(0, 512, (n,)).tolist() for n in lengths]


def _prefilled(model, config, prompts, settings=None, **build):
    caches = []
    for prompt in prompts:
        cache = KVCacheBuilder(config).for_model(model).build(settings=settings, **build)
        model(mx.array([prompt]), cache=cache)
        caches.append(cache)
    return caches


def _fp16_batch_noise(model, prompts, steps, seed=1):
    """The largest logit gap between mlx-lm's own `BatchKVCache` and its per-sequence `KVCache`s, fed as
    `_decode_both` feeds ours: the float noise of batching on this device (a GPU picks other matmul kernels
    for a batch of rows than for one)."""
    singles = [make_prompt_cache(model) for _ in prompts]
    rows = [make_prompt_cache(model) for _ in prompts]
    for prompt, single, row in zip(prompts, singles, rows):
        for cache in (single, row):
            mx.eval(model(mx.array([prompt]), cache=cache))
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    return _decode_both(model, batch, singles, steps, seed)


def _prefill_tolerance(model, prompts):
    """3x the largest logit gap between mlx-lm's own `BatchKVCache` prefill of `prompts` and one `KVCache` per
    prompt, at least 1e-4: a batch's matmuls round by its shape, on a GPU more than on the CPU."""
    single = mx.stack([model(mx.array([p]), cache=make_prompt_cache(model))[0, -1] for p in prompts])
    batched = _last_logits_batched(model, [BatchKVCache([0] * len(prompts)) for _ in model.layers], prompts)
    return max(1e-4, 3 * mx.abs(batched - single).max().item())


def _batch_tolerance(model, prompts, steps):
    # Our batched attention adds its own reductions to the model's: 3x the fp16 gap, at least 1e-4.
    return max(1e-4, 3 * _fp16_batch_noise(model, prompts, steps))


def _decode_both(model, batch, singles, steps, seed=1):
    """Feed the same tokens to the batch and to each sequence's own caches; the largest logit gap."""
    mx.random.seed(seed)
    worst = 0.0
    for _ in range(steps):
        tokens = mx.random.randint(0, 512, (len(singles),)).tolist()
        batched = model(mx.array([[t] for t in tokens]), cache=batch)[:, -1]
        alone = mx.stack([model(mx.array([[t]]), cache=c)[0, -1] for t, c in zip(tokens, singles)])
        worst = max(worst, mx.abs(batched - alone).max().item())
    return worst


# On CUDA (an H100) a batch encodes each leaving token with the row encoder and attends through the ragged kernel,
# where one stream's fused step encodes it inside its merge kernel; their float noise moves a few codes. Measured
# logit gaps: turboquant_mse K4/V3 with a 4-token window 0.0070 against a tolerance of 0.0065 (3x fp16's batch
# gap), vq2 0.040 against 0.008 (on the MLX-ops batch path); vq4 and vq3 pass. Sliding-window rows decode one by
# one, but their keys come from the batch's projections, which round by batch shape on a GPU: on an H200 the
# 16-token window's decode gap was 0.0217 against 0.0065.
_CODE_FLIPS_ON_GPU = pytest.mark.xfail(mx.default_device() == mx.gpu, strict=False,
                                       reason="float noise flips codes on CUDA (measured 0.0070 K4/V3, 0.040 vq2, "
                                              "0.0217 sliding window)")


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=_CODE_FLIPS_ON_GPU), "portable"])
def test_ragged_batch_decode_matches_per_sequence(model, backend):
    from veloxquant_mlx.kernels import native
    from veloxquant_mlx.settings import EngineSettings

    settings = EngineSettings.resolve(backend)
    config = config_for("turboquant_mse", 4, value_bits=3, residual_length=4, sink_tokens=2, center=True)
    prompts = _ragged_prompts()
    singles = _prefilled(model, config, prompts, settings)
    rows = _prefilled(model, config, prompts, settings)
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    tol = _batch_tolerance(model, prompts, 6)
    assert _decode_both(model, batch, singles, 6) < tol
    decoder = batch[0]._decoder
    assert decoder.active and decoder.count.tolist() != decoder.count.tolist()[:1] * 3  # ragged codes
    expected = "batch_kernel" if settings.backend in ("cuda", "metal") else "batch_native" if (
        settings.backend == "native" and native.module() is not None
        and hasattr(native.module(), "mse_attention_partials_ragged")) else "batch_ops"
    assert decoder.last_path == expected
    # filter keeps the shared buffers; extend and extract give the rows back, and decoding resumes batched
    for c in batch:
        c.filter([2, 0])
    singles = [singles[2], singles[0]]
    assert _decode_both(model, batch, singles, 3, seed=2) < tol and decoder.active
    newcomer = _prefilled(model, config, _ragged_prompts(3, [17]), settings)
    for c, n in zip(batch, newcomer[0]):
        c.extend(CompressedKVCache.merge([n]))
    singles.append(_prefilled(model, config, _ragged_prompts(3, [17]), settings)[0])
    assert _decode_both(model, batch, singles, 3, seed=4) < tol
    assert decoder.active and len(decoder.rows) == 3  # joined the buffers on its first decode step
    extracted = batch[0].extract(1)
    assert extracted.offset == singles[1][0].offset and extracted.encoded == singles[1][0].encoded
    assert mx.allclose(extracted.dequantized()[0], singles[1][0].dequantized()[0], atol=1e-3).item()
    assert decoder.active  # extract copies a row out of the buffers
    batch[0].trim(2)  # anything else writes them back first
    assert not decoder.active and batch[0].rows[1].offset == singles[1][0].offset - 2


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_gpu_ragged_kernel_matches_each_sequence_on_its_own(model, tensor_cores):
    """The GPU partial kernel's ragged form (one launch for the batch, one token count per sequence),
    run as C++ by the emulator, against the single-sequence kernel on each row copied out (the same
    arithmetic) and against the generic path (the tensor-core kernel takes fp16 operands)."""
    from veloxquant_mlx import kernels
    from veloxquant_mlx.settings import EngineSettings

    config = config_for("turboquant_mse", 4, value_bits=3, residual_length=4, sink_tokens=2, center=True)
    rows = _prefilled(model, config, _ragged_prompts())
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    model(mx.array([[1], [2], [3]]), cache=batch)
    decoder = batch[0]._decoder
    assert decoder.active and len(set(decoder.count.tolist())) == 3
    mx.random.seed(5)
    queries = mx.random.normal((3, 8, 1, 32))
    decoder.settings, decoder.path = EngineSettings.resolve(backend="emulator", tensor_cores=tensor_cores), None
    out = decoder.attend(queries, 0.2)
    assert decoder.last_path == "batch_kernel"
    for b in range(3):
        row = decoder.extract(b)
        row.settings = row.settings.replace(tensor_cores=tensor_cores)
        alone = kernels.decode_attention(row, queries[b : b + 1], 0.2, using="emulator")
        assert mx.allclose(out[b : b + 1], alone, atol=1e-6).item()
    decoder.settings, decoder.path = EngineSettings.resolve(backend="portable"), None
    assert mx.allclose(out, decoder.attend(queries, 0.2), atol=1e-3 if tensor_cores else 1e-5).item()
    assert decoder.last_path == "batch_ops"


@_CODE_FLIPS_ON_GPU
def test_sliding_window_batch_matches_single_runs(model):
    from veloxquant_mlx.rotating import CompressedRotatingKVCache

    config = config_for("turboquant_mse", 4, value_bits=3, residual_length=4, sink_tokens=2)
    prompts = _ragged_prompts()
    singles = [KVCacheBuilder(config).for_model(model).build(max_kv_size=16) for _ in prompts]
    first = mx.stack([model(mx.array([p]), cache=c)[0, -1] for p, c in zip(prompts, singles)])
    empty = [KVCacheBuilder(config).for_model(model).build(max_kv_size=16) for _ in prompts]
    batch = [empty[0][i].merge([r[i] for r in empty]) for i in range(len(empty[0]))]
    assert all(isinstance(r, CompressedRotatingKVCache) for r in batch[0].rows)
    tol = max(_batch_tolerance(model, prompts, 8), _prefill_tolerance(model, prompts))
    batched = _last_logits_batched(model, batch, prompts)
    assert mx.allclose(batched, first, atol=tol).item(), (mx.abs(batched - first).max().item(), tol)
    gap = _decode_both(model, batch, singles, 8)  # windows full, rows evicting at different points
    assert gap < tol, (gap, tol)
    assert [r.size() for r in batch[0].rows] == [16, 16, 16]
    extracted = batch[0].extract(1)
    assert isinstance(extracted, CompressedRotatingKVCache) and extracted.offset == singles[1][0].offset
    with pytest.raises(ValueError, match="max_size"):
        other = KVCacheBuilder(config).for_model(model).build(max_kv_size=24)
        BatchCompressedKVCache.merge([batch[0].rows[0], other[0]])


@pytest.mark.parametrize("window", [None, 16])
def test_batch_cache_file_round_trip(model, tmp_path, window):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    config = config_for("turboquant_mse", 4, value_bits=3, residual_length=4, sink_tokens=2)
    prompts = _ragged_prompts(lengths=[30, 9])
    rows = _prefilled(model, config, prompts, max_kv_size=window)
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    model(mx.array([[3], [4]]), cache=batch)
    assert _history_shape(batch[0]) == (2, 2, 31 if window is None else 16, 32)
    save_prompt_cache(str(tmp_path / "batch.safetensors"), batch)
    loaded = load_prompt_cache(str(tmp_path / "batch.safetensors"))
    assert [type(c).__name__ for c in loaded] == ["BatchCompressedKVCache"] * len(batch)
    assert loaded[0].offset.tolist() == batch[0].offset.tolist() == [31, 10]
    assert loaded[0].left_padding.tolist() == batch[0].left_padding.tolist()
    step = mx.array([[7], [8]])
    assert mx.allclose(model(step, cache=loaded), model(step, cache=batch), atol=1e-4).item()


def _history_shape(cache):
    from veloxquant_mlx.batch import BatchHistory

    return BatchHistory(cache, "keys").shape


def test_served_max_kv_size_makes_batchable_sliding_window_caches(model):
    from veloxquant_mlx.rotating import CompressedRotatingKVCache

    patch_model(model, _config("turboquant_mse"), max_kv_size=16)
    try:
        caches = model.make_cache()
        assert all(isinstance(c, CompressedRotatingKVCache) and c.max_size == 16 for c in caches)
        assert all(getattr(c, "batchable", hasattr(c, "merge")) for c in caches)  # what the server checks
    finally:
        unpatch_model(model)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["vq4", "vq3", pytest.param("vq2", marks=_CODE_FLIPS_ON_GPU)])
@pytest.mark.parametrize("backend", ["auto", "portable"])
def test_ragged_batch_decode_matches_per_sequence_for_presets(model, preset, backend):
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.settings import EngineSettings

    settings = EngineSettings.resolve(backend)
    config = KVCacheConfig.preset(preset)
    prompts = _ragged_prompts(lengths=[120, 37, 80])  # offsets more than the 32-token window apart
    singles = _prefilled(model, config, prompts, settings)
    rows = _prefilled(model, config, prompts, settings)
    batch = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    # every row's codes grow while batched
    assert _decode_both(model, batch, singles, 40) < _batch_tolerance(model, prompts, 40)
    assert batch[0]._decoder.active


def _decode_alone_and_together(model, config, prompts, steps):
    """Greedy logits of each prompt decoded in a batch of its own and in one batch with the others."""
    alone = [[c.merge([c]) for c in caches] for caches in _prefilled(model, config, prompts)]
    rows = _prefilled(model, config, prompts)
    together = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    tokens = [[p[-1]] for p in prompts]
    logits_alone, logits_together = [], []
    for _ in range(steps):
        one = mx.concatenate([model(mx.array([t]), cache=c)[:, -1] for t, c in zip(tokens, alone)])
        logits_together.append(model(mx.array(tokens), cache=together)[:, -1])
        logits_alone.append(one)
        tokens = [[t] for t in mx.argmax(one, axis=-1).tolist()]
    return mx.stack(logits_alone), mx.stack(logits_together), together


def test_a_sequence_decodes_to_the_same_bits_whatever_shares_its_batch():
    """A server's concurrent answers are its one-at-a-time answers: each row takes the shared-buffer decode
    or the row-by-row one by its own state, and a batch of one takes it too. The prompts include one too
    short to hold codes (it joins the buffers steps later) and lengths far apart."""
    import mlx.nn as nn

    model = tiny_llama()
    nn.quantize(model, group_size=64, bits=4)  # MLX's own matmul kernels, which treat rows independently
    config = config_for("turboquant_mse", 4, value_bits=3, residual_length=4, sink_tokens=2, center=True,
                        mean_tokens=16)
    prompts = _ragged_prompts(5, [3, 40, 9, 23])
    alone, together, batch = _decode_alone_and_together(model, config, prompts, 8)
    assert batch[0]._decoder.active and len(batch[0]._decoder.rows) == 4
    # The late joiner's row is moved to its place in the buffers, so layers read the batch without a gather.
    assert all(held is row for held, row in zip(batch[0]._decoder.rows, batch[0].rows))
    assert mx.array_equal(alone, together).item()
