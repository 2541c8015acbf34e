"""Hybrid models (linear-attention or state-space layers beside attention layers: Qwen3-Next and Qwen3.5,
Nemotron-H, Jamba, LFM2, Falcon-H1, ...): the attention layers' caches are compressed, the state caches
(`ArraysCache`, a `CacheList`'s state member) kept as mlx-lm makes them, and the mixed cache lists go through
prompt-cache files (the library's and mlx-lm's), trimming (refused, as mlx-lm refuses it for a state cache),
batch merge / extract, the footprint, `veloxquant chat` and `veloxquant serve`. Tiny random models."""

import copy
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.cache.latent import CompressedLatentCache
from veloxquant_mlx.evaluation import models_matrix as matrix
from veloxquant_mlx.footprint import footprint
from veloxquant_mlx.integration import load_prompt_cache, save_prompt_cache

CONFIG = KVCacheConfig(method="turboquant_mse", bits=4)
PROMPT = mx.random.randint(0, matrix.VOCAB, (48,), key=mx.random.key(1))


@pytest.fixture(scope="module", params=["qwen3_next", "falcon_h1", "kimi_linear"])
def hybrid(request):
    """(file, model): Qwen3-Next (an ArraysCache per linear layer), Falcon-H1 (a CacheList per layer), Kimi-Linear
    (ArraysCaches beside MLA latent caches)."""
    model, _ = matrix.build_model(request.param)
    return request.param, model


def _caches(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "layer(s) keep their own non-attention cache uncompressed"
        return KVCacheBuilder(CONFIG).for_model(model).build()


def _attention_members(caches):
    return [m for c in caches for m in (c.caches if isinstance(c, mlx_cache.CacheList) else [c])]


def _next_logits(model, caches, tokens=PROMPT[-4:]):
    return model(tokens[None], cache=caches)


def _filled(model, tokens=PROMPT[:-4]):
    caches = _caches(model)
    mx.eval(model(tokens[None], cache=caches))
    return caches


def test_attention_layers_compressed_state_kept_logits_follow_mlx_lm(hybrid):
    name, model = hybrid
    caches, reference = _caches(model), mlx_cache.make_prompt_cache(model)
    members, own = _attention_members(caches), _attention_members(reference)
    ours_kinds = (CompressedKVCache, CompressedLatentCache)
    assert any(isinstance(m, ours_kinds) for m in members)
    for ours, theirs in zip(members, own):  # a state cache stays mlx-lm's, an attention cache becomes ours
        assert type(ours) is type(theirs) if isinstance(theirs, mlx_cache.ArraysCache) else isinstance(ours, ours_kinds)
    ours = model(PROMPT[None], cache=caches)[0, -8:].astype(mx.float32)
    theirs = model(PROMPT[None], cache=reference)[0, -8:].astype(mx.float32)
    kl, _ = matrix.kl_and_max(theirs, ours)
    assert kl < 0.01, kl


def test_prompt_cache_files_library_and_mlx_lm(hybrid, tmp_path):
    _, model = hybrid
    caches = _filled(model)
    expected = _next_logits(model, copy.deepcopy(caches))
    path = tmp_path / "hybrid.safetensors"
    save_prompt_cache(path, caches, {"note": "hybrid"})
    loaded, metadata = load_prompt_cache(path, CONFIG, return_metadata=True, model=model)
    assert metadata == {"note": "hybrid"}
    assert mx.array_equal(_next_logits(model, loaded), expected).item()
    mlx_cache.save_prompt_cache(str(path), caches)
    assert mx.array_equal(_next_logits(model, mlx_cache.load_prompt_cache(str(path))), expected).item()


def test_trim_is_refused_as_mlx_lm_refuses_it_for_state_caches(hybrid):
    _, model = hybrid
    caches, reference = _filled(model), mlx_cache.make_prompt_cache(model)
    assert mlx_cache.can_trim_prompt_cache(caches) == mlx_cache.can_trim_prompt_cache(reference) is False
    expected = _next_logits(model, copy.deepcopy(caches))
    assert mlx_cache.trim_prompt_cache(caches, 3) == 0
    assert mx.array_equal(_next_logits(model, caches), expected).item()


def test_batch_merge_and_extract_keep_each_sequence(hybrid):
    """mlx-lm's batching merges each layer's caches with its class's `merge` (ours for the attention layers,
    mlx-lm's for the state) and extracts a sequence's back."""
    _, model = hybrid
    first, second = _filled(model), _filled(model, PROMPT[:30])
    expected = _next_logits(model, copy.deepcopy(second))
    merged = [type(a).merge([a, b]) for a, b in zip(first, second)]
    extracted = [layer.extract(1) for layer in merged]
    assert mx.array_equal(_next_logits(model, extracted), expected).item()


def test_footprint_reports_the_whole_cache(hybrid):
    _, model = hybrid
    caches = _filled(model)
    kv = footprint(caches)
    assert kv.state > 0 and kv.held > 0
    assert 1.0 < kv.whole_smaller < kv.smaller  # the state, kept, dilutes the saving over the whole cache
    assert kv.whole_smaller == pytest.approx((kv.fp16_bytes + kv.state) / (kv.held + kv.state))
    assert "the whole cache" in kv.describe()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny random Qwen3-Next with SmolLM2's tokenizer and chat template, as a model folder."""
    from veloxquant_mlx.evaluation.shapes import write_random_model_folder

    return write_random_model_folder(tmp_path_factory.mktemp("tiny-qwen3-next"),
                                     {**matrix.derive_config("qwen3_next"), "model_type": "qwen3_next"})


def test_chat_turns_match_a_fresh_prefill(tmp_path):
    """A state cache cannot be trimmed back to what two renderings of the conversation share: where the
    cache holds more, the chat prefills the conversation again; it saves and loads the mixed list."""
    from mlx_lm.generate import generate_step
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from test_serving import _Tokenizer
    from veloxquant_mlx.chat import ChatSession

    model, _ = matrix.build_model("qwen3_next")
    tokenizer = TokenizerWrapper(_Tokenizer())
    chat = ChatSession(model, tokenizer, CONFIG, model_name="tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(chat.turn("first message", max_tokens=4))
        assert chat.cache_tokens == len(chat.cached_tokens) > 0
        second = "".join(chat.turn("second", max_tokens=4))
    assert chat.cache_tokens == len(chat.cached_tokens)
    fresh = ChatSession(model, tokenizer, CONFIG)
    fresh.messages = chat.messages[:-1]
    steps = generate_step(mx.array(fresh._render()), model, prompt_cache=_caches(model))
    ids = [int(t) for (t, _), _ in zip(steps, range(4))]
    assert len(second) > 0 and second == tokenizer.decode([i for i in ids if i != 0])[: len(second)]
    saved, held = chat.save(str(tmp_path / "chat")), chat.cached_tokens
    chat.reset()
    chat.load(str(saved))
    assert chat.cached_tokens == held and chat.cache_tokens == len(held)


@pytest.mark.slow  # loading a model folder's tokenizer (transformers) takes seconds
def test_serve_answers_with_mixed_caches(hybrid_dir):
    """`veloxquant serve`: a request, a repeat (the prompt pool's entry for a state cache is reused only
    where the prompt extends it), and the answer of a cold cache."""
    openai = pytest.importorskip("openai")
    from mlx_lm import generate

    from conftest import serve_in_thread

    httpd, generator = serve_in_thread(["--model", str(hybrid_dir), "--served-model-name", "tiny", "--port", "0",
                                        "--max-tokens", "6", "--log-level", "WARNING", "--method", "turboquant_mse",
                                        "--bits", "4"])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Tell me about lighthouses."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0.0)
        assert again.choices[0].message.content == first.choices[0].message.content
        provider = generator.model_provider
        prompt = provider.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        caches = provider.model.make_cache()
        assert any(isinstance(c, CompressedKVCache) for c in caches)
        assert any(isinstance(c, mlx_cache.ArraysCache) for c in caches)
        cold = generate(provider.model, provider.tokenizer, prompt, max_tokens=6, prompt_cache=caches)
        assert first.choices[0].message.content == cold
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
