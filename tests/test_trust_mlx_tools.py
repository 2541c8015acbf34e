"""mlx-lm's own tools with saved caches, each in a fresh process: mlx-lm's load_prompt_cache then
its generate_step on a compressed file (the attention hook comes with the restored cache), and a
`cache-prompt --for-mlx-lm` file read by a process that never imports this library."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import config_for

from veloxquant_mlx import make_prompt_cache, save_prompt_cache
from veloxquant_mlx.prompt_cache import for_mlx_lm_caches, prefill

ROOT = Path(__file__).resolve().parent.parent
# The same tiny random llama in this process and in the child (seeded, built from mlx-lm's ModelArgs).
MODEL = textwrap.dedent("""
    import mlx.core as mx
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=128,
                           rope_traditional=True)
    mx.random.seed(7)
    model = llama.Model(args)
    mx.eval(model.parameters())
""")
DOCUMENT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
QUESTION = [16, 93, 99, 37]
GREEDY = textwrap.dedent("""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    tokens = [int(t) for t, _ in generate_step(mx.array(QUESTION), model, max_tokens=6, prompt_cache=cache,
                                                sampler=make_sampler(0.0))]
""")


def _child(script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _here(cache) -> list:
    namespace = {"mx": mx}
    exec(MODEL, namespace)
    namespace.update(cache=cache(namespace["model"]), QUESTION=QUESTION)
    exec(GREEDY, namespace)
    return namespace["tokens"]


def _filled(model, config):
    caches = make_prompt_cache(model, config)
    prefill(model, caches, DOCUMENT)
    return caches


def test_mlx_lm_load_then_generate_in_a_fresh_process(tmp_path):
    """Regression: mlx-lm's load_prompt_cache then its generate raised TypeError in
    scaled_dot_product_attention: the hook came only with building a cache or patching a model."""
    config = config_for("turboquant_mse", 4, residual_length=4)
    path = tmp_path / "doc.safetensors"
    expected = _here(lambda model: (save_prompt_cache(path, _filled(model, config)),
                                    __import__("veloxquant_mlx").load_prompt_cache(path))[1])
    script = MODEL + textwrap.dedent(f"""
        import json
        import veloxquant_mlx  # registers the cache classes: nothing is built or patched here
        from mlx_lm.models.cache import load_prompt_cache
        cache = load_prompt_cache({str(path)!r})
        QUESTION = {QUESTION}
    """) + GREEDY + "print(json.dumps({'tokens': tokens}))"
    assert _child(script)["tokens"] == expected


def test_for_mlx_lm_file_needs_no_veloxquant(tmp_path):
    """`cache-prompt --for-mlx-lm` writes mlx-lm's KVCache of the decoded keys and values: a process
    that never imports this library reads it and answers as a cache of those values does here."""
    config = config_for("turboquant_mse", 4, residual_length=4)
    path = tmp_path / "doc.safetensors"
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.cache import save_prompt_cache as mlx_save

    def decoded(model):
        plain = for_mlx_lm_caches(_filled(model, config))
        assert all(type(c) is KVCache and c.offset == len(DOCUMENT) for c in plain)
        mlx_save(str(path), plain, {"model": "tiny", "tokenizer_config": "{}"})
        return plain

    expected = _here(decoded)
    script = MODEL + textwrap.dedent(f"""
        import json, sys
        from mlx_lm.models.cache import load_prompt_cache
        cache, metadata = load_prompt_cache({str(path)!r}, return_metadata=True)
        QUESTION = {QUESTION}
    """) + GREEDY + ("assert not [m for m in sys.modules if m.startswith('veloxquant')]\n"
                     "print(json.dumps({'tokens': tokens, 'model': metadata['model']}))")
    got = _child(script)
    assert got == {"tokens": expected, "model": "tiny"}


@pytest.mark.model
def test_cache_prompt_for_mlx_lm_runs_in_mlx_lms_cli(tmp_path):
    from veloxquant_mlx.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper counted ships before dawn. " * 20)
    out = tmp_path / "doc.safetensors"
    assert main(["cache-prompt", "--prompt-file", str(doc), "--out", str(out), "--for-mlx-lm", "--kv", "vq4"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", str(out),
                           "--prompt", "How many ships?", "--max-tokens", "5"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
