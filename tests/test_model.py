"""Every method at 4 bits on the real SmolLM2-135M-Instruct model (marked `model`)."""

import mlx.core as mx
import pytest
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache

from conftest import ALL_METHODS, WIKITEXT, agreement_with_reference, config_for, forced_logprobs
from veloxquant_mlx import (
    KVCacheBuilder,
    load_prompt_cache,
    patch_model,
    save_prompt_cache,
    unpatch_model,
)

pytestmark = pytest.mark.model

PROMPT_TOKENS, SCORED, CHUNK = 1536, 512, 512

# Mean KL(fp16 || method) of next-token distributions over the last 512 positions of a
# 1536-token WikiText-2 prompt, every method at 4 bits with no fp16 window or sinks.
# Measured values in comments; bounds leave ~1.5x headroom for platform differences.
KL_BOUNDS = {
    "fp16": 1e-4,  # measured 0.0000
    "turboquant_mse": 0.11,  # measured 0.074
    "turboquant_prod": 0.65,  # measured 0.428: unbiased, but the sketch's variance costs more
    "turboquant_rvq": 0.14,  # measured 0.095
    "polarquant": 0.37,  # measured 0.244
    "qjl": 3.5,  # measured 2.44: the sign sketch alone is far too noisy for this model
    "rabitq": 0.087,  # measured 0.0578 (4-bit extended codes + two fp16 scalars: 16 bits/token over turboquant_mse)
    "kivi": 0.03,  # measured 0.0185 (group 32: fp16 scale and min cost 1 bit/coordinate more)
    "mlxq": 0.066,  # measured 0.0442 (mx.quantize affine on turboquant_mse's rotation)
}


@pytest.fixture(scope="module")
def prompt(smollm2):
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} not found (the shared WikiText-2 test split)")
    _, tokenizer = smollm2
    text = WIKITEXT.read_text()[:20000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= PROMPT_TOKENS
    return mx.array(ids[:PROMPT_TOKENS])[None]


def last_logprobs(model, caches, tokens):
    outputs = []
    for start in range(0, tokens.shape[1], CHUNK):
        logits = model(tokens[:, start : start + CHUNK], cache=caches)
        mx.eval(logits)
        outputs.append(logits)
    logits = mx.concatenate(outputs, axis=1)[0, -SCORED:].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    model, _ = smollm2
    return last_logprobs(model, make_prompt_cache(model), prompt)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_kl_against_fp16_on_wikitext(smollm2, prompt, reference, method):
    model, _ = smollm2
    caches = KVCacheBuilder(config_for(method, 4)).for_model(model).build()
    logprobs = last_logprobs(model, caches, prompt)
    kl = mx.mean(mx.sum(mx.exp(reference) * (reference - logprobs), axis=-1)).item()
    print(f"{method}: mean KL {kl:.4f}")
    assert kl < KL_BOUNDS[method], (method, kl)


# Teacher-forced over the fp16 model's 16 greedy tokens (conftest.chat_reference). The reference has two
# near-ties (under 0.3 nats) that a 4-bit cache may flip, so 13 of 16 leaves room for them and one more.
COHERENT_AGREE, COHERENT_KL = 13, 0.4
QJL_INCOHERENT = pytest.mark.xfail(
    strict=True, reason="qjl's sign-sketch keys are too noisy on SmolLM2 at 4 bits (4 of 16 tokens, KL 3.1)"
)


@pytest.mark.parametrize("method", [pytest.param(m, marks=QJL_INCOHERENT) if m == "qjl" else m for m in ALL_METHODS])
def test_generated_text_stays_coherent(smollm2, chat_reference, method):
    """Decoding a chat answer through the compressed cache predicts the fp16 model's greedy tokens."""
    model, _ = smollm2
    prompt, tokens, reference = chat_reference
    caches = KVCacheBuilder(config_for(method, 4)).for_model(model).build()
    agree, kl = agreement_with_reference(reference, tokens, forced_logprobs(model, prompt, tokens, caches))
    assert agree >= COHERENT_AGREE and kl < COHERENT_KL, (method, agree, kl)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_saved_and_loaded_cache_gives_identical_logits(tmp_path, smollm2, prompt, method):
    model, _ = smollm2
    config = config_for(method, 4, sink_tokens=2, residual_length=16)
    caches = KVCacheBuilder(config).for_model(model).build()
    mx.eval(model(prompt[:, :300], cache=caches))
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path, config=config)
    next_token = prompt[:, 300:301]
    assert mx.array_equal(model(next_token, cache=caches), model(next_token, cache=loaded)).item()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_trim_equals_never_having_seen_the_tokens(smollm2, prompt, method):
    model, _ = smollm2
    config = config_for(method, 4)
    trimmed = KVCacheBuilder(config).for_model(model).build()
    fresh = KVCacheBuilder(config).for_model(model).build()
    # As in speculative decoding: a prompt, then draft tokens that get rejected.
    mx.eval(model(prompt[:, :300], cache=trimmed))
    mx.eval(model(prompt[:, 300:310], cache=trimmed))
    assert [c.trim(10) for c in trimmed] == [10] * len(trimmed)
    mx.eval(model(prompt[:, :300], cache=fresh))
    next_token = prompt[:, 400:401]
    a = model(next_token, cache=trimmed)
    b = model(next_token, cache=fresh)
    assert mx.allclose(a, b, atol=1e-4).item(), mx.abs(a - b).max().item()


def test_plain_mlx_lm_generate_uses_patched_caches(smollm2):
    model, tokenizer = smollm2
    config = config_for("turboquant_mse", 4)
    patch_model(model, config)
    try:
        made = []
        original = model.make_cache
        model.make_cache = lambda: made.append(original()) or made[-1]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name a primary color."}], add_generation_prompt=True, tokenize=False
        )
        first = generate(model, tokenizer, prompt, max_tokens=8)
        second = generate(model, tokenizer, prompt, max_tokens=8)
        assert first == second and first.strip()
        assert len(made) == 2 and made[0][0] is not made[1][0]
        assert made[0][0].offset > 0 and made[0][0].nbytes > 0
    finally:
        unpatch_model(model)
