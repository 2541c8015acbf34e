"""Batches, caches and the server's prompt-cache pool hold the memory their tokens need, and no more (`batch_decode.py`,
`storage.py`, `prompt_cache.py`)."""

import copy
import gc
import weakref

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from conftest import config_for
from veloxquant_mlx.batch import BatchCompressedKVCache
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.prompt_cache import FreshPromptCache
from veloxquant_mlx.storage import STEP

HEADS, QUERY_HEADS, DIM = 2, 4, 64
CONFIG = config_for("turboquant_mse", 4, value_bits=3, residual_length=8, sink_tokens=2, center=True, mean_tokens=16)


def _row(tokens: int, seed: int) -> CompressedKVCache:
    mx.random.seed(seed)
    cache = CompressedKVCache(CONFIG)
    cache.update_and_fetch(mx.random.normal((1, HEADS, tokens, DIM)), mx.random.normal((1, HEADS, tokens, DIM)))
    cache.attend(mx.random.normal((1, QUERY_HEADS, 1, DIM)), scale=DIM**-0.5)
    return cache


def _settled_active_memory() -> int:
    """MLX's active memory once Python's garbage is collected and every queued computation has run."""
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


def _step(batch: BatchCompressedKVCache, seed: int) -> mx.array:
    mx.random.seed(seed)
    n = len(batch.rows)
    batch.update_and_fetch(mx.random.normal((n, HEADS, 1, DIM)), mx.random.normal((n, HEADS, 1, DIM)))
    out = batch.attend(mx.random.normal((n, QUERY_HEADS, 1, DIM)), scale=DIM**-0.5)
    mx.eval(out)
    return out


def test_buffers_follow_the_rows_held_not_the_steps_taken():
    """Rows finishing (`filter`) and joining (`extend`) while the buffers stay held: their capacity follows
    the longest row held, not the longest row at take-over plus every step since."""
    batch = BatchCompressedKVCache.merge([_row(100 + 10 * b, b) for b in range(3)])
    decoder = batch._decoder
    for step in range(3 * STEP):
        if step and step % 40 == 0:  # the longest row finishes and a short one joins
            offsets = batch.offset.tolist()
            longest = offsets.index(max(offsets))
            batch.filter([i for i in range(len(offsets)) if i != longest])
            batch.extend(BatchCompressedKVCache([_row(100, 100 + step)]))
        _step(batch, step)
    assert decoder.active
    longest = max(decoder.count.tolist())
    assert longest <= decoder.most <= longest + 40  # the step's bound: exact after a filter, then one a step
    assert decoder.capacity <= longest + 2 * STEP, (decoder.capacity, longest)
    assert decoder.codes.shape[2] == decoder.capacity


def test_release_lets_the_shared_buffers_go():
    """Written back into the rows, the shared buffers are freed: no second copy of the batch stays alive."""
    batch = BatchCompressedKVCache.merge([_row(1000 + 10 * b, b) for b in range(4)])
    _step(batch, 0)
    assert batch._decoder.active
    held = _settled_active_memory()
    batch._release()
    assert all(getattr(batch._decoder, name, None) is None for name in ("codes", "window_keys", "window_values"))
    mx.eval([a for c in batch.rows for a in (c.store.rows, c._window_keys, c._window_values) if a is not None])
    # The rows' copies replace the buffers (kept, these were a second copy of every row, out of `nbytes`).
    after = _settled_active_memory()
    assert after < held + batch.nbytes // 4, (after, held, batch.nbytes)
    _step(batch, 1)  # taken over again
    assert batch._decoder.active


def test_a_batch_with_held_buffers_deep_copies_into_an_independent_one():
    """mlx-lm's `PromptProcessingBatch.split` deep-copies its batch caches, which may hold decode buffers
    (a chunk of one token for every row decodes): the copy decodes as the original would, on its own buffers."""
    batch = BatchCompressedKVCache.merge([_row(60 + 7 * b, b) for b in range(3)])
    _step(batch, 0)
    assert batch._decoder.active
    twin = copy.deepcopy(batch)
    assert set(map(id, twin._decoder.rows)) <= set(map(id, twin.rows))  # the copy's buffers hold the copy's rows
    assert not set(map(id, twin._decoder.rows)) & set(map(id, batch.rows))
    assert twin._decoder.codes is not batch._decoder.codes
    for seed in range(1, 4):
        assert mx.array_equal(_step(batch, seed), _step(twin, seed)).item()
    batch.filter([0])  # the original changes; the copy does not
    assert len(twin.rows) == 3 and twin.offset.tolist() == [60 + 7 * b + 4 for b in range(3)]


def _freed_by_reference_counting(make) -> bool:
    """Whether what `make` returns is freed as soon as its last reference goes, without Python's cyclic
    collector (which runs only now and then, and until it does a cycle keeps every MLX buffer it holds)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        made = make()
        ref = weakref.ref(made)
        del made
        return ref() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("method", ["turboquant_mse", "kivi"])  # a row store and a field store
def test_a_dropped_cache_is_not_a_reference_cycle(method):
    config = CONFIG if method == "turboquant_mse" else config_for("kivi", 4, residual_length=8)

    def filled():
        cache = CompressedKVCache(config)
        cache.update_and_fetch(mx.random.normal((1, HEADS, 40, DIM)), mx.random.normal((1, HEADS, 40, DIM)))
        cache.update_and_fetch(mx.random.normal((1, HEADS, 1, DIM)), mx.random.normal((1, HEADS, 1, DIM)))
        mx.eval(cache.attend(mx.random.normal((1, QUERY_HEADS, 1, DIM)), scale=DIM**-0.5))
        return cache

    assert _freed_by_reference_counting(filled)
    assert _freed_by_reference_counting(lambda: copy.deepcopy(filled()))
    twin = copy.deepcopy(filled())  # the copy's store encodes into the copy, which works on its own
    twin.update_and_fetch(mx.random.normal((1, HEADS, 20, DIM)), mx.random.normal((1, HEADS, 20, DIM)))
    assert twin.offset == 61 and twin.encoded > 0


def test_an_extracted_row_holds_its_own_tokens_not_the_batch():
    """mlx-lm's server extracts a finished sequence's cache from the running batch (and may pool it): once the
    batch is gone, the extracted row holds about its own bytes, not the batch's decode buffers."""
    before = _settled_active_memory()
    gc.disable()
    try:
        batch = BatchCompressedKVCache.merge([_row(3000 + 10 * b, b) for b in range(6)])
        _step(batch, 0)
        assert batch._decoder.active
        batch_bytes = batch.nbytes
        row = batch.extract(2)
        del batch
        mx.synchronize()
        held = mx.get_active_memory() - before
    finally:
        gc.enable()
    assert held < 2 * row.nbytes + batch_bytes // 6, (held, row.nbytes, batch_bytes)
    assert row.offset == 3021


def test_a_pooled_cache_of_mlx_lm_holds_its_own_tokens_not_the_batch():
    """`veloxquant serve --kv none` pools mlx-lm's caches, which `BatchKVCache.extract` cuts from the running
    batch as lazy slices: pooled, each holds its own tokens, not the batch's buffers as they were."""
    sequences = 6

    def row():
        cache = KVCache()
        keys = mx.random.normal((1, HEADS, 3000, DIM)).astype(mx.float16)
        cache.update_and_fetch(keys, keys)
        return cache

    def step(batch):
        keys = mx.random.normal((sequences, HEADS, 1, DIM)).astype(mx.float16)
        mx.eval(*batch.update_and_fetch(keys, keys))

    before = _settled_active_memory()
    batch = BatchKVCache.merge([row() for _ in range(sequences)])
    step(batch)
    pool, pooled = FreshPromptCache(max_size=10), 0
    for b in range(4):
        extracted = batch.extract(b)
        pooled += extracted.nbytes
        pool.insert_cache("model", list(range(b, b + 8)), [extracted])
        del extracted
        for _ in range(2):  # each decode step writes the batch's buffers anew
            step(batch)
    batch_bytes = batch.nbytes
    del batch
    held = _settled_active_memory() - before
    assert len(pool) == 4
    assert held < pooled + batch_bytes // 2, (held, pooled, batch_bytes)
