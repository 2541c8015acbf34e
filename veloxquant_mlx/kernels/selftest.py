"""Deterministic test vectors for the kernels, and a one-command check of a back end.

    python -m veloxquant_mlx.kernels.selftest --backend cuda
    python -m veloxquant_mlx.kernels.selftest --backend metal
    python -m veloxquant_mlx.kernels.selftest --backend emulator      # the C++ emulation, CPU

Every case draws its inputs from `numpy.random.default_rng(case seed)`, so the
vectors are the same on every machine. Each case builds a turboquant_mse cache,
then compares the back end's output with

* ``portable``: the same maths in MLX ops (`kernels.portable`),
* ``generic``:  the generic blockwise attention of `veloxquant_mlx.attention`,
* ``dequant``:  plain softmax attention over the cache's dequantized keys and
                values (`cache.dequantized()`), in float64 numpy,

as max |out - ref| / max |ref|. Tolerances (`TOLERANCES`): 1e-4 for float32
queries (float32 arithmetic in a different order), 4e-3 for float16 queries
(the output is rounded to fp16; prefill also rounds the decoded codes to fp16).
On a GPU, MLX runs float32 matmuls and SDPA at TF32 precision unless
MLX_ENABLE_TF32=0, so comparisons that go through them (the portable and
generic references, prefill, the fp16-window partial) allow 2e-3 there; run
with MLX_ENABLE_TF32=0 for the strict check.
Encoding: at least 99.9% of codes equal (a coordinate within float rounding of a
boundary may round either way) and norms equal to an fp16 ulp.

On a kernel back end (cuda, metal, emulator) it then checks every other format with a
kernel snippet (`FORMAT_SPECS`, `run_format`): the caches of a random-weight llama of head
dim 128 (calibrated first on random tokens where the method needs it), filled through that
back end's paths; per layer, its dequant kernel against the codec's `decode`, its formats'
partial kernel against the engine's MLX-ops decode, and its encode kernel against `encode`.

`--write FILE` saves inputs, outputs and errors (npz); `--check FILE` also
compares this back end's outputs with a file written elsewhere (e.g. on CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..kernel_cases import (  # noqa: F401  (the cases on whole caches, shared with the first-use check)
    ENCODE_CASES, ENCODE_MIN_EQUAL, TOLERANCES, Case, _attend_dequantized, _cache, _config, _encode_name, _inputs,
    _rel, dequant_record, partial_record, run_case, run_encode, run_fused)
from .check import TF32_TOLERANCE  # noqa: F401

CASES: List[Case] = [
    Case("d128_k3v4_gqa4_fp16", 128, 3, 4, 4, tokens=1000, dtype="float16", seed=1),
    Case("d128_k3v3_gqa4", 128, 3, 3, 4, tokens=777, seed=2),
    Case("d128_k3v3_window_sinks_center", 128, 3, 3, 4, tokens=500, seed=3,
         options={"residual_length": 16, "sink_tokens": 4, "center": True}),
    Case("d64_k4v2_gqa3_batch2", 64, 4, 2, 3, batch=2, tokens=333, seed=4),
    Case("d128_k1v8_mha", 128, 1, 8, 1, kv_heads=3, tokens=300, seed=5),
    Case("d256_k2v4_gqa8", 256, 2, 4, 8, kv_heads=1, tokens=260, seed=6),
    Case("d96_k3v4_prerotated", 96, 3, 4, 2, tokens=200, seed=7),
    Case("d128_k3v4_renorm", 128, 3, 4, 4, tokens=400, seed=8, options={"renorm": True}),
    Case("d128_k3v2_unbiased_values", 128, 3, 2, 4, tokens=400, seed=11, options={"renorm": True, "unbiased_values": True}),
    Case("d128_k3v4_gqa4_fp16_simt", 128, 3, 4, 4, tokens=1000, dtype="float16", seed=1, tensor_cores=False),
    Case("d256_k2v4_gqa8_simt", 256, 2, 4, 8, kv_heads=1, tokens=260, seed=6, tensor_cores=False),
    Case("d128_k3v3_window_sinks_center_simt", 128, 3, 3, 4, tokens=500, seed=3, tensor_cores=False,
         options={"residual_length": 16, "sink_tokens": 4, "center": True}),
    Case("prefill_d128_k3v4_fp16", 128, 3, 4, 4, tokens=300, queries=16, dtype="float16", seed=9),
    Case("prefill_d64_k3v3_center", 64, 3, 3, 2, tokens=200, queries=8, seed=10, options={"center": True}),
]


def run_ratequant(backend: str) -> Dict:
    """ratequant's snippets on `backend`: (1) at fractional widths (two code widths per token, head
    dim 128) the encode kernel's rows against `encode`'s and the dequant kernel against `decode`;
    (2) a ratequant cache calibrated on a random-weight llama (per-layer widths from a 2.5 / 3-bit
    budget) through the formats' partial kernel against the engine's MLX-ops decode of its codes."""
    import tempfile

    from mlx_lm.models import llama

    from ..calibration import calibrate
    from ..config import KVCacheConfig
    from ..integration import KVCacheBuilder
    from ..methods.ratequant import RateCodec
    from ..settings import EngineSettings
    from ..storage import row_layout, store_for
    from . import check, encode, ops, partial

    run = ops.runner(backend)
    rows_equal, decode_error = 1.0, 0.0
    for width, renorm in ((2.5, False), (3.25, True)):
        kc, vc = RateCodec(128, width, seed=1, renorm=renorm), RateCodec(128, 2.0, seed=2)
        layout = row_layout(kc, vc)
        keys = mx.random.normal((1, 2, 33, 128), key=mx.random.key(1)).astype(mx.float16)
        values = mx.random.normal((1, 2, 33, 128), key=mx.random.key(2)).astype(mx.float16)
        store = store_for(kc, vc, lambda k, v: encode.encode_rows(run, layout, kc, vc, k, v))
        store.append(keys, values)
        store.flush()
        with mx.stream(mx.cpu):
            want = layout.pack(kc.encode(keys), vc.encode(values))
            mx.eval(want)
        rows_equal = min(rows_equal, float(np.mean(np.array(store.rows[..., :33, :]) == np.array(want))))
        decode_error = max(decode_error, check.dequant_error(backend, store, kc, vc, 33))

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512)
    mx.random.seed(0)
    model = llama.Model(args)
    config = KVCacheConfig(method="ratequant", bits=3, options={"kbudget": 2.5, "vbudget": 3.0, "renorm": True})
    sequences = [mx.random.randint(0, 512, (64,), key=mx.random.key(60 + i)) for i in range(2)]
    with tempfile.TemporaryDirectory() as artifacts:
        calibrate(model, config, sequences, artifacts, progress=False)
        caches = KVCacheBuilder(config.replace(artifact_dir=artifacts)).for_model(model).build(
            settings=EngineSettings.resolve(backend=backend))
        model(mx.random.randint(0, 512, (1, 300), key=mx.random.key(70)), cache=caches)
    partial_error = 0.0
    for cache in caches:
        partial_error = max(partial_error, check.partial_error(cache.attention_history(), rep=4, seed=5))
    ok = (rows_equal >= encode.CHECK_MIN_EQUAL and decode_error <= check.DEQUANT_TOLERANCE
          and partial_error <= partial.CHECK_TOLERANCE)
    return {"case": "ratequant_kernels", "backend": backend, "rows_equal": rows_equal,
            "vs_decode": decode_error, "vs_compiled_decode": partial_error,
            "status": "ok" if ok else "FAIL"}


# Every format with a kernel snippet (`kernel_decode`, and `kernel_encode` where it has one), each
# as a cache of a random-weight llama of head dim 128, calibrated first where the method needs it.
# turboquant_mse has the cases above; ratequant has `run_ratequant`; commvq has no kernel.
FORMAT_SPECS = (
    "turboquant_prod:4", "turboquant_rvq:2", "polarquant:4", "qjl:4", "kivi:2", "kivi:4:sinks=2,window=8",
    "rabitq:1:vbits=4", "rabitq:3:vbits=4", "spectralquant:3", "spectralquant:3:sinks=2,window=8,center=true",
    "vecinfer:2:vbits=3",
    "vecinfer:2:vbits=3,sinks=2,window=8,center=true", "turboquant_mse:3:vbits=4,outliers=8",
    "rabitq:3:vbits=4,outliers=4", "turboquant_mse:3:vbits=4,smooth_keys=0.5",
)


def _calibration_model():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=2, intermediate_size=1024,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512)
    mx.random.seed(0)
    return llama.Model(args)


def run_format(backend: str, spec: str, model=None, tokens: int = 300) -> Dict:
    """One format's kernels on `backend`, on the caches a random-weight llama (head dim 128, 2 kv heads,
    GQA 4) fills with `tokens` tokens through `backend`'s paths, then one decode token: per layer, the dequant
    kernel against the codecs' `decode` of the stored codes, the formats' partial kernel against the
    engine's MLX-ops decode (both references in float32 on the CPU), and, for per-token formats with
    encode snippets, the encode kernel against the codecs' `encode` of 40 random tokens."""
    import tempfile

    from ..calibration import calibrate
    from ..evaluation.specs import parse_method_spec
    from ..integration import KVCacheBuilder
    from ..methods.outliers import CalibrationRequiredError
    from ..settings import EngineSettings
    from ..storage import row_layout
    from . import check, encode

    model = model if model is not None else _calibration_model()
    config = parse_method_spec(spec).config
    settings = EngineSettings.resolve(backend=backend)
    record = {"case": f"format {spec}", "backend": backend}
    prompt = mx.random.randint(0, 512, (1, tokens), key=mx.random.key(90))
    with tempfile.TemporaryDirectory() as artifacts:
        try:
            caches = KVCacheBuilder(config).for_model(model).build(settings=settings)
            logits = model(prompt, cache=caches)  # the codecs are made, and may ask for calibration, here
        except CalibrationRequiredError:
            sequences = [mx.random.randint(0, 512, (256,), key=mx.random.key(80 + i)) for i in range(4)]
            calibrate(model, config, sequences, artifacts, progress=False)
            config = config.replace(artifact_dir=artifacts)
            caches = KVCacheBuilder(config).for_model(model).build(settings=settings)
            logits = model(prompt, cache=caches)
        record["calibrated"] = config.artifact_dir is not None
        model(mx.argmax(logits[:, -1:], axis=-1), cache=caches)  # a decode step: the token's encode and store
        rows_equal, decode_error, partial_error = 1.0, 0.0, 0.0
        for layer, cache in enumerate(caches):
            h = cache.attention_history()
            kc, vc = h.key_codec, h.value_codec
            record["paths"] = sorted(set(record.get("paths", [])) | {cache.last_path})
            decode_error = max(decode_error, check.dequant_error(backend, h.store, kc, vc, h.count))
            partial_error = max(partial_error, check.partial_error(h, rep=4, seed=100 + layer))
            layout = row_layout(kc, vc)
            if encode.supported(layout, kc, vc):
                agreement = check.encode_agreement(backend, layout, kc, vc, tokens=40, seed=110 + 2 * layer)
                record["encode_kernel"] = True
                rows_equal = min(rows_equal, agreement[0] if check.encode_ok(agreement) else 0.0)
    tolerance = check.partial_tolerance(backend)
    record.update(vs_codec_decode=decode_error, vs_compiled_decode=partial_error, tolerance=tolerance)
    if record.get("encode_kernel"):
        record["codes_equal"] = rows_equal
    ok = (decode_error <= check.DEQUANT_TOLERANCE and partial_error <= tolerance
          and rows_equal >= encode.CHECK_MIN_EQUAL)
    record["status"] = "ok" if ok else "FAIL"
    return record


def run_all(backend: str, cases: Optional[List[Case]] = None, encode: bool = True, safe: bool = False) -> List[Dict]:
    """All records; with `safe`, a case that raises is recorded as an error, not raised."""
    jobs = []
    if encode:
        jobs += [(_encode_name(*c), lambda c=c: run_encode(backend, *c)) for c in ENCODE_CASES]
    jobs += [(case.name, lambda case=case: run_case(case, backend)) for case in cases or CASES]
    if backend in ("cuda", "metal", "emulator") and cases is None:
        from . import encode

        jobs.append(("format_encode", lambda: encode.check_record(backend)))
        jobs.append(("format_partial", lambda: partial_record(backend)))
        jobs.append(("fused_window_center", lambda: run_fused(backend)))
        jobs.append(("fused_window_center_smoothed", lambda: run_fused(backend, smoothed=True)))
        jobs.append(("fused_window_center_kept", lambda: run_fused(backend, kept=True)))
        jobs.append(("ratequant_kernels", lambda: run_ratequant(backend)))
        jobs += [(f"format {spec}", lambda spec=spec: run_format(backend, spec)) for spec in FORMAT_SPECS]
    records = []
    for name, job in jobs:
        try:
            records.append(job())
        except Exception as error:
            if not safe:
                raise
            records.append({"case": name, "backend": backend, "status": "FAIL", "error": repr(error)[:2000]})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veloxquant_mlx.kernels.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="cuda, metal, emulator or portable (default: the active one)")
    parser.add_argument("--write", default=None, help="save inputs / outputs / errors to this .npz")
    parser.add_argument("--check", default=None, help="also compare outputs with a .npz written elsewhere")
    parser.add_argument("--json", default=None, help="write the records as JSON")
    args = parser.parse_args(argv)
    from .. import kernels

    backend = args.backend or kernels.backend()
    records = run_all(backend)
    stored = dict(np.load(args.check)) if args.check else {}
    failed = 0
    arrays = {}
    for r in records:
        out = r.pop("output", None)
        if out is not None:
            arrays[r["case"]] = out
            if r["case"] in stored:
                r["vs_stored"] = _rel(out, stored[r["case"]])
                if r["vs_stored"] > r["tolerance"]:
                    r["status"] = "FAIL"
        failed += r["status"] == "FAIL"
        errs = " ".join(f"{k}={v:.2e}" for k, v in r.items()
                        if k.startswith("vs_") or k in ("codes_equal", "norm_rel_error", "rows_equal"))
        print(f"{r['status']:>14}  {r['case']:<36} {errs}")
    if args.write:
        np.savez_compressed(args.write, **arrays)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    print(f"{len(records) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
