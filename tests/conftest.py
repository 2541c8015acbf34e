import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, llama

from veloxquant_mlx import KVCacheConfig, available_methods


# The WikiText-2 test split: $VELOXQUANT_WIKITEXT, else ../shared/data next to the clone. A clone without
# it (CI, users) skips the tests that need it.
WIKITEXT = Path(os.environ.get("VELOXQUANT_WIKITEXT")
                or Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-test.txt")


# Cases `make test` leaves to `make test-all` (marked `slow`), chosen from a timed run of the suite on the
# 2-core machine so that `make test` stays within 8 minutes: the costliest end-to-end runs (real-process
# Ctrl-C, mlx-lm's own CLI, coherence on SmolLM2, thread sweeps) and, of each parametrized family, every
# case but its cheapest, which stays in `make test` as the family's representative.
SLOW_CASES = {
    'test_calibrated.py': (
        'test_outliers_encode_snippet_stores_what_encode_does[rabitq-dense120]',
        'test_first_use_calibrates_once_per_model_and_keeps_it',
        'test_calibrate_command_on_smollm2',
        'test_ratequant_takes_the_formats_kernels',
        'test_first_use_calibration_through_an_eval_spec',
        'test_calibrated_partial_kernels_compile_with_nvcc[mse+outliers]',
    ),
    'test_cli.py': (
        'test_generate_reports_speed_and_kv_memory',
    ),
    'test_commvq.py': (
        'test_em_stage_is_no_worse_than_before_and_uses_all_its_codewords[True]',
        'test_generates_coherent_text_on_smollm2',
        'test_em_stage_is_no_worse_than_before_and_uses_all_its_codewords[False]',
    ),
    'test_contract.py': (
        'test_to_quantized_converts_into_the_nearest_config[8-None]',
    ),
    'test_engine.py': (
        'test_dequant_kernel_equals_codec_decode[qjl]',
        'test_dequant_kernel_equals_codec_decode[turboquant_prod]',
        'test_format_kernel_paths_equal_generic[polarquant-plain]',
        'test_format_kernel_paths_equal_generic[qjl-plain]',
        'test_format_kernel_paths_equal_generic[qjl-protected]',
        'test_format_kernel_paths_equal_generic[turboquant_mse-plain]',
        'test_format_kernel_paths_equal_generic[turboquant_prod-plain]',
        'test_format_kernel_paths_equal_generic[turboquant_rvq-plain]',
        'test_smoothed_keys_take_the_format_kernels[plain]',
        'test_smoothed_keys_take_the_fused_mse_step[plain-dtype0-mma]',
        'test_smoothed_keys_take_the_fused_mse_step[plain-dtype0-simt]',
        'test_smoothed_keys_take_the_fused_mse_step[plain-dtype1-simt]',
        'test_smoothed_keys_take_the_fused_mse_step[protected-dtype0-mma]',
        'test_smoothed_keys_take_the_fused_mse_step[protected-dtype0-simt]',
        'test_smoothed_keys_take_the_fused_mse_step[protected-dtype1-mma]',
        'test_smoothed_keys_take_the_fused_mse_step[protected-dtype1-simt]',
        'test_smoothed_keys_take_the_format_kernels[protected]',
        'test_each_formats_kernels_are_checked_at_first_use',
        'test_format_kernel_paths_equal_generic[turboquant_mse-protected]',
    ),
    'test_evaluation.py': (
        'test_ppl_smollm2',
        'test_needle_smollm2',
    ),
    'test_gguf.py': (
        'test_chat_answer_scores_the_right_capital_first',
        'test_fp32_perplexity_needs_the_traditional_rope',
    ),
    'test_integration.py': (
        'test_prefill_peak_memory_not_above_fp16[2048]',
    ),
    'test_kept.py': (
        'test_decode_paths_that_read_kept_tokens_match_the_generic_path_and_others_warn[False-emulator]',
        'test_fused_decode_steps_slide_the_window_and_keep_tokens_as_the_other_paths_do[False]',
        'test_fused_decode_steps_slide_the_window_and_keep_tokens_as_the_other_paths_do[True]',
        'test_prefill_over_decoded_codes_sees_kept_tokens_in_fp16[decode]',
        'test_prefill_over_decoded_codes_sees_kept_tokens_in_fp16[chunk]',
        'test_decode_paths_that_read_kept_tokens_match_the_generic_path_and_others_warn[True-emulator]',
    ),
    'test_kernels.py': (
        'test_format_encode_kernel_equals_the_codecs_encode[turboquant_rvq-options1-128-3-4-dtype1]',
        'test_format_encode_kernel_equals_the_codecs_encode[polarquant-options7-128-4-3-dtype7]',
        'test_format_encode_kernel_equals_the_codecs_encode[qjl-options4-128-1-3-dtype4]',
        'test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader[nbytes]',
        'test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader[prefill]',
        'test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader[state]',
        'test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader[trim]',
        'test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader[update]',
        'test_decode_steps_split_by_the_settings_not_the_environment',
        "test_emulated_encode_matches_codec[(128, 3, 128, 2, 'unbiased')]",
        "test_emulated_encode_matches_codec[(128, 3, 128, 4, 'norm')]",
        "test_emulated_encode_matches_codec[(128, 3, 64, 4, 'norm')]",
        "test_emulated_encode_matches_codec[(64, 4, 64, 2, 'renorm')]",
        "test_emulated_encode_matches_codec[(96, 3, 96, 4, 'norm')]",
        'test_format_self_test_runs_a_calibrated_format_and_can_fail',
        'test_fused_step_takes_the_token_leaving_the_window[0-5-False-1]',
        'test_fused_step_takes_the_token_leaving_the_window[2-8-True-1]',
        'test_fused_step_takes_the_token_leaving_the_window[2-8-True-2]',
        'test_fused_step_takes_the_token_leaving_the_window[3-0-False-1]',
        'test_partial_kernel_reads_the_filled_part_of_a_window_buffer[window]',
        'test_the_ratequant_selftest_record_passes_in_the_emulator',
        'test_partial_kernel_reads_the_filled_part_of_a_window_buffer[sinks-residual]',
        'test_format_encode_kernel_equals_the_codecs_encode[turboquant_rvq-options2-256-4-2-dtype2]',
        "test_emulated_encode_matches_codec[(96, 3, 96, 2, 'unbiased')]",
        'test_format_partial_kernels_compile_with_nvcc[kivi-dim256]',
        'test_emulated_kernels_match_portable_generic_and_fp64[prefill_d64_k3v3_center]',
    ),
    'test_gemma3.py': (
        'test_gemma3_caches_past_the_sliding_window',
    ),
    'test_metal_sources.py': (
        'test_every_metal_launch_of_the_self_tests_type_checks',
    ),
    'test_method_prod_qjl.py': (
        'test_scores_are_unbiased[qjl-2]',
        'test_scores_are_unbiased[prod-4]',
        'test_prod_variance_matches_qjl_formula_and_thm2_bound[4]',
        'test_scores_are_unbiased[prod-3]',
    ),
    'test_mlxq.py': (
        'test_kl_is_a_fraction_of_mlx_quantized_cache_at_the_same_bits',
    ),
    'test_model.py': (
        'test_trim_equals_never_having_seen_the_tokens[kivi]',
        'test_trim_equals_never_having_seen_the_tokens[mlxq]',
        'test_saved_and_loaded_cache_gives_identical_logits[kivi]',
        'test_saved_and_loaded_cache_gives_identical_logits[mlxq]',
        'test_generated_text_stays_coherent[turboquant_prod]',
        'test_generated_text_stays_coherent[rabitq]',
        'test_generated_text_stays_coherent[kivi]',
        'test_generated_text_stays_coherent[fp16]',
        'test_generated_text_stays_coherent[turboquant_rvq]',
        'test_generated_text_stays_coherent[qjl]',
        'test_generated_text_stays_coherent[polarquant]',
        'test_kl_against_fp16_on_wikitext[fp16]',
        'test_kl_against_fp16_on_wikitext[turboquant_mse]',
        'test_kl_against_fp16_on_wikitext[turboquant_prod]',
        'test_kl_against_fp16_on_wikitext[turboquant_rvq]',
        'test_kl_against_fp16_on_wikitext[polarquant]',
        'test_kl_against_fp16_on_wikitext[qjl]',
        'test_kl_against_fp16_on_wikitext[rabitq]',
        'test_kl_against_fp16_on_wikitext[kivi]',
        'test_kl_against_fp16_on_wikitext[mlxq]',
        'test_trim_equals_never_having_seen_the_tokens[turboquant_prod]',
        'test_trim_equals_never_having_seen_the_tokens[turboquant_rvq]',
        'test_trim_equals_never_having_seen_the_tokens[polarquant]',
        'test_trim_equals_never_having_seen_the_tokens[qjl]',
        'test_trim_equals_never_having_seen_the_tokens[rabitq]',
        'test_trim_equals_never_having_seen_the_tokens[fp16]',
        'test_saved_and_loaded_cache_gives_identical_logits[turboquant_prod]',
        'test_saved_and_loaded_cache_gives_identical_logits[turboquant_rvq]',
        'test_saved_and_loaded_cache_gives_identical_logits[polarquant]',
        'test_saved_and_loaded_cache_gives_identical_logits[qjl]',
        'test_saved_and_loaded_cache_gives_identical_logits[rabitq]',
        'test_saved_and_loaded_cache_gives_identical_logits[fp16]',
    ),
    'test_newcomer.py': (
        'test_sigint_ends_generate_cleanly_in_a_process',
    ),
    'test_parity.py': (
        'test_speculative_decoding_gives_the_greedy_tokens[vq3-perturbed]',
    ),
    'test_presets.py': (
        'test_preset_bits_hold_from_2k_tokens[vq2]',
        'test_preset_bits_hold_from_2k_tokens[vq4]',
        'test_preset_bits_hold_from_2k_tokens[mlxq4]',
        'test_preset_bits_hold_from_2k_tokens[mlxq8]',
        'test_preset_bits_hold_from_2k_tokens[vq3]',
    ),
    'test_rabitq.py': (
        'test_encode_kernel_stores_what_encode_does[1]',
        'test_encode_kernel_stores_what_encode_does[3]',
        'test_generates_coherent_text_on_smollm2',
    ),
    'test_rotating.py': (
        'test_kernel_slid_window_evicts_like_the_op_by_op_cache',
    ),
    'test_server.py': (
        'test_load_8_clients_50_requests_each',
    ),
    'test_trust_integrity.py': (
        'test_fuzzed_cache_files_are_refused_or_identical[turboquant_rvq]',
        'test_fuzzed_cache_files_are_refused_or_identical[rabitq]',
        'test_fuzzed_cache_files_are_refused_or_identical[qjl]',
        'test_fuzzed_cache_files_are_refused_or_identical[turboquant_prod]',
        'test_fuzzed_cache_files_are_refused_or_identical[mlxq]',
        'test_fuzzed_cache_files_are_refused_or_identical[polarquant]',
        'test_fuzzed_cache_files_are_refused_or_identical[fp16]',
    ),
    'test_trust_mlx_tools.py': (
        'test_cache_prompt_for_mlx_lm_runs_in_mlx_lms_cli',
    ),
    'test_trust_threads.py': (
        'test_threads_generate_with_every_method_from_a_cold_start[turboquant_mse,kivi]',
    ),
    'test_vecinfer.py': (
        'test_coherent_generation_on_smollm2',
        'test_encode_kernel_stores_what_encode_does[plain]',
        'test_encode_kernel_stores_what_encode_does[smooth]',
    ),
    'test_weights.py': (
        'test_smollm2_folder_reloads_bit_identical',
        'test_weights_kernel_first_use_check_stands_aside_with_a_warning',
        'test_gpu_route_launch_arguments_run_the_kernel_in_the_emulator',
    ),
    'test_weights_rotating_matmul.py': (
        'test_model_decode_logits_are_unchanged',
        'test_a_failed_sibling_check_warns_and_keeps_one_launch_per_layer',
    ),
    'test_weights_rotation_kernel.py': (
        'test_model_logits_are_unchanged_through_the_fused_route[False]',
        'test_model_logits_are_unchanged_through_the_fused_route[True]',
    ),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name in SLOW_CASES.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)


def random_model(module, seed=0, **args):
    """`module.Model` of `module.ModelArgs(**args)` with seeded random weights, evaluated."""
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**args))
    mx.eval(model.parameters())
    return model


def decode_logits(model, make_cache=None, steps=3):
    """The last logits of a 10-token prompt and those of `steps` decode steps, evaluated step by
    step as mlx-lm's generate does; the cache from `make_cache(model)` (mlx-lm's by default)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = (make_cache or make_prompt_cache)(model)
    out = [model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), cache=cache)[:, -1]]
    mx.eval(out)
    for token in range(steps):
        out.append(model(mx.array([[11 + token]]), cache=cache)[:, -1])
        mx.eval(out[-1])
    return mx.concatenate(out)


def tiny_llama(layers=2, hidden=256, heads=8, kv_heads=2, vocab=512, seed=0):
    """A random-weight llama of real structure (GQA, RoPE) for fast tests."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_traditional=True,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(layers=3, sliding_window=32, pattern=3, vocab=512, seed=0):
    """A random-weight Gemma 3 with the 270M model's attention shapes (hidden 640, 4 query
    heads, one KV head of dim 256, QK-norm) and a short sliding window, for fast tests:
    layers 0..pattern-2 of each period slide, the last is global."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=640,
        num_hidden_layers=layers,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=vocab,
        query_pre_attn_scalar=256,
        sliding_window=sliding_window,
        sliding_window_pattern=pattern,
    )
    mx.random.seed(seed)
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_llama_dir(target: Path, context: int) -> Path:
    """A 2-layer random llama with SmolLM2's tokenizer, saved as a model folder (for servers and commands)."""
    from veloxquant_mlx.evaluation.shapes import write_random_model_folder

    return write_random_model_folder(target, dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=context, tie_word_embeddings=True,
        rope_theta=10000.0))


def bound_server(argv):
    """`veloxquant serve ARGV`'s (HTTP server, generator), bound and listening but not yet accepting."""
    from veloxquant_mlx.cli import build_parser, config_from_args
    from veloxquant_mlx.server import make_server, server_arguments

    args = build_parser().parse_args(["serve", *argv])
    config = config_from_args(args)
    return make_server(server_arguments(args, config), config)


def serve_in_thread(argv):
    """`veloxquant serve ARGV` on a thread of this process: (its HTTP server, its generator)."""
    import threading

    httpd, generator = bound_server(argv)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, generator


def random_sequences(n: int, length: int, vocab: int = 512, seed: int = 0):
    """`n` token sequences of `length` random ids (calibration inputs in the tests)."""
    rng = np.random.default_rng(seed)
    return [mx.array(rng.integers(0, vocab, length)) for _ in range(n)]


@pytest.fixture(scope="module")
def small():
    """A two-layer random llama (GQA 2) for the method tests, one per test module."""
    return tiny_llama(layers=2, hidden=128, heads=4, kv_heads=2)


def config_for(method: str, bits: int = 4, **changes) -> KVCacheConfig:
    """A valid config of `method` at `bits` (fp16 has one width; KIVI needs small groups)."""
    if method == "fp16":
        bits = 16
        changes.pop("value_bits", None)
    changes.setdefault("group_size", 32)
    return KVCacheConfig(method=method, bits=bits, **changes)


# Methods that run without an artifact dir; calibrated ones are tested in test_calibrated.py.
ALL_METHODS = sorted(n for n, m in available_methods().items() if not m.calibrated)


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    from veloxquant_mlx.models import load_model

    return load_model("smollm2")


@pytest.fixture
def cli_shares_smollm2(smollm2, monkeypatch):
    """Commands run in-process (`cli.main`) get the default model from the `smollm2` fixture instead of
    loading it again (seconds each). Only for commands that leave the model as they found it: a
    dtype, a dequantize argument or another model loads as usual."""
    from veloxquant_mlx import models

    load = models.load_model

    def shared(model=models.DEFAULT_MODEL, dequantize=None, **sharding):
        if str(model) == models.DEFAULT_MODEL and dequantize is None and sharding.get("group") is None:
            return smollm2
        return load(model, dequantize, **sharding)

    monkeypatch.setattr(models, "load_model", shared)


@pytest.fixture(scope="session")
def chat_reference(smollm2):
    """SmolLM2's chat prompt asking for the capital of France, the fp16 model's first 16 greedy tokens
    of its answer and their log-probabilities (greedy_reference)."""
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    return (prompt, *greedy_reference(model, prompt, 16))


def assert_engine_paths_agree(model, config, tokens, settings=None):
    """Caches of `config` on `model` fed `tokens` (90 prefill, 10 decode): the compiled decode,
    the generic path, the SDPA prefill (the GPU path, run on the CPU, where the domains are
    orthogonal and there is no window) and attention over the dequantized cache agree."""
    from veloxquant_mlx import EngineSettings, KVCacheBuilder, engine

    settings = settings or EngineSettings.resolve(backend="portable")
    caches = KVCacheBuilder(config).for_model(model).build(settings=settings)
    model(tokens[None, :90], cache=caches)
    for i in range(90, 100):
        model(tokens[None, i : i + 1], cache=caches)
    cache = caches[1]
    assert cache.last_path == "compiled_decode"

    def generic(q, mask=None):
        cache.settings = settings.replace(kernels=False)
        try:
            return cache.attend(q, 0.2, mask)
        finally:
            cache.settings = settings

    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(3))
    out, ref = engine.compiled_decode(cache._history(), q, 0.2), generic(q)
    assert mx.allclose(out, ref, rtol=1e-4, atol=2e-5).item(), float(mx.abs(out - ref).max())
    # the GPU decode path for formats without a kernel, with the settings of a GPU device
    cache.settings = settings.replace(gpu_device=True)
    try:
        on_gpu = cache._history()
    finally:
        cache.settings = settings
    orthogonal = cache.key_codec.format.orthogonal_domain and cache.value_codec.format.orthogonal_domain
    assert engine._sdpa_decode_supports(on_gpu, q, None) == (orthogonal and not cache.key_codec.positional)
    if engine._sdpa_decode_supports(on_gpu, q, None):
        out = engine.sdpa_decode(on_gpu, q, 0.2)
        assert mx.allclose(out, ref, rtol=1e-4, atol=2e-5).item(), float(mx.abs(out - ref).max())
    q = mx.random.normal((1, 4, 100, 32), key=mx.random.key(4))
    history = cache._history()
    # any key domain joins the fused prefill (keys out of a non-orthogonal one); values need an orthogonal one
    assert engine.sdpa_prefill_applies(history, q, "causal") == cache.value_codec.format.orthogonal_domain
    if engine.sdpa_prefill_applies(history, q, "causal") and not cache.config.residual_length:
        out, ref = engine.sdpa_prefill(history, q, 0.2, "causal"), generic(q, "causal")
        assert mx.allclose(out, ref, rtol=1e-4, atol=2e-5).item(), float(mx.abs(out - ref).max())
    keys, values = cache.dequantized()
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(5))
    plain = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2)
    assert mx.allclose(generic(q), plain, rtol=1e-3, atol=1e-4).item()


def assert_format_kernels_agree(model, config, tokens):
    """Caches of `config` on `model` fed `tokens` (90 prefill, 10 decode): in every layer the dequant
    kernel (emulated) equals the codecs' `decode` bit for bit, and the formats' partial kernel, with
    the fp16 sinks / window where the config has them, equals the engine's MLX-ops decode of the
    same codes."""
    from veloxquant_mlx import EngineSettings, KVCacheBuilder, engine
    from veloxquant_mlx.kernels import dequant, ops, partial

    caches = KVCacheBuilder(config).for_model(model).build(settings=EngineSettings.resolve(backend="portable"))
    model(tokens[None, :90], cache=caches)
    for i in range(90, 100):
        model(tokens[None, i : i + 1], cache=caches)
    for c in caches:
        c.flush()
        for role, codec in (("keys", c.key_codec), ("values", c.value_codec)):
            assert dequant.supported(codec), role
            out = dequant.dequantize(ops.runner("emulator"), c.store, role, codec, c.encoded, mx.float32)
            assert mx.array_equal(out, codec.decode(c.store.fields(role))).item(), role
    h = caches[1]._history()
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(5))
    ref = engine.compiled_decode(h, q, 0.2, compiled=False)
    h.settings = h.settings.replace(backend="emulator")
    out = partial.decode(h, q, 0.2, chunk=partial.THREADS)
    assert float(mx.max(mx.abs(out - ref))) <= 2e-5 * float(mx.max(mx.abs(ref)))


def emulate_gpu_kernels(monkeypatch, launched=None):
    """Run the weights' GPU kernel launches (`mx.fast.cuda_kernel`) through the C++ emulation of the
    same kernel text instead; each launched kernel's name is appended to `launched`."""
    import numpy as np
    import pytest

    from veloxquant_mlx.kernels import emulator, launch
    from veloxquant_mlx.weights import kernel

    if emulator.compiler() is None:
        pytest.skip("no C++20 compiler for the kernel emulator")
    names = {value: name for name, value in launch._DTYPES.items()}

    def emulated(dialect, name):
        def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            if launched is not None:
                launched.append(name)
            template = [(k, names[v] if isinstance(v, mx.Dtype) else v) for k, v in template]
            outs = emulator.run(name, [np.array(a) for a in inputs], template, grid, threadgroup, output_shapes,
                                [names[d] for d in output_dtypes])
            return [mx.array(o) for o in outs]
        return run

    monkeypatch.setattr(kernel, "_gpu_dialect", lambda: "cuda")
    monkeypatch.setattr(launch, "_mlx_kernel", emulated)
    # the emulation reads its inputs as numpy arrays, which mx.compile's tracing cannot give it
    monkeypatch.setattr(kernel, "COMPILE_ROUTES", False)


def compile_cuda_without_spills(src, out) -> str:
    """nvcc's sm_90 build of the translation unit `src` into `out` (skips the test without a usable
    CUDA toolkit); asserts it compiles with no register spills and returns ptxas's report."""
    import subprocess

    import pytest

    result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", "-Xptxas", "-v", "-o", str(out), str(src)],
                            capture_output=True, text=True)
    if result.returncode != 0 and "cannot find" in (result.stderr + result.stdout).lower():
        pytest.skip("nvcc without a usable CUDA toolkit")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 bytes spill stores" in result.stderr, result.stderr[-2000:]
    return result.stderr


def assert_partial_kernel_compiles(store, key_codec, value_codec, rep, tmp_path, tokens=300):
    """The formats' partial kernel for `store` (8 kv rows, `rep` query heads each), rendered from the
    codecs' snippets, compiles for sm_90 without spills and within the static shared memory that
    `partial.shared_bytes` counts."""
    import re

    from veloxquant_mlx.kernels import launch, partial, templates

    assert partial.fits(store, key_codec, value_codec, rep, "cuda")
    prepared = partial.prepare(store, key_codec, value_codec, 8, rep, tokens, backend="cuda")
    spec = templates.KERNELS[prepared.plan.kernel]
    ins = {"q": "float32", **{name: launch.dtype_name(a.dtype) for name, a in zip(spec["inputs"][1:], prepared.inputs)}}
    src = tmp_path / "partial.cu"
    src.write_text(templates.render_cuda(prepared.plan.kernel, prepared.plan.template, ins,
                                         {"o": "float32", "ml": "float32"}, mlx_header=False))
    report = compile_cuda_without_spills(src, tmp_path / "partial.o")
    smem = int(re.search(r"(\d+) bytes smem", report).group(1))
    counted = partial.program(store, key_codec, value_codec, rep, "cuda").shared_bytes(rep)
    assert smem <= partial.SHARED_LIMIT and abs(smem - counted) <= 16, (smem, counted)


def compile_encode_kernel(plan, tmp_path):
    """The encode kernel of `plan` (fp16 inputs) builds for sm_90 without spills."""
    from veloxquant_mlx.kernels import templates

    spec = templates.KERNELS[plan.kernel]
    inputs = {"kx": "float16", "vx": "float16", "ktab": "float32", "vtab": "float32", "emeta": "int32"}
    src = tmp_path / "encode.cu"
    src.write_text(templates.render_cuda(plan.kernel, plan.template, {name: inputs[name] for name in spec["inputs"]},
                                         dict(zip(spec["outputs"], plan.output_dtypes)), mlx_header=False))
    compile_cuda_without_spills(src, tmp_path / "encode.o")


def random_rows(rows, dim, seed=0, dtype=None):
    """(rows, dim) standard normal values from numpy's seeded generator, as an MLX array of `dtype`."""
    import numpy as np

    x = mx.array(np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32))
    return x if dtype is None else x.astype(dtype)


def assert_close_relative(got, expected, tolerance):
    """Same shape, and max |got - expected| <= tolerance * max |expected|."""
    import numpy as np

    got, expected = np.array(got.astype(mx.float32)), np.array(expected.astype(mx.float32))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max(), np.abs(got - expected).max()


def llama_of_8b_form(seed=0):
    """Llama-3.1-8B's dimensions in small: hidden 2^k (as 4096), intermediate 28 * 2^k (as 14336)."""
    from mlx_lm.models import llama

    return random_model(llama, seed, model_type="llama", hidden_size=64, num_hidden_layers=2,
                        intermediate_size=28 * 8, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                        vocab_size=96, rope_traditional=False)


def greedy_reference(model, prompt, n):
    """`n` greedy tokens after the token ids `prompt`, decoded step by step with mlx-lm's own caches,
    and the log-probabilities each came from, (n, vocab): the fp16 reference of a test that compares
    a compressed cache's predictions with it in the same run."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits, tokens, rows = model(mx.array([prompt]), cache=cache)[0, -1], [], []
    for _ in range(n):
        rows.append(logits.astype(mx.float32))
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    logits = mx.stack(rows)
    return tokens, logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forced_logprobs(model, prompt, tokens, cache=None):
    """Next-token log-probabilities after `prompt` (one prefill) and after each of `tokens[:-1]`, fed
    one decode step at a time through `cache` (mlx-lm's by default): (len(tokens), vocab)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    logits = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for token in tokens[:-1]:
        logits.append(model(mx.array([[token]]), cache=cache)[0, -1])
        mx.eval(logits[-1])
    logits = mx.stack(logits).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def agreement_with_reference(reference, tokens, logprobs):
    """How a compressed cache's teacher-forced predictions `logprobs` (forced_logprobs on the reference
    `tokens`) follow the reference's own `reference` log-probabilities: (the number of positions whose
    argmax is the reference's greedy token, the mean KL(reference || compressed) per position). Teacher
    forcing keeps one near-tie from derailing the rest, as free-running greedy text would."""
    agree = sum(int(a) == b for a, b in zip(mx.argmax(logprobs, axis=-1).tolist(), tokens))
    kl = mx.mean(mx.sum(mx.exp(reference) * (reference - logprobs), axis=-1)).item()
    return agree, kl
