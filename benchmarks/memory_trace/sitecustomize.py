"""Where a server's memory goes, step by step: with this folder first on PYTHONPATH and VQ_MEMORY_TRACE set,
every Python process that runs mlx-lm's `BatchGenerator` (`veloxquant serve`, and the servers
`veloxquant benchmark serve` starts) writes `$VQ_MEMORY_TRACE.<pid>`: one line for each generation step that
raised MLX's peak or active memory to a new high, and every 100th step.

    PYTHONPATH=benchmarks/memory_trace:$PWD VQ_MEMORY_TRACE=/tmp/trace veloxquant benchmark serve ...

A line: the step, the sequences decoding and prefilling before -> after it, the requests waiting, MLX's active
memory before -> after (GB), MLX's peak so far, the `nbytes` of the decoding and prefilling batches' caches,
and the step's seconds. Each step ends in `mx.synchronize()`, so the server runs slower while traced: read
its timings, not the benchmark's throughput.
"""

import os
import sys

if os.environ.get("VQ_MEMORY_TRACE"):
    import time

    import mlx.core as mx
    import mlx_lm.generate  # noqa: F401  (mlx_lm's __init__ binds the name `generate` to a function)

    _generation = sys.modules["mlx_lm.generate"]
    _untraced_next = _generation.BatchGenerator._next
    _state = {"steps": 0, "most_active": 0, "log": None}

    def _gigabytes(caches) -> float:
        return sum(c.nbytes for c in caches or []) / 1e9

    def _traced_next(self):
        if _state["log"] is None:
            _state["log"] = open(f"{os.environ['VQ_MEMORY_TRACE']}.{os.getpid()}", "w", buffering=1)
        decoding, prefilling = len(self._generation_batch), len(self._prompt_batch)
        waiting = len(self._unprocessed_sequences)
        peak_before, active_before, start = mx.get_peak_memory(), mx.get_active_memory(), time.perf_counter()
        result = _untraced_next(self)
        mx.synchronize()
        peak, active = mx.get_peak_memory(), mx.get_active_memory()
        _state["steps"] += 1
        kind = "PEAK" if peak > peak_before else "HIGH" if active > _state["most_active"] else "step"
        _state["most_active"] = max(active, _state["most_active"])
        if kind != "step" or _state["steps"] % 100 == 0:
            _state["log"].write(
                f"{kind} {_state['steps']} decoding {decoding}->{len(self._generation_batch)} prefilling "
                f"{prefilling}->{len(self._prompt_batch)} waiting {waiting} active {active_before / 1e9:.2f}->"
                f"{active / 1e9:.2f} peak {peak / 1e9:.2f} decoding_caches "
                f"{_gigabytes(self._generation_batch.prompt_cache):.2f} prefilling_caches "
                f"{_gigabytes(self._prompt_batch.prompt_cache):.2f} seconds {time.perf_counter() - start:.3f}\n")
        return result

    _generation.BatchGenerator._next = _traced_next
