"""Threads: several threads generate at once with the real model, each with its own caches, from a
cold start (a fresh process: no codec, compiled step or weight evaluated yet), for every method.
Each thread's greedy text must equal the same prompt's text generated alone, and the process must
exit cleanly (each thread calls mx.clear_streams(), as MLX requires)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ALL_METHODS

SCRIPT = textwrap.dedent('''
    import sys, threading
    import mlx.core as mx
    from mlx_lm import generate
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.models import load_model

    methods, threads, rounds = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    model, tokenizer = load_model("smollm2")
    prompts = [f"List {i + 2} colours:" for i in range(threads)]
    failures = []
    for method in methods:
        for round_ in range(rounds):
            # A new seed per round: new codecs, built by whichever thread gets there first.
            config = KVCacheConfig(method=method, bits=16 if method == "fp16" else 4, group_size=32,
                                   residual_length=8, sink_tokens=2, seed=round_)
            texts, errors = {}, []

            def work(i):
                try:
                    caches = KVCacheBuilder(config).for_model(model).build()
                    texts[i] = generate(model, tokenizer, prompts[i], max_tokens=5, prompt_cache=caches)
                except BaseException as error:
                    errors.append(f"{type(error).__name__}: {error}")
                finally:
                    mx.clear_streams()

            workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            alone = [generate(model, tokenizer, p, max_tokens=5,
                              prompt_cache=KVCacheBuilder(config).for_model(model).build()) for p in prompts]
            if errors or [texts.get(i) for i in range(threads)] != alone:
                failures.append(f"{method} round {round_}: {errors or 'texts differ from single-thread runs'}")
            print(f"{method} round {round_}: {'ok' if not failures or method not in failures[-1] else 'FAILED'}")
    print("FAILURES", failures)
    mx.clear_streams()
    sys.exit(1 if failures else 0)
''')


# The process's cold start is what is tested, so each case pays one interpreter, MLX import and model load:
# `make test` runs a row-store and a group-store method, `make test-all` every method.
@pytest.mark.model
@pytest.mark.parametrize("methods", [
    ["turboquant_mse", "kivi"],
    pytest.param(ALL_METHODS, marks=pytest.mark.slow, id="every-method"),
], ids=lambda methods: ",".join(methods))
def test_threads_generate_with_every_method_from_a_cold_start(tmp_path, methods):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, str(script), ",".join(methods), "3", "2"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(": ok") == 2 * len(methods)
