"""Decode-attention kernels: correctness on this back end, then speed against fp16 SDPA.

    python benchmarks/kernel_bench.py --out results/kernels [--contexts 4096,16384,32768]

1. `veloxquant_mlx.kernels.selftest` on the active back end (CUDA on the GPU
   machine), its records to selftest.json and the kernel outputs to vectors.npz.
2. For each context T, one layer of the Llama-3.1-8B shape (1 x 32 query heads,
   8 kv heads, d = 128, fp16): microseconds per call and GB/s of
   * fp16 `mx.fast.scaled_dot_product_attention` (reads 2 x T x 8 x 128 x 2 bytes),
   * dequantize-then-SDPA (codes decoded to fp16 by a kernel, then SDPA),
   * the generic portable path on the GPU (MLX ops, blockwise online softmax),
   * the packed-code decode path (partial kernel + merge kernel, query rotation
     and output un-rotation included), and the partial kernel alone, per split size,
   * encoding one new token (keys + values) and a 2048-token prefill chunk:
     kernel vs the MLX-ops codec.
   Each figure is the median of `--rounds` rounds; a round calls the function
   once on each of `--layers` distinct caches (so the data is not served from
   L2) and evaluates everything once. GB/s counts the bytes the call must read
   (codes + norms, or fp16 K/V); the roofline fraction divides by the measured
   device copy bandwidth (read + write of a 2 GiB buffer) and by the 4.8 TB/s datasheet.
Writes kernels.json and kernels.md under --out; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx import kernels  # noqa: E402
from veloxquant_mlx.cache import CompressedKVCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402
from veloxquant_mlx.kernels import ops, selftest  # noqa: E402

DATASHEET_BW = 4.8e12


ERRORS = []


def timed(fn, calls: int, rounds: int, warmup: int = 2, passes: int = 1) -> float:
    """Median seconds per call; fn(i) for i in range(calls) per round, one eval per round
    (None, with the error recorded, if fn fails)."""
    try:
        return _timed(fn, calls, rounds, warmup, passes)
    except Exception as error:  # record and go on: one broken path must not lose the rest
        import traceback

        ERRORS.append(f"{getattr(fn, '__name__', fn)}: {error!r}")
        traceback.print_exc()
        return None


def _timed(fn, calls: int, rounds: int, warmup: int = 2, passes: int = 1) -> float:
    for _ in range(warmup):
        mx.eval([fn(i) for i in range(calls)])
    mx.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval([fn(i) for _ in range(passes) for i in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - start) / (calls * passes))
    return statistics.median(times)


def build_time(fn, calls: int, rounds: int) -> float:
    """Median host seconds per call to build fn's graph (evaluated afterwards, untimed)."""
    try:
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            outs = [fn(i) for i in range(calls)]
            times.append((time.perf_counter() - start) / calls)
            mx.eval(outs)
        return statistics.median(times[1:])
    except Exception as error:
        ERRORS.append(f"build_time: {error!r}")
        return None


def copy_bandwidth() -> float:
    n = (1 << 29) if kernels.backend() != "portable" else (1 << 24)  # 2 GiB on a GPU
    x = mx.random.uniform(shape=(n,)).astype(mx.float32)
    mx.eval(x)
    t = timed(lambda i: x * 1.0, 1, 5)
    del x
    return 2 * 4 * n / t


def build_layers(n_layers: int, T: int, cfg: KVCacheConfig, B=1, kv=8, D=128):
    caches, fp16 = [], []
    for layer in range(n_layers):
        key = mx.random.key(1000 * T + layer)
        k1, k2 = mx.random.split(key)
        k = mx.random.normal((B, kv, T, D), key=k1).astype(mx.float16)
        v = mx.random.normal((B, kv, T, D), key=k2).astype(mx.float16)
        c = CompressedKVCache(cfg)
        for start in range(0, T, 4096):
            c.update_and_fetch(k[..., start : start + 4096, :], v[..., start : start + 4096, :])
            mx.eval(c.store.rows)
        caches.append(c)
        fp16.append((k, v))
        mx.eval(k, v)
    return caches, fp16


def packed_bytes(c: CompressedKVCache) -> int:
    """Bytes of the rows holding the first `encoded` tokens (what decoding must read)."""
    return c.store.rows.shape[0] * c.store.rows.shape[1] * c.encoded * c.store.rows.shape[3] * c.store.rows.itemsize


def microbench(T: int, args, vbits: int, copy_bw: float):
    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=vbits)
    B, Hq, kv, D = 1, 32, 8, 128
    L = args.layers
    caches, fp16 = build_layers(L, T, cfg, B, kv, D)
    qs = [mx.random.normal((B, Hq, 1, D), key=mx.random.key(7 + i)).astype(mx.float16) for i in range(L)]
    mx.eval(qs)
    scale = D ** -0.5
    fp16_bytes = 2 * B * kv * T * D * 2
    code_bytes = packed_bytes(caches[0])
    rows = []

    def add(name, seconds, nbytes, **extra):
        if seconds is None:
            return
        rows.append({"context": T, "value_bits": vbits, "path": name, "us": seconds * 1e6,
                     "bytes": nbytes, "GBps": nbytes / seconds / 1e9, "errors": None,
                     "roofline_measured": nbytes / seconds / copy_bw,
                     "roofline_datasheet": nbytes / seconds / DATASHEET_BW, **extra})

    P = args.passes
    add("fp16 SDPA", timed(lambda i: mx.fast.scaled_dot_product_attention(
        qs[i], fp16[i][0], fp16[i][1], scale=scale), L, args.rounds, passes=P), fp16_bytes)
    on_kernels = kernels.backend() != "portable"
    run = ops.runner(kernels.backend()) if on_kernels else None

    def dequant_sdpa(i):
        c = caches[i]
        keys = ops.mse_dequant(run, c.key_codec, c.store.layout, "keys", c.store.rows, c.encoded, mx.float16)
        values = ops.mse_dequant(run, c.value_codec, c.store.layout, "values", c.store.rows, c.encoded, mx.float16)
        q = c.key_codec.to_domain(qs[i].astype(mx.float32)).astype(mx.float16)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
        return c.value_codec.from_domain(out.astype(mx.float32))

    if on_kernels:
        add("dequantize kernel + fp16 SDPA", timed(dequant_sdpa, L, args.rounds, passes=P), code_bytes)

    def generic(i):
        caches[i].settings = caches[i].settings.replace(kernels=False)
        try:
            return caches[i].attend(qs[i], scale=scale)
        finally:
            caches[i].settings = caches[i].settings.replace(kernels=True)

    add("generic MLX-ops path", timed(generic, L, max(3, args.rounds // 3)), code_bytes)
    add("portable compiled path", timed(lambda i: kernels.decode_attention(
        caches[i], qs[i], scale, using="portable"), L, max(3, args.rounds // 3)), code_bytes)
    for chunk in ([None] + args.chunks) if on_kernels else []:
        name = "packed-code decode (partial + merge)"
        plan_chunk = kernels.launch.choose_chunk(T, B * kv, chunk=chunk)
        add(name, timed(lambda i: kernels.decode_attention(caches[i], qs[i], scale, chunk=chunk), L, args.rounds,
                        passes=P), code_bytes, chunk=plan_chunk, auto=chunk is None)
        o_only = lambda i: ops.mse_partials(run, qs[i], caches[i].key_codec, caches[i].value_codec,  # noqa: E731
                                            caches[i].store.rows, caches[i].encoded, scale, chunk=chunk)[:2]
        add("partial kernel alone", timed(o_only, L, args.rounds, passes=P), code_bytes, chunk=plan_chunk,
            auto=chunk is None)
    new = [(mx.random.normal((B, kv, 1, D), key=mx.random.key(99 + i)).astype(mx.float16),) * 2 for i in range(L)]

    def append(i):
        caches[i].update_and_fetch(*new[i])
        return caches[i].store.rows

    add("update_and_fetch (encode 1 token + store)", timed(append, L, args.rounds), 0)

    # One decoding step's cache work over all L layers: append the new token, attend.
    fp16_caches = []
    for k, v in fp16:
        c = KVCache()
        c.update_and_fetch(k, v)
        fp16_caches.append(c)

    def fp16_step(i):
        k, v = fp16_caches[i].update_and_fetch(*new[i])
        return mx.fast.scaled_dot_product_attention(qs[i], k, v, scale=scale)

    def vq_step(i):
        caches[i].update_and_fetch(*new[i])
        return caches[i].attend(qs[i], scale=scale)

    add(f"decode step, {L} layers: fp16 KVCache append + SDPA (per layer)", timed(fp16_step, L, args.rounds), fp16_bytes)
    add(f"decode step, {L} layers: packed append + attend (per layer)", timed(vq_step, L, args.rounds), code_bytes)
    # The same steps, host side only: building the graph (Python + MLX), no evaluation.
    add("host: graph build of fp16 append + SDPA (per layer)", build_time(fp16_step, L, args.rounds), 0)
    add("host: graph build of packed append + attend (per layer)", build_time(vq_step, L, args.rounds), 0)
    add("host: graph build of packed attend only (per layer)",
        build_time(lambda i: caches[i].attend(qs[i], scale=scale), L, args.rounds), 0)
    # The same with the compiled decode step off (kernels/step.py): the op-by-op path.
    for c in caches:
        c.flush()
        c.settings = c.settings.replace(compile_step=False)
    add(f"decode step, {L} layers: packed append + attend, op by op (per layer)",
        timed(vq_step, L, args.rounds), code_bytes)
    add("host: graph build of packed append + attend, op by op (per layer)", build_time(vq_step, L, args.rounds), 0)
    for c in caches:
        c.flush()
        c.settings = c.settings.replace(compile_step=True)
    del fp16
    return rows, caches


def encode_bench(args):
    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4)
    c = CompressedKVCache(cfg)
    c.update_and_fetch(mx.zeros((1, 8, 1, 128), mx.float16), mx.zeros((1, 8, 1, 128), mx.float16))
    kc, vc = c.key_codec, c.value_codec
    if kernels.backend() == "portable":
        return []
    run = ops.runner(kernels.backend())
    rows = []
    for tokens in (1, 2048):
        xs = [mx.random.normal((1, 8, tokens, 128), key=mx.random.key(i)).astype(mx.float16) for i in range(8)]
        mx.eval(xs)
        kern = timed(lambda i: ops.mse_encode_rows(run, kc, vc, xs[i], xs[i]), 8, args.rounds, passes=8)
        base = timed(lambda i: (kc.encode(xs[i]), vc.encode(xs[i])), 8, args.rounds, passes=8)
        rows.append({"tokens": tokens, "kernel_us": kern * 1e6, "mlx_ops_us": base * 1e6})
    return rows


def markdown(result) -> str:
    lines = [f"# Decode-attention kernels ({result['device']})", ""]
    lines.append(f"Measured copy bandwidth (read + write, 2 GiB): **{result['copy_GBps']:.0f} GB/s**; "
                 f"datasheet {DATASHEET_BW / 1e9:.0f} GB/s. Llama-3.1-8B layer shape: 1 x 32 q heads, 8 kv heads, "
                 "d = 128, fp16 queries; turboquant_mse K3 (values 3 or 4 bits). Median of rounds over "
                 f"{result['layers']} distinct caches per round.")
    lines.append("")
    lines.append("| T | V bits | path | split | us / call | bytes read | GB/s | of measured copy BW | of 4.8 TB/s |")
    lines.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        split = r.get("chunk", "")
        if split and r.get("auto"):
            split = f"{split} (auto)"
        lines.append(f"| {r['context']} | {r['value_bits']} | {r['path']} | {split} | {r['us']:.1f} | "
                     f"{r['bytes'] / 1e6:.1f} MB | {r['GBps']:.0f} | {100 * r['roofline_measured']:.0f}% | "
                     f"{100 * r['roofline_datasheet']:.0f}% |")
    lines.append("")
    lines.append("Encoding (keys + values of 8 kv heads, d = 128, K3/V4):")
    lines.append("")
    lines.append("| tokens | kernel us | MLX ops us |")
    lines.append("|---:|---:|---:|")
    for r in result["encode"]:
        lines.append(f"| {r['tokens']} | {r['kernel_us']:.1f} | {r['mlx_ops_us']:.1f} |")
    lines.append("")
    ok = sum(r["status"] == "ok" for r in result["selftest"])
    lines.append(f"Self-test on `{result['backend']}`: {ok} / {len(result['selftest'])} cases within tolerance.")
    lines.append("")
    lines.append("| case | status | vs portable | vs generic | vs fp64 attention on dequantized | tolerance |")
    lines.append("|---|---|---:|---:|---:|---:|")
    for r in result["selftest"]:
        if "codes_equal" in r:
            continue
        f = lambda k: f"{r[k]:.1e}" if k in r else ""  # noqa: E731
        lines.append(f"| {r['case']} | {r['status']} | {f('vs_portable')} | {f('vs_generic')} | "
                     f"{f('vs_dequant_fp64')} | {r.get('tolerance', '')} |")
    enc = [r for r in result["selftest"] if "codes_equal" in r]
    if enc:
        lines.append("")
        lines.append(f"Encode kernel: {sum(r['status'] == 'ok' for r in enc)} / {len(enc)} cases ok; "
                     f"lowest fraction of equal codes {min(r['codes_equal'] for r in enc):.5f}, "
                     f"largest norm error {max(r['norm_rel_error'] for r in enc):.1e}.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--value-bits", default="4,3")
    parser.add_argument("--chunks", default="256,512,1024")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--passes", type=int, default=2, help="calls per cache per timed round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--skip-selftest", action="store_true")
    args = parser.parse_args()
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": str(mx.default_device()), "backend": kernels.backend(), "layers": args.layers,
              "platform": platform.platform(), "mlx": mx.__version__, "rows": [], "encode": [], "selftest": [],
              "copy_GBps": 0.0}
    try:
        import subprocess

        result["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                          capture_output=True, text=True).stdout.strip() or result["device"]
    except Exception:
        pass

    def save():
        result["errors"] = ERRORS
        (out / "kernels.json").write_text(json.dumps(result, indent=1))
        (out / "kernels.md").write_text(markdown(result))

    if not args.skip_selftest:
        t = time.perf_counter()
        records = selftest.run_all(result["backend"], safe=True)
        arrays = {r["case"]: r.pop("output") for r in records if "output" in r}
        np.savez_compressed(out / "vectors.npz", **arrays)
        result["selftest"] = records
        for r in records:
            print(f"{r['status']:>14}  {r['case']:<36} " + " ".join(
                f"{k}={v:.2e}" for k, v in r.items() if k.startswith("vs_") or k in ("codes_equal", "norm_rel_error")))
        print(f"selftest {time.perf_counter() - t:.1f}s", flush=True)
        save()
    result["copy_GBps"] = copy_bandwidth() / 1e9
    print(f"copy bandwidth {result['copy_GBps']:.0f} GB/s", flush=True)
    result["encode"] = encode_bench(args)
    save()
    for T in [int(x) for x in args.contexts.split(",")]:
        for vbits in [int(x) for x in args.value_bits.split(",")]:
            t = time.perf_counter()
            rows, _ = microbench(T, args, vbits, result["copy_GBps"] * 1e9)
            result["rows"] += rows
            save()
            for r in rows:
                print(f"T={T} V{vbits} {r['path']:<40} {r.get('chunk', ''):>6} {r['us']:9.1f} us "
                      f"{r['GBps']:7.0f} GB/s {100 * r['roofline_measured']:4.0f}%", flush=True)
            print(f"  ({time.perf_counter() - t:.1f}s)", flush=True)
            mx.clear_cache()
    result["errors"] = ERRORS
    save()
    print(markdown(result))
    if ERRORS:
        print("ERRORS:\n" + "\n".join(ERRORS))


if __name__ == "__main__":
    main()
