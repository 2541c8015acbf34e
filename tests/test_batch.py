"""Batching compressed caches (mlx-lm's merge/extend/filter/extract protocol)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import BatchKVCache
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
    assert mx.allclose(batched, single, atol=1e-4, rtol=1e-4).item()
    # One decode step for everyone: each row continues at its own position.
    step = model(mx.array([[4], [4], [4]]), cache=batch)[:, -1]
    for i, prompt in enumerate(PROMPTS):
        caches = KVCacheBuilder(config).for_model(model).build()
        alone = model(mx.array([prompt + [4]]), cache=caches)[0, -1]
        assert mx.allclose(step[i], alone, atol=1e-4, rtol=1e-4).item(), i
    assert [c.offset for c in batch[0].rows] == [len(p) + 1 for p in PROMPTS]


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
