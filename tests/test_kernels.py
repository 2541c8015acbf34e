"""Decode-attention kernels: source generation, the C++ emulation of the kernel
text, the portable path, and dispatch. CI has no GPU: the CUDA kernels run on the
GPU machine (`python -m veloxquant_mlx.kernels.selftest --backend cuda`, results in
benchmarks/results/gpu/); here the same kernel bodies run in the emulator.

Tolerances (max |out - ref| / max |ref|): 1e-4 for float32 inputs, 4e-3 for fp16
(rounding of the output / of decoded codes); see kernels.selftest.
"""

import functools
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_partial_kernel_compiles, compile_cuda_without_spills, compile_encode_kernel

from veloxquant_mlx import KVCacheConfig, kernels
from veloxquant_mlx.cache import CompressedKVCache
from veloxquant_mlx.kernels import emulator, encode, launch, native, ops, portable, selftest, templates
from veloxquant_mlx.methods.turboquant_mse import MSECodec

needs_cxx = pytest.mark.skipif(emulator.compiler() is None, reason="no C++20 compiler for the kernel emulator")
needs_native = pytest.mark.skipif(not native.available(), reason="veloxquant_mlx._native not built")
CPU_DEFAULT = "native" if native.available() else "portable"

IN_DTYPES = {
    "mse_partial": {"q": "float16", "rows": "uint32", "kcent": "float32", "vcent": "float32", "ksigns": "float32",
                    "meta": "int32", "qscale": "float32", "kscale": "float32"},
    "mse_partial_mma": {"q": "float16", "rows": "uint32", "kcent": "float32", "vcent": "float32",
                        "ksigns": "float32", "meta": "int32", "qscale": "float32", "kscale": "float32"},
    "merge": {"o": "float32", "ml": "float32", "vsigns": "float32", "meta": "int32", "po": "float32",
              "pml": "float32", "vmean": "float32", "q": "float16", "qscale": "float32", "kmean": "float32",
              "pa_k": "float16", "pa_v": "float16", "pb_k": "float16", "pb_v": "float16", "vmap": "float32"},
    "mse_dequant": {"rows": "uint32", "cent": "float32", "meta": "int32"},
    "mse_encode": {n: "float32" for n in templates.KERNELS["mse_encode"]["inputs"]},
}
IN_DTYPES["kept_splits"] = {n: "float32" for n in templates.KERNELS["kept_splits"]["inputs"]}
IN_DTYPES["kept_splits"].update(q="float16", rows="uint32", kk="float16", kv="float16", kpos="int32", meta="int32",
                                slide="int32")
IN_DTYPES["kept_settle"] = {n: "float16" for n in templates.KERNELS["kept_settle"]["inputs"]}
IN_DTYPES["kept_settle"].update(run="float32", meta="int32", par="float32", count="int32", kpos="int32")
for _kernel in ("merge_encode", "merge_encode_slide"):
    IN_DTYPES[_kernel] = {n: "float32" for n in templates.KERNELS[_kernel]["inputs"]}
    IN_DTYPES[_kernel].update(meta="int32", q="float16", **{n: "float16" for n in ("kx", "vx", "pa_k", "pa_v", "pb_k", "pb_v")})


def _plans():
    """A plan of every kernel for each supported bit width and a spread of dims."""
    for dim in (64, 96, 128, 256):
        for bits in range(1, 9):
            vbits = 9 - bits
            pow2 = dim & (dim - 1) == 0
            yield launch.encode_plan(4, (dim, bits, pow2, bits in (2, 3)), (dim, vbits, pow2, False), "float16")
            yield launch.partial_plan(2, 4, dim, bits, vbits, 1000, 1024, rotate_query=pow2, q_dtype="float16")
            if launch.mma_fits(dim, 4, bits, vbits, 48 * 1024):
                yield launch.mma_partial_plan(2, 4, dim, bits, vbits, 1000, 1024, rotate_query=pow2,
                                              q_dtype="float16")
            words = -(-dim * bits // 32) + -(-dim * vbits // 32) + 1
            yield launch.dequant_plan(2, dim, bits, 1000, 1024, out_dtype="float16", row_words=words, offset=0,
                                      norm_half=2 * (words - 1))
        if dim & (dim - 1) == 0:
            yield launch.merge_plan(2, 4, dim, 7, unrotate=True, plain=True, value_mean=True, out_dtype="float16")
            yield launch.merge_plan(2, 4, dim, 7, unrotate=False, plain=False, value_mean=True, out_dtype="float16",
                                    tokens=64, x_dtype="float16")
            yield launch.kept_splits_plan(2, 4, dim, bits, vbits, 17, center=True, x_dtype="float16",
                                          key_scale_heads=2)
            yield launch.kept_settle_plan(2, 4, dim, 24, 4, 17, x_dtype="float16")
            for window in (0, 64):
                yield launch.merge_encode_plan(2, 4, dim, 7, (3, 1), (4, 2), center=True, x_dtype="float16",
                                               out_dtype="float16", plain_tokens=68, slide_window=window)


def _dtypes(plan):
    ins = dict(IN_DTYPES[plan.kernel])
    if plan.kernel == "mse_encode":
        ins["kx"] = ins["vx"] = "float16"
    if plan.kernel == "merge":  # the fp16 tokens' arrays (dummies without them) are of the plan's TX
        ins.update({n: dict(plan.template)["TX"] for n in ("pa_k", "pa_v", "pb_k", "pb_v")})
    return ins, dict(zip(templates.KERNELS[plan.kernel]["outputs"], plan.output_dtypes))


@pytest.mark.parametrize("dialect", ["cuda", "metal", "cpp"])
def test_sources_render_for_every_width_and_dim(dialect):
    plans = [p for p in _plans() if dialect in templates.KERNELS[p.kernel].get("dialects", templates.DIALECTS)]
    assert len(plans) > 90
    for plan in plans:
        body = templates.source(plan.kernel, dialect)
        header = templates.header(dialect)
        assert "vq_tid" in body and body.count("{") == body.count("}")
        if dialect == "metal":  # MLX finds Metal attributes by scanning the body
            assert "thread_position_in_threadgroup" in body and "threadgroup_position_in_grid" in body
            assert "threadgroup_barrier" in header
        if dialect == "cuda":
            assert "threadIdx" in body and "__syncthreads" in header
            ins, outs = _dtypes(plan)
            unit = templates.render_cuda(plan.kernel, plan.template, ins, outs, mlx_header=False)
            for name, value in plan.template:
                assert f" {name} = " in unit
        if dialect == "cpp":
            ins, outs = _dtypes(plan)
            text = templates.render_cpp(plan.kernel, plan.template, ins, outs, "k")
            assert "vq_emu::ctx.tid" in text


def test_templates_have_one_body_per_kernel():
    # The dialects differ only in header and prologue: the maths is one text.
    for kernel, spec in templates.KERNELS.items():
        bodies = {templates.source(kernel, d).split("\n", 4)[-1] for d in spec.get("dialects", templates.DIALECTS)}
        assert len(bodies) == 1


def test_tensor_core_kernel_is_not_rendered_for_metal():
    with pytest.raises(ValueError, match="not metal"):
        templates.source("mse_partial_mma", "metal")


def test_tensor_core_plans_refuse_shapes_they_cannot_hold():
    assert launch.mma_fits(128, 4, 3, 4, 48 * 1024) and launch.mma_fits(256, 8, 2, 4, 48 * 1024)
    assert not launch.mma_fits(128, 16, 3, 4, 48 * 1024)  # n = 8 query heads per mma
    assert not launch.mma_fits(256, 4, 1, 8, 48 * 1024)  # a thread's share of 4 value rows' codes
    with pytest.raises(ValueError, match="mse_partial_mma takes"):
        launch.mma_partial_plan(1, 16, 128, 3, 4, 100, 256, rotate_query=True, q_dtype="float16")
    assert not launch.use_mma("metal", True, 128, 4, 3, 4) and not launch.use_mma("cuda", False, 128, 4, 3, 4)
    assert launch.use_mma("cuda", True, 128, 4, 3, 4)


def test_plans_fit_and_split_sensibly():
    plan = launch.partial_plan(8, 4, 128, 3, 4, 32768, 32768, rotate_query=True, q_dtype="float16")
    splits = plan.meta["splits"]
    assert splits * plan.meta["chunk"] >= 32768 and plan.meta["chunk"] % launch.PARTIAL_THREADS == 0
    assert 8 * splits >= 400  # enough blocks to fill a large GPU
    assert launch.partial_shared_bytes(128, 4, 3, 4) < 48 * 1024
    assert launch.choose_chunk(10, 8) == launch.PARTIAL_THREADS
    with pytest.raises(ValueError):
        launch.partial_plan(1, 1, 80, 3, 3, 10, 16, rotate_query=False, q_dtype="float16")  # dim % 32


def _nvcc_picks():
    """The translation units compiled with nvcc, by name: the first plans of _plans() (no mse_partial),
    the 8B shape's partial, merges and tensor-core partial."""
    picks = {f"plan{i}-{p.kernel}": p for i, p in enumerate([p for p in _plans() if p.kernel != "mse_partial"][:3])}
    picks["partial-8b"] = launch.partial_plan(8, 4, 128, 3, 4, 32768, 32768, rotate_query=True, q_dtype="float16")
    picks["merge-unrotate"] = launch.merge_plan(8, 4, 128, 64, unrotate=True, plain=True, value_mean=True,
                                                out_dtype="float16")
    picks["merge-tokens"] = launch.merge_plan(8, 4, 128, 64, unrotate=False, plain=False, value_mean=True,
                                              out_dtype="float16", tokens=128, x_dtype="float16")
    picks["merge-unmap"] = launch.merge_plan(8, 4, 128, 64, unrotate=False, plain=False, value_mean=True,
                                             out_dtype="float16", tokens=128, x_dtype="float16", unmap=8)
    picks["mma"] = launch.mma_partial_plan(8, 4, 128, 3, 4, 32768, 32768, rotate_query=True, q_dtype="float16")
    return picks


# Each nvcc run costs seconds: `make test` compiles the tensor-core partial (its register bound) and the
# fullest merge, `make test-all` every unit.
NVCC_IN_MAKE_TEST = ("merge-unmap", "mma")
NVCC_UNITS = ["plan0-mse_encode", "plan1-mse_partial_mma", "plan2-mse_dequant", "partial-8b", "merge-unrotate",
              "merge-tokens", "merge-unmap", "mma"]


def test_nvcc_units_are_the_named_ones():
    assert list(_nvcc_picks()) == NVCC_UNITS


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("unit", [u if u in NVCC_IN_MAKE_TEST else pytest.param(u, marks=pytest.mark.slow)
                                  for u in NVCC_UNITS])
def test_cuda_sources_compile_with_nvcc(unit, tmp_path):
    """The generated translation units compile for sm_90 without spills (a stand-in
    for MLX's own NVRTC build on the GPU machine)."""
    plan = _nvcc_picks()[unit]
    ins, outs = _dtypes(plan)
    src = tmp_path / "k.cu"
    src.write_text(templates.render_cuda(plan.kernel, plan.template, ins, outs, name="k0", mlx_header=False))
    report = compile_cuda_without_spills(src, tmp_path / "k.o")
    if unit == "mma":  # the tensor-core partial's occupancy is register-bound: 4 blocks per SM need <= 128
        registers = int(re.search(r"Used (\d+) registers", report).group(1))
        assert registers <= 128, report[-2000:]


# ---- the kernel text, run in the C++ emulator -----------------------------------------

QUICK = [c for c in selftest.CASES if c.name in (
    "d128_k3v4_gqa4_fp16", "d128_k3v3_window_sinks_center", "d64_k4v2_gqa3_batch2", "d96_k3v4_prerotated",
    "prefill_d64_k3v3_center", "d128_k3v4_gqa4_fp16_simt", "d128_k3v2_unbiased_values")]


@needs_cxx
@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.name)
def test_emulated_kernels_match_portable_generic_and_fp64(case):
    record = selftest.run_case(case, "emulator")
    assert record["status"] == "ok", {k: v for k, v in record.items() if k != "output"}
    on_tensor_cores = case.tensor_cores and case.queries == 1
    assert record["partial_kernel"] == ("mse_partial_mma" if on_tensor_cores else "mse_partial")
    # fp16 operands on tensor cores: fp16's tolerance whatever the cache's dtype
    assert record["vs_dequant_fp64"] <= selftest.TOLERANCES["float16" if on_tensor_cores else case.dtype]


@needs_cxx
@pytest.mark.parametrize("spec", [(128, 3, 128, 4, "norm"), (64, 4, 64, 2, "renorm"), (96, 3, 96, 4, "norm"),
                                  (128, 3, 64, 4, "norm"), (128, 3, 128, 2, "unbiased"), (96, 3, 96, 2, "unbiased")],
                         ids=str)
def test_emulated_encode_matches_codec(spec):
    record = selftest.run_encode("emulator", *spec)
    assert record["status"] == "ok", record


@needs_cxx
@pytest.mark.parametrize("mean", [False, True])
def test_emulated_merge_leaves_a_dense_per_head_value_domain(mean):
    # spectralquant's values live in a learned PCA basis per head: the merge kernel takes the value
    # sum out of it through one (D, D) matrix per head (from_domain of the identity), as the
    # engine's MLX-ops merge does with from_domain itself.
    from veloxquant_mlx import engine
    from veloxquant_mlx.methods.spectralquant import SpectralCodec

    heads, rep, splits, dim = 2, 3, 4, 64
    basis = mx.linalg.qr(mx.random.normal((heads, dim, dim), key=mx.random.key(1)), stream=mx.cpu)[0]
    codec = SpectralCodec(dim, 3, {"heads.basis": basis, "heads.sigma": mx.ones((heads, dim)),
                                   "split": mx.array([32, 4, 2])})
    domain = ops.merge_domain(codec, dim)
    assert domain[0] == "dense" and domain[1].shape == (heads, dim, dim)
    bh = 2 * heads  # batch 2: row bh takes head bh % heads
    o = mx.random.normal((bh, splits, rep, dim), key=mx.random.key(2))
    ml = mx.stack([mx.random.normal((bh, splits, rep), key=mx.random.key(3)),
                   mx.random.uniform(0.5, 2.0, (bh, splits, rep), key=mx.random.key(4))], axis=-1)
    vmean = mx.random.normal((bh, dim), key=mx.random.key(5)) if mean else None
    out_shape = (2, heads * rep, 1, dim)
    out = ops.merge(ops.runner("emulator"), o, ml, codec, out_shape, mx.float32, value_mean=vmean)
    ref = engine.merge_partials(o, ml, codec, out_shape, mx.float32, value_mean=vmean)
    assert selftest._rel(np.array(out), np.array(ref)) < 1e-5


@needs_cxx
def test_format_self_test_runs_a_calibrated_format_and_can_fail(monkeypatch):
    # The self-test's format matrix (every format with a kernel snippet, run on CUDA by
    # `python -m veloxquant_mlx.kernels.selftest --backend cuda`): one calibrated spec with an fp16
    # window and centring on the emulator, then the same with the partial kernel's output off by 1%.
    from veloxquant_mlx.kernels import partial

    spec = "vecinfer:2:vbits=3,sinks=2,window=8,center=true"
    assert spec in selftest.FORMAT_SPECS
    record = selftest.run_format("emulator", spec, tokens=80)
    assert record["status"] == "ok" and record["calibrated"] and record["encode_kernel"], record
    decode = partial.decode
    monkeypatch.setattr(partial, "decode", lambda *a, **k: decode(*a, **k) * 1.01)
    assert selftest.run_format("emulator", spec, tokens=80)["status"] == "FAIL"


@needs_cxx
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_emulated_long_sequence_many_splits(tensor_cores):
    # Several splits of several tiles, a ragged last tile, B = 2; on tensor cores also warps
    # whose tiles run past the split's end.
    case = selftest.Case("long", 64, 3, 4, 2, batch=2, tokens=1100, seed=11)
    keys, values, queries = selftest._inputs(case)
    cache = selftest._cache(case, keys, values)
    cache.settings = cache.settings.replace(tensor_cores=tensor_cores)
    q = mx.array(queries)
    out = kernels.decode_attention(cache, q, 0.125, using="emulator", chunk=256)
    ref = kernels.decode_attention(cache, q, 0.125, using="portable")
    assert selftest._rel(np.array(out), np.array(ref)) < (2e-3 if tensor_cores else 1e-5)


@needs_cxx
def test_emulated_tensor_core_partial_with_eight_warps_equals_four():
    # More warps per block share a split's tiles and merge in shared memory: the same partials
    # up to the fp16 rounding of the weights, which are scaled by each warp's running max.
    case = selftest.Case("warps", 128, 3, 4, 4, batch=1, tokens=1100, seed=12)
    keys, values, queries = selftest._inputs(case)
    cache = selftest._cache(case, keys, values)
    run = ops.runner("emulator")
    q = mx.array(queries).astype(mx.float16)
    parts = {threads: ops.mse_partials(run, q, cache.key_codec, cache.value_codec, cache.store.rows, 1100, 0.125,
                                       chunk=512, mma=True, threads=threads) for threads in (128, 256)}
    assert parts[256][2].threadgroup == (256, 1, 1) and parts[128][2].meta["splits"] == parts[256][2].meta["splits"]
    for a, b in zip(parts[128][:2], parts[256][:2]):
        assert selftest._rel(np.array(a), np.array(b)) < 2e-3


@needs_cxx
@pytest.mark.parametrize("center", [False, True])
def test_capacity_planned_step_attend_matches_portable(center):
    # The compiled step plans its grid from the buffer capacity (512 rows for 300 tokens):
    # the splits past the last token must contribute nothing.
    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, center=center)
    cache = CompressedKVCache(cfg)
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(5)).astype(mx.float16)
    cache.update_and_fetch(k, mx.sin(k))
    assert cache.store.capacity == 512
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(6)).astype(mx.float16)
    plan, _ = kernels.step._step_fn("attend", "emulator", cache.key_codec, cache.value_codec, tuple(q.shape),
                                    q.dtype, "float16", 0.125, 2, 512, center)
    assert plan.meta["splits"] > 1 and plan.meta["chunk"] * (plan.meta["splits"] - 1) >= 300  # empty splits
    out = kernels.step.attend("emulator", cache._history(), q, 0.125)
    ref = kernels.decode_attention(cache, q, 0.125, using="portable")
    assert selftest._rel(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))) < 2e-3


# ---- the CPU kernel (csrc/mse_attention.cpp) ----------------------------------------------

def test_native_kernel_is_built_where_it_can_be():
    # `make setup` builds it wherever cmake and a C++ compiler exist (scripts/setup.sh installs
    # them on CI), so CI exercises the kernel rather than skipping the tests below.
    if shutil.which("cmake") and shutil.which("c++"):
        assert native.available()


@needs_native
@pytest.mark.parametrize("case", [c for c in selftest.CASES if c.queries == 1], ids=lambda c: c.name)
def test_native_kernel_matches_portable_generic_and_fp64(case):
    record = selftest.run_case(case, "native")
    assert record["status"] == "ok", {k: v for k, v in record.items() if k != "output"}
    assert record["vs_portable"] <= selftest.TOLERANCES[case.dtype]


@needs_native
@pytest.mark.parametrize("tokens", [1, 31, 33, 1100, 2600])
def test_native_kernel_splits_and_ragged_blocks(tokens):
    # Ragged 32-token blocks, several splits (>= 512 tokens each), B = 2, spare capacity.
    case = selftest.Case("long", 64, 3, 4, 2, batch=2, tokens=tokens, seed=tokens)
    keys, values, queries = selftest._inputs(case)
    cache = selftest._cache(case, keys, values)
    q = mx.array(queries)
    out = kernels.decode_attention(cache, q, 0.125, using="native")
    ref = kernels.decode_attention(cache, q, 0.125, using="portable")
    assert selftest._rel(np.array(out), np.array(ref)) < 1e-5


@needs_native
def test_native_kernel_rejects_bad_arguments():
    rows = mx.zeros((2, 64, 13), mx.uint32)  # d = 64 at 3 + 3 bits: 6 + 6 + 1 words
    q = mx.zeros((2, 3, 64))
    cent = mx.zeros((8,))
    words = (0, 6, 12)  # key codes, value codes, norms: the row layout's offsets
    run = native.module().mse_attention_partials
    mx.eval(run(q, rows, cent, cent, 64, 3, 3, 1, *words))
    with pytest.raises(ValueError, match="tokens"):
        run(q, rows, cent, cent, 65, 3, 3, 1, *words)
    with pytest.raises(ValueError, match="outside the row"):
        run(q, rows, cent, cent, 10, 3, 3, 1, 0, 6, 13)
    with pytest.raises(ValueError, match="outside the row"):
        run(q, rows, cent, cent, 10, 4, 4, 1, 0, 8, 12)
    with pytest.raises(ValueError, match="2\\^bits"):
        run(q, rows, cent, cent, 10, 3, 2, 1, *words)
    with pytest.raises(ValueError, match="float32"):
        run(q.astype(mx.float16), rows, cent, cent, 10, 3, 3, 1, *words)


# ---- the portable path and dispatch ---------------------------------------------------

# make test: a power-of-two dim and one that is not; make test-all: every dim.
@pytest.mark.parametrize("dim,bits", [pytest.param(d, b, marks=[pytest.mark.slow] if d in (128, 96) else [])
                                      for d in (64, 128, 96, 80) for b in range(1, 9)])
def test_portable_group_decode_equals_codec_decode(dim, bits):
    codec = MSECodec(dim, bits, seed=1)
    fields = codec.encode(mx.random.normal((1, 2, 17, dim), key=mx.random.key(dim * bits)))
    unit = portable.decode_unit(codec, fields["codes"])
    ref = codec.decode(fields) / fields["norm"].astype(mx.float32)
    assert mx.allclose(unit, ref, atol=1e-6).item()


@pytest.mark.parametrize("case", [c for c in selftest.CASES if c.queries == 1], ids=lambda c: c.name)
def test_portable_decode_matches_generic_and_fp64(case):
    record = selftest.run_case(case, "portable")
    assert record["status"] == "ok", {k: v for k, v in record.items() if k != "output"}


def test_cache_decode_goes_through_the_kernel_path_and_matches_generic():
    cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4))
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(2))
    fast = cache.attend(q, scale=0.125)
    assert cache.last_path == ("mse_native" if CPU_DEFAULT == "native" else "mse_portable")
    cache.settings = cache.settings.replace(kernels=False)
    slow = cache.attend(q, scale=0.125)
    assert cache.last_path == "generic"
    assert mx.allclose(fast, slow, rtol=1e-4, atol=1e-5).item()


def test_other_methods_take_the_engine_paths_and_masks_the_generic_one():
    cache = CompressedKVCache(KVCacheConfig(method="turboquant_prod", bits=3))
    k = mx.random.normal((1, 2, 40, 64))
    cache.update_and_fetch(k, k)
    assert kernels.decode_attention(cache, mx.zeros((1, 4, 1, 64)), 0.1) is None  # no mse kernel
    cache.attend(mx.zeros((1, 4, 1, 64)), 0.1)
    assert cache.last_path == "compiled_decode"
    mse = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3))
    mse.update_and_fetch(k, k)
    assert kernels.decode_attention(mse, mx.zeros((1, 4, 1, 64)), 0.1, mask=mx.ones((1, 40), mx.bool_)) is None
    mse.attend(mx.zeros((1, 4, 1, 64)), 0.1, mask=mx.ones((1, 1, 1, 40), mx.bool_))
    assert mse.last_path == "generic"
    assert kernels.prefill_attention(mse, mx.zeros((1, 4, 3, 64)), 0.1, "causal") is None  # CPU: generic


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("VELOXQUANT_KERNELS", raising=False)
    monkeypatch.delenv("VELOXQUANT_METAL_KERNELS", raising=False)
    assert kernels.backend() == CPU_DEFAULT  # CI: CPU only
    monkeypatch.setenv("VELOXQUANT_KERNELS", "portable")
    assert kernels.backend() == "portable"
    monkeypatch.setenv("VELOXQUANT_KERNELS", "emulator")
    assert kernels.backend() == "emulator"
    monkeypatch.setenv("VELOXQUANT_KERNELS", "off")
    assert kernels.backend() == "portable"
    cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3))
    cache.update_and_fetch(mx.ones((1, 1, 4, 64)), mx.ones((1, 1, 4, 64)))
    assert not cache.settings.kernels
    cache.attend(mx.ones((1, 1, 1, 64)), 0.1)
    assert cache.last_path == "generic"  # off: the generic path


def test_cpu_without_the_extension_warns_that_it_takes_the_portable_path(monkeypatch):
    from veloxquant_mlx import settings

    monkeypatch.delenv("VELOXQUANT_KERNELS", raising=False)
    monkeypatch.setattr(native, "available", lambda: False)
    settings.detect_backend.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU kernels .* are not built"):
            assert settings.detect_backend("", True, mx.Device(mx.cpu)) == "portable"
    finally:
        settings.detect_backend.cache_clear()


def test_selftest_cli_runs_portable(capsys):
    assert selftest.main(["--backend", "portable"]) == 0
    assert "0 failed" in capsys.readouterr().out


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("bits,value_bits", [(3, 4), (2, 2), (4, 3)])
def test_compiled_append_stores_what_the_op_by_op_path_stores(monkeypatch, center, bits, value_bits):
    # 250-token prefill, then 50 decode tokens across the 256-row growth step.
    cfg = KVCacheConfig(method="turboquant_mse", bits=bits, value_bits=value_bits, center=center)
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(bits)).astype(mx.float16)
    v = mx.random.normal((1, 2, 300, 64), key=mx.random.key(9)).astype(mx.float16)
    caches = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("VELOXQUANT_COMPILE_STEP", flag)
        cache = CompressedKVCache(cfg)
        cache.update_and_fetch(k[..., :250, :], v[..., :250, :])
        assert cache.settings.compile_step == (flag == "1")
        for i in range(250, 300):
            cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
        caches[flag] = cache
    fast, slow = caches["1"], caches["0"]
    assert fast.encoded == slow.encoded == 300
    for role in ("key_fields", "value_fields"):
        for name in ("codes", "norm"):
            a, b = getattr(fast, role)[name], getattr(slow, role)[name]
            assert a.shape == b.shape and a.shape[2] == 300 and fast.store.capacity == 512
            assert mx.array_equal(a, b).item(), (role, name)


# ---- the fused decode step (partial + merge_encode + one store), in the emulator ---------

@needs_cxx
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("bits,value_bits,options", [(3, 4, {"renorm": False}), (2, 2, {"renorm": True}),
                                                      (3, 2, {"renorm": True, "unbiased_values": True})], ids=str)
def test_fused_step_equals_store_then_attend(center, bits, value_bits, options):
    cfg = KVCacheConfig(method="turboquant_mse", bits=bits, value_bits=value_bits, center=center, options=options)
    k = mx.random.normal((1, 2, 301, 64), key=mx.random.key(bits)).astype(mx.float16)
    v = mx.random.normal((1, 2, 301, 64), key=mx.random.key(7)).astype(mx.float16)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(8)).astype(mx.float16)
    ref, fused = CompressedKVCache(cfg), CompressedKVCache(cfg)
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., :300, :], v[..., :300, :])
    ref.update_and_fetch(k[..., 300:, :], v[..., 300:, :])
    expected = kernels.decode_attention(ref, q, 0.125, using="portable")
    out, rows = kernels.step.fused("emulator", fused._history(), q, k[..., 300:, :], v[..., 300:, :], 0.125)
    assert rows.shape == ref.store.rows.shape
    assert selftest._rel(np.array(out.astype(mx.float32)), np.array(expected.astype(mx.float32))) < 2e-3
    assert mx.array_equal(rows[..., :301, :], ref.store.rows[..., :301, :]).item()  # the new row, stored in place


@needs_cxx
@pytest.mark.parametrize("sinks,window,center,batch", [(2, 8, True, 1), (0, 5, False, 1), (3, 0, False, 1),
                                                       (2, 8, True, 2)])
def test_fused_step_takes_the_token_leaving_the_window(sinks, window, center, batch):
    """With fp16 sinks / a window, the token that leaves the window is encoded, attended to (from
    its codes) and stored by the fused step, and the fp16 partial merged. With a window the new
    token waits (`incoming`) and the merge kernel slides the window as a ring (several turns
    here); without one the cache defers the token leaving the sinks' side. Everything else
    reads the window in position order, as the op-by-op cache holds it."""
    from veloxquant_mlx import EngineSettings

    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, center=center, sink_tokens=sinks,
                        residual_length=window)
    steps = 2 * window + 3
    k = mx.random.normal((batch, 2, 300 + steps, 64), key=mx.random.key(1)).astype(mx.float16)
    v = mx.random.normal((batch, 2, 300 + steps, 64), key=mx.random.key(2)).astype(mx.float16)
    ref = CompressedKVCache(cfg, settings=EngineSettings.resolve(backend="portable"))
    fused = CompressedKVCache(cfg, settings=EngineSettings.resolve(backend="emulator"))
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., :300, :], v[..., :300, :])
    for t in range(300, 300 + steps):
        q = mx.random.normal((batch, 6, 1, 64), key=mx.random.key(t)).astype(mx.float16)
        for cache in (ref, fused):
            cache.update_and_fetch(k[..., t:t + 1, :], v[..., t:t + 1, :])
        assert (fused.incoming is not None) == (window > 0) and (fused.store.pending is not None) == (window == 0)
        assert ref.store.pending is None and ref.incoming is None
        expected = ref.attend(q, 0.125)
        out = fused.attend(q, 0.125)
        assert fused.last_path == "mse_fused_step" and fused.store.pending is None and fused.incoming is None
        assert selftest._rel(np.array(out.astype(mx.float32)), np.array(expected.astype(mx.float32))) < 2e-3
        assert fused.encoded == ref.encoded and fused.window == ref.window == window
        assert mx.array_equal(fused.store.rows[..., :fused.encoded, :], ref.store.rows[..., :ref.encoded, :]).item()
    if window:
        assert fused.window_start == steps % window  # the ring turned, and is read in order:
        assert mx.array_equal(fused.window_keys, ref.window_keys).item()
        assert fused.window_start == 0 and mx.array_equal(fused.window_values, ref.window_values).item()


@needs_cxx
@pytest.mark.parametrize("reader", ["update", "trim", "state", "prefill", "nbytes"])
def test_a_token_waiting_to_enter_the_window_is_stored_by_any_reader(reader):
    """A decode token that waits for the kernels' slide (`incoming`) enters the window op by op
    when anything else reads the cache first, with the ring put back in position order: the
    cache then equals one that never deferred it."""
    from veloxquant_mlx import EngineSettings

    cfg = KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4, center=True, sink_tokens=2,
                        residual_length=6)
    k = mx.random.normal((1, 2, 340, 64), key=mx.random.key(3)).astype(mx.float16)
    v = mx.random.normal((1, 2, 340, 64), key=mx.random.key(4)).astype(mx.float16)
    ref = CompressedKVCache(cfg, settings=EngineSettings.resolve(backend="portable"))
    fused = CompressedKVCache(cfg, settings=EngineSettings.resolve(backend="emulator"))
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., :300, :], v[..., :300, :])
    for t in range(300, 310):  # the ring turns past its start
        q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(t)).astype(mx.float16)
        for cache in (ref, fused):
            cache.update_and_fetch(k[..., t:t + 1, :], v[..., t:t + 1, :])
            cache.attend(q, 0.125)
    for cache in (ref, fused):
        cache.update_and_fetch(k[..., 310:311, :], v[..., 310:311, :])
    assert fused.incoming is not None and fused.window_start == 4
    for cache in (ref, fused):
        if reader == "update":  # two tokens: a decode token would wait in its turn
            cache.update_and_fetch(k[..., 311:313, :], v[..., 311:313, :])
        elif reader == "trim":
            cache.trim(3)
        elif reader == "state":
            cache.state = cache.state
        elif reader == "prefill":
            cache.update_and_fetch(k[..., 311:340, :], v[..., 311:340, :])
        else:
            cache.nbytes
    assert fused.incoming is None and fused.store.pending is None and fused.window_start == 0
    assert (fused.offset, fused.encoded, fused.window) == (ref.offset, ref.encoded, ref.window)
    assert mx.array_equal(fused.window_keys, ref.window_keys).item()
    assert mx.array_equal(fused.window_values, ref.window_values).item()
    assert mx.array_equal(fused.store.rows[..., :fused.encoded, :], ref.store.rows[..., :ref.encoded, :]).item()
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(99)).astype(mx.float16)
    a, b = fused.attend(q, 0.125), ref.attend(q, 0.125)
    assert selftest._rel(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))) < 2e-3


@needs_cxx
def test_deferred_tokens_decode_like_the_op_by_op_path(model):
    # On a GPU a decode token waits in the store (`pending`) for the attention call, whose
    # "decode_store" path encodes, attends to and stores it; here the same protocol runs with
    # the emulated kernels.
    from mlx_lm.generate import generate_step

    from veloxquant_mlx import EngineSettings, KVCacheBuilder

    def greedy(model, prompt, n, caches):
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=caches)]

    cfg = KVCacheConfig(method="turboquant_mse", bits=4, value_bits=4)
    prompt = list(range(1, 30))
    expected = greedy(model, prompt, 4, KVCacheBuilder(cfg).for_model(model).build())

    caches = KVCacheBuilder(cfg).for_model(model).build(settings=EngineSettings.resolve(backend="emulator"))
    paths = []
    original = CompressedKVCache.attend

    def attend(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        paths.append(self.last_path)
        return out

    CompressedKVCache.attend = attend
    try:
        assert greedy(model, prompt, 4, caches) == expected
    finally:
        CompressedKVCache.attend = original
    assert paths.count("mse_fused_step") >= 3 * len(model.layers)  # every decode step after the prompt
    cache = caches[0]
    assert cache.offset == len(prompt) + 4
    encoded = cache.encoded
    cache.update_and_fetch(mx.ones((1, 2, 1, 32)), mx.ones((1, 2, 1, 32)))
    assert cache.store.pending is not None and cache.store.count == encoded  # stored by the next attention call...
    assert cache.nbytes == cache.store.rows.nbytes and cache.store.pending is None  # ...or by anything reading it
    assert cache.encoded == encoded + 1 == cache.offset


# ---- the formats' partial kernel (every method with a decode snippet), in the emulator ----------

PARTIAL_FORMATS = [
    {"method": "kivi", "bits": 4, "group_size": 32},
    {"method": "kivi", "bits": 2, "group_size": 32},
    {"method": "turboquant_rvq", "bits": 2},
    {"method": "qjl", "bits": 3},
    {"method": "turboquant_prod", "bits": 3},
    {"method": "polarquant", "bits": 3},
    {"method": "rabitq", "bits": 3, "value_bits": 4},
    {"method": "rabitq", "bits": 1, "value_bits": 2},
    {"method": "polarquant", "bits": 4, "options": {"levels": 0}},  # the deepest tree: 6 levels at dim 64
    {"method": "turboquant_mse", "bits": 3, "value_bits": 4},
    {"method": "turboquant_mse", "bits": 3, "sink_tokens": 4, "residual_length": 16, "center": True,
     "options": {"renorm": True}},
]


def _emulated_partial_and_ops_decode(options: dict, keys: mx.array, queries: mx.array):
    """(the formats' partial kernel in the emulator, the engine's MLX-ops decode of the same codes, the
    history) for a cache of `options` holding `keys` (values sin(3 keys)), scale 1/8, chunks of one tile."""
    from veloxquant_mlx import engine
    from veloxquant_mlx.kernels import partial
    from veloxquant_mlx.settings import EngineSettings

    cache = CompressedKVCache(KVCacheConfig(**options), settings=EngineSettings.resolve(backend="portable"))
    cache.update_and_fetch(keys, mx.sin(3 * keys))
    cache.flush()
    h = cache._history()
    ref = engine.compiled_decode(h, queries, 0.125, compiled=False)
    h.settings = h.settings.replace(backend="emulator")
    return partial.decode(h, queries, 0.125, chunk=partial.THREADS), ref, h


def _close_to(out, ref) -> bool:
    return float(mx.max(mx.abs(out - ref))) <= 2e-5 * float(mx.max(mx.abs(ref)))


@needs_cxx
@pytest.mark.parametrize("options", PARTIAL_FORMATS, ids=lambda o: "-".join(f"{v}" for v in o.values() if not isinstance(v, dict)))
def test_format_partial_kernel_matches_the_engines_ops_decode(options):
    """The partial kernel rendered from each method's decode snippets (kernels/partial.py),
    several splits, a ragged last split, batch 2, GQA 3, sinks/window/centering where set:
    the same output as the engine's MLX-ops decode of the same codes."""
    keys = mx.random.normal((2, 2, 333, 64), key=mx.random.key(7)) + 0.3
    out, ref, _ = _emulated_partial_and_ops_decode(options, keys, mx.random.normal((2, 6, 1, 64), key=mx.random.key(8)))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _close_to(out, ref)


@needs_cxx
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "decoded"])
def test_format_partial_kernel_folds_kivi_scales_into_queries_and_weights(fold, monkeypatch):
    """KIVI's key scale and minimum are shared by a group of tokens and its value scale and minimum by a
    group of channels: the partial kernel folds them into the queries and the weights (one multiply-add
    per code) where its shared memory allows, and decodes each element otherwise; both give the ops
    decode's output."""
    from veloxquant_mlx.kernels import partial

    if not fold:
        monkeypatch.setattr(partial, "FOLD_LIMIT", 0)
        monkeypatch.setattr(partial, "_value_fold", lambda codec, g: False)
    # A cache of its own for the kernel's choice, which depends on the two patched above.
    monkeypatch.setattr(partial, "_fitting_program", functools.lru_cache(maxsize=8)(partial._fitting_program.__wrapped__))
    keys = mx.random.normal((1, 2, 300, 64), key=mx.random.key(27)) * mx.arange(1, 65) / 16
    out, ref, h = _emulated_partial_and_ops_decode(
        {"method": "kivi", "bits": 3, "group_size": 16, "residual_length": 16}, keys,
        mx.random.normal((1, 6, 1, 64), key=mx.random.key(28)))
    body = templates.KERNELS[partial.program(h.store, h.key_codec, h.value_codec, 3).kernel]["body"]
    assert ("vq_qf" in body and "accm[r] += wv[r]" in body) is fold
    assert _close_to(out, ref)


@needs_cxx
@pytest.mark.parametrize("options, merged_in_kernel", [
    ({"method": "kivi", "bits": 4, "group_size": 32}, True),  # identity value domain, fp16 residual tokens
    ({"method": "turboquant_rvq", "bits": 2, "sink_tokens": 2, "residual_length": 8, "center": True}, True),
    ({"method": "kivi", "bits": 2, "group_size": 32, "sink_tokens": 3}, False),  # merge_domain says no (below)
], ids=["kivi", "rvq-window-centred", "ops-merge"])
def test_format_step_attends_to_fp16_tokens_in_the_merge_kernel(options, merged_in_kernel, monkeypatch):
    """The formats' decode step is two launches (partial, merge) when the merge kernel can leave the
    value domain (identity, or a seeded-sign Hadamard rotation): it attends to the fp16 sinks and
    window itself; other domains keep the MLX-ops merge. Same output as the engine's ops decode."""
    if not merged_in_kernel:  # a domain the kernel cannot leave (a dense rotation, outlier channels...)
        monkeypatch.setattr(ops, "merge_domain", lambda codec, dim: None)
    launched = []
    run_emulator = launch.run_emulator
    monkeypatch.setattr(launch, "run_emulator", lambda plan, inputs: launched.append(
        plan.kernel + ("+tokens" if dict(plan.template).get("HAS_TOKENS") else "")) or run_emulator(plan, inputs))
    keys = mx.random.normal((1, 2, 301, 64), key=mx.random.key(17)) + 0.3
    out, ref, h = _emulated_partial_and_ops_decode(options, keys, mx.random.normal((1, 6, 1, 64), key=mx.random.key(18)))
    assert h.window > 0
    assert _close_to(out, ref)
    assert (launched[1:] == ["merge+tokens"]) is merged_in_kernel and launched[0].startswith("partial_")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("options, dim, rep", [
    pytest.param({"method": "polarquant", "bits": 4, "options": {"levels": 0}}, 128, 4, marks=pytest.mark.slow,
                 id="polarquant"),
    pytest.param({"method": "kivi", "bits": 2, "group_size": 32}, 128, 4, marks=pytest.mark.slow, id="kivi"),
    pytest.param({"method": "qjl", "bits": 3}, 128, 4, marks=pytest.mark.slow, id="qjl"),
    pytest.param({"method": "rabitq", "bits": 3, "value_bits": 4}, 128, 4, marks=pytest.mark.slow, id="rabitq"),
    # fits only without its key fold and staged scalars: the tightest, compiled by `make test` too
    pytest.param({"method": "kivi", "bits": 4, "group_size": 64}, 256, 4, id="kivi-dim256"),
])
def test_format_partial_kernels_compile_with_nvcc(options, dim, rep, tmp_path):
    """The formats' partial kernel, rendered from each codec's snippets for the 8B shape (dim 128,
    GQA 4) and Gemma 3's head dim, compiles for sm_90 without spills and within the static shared
    memory `partial.shared_bytes` counts: a snippet's CUDA errors show here, not on the GPU."""
    from veloxquant_mlx.settings import EngineSettings

    cache = CompressedKVCache(KVCacheConfig(**options), settings=EngineSettings.resolve(backend="portable"))
    keys = mx.random.normal((1, 8, 300, dim), key=mx.random.key(3))
    cache.update_and_fetch(keys, keys)
    cache.flush()
    h = cache._history()
    assert_partial_kernel_compiles(h.store, h.key_codec, h.value_codec, rep, tmp_path)


def test_mse_decode_kernel_respects_each_back_ends_shared_memory():
    """turboquant_mse's partial kernel at head dim 256 (Gemma 3), K3/V4, GQA 4 needs about 35 KB of
    static shared memory: under CUDA's limit, over Apple GPUs' 32 KB of threadgroup memory, where
    the pipeline would fail to build in the middle of generation. Metal leaves that shape to the
    engine's paths, with a warning naming the bytes."""

    keys = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4))
    x = mx.random.normal((1, 1, 8, 256), key=mx.random.key(2))
    keys.update_and_fetch(x, x)
    kc, vc = keys.key_codec, keys.value_codec
    need = launch.partial_shared_bytes(256, 4, 3, 4)
    assert 32 * 1024 < need <= 44 * 1024
    assert kernels._decode_kernel_ok(kc, vc, 4, "cuda") and not kernels._decode_kernel_ok(kc, vc, 4, "metal")
    assert kernels._decode_kernel_ok(kc, vc, 2, "metal") is (launch.partial_shared_bytes(256, 2, 3, 4) <= 32 * 1024)
    kernels._warn_no_kernel.cache_clear()
    with pytest.warns(RuntimeWarning, match=f"{need} bytes of shared memory \\(> 32768 on metal\\)"):
        kernels._warn_no_kernel("metal", kc, vc, 4)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_format_partial_kernel_fits_each_back_ends_shared_memory(backend):
    """The kernel drops what it keeps in shared memory (the key fold, then the staged fp16 scalars,
    then the shared tables) until it fits the back end's limit (48 KB of CUDA's static shared memory
    less a margin, Apple GPUs' 32 KB of threadgroup memory), and says it does not fit otherwise."""
    from veloxquant_mlx.kernels import partial
    from veloxquant_mlx.settings import EngineSettings

    limit = partial.shared_limit(backend)
    cases = [({"method": "kivi", "bits": 4, "group_size": 64}, 128, 4), ({"method": "kivi", "bits": 4, "group_size": 64}, 128, 8),
             ({"method": "kivi", "bits": 4, "group_size": 64}, 256, 4), ({"method": "kivi", "bits": 2, "group_size": 32}, 64, 8),
             ({"method": "polarquant", "bits": 4}, 128, 4), ({"method": "turboquant_rvq", "bits": 2}, 256, 8)]
    fitted = {}
    for options, dim, rep in cases:
        cache = CompressedKVCache(KVCacheConfig(**options), settings=EngineSettings.resolve(backend="portable"))
        keys = mx.random.normal((1, 2, 200, dim), key=mx.random.key(5))
        cache.update_and_fetch(keys, keys)
        cache.flush()
        h = cache._history()
        prog = partial.program(h.store, h.key_codec, h.value_codec, rep, backend)
        fitted[(options["method"], dim, rep)] = partial.fits(h.store, h.key_codec, h.value_codec, rep, backend)
        assert fitted[(options["method"], dim, rep)] == (prog.shared_bytes(rep) <= limit)
    assert fitted[("kivi", 128, 4)] and fitted[("kivi", 128, 8)] and fitted[("polarquant", 128, 4)]
    assert fitted[("kivi", 256, 4)] is (backend == "cuda")


# ---- the formats' encode kernel (kernels/encode.py) ------------------------------------------

def _encode_fields_close(got, refs):
    """(share of equal code words, worst relative error of the fp16 scalars); names, shapes and
    dtypes must match."""
    equal, half_error, same = encode.fields_agreement(got, refs)
    assert same
    return equal, half_error


ENCODE_FORMATS = [  # (method, options, dim, key bits, value bits, input dtype)
    ("turboquant_rvq", {}, 64, 2, 3, mx.float32),
    ("turboquant_rvq", {}, 128, 3, 4, mx.float16),
    ("turboquant_rvq", {}, 256, 4, 2, mx.float32),
    ("qjl", {}, 64, 2, 4, mx.float16),
    ("qjl", {"group_size": 48}, 128, 1, 3, mx.float32),  # a ragged last value group
    ("turboquant_prod", {}, 128, 3, 4, mx.float16),
    ("turboquant_mse", {"options": {"renorm": True}}, 64, 3, 2, mx.float32),
    ("polarquant", {}, 128, 4, 3, mx.float16),
    ("polarquant", {"options": {"levels": 0}}, 64, 4, 2, mx.float32),  # 6 levels; value level 2-4 at 0 bits
]


@needs_cxx
@pytest.mark.parametrize("method, options, dim, bits, value_bits, dtype", ENCODE_FORMATS,
                         ids=lambda v: str(v) if not isinstance(v, (dict, mx.Dtype)) else None)
def test_format_encode_kernel_equals_the_codecs_encode(method, options, dim, bits, value_bits, dtype):
    """Rows written by the encode kernel rendered from each method's encode snippets: the fields
    of `codec.encode`, packed as `RowLayout.pack` packs them (both roles, batch 2, 3 heads)."""
    from veloxquant_mlx.formats import RowLayout
    from veloxquant_mlx.kernels import encode
    from veloxquant_mlx.methods import get_method

    config = KVCacheConfig(method=method, bits=bits, value_bits=value_bits, seed=dim, **options)
    kc, vc = get_method(method).key_codec(config, dim), get_method(method).value_codec(config, dim)
    layout = RowLayout.of(kc.format, vc.format)
    keys = (mx.random.normal((2, 3, 11, dim), key=mx.random.key(dim)) + 0.2).astype(dtype)
    values = mx.random.normal((2, 3, 11, dim), key=mx.random.key(dim + 1)).astype(dtype)
    values = values.at[0, 0, 3, 5].add(40.0)  # one outlier: a wide value group
    refs = (kc.encode(keys), vc.encode(values))
    # Rows (a RowStore: every per-token format); a field store holds block formats, which have no snippet.
    assert encode.supported(layout, kc, vc) and not encode.supported(None, kc, vc)
    rows = encode.encode_rows(ops.runner("emulator"), layout, kc, vc, keys, values)
    assert rows.shape == (2, 3, 11, layout.words) and rows.dtype == mx.uint32
    # names, shapes and dtypes checked in _encode_fields_close
    equal, half_error = _encode_fields_close(layout.views(rows), refs)
    assert equal >= encode.CHECK_MIN_EQUAL and half_error <= encode.CHECK_HALF_ERROR


@needs_cxx
def test_format_encode_check_passes_in_the_emulator():
    from veloxquant_mlx.kernels import encode

    # The emulator runs each block's threads as OS threads: a few tokens (the GPU check takes 300).
    record = encode.check_record("emulator", tokens=12)
    assert record["status"] == "ok" and record["formats"] == [name for name, _ in encode.CHECK_FORMATS]


@needs_cxx
@pytest.mark.parametrize("method", ["turboquant_rvq", "qjl"], ids=["rows", "rows-half-word-padding"])
def test_format_encoder_stores_decode_tokens_of_a_protected_cache(method, monkeypatch):
    """A cache on the kernel back end (emulated) encodes its prefill chunk and each token leaving
    the fp16 window with the encode kernel, into its rows (qjl's with a half word of padding):
    the same codes as the MLX-ops encoder."""
    from veloxquant_mlx.settings import EngineSettings
    from veloxquant_mlx.storage import RowStore

    launched = []
    run_emulator = launch.run_emulator
    monkeypatch.setattr(launch, "run_emulator", lambda plan, inputs: launched.append(plan.kernel)
                        or run_emulator(plan, inputs))
    config = KVCacheConfig(method=method, bits=2, value_bits=3, sink_tokens=2, residual_length=8, center=True)
    fast = CompressedKVCache(config, settings=EngineSettings.resolve(backend="emulator"))
    ref = CompressedKVCache(config, settings=EngineSettings.resolve(backend="portable"))
    keys = mx.random.normal((1, 2, 100, 64), key=mx.random.key(70)) + 0.3
    values = mx.sin(3 * keys)
    for cache in (fast, ref):
        cache.update_and_fetch(keys[:, :, :90], values[:, :, :90])
        for i in range(90, 100):
            cache.update_and_fetch(keys[:, :, i:i + 1], values[:, :, i:i + 1])
        cache.flush()
    assert fast.encoded == ref.encoded == 90
    assert sum(name.startswith("encode_") for name in launched) == 11  # the chunk, then one per token
    assert isinstance(fast.store, RowStore)
    equal, half_error = _encode_fields_close((fast.key_fields, fast.value_fields), (ref.key_fields, ref.value_fields))
    assert equal >= 0.999 and half_error <= 2 ** -10


def test_format_encoder_takes_only_codecs_with_snippets():
    from veloxquant_mlx.formats import RowLayout
    from veloxquant_mlx.kernels import encode
    from veloxquant_mlx.methods import get_method

    def codecs(name, dim, **options):
        config = KVCacheConfig(method=name, bits=3, **options)
        method = get_method(name)
        kc, vc = method.key_codec(config, dim), method.value_codec(config, dim)
        return RowLayout.of(kc.format, vc.format), kc, vc

    assert encode.supported(*codecs("turboquant_rvq", 128))
    assert not encode.supported(*codecs("turboquant_rvq", 96))  # a dense rotation: no kernel FWHT
    from veloxquant_mlx.methods.outliers import OutlierCodec
    from veloxquant_mlx.methods.turboquant_mse import MSECodec

    outliers = OutlierCodec(MSECodec(120, 3, 1), mx.array([[0, 5, 9, 11, 40, 64, 90, 127]] * 2), 128)
    assert encode.supported(RowLayout.of(outliers.format, outliers.format), outliers, outliers)  # a dense base
    base = MSECodec(120, 3, 1)
    base.kernel_encode = None  # a base without an encode snippet
    outliers = OutlierCodec(base, mx.array([[0, 5, 9, 11, 40, 64, 90, 127]] * 2), 128)
    assert not encode.supported(RowLayout.of(outliers.format, outliers.format), outliers, outliers)
    layout, kc, vc = codecs("kivi", 128, group_size=32)
    assert layout is None and not encode.supported(None, kc, vc)  # per-block key scales: no snippet


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("method, options", [
    # each nvcc run costs seconds: `make test` compiles one format's encode kernel, `make test-all` every one
    pytest.param(m, o, marks=() if i == len(encode.CHECK_FORMATS) else pytest.mark.slow, id=f"{m}-options{i}")
    for i, (m, o) in enumerate(encode.CHECK_FORMATS + (("rabitq", {"bits": 3, "value_bits": 4}),))])
def test_format_encode_kernel_compiles_with_nvcc(method, options, tmp_path):
    from veloxquant_mlx.methods import get_method
    from veloxquant_mlx.storage import row_layout

    config = KVCacheConfig(method=method, **options)
    kc, vc = get_method(method).key_codec(config, 128), get_method(method).value_codec(config, 128)
    layout = row_layout(kc, vc)  # the store's: rows, or one output per field
    plan = encode.plan(layout, kc, vc, 8, "float16")
    compile_encode_kernel(plan, tmp_path)


def test_codecs_declare_how_their_domain_is_left():
    from veloxquant_mlx.methods import get_method
    from veloxquant_mlx.rotations import HadamardRotation

    for name, expected in (("kivi", "identity"), ("turboquant_rvq", "rotation"), ("turboquant_mse", "rotation"),
                           ("qjl", "identity"), ("polarquant", "rotation")):
        codec = get_method(name).value_codec(KVCacheConfig(method=name, bits=3), 64)
        assert codec.domain == expected, name
        if expected == "rotation" and isinstance(codec.rotation, HadamardRotation):
            kind, signs = ops.merge_domain(codec, 64)
            assert kind == "hadamard" and signs.shape == (64,)
    qjl_keys = get_method("qjl").key_codec(KVCacheConfig(method="qjl", bits=3), 64)
    assert qjl_keys.domain == "custom" and ops.merge_domain(qjl_keys, 64) is None
    kivi96 = get_method("kivi").value_codec(KVCacheConfig(method="kivi", bits=3, group_size=32), 96)
    assert ops.merge_domain(kivi96, 96) is None  # not a power of two: one thread per coordinate, FWHT-sized


def test_format_partial_kernel_fits_and_its_path_is_registered():
    from veloxquant_mlx import engine
    from veloxquant_mlx.kernels import partial

    assert "format_kernel_step" in [p.name for p in engine.paths("decode")]
    kivi = CompressedKVCache(KVCacheConfig(method="kivi", bits=4))
    kivi.update_and_fetch(mx.zeros((1, 1, 40, 128)), mx.zeros((1, 1, 40, 128)))
    assert partial.fits(kivi.store, kivi.key_codec, kivi.value_codec, 8)
    assert not partial.fits(kivi.store, kivi.key_codec, kivi.value_codec, 64)  # shared memory bound


# ---- KIVI's C++ CPU kernel ------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("options", [
    {"method": "kivi", "bits": 4, "group_size": 32},
    {"method": "kivi", "bits": 2, "group_size": 64},
    {"method": "kivi", "bits": 3, "group_size": 32, "value_bits": 2, "residual_length": 32, "sink_tokens": 4},
], ids=["k4g32", "k2g64", "k3v2g32-window-sinks"])
def test_kivi_native_kernel_matches_the_engines_ops_decode(options):
    """Several splits (>= 512 tokens each), batch 2, GQA 3, the last token of the buffers
    (scalar decoders), and the fp16 window/sinks merged where set."""
    from veloxquant_mlx import engine

    cache = CompressedKVCache(KVCacheConfig(**options))
    keys = mx.random.normal((2, 2, 2048, 64), key=mx.random.key(9)) * mx.linspace(0.2, 3.0, 64)
    cache.update_and_fetch(keys, mx.cos(keys))
    cache.flush()
    assert cache.store.count == cache.store.capacity or cache.store.count > 1024
    queries = mx.random.normal((2, 6, 1, 64), key=mx.random.key(10))
    out = cache.attend(queries, 0.125)
    assert cache.last_path == "kivi_native"
    ref = engine.compiled_decode(cache._history(), queries, 0.125, compiled=False)
    assert float(mx.max(mx.abs(out - ref))) <= 1e-5 * float(mx.max(mx.abs(ref)))


@needs_native
def test_kivi_native_kernel_rejects_bad_arguments():
    run = native.module().kivi_attention_partials
    q, codes = mx.zeros((1, 2, 64)), mx.zeros((1, 64, 8), mx.uint32)  # 64 tokens, 4-bit codes
    ks = mx.zeros((1, 2, 64), mx.float16)  # two key groups of 32
    vs = mx.zeros((1, 64, 1), mx.float16)
    mx.eval(run(q, codes, ks, ks, codes, vs, vs, 64, 4, 4, 32, 1))
    with pytest.raises(ValueError, match="tokens"):
        run(q, codes, ks, ks, codes, vs, vs, 65, 4, 4, 32, 1)
    with pytest.raises(ValueError, match="one row of D per group"):
        run(q, codes, ks, ks, codes, vs, vs, 64, 4, 4, 16, 1)
    with pytest.raises(ValueError, match="narrower"):
        run(q, codes, ks, ks, codes, vs, vs, 64, 8, 4, 32, 1)
    with pytest.raises(ValueError, match="float16"):
        run(q, codes, ks.astype(mx.float32), ks, codes, vs, vs, 64, 4, 4, 32, 1)


@pytest.mark.skipif(__import__("veloxquant_mlx.kernels.emulator").kernels.emulator.compiler() is None,
                    reason="no C++20 compiler for the kernel emulator")
def test_the_ratequant_selftest_record_passes_in_the_emulator():
    """The self-test's ratequant record (what a GPU run checks) on the C++ emulation."""
    record = selftest.run_ratequant("emulator")
    assert record["status"] == "ok", record
    assert record["rows_equal"] == 1.0 and record["vs_compiled_decode"] <= 1e-5


@needs_cxx
@pytest.mark.parametrize("options", [{}, {"residual_length": 8, "sink_tokens": 2}], ids=["window", "sinks-residual"])
def test_partial_kernel_reads_the_filled_part_of_a_window_buffer(options):
    """The formats' decode step hands KIVI's fixed-capacity window buffer to the merge kernel whole,
    with its fill in the kernel's meta: the same output as the engine's MLX-ops decode, over a
    key group's worth of decode steps (the window filling, flushed, filling again)."""
    from veloxquant_mlx import engine
    from veloxquant_mlx.kernels import partial
    from veloxquant_mlx.settings import EngineSettings

    config = KVCacheConfig(method="kivi", bits=4, group_size=32, **options)
    cache = CompressedKVCache(config, settings=EngineSettings.resolve(backend="portable"))
    keys = mx.random.normal((1, 2, 100, 128), key=mx.random.key(1)).astype(mx.float16)
    cache.update_and_fetch(keys, keys * 0.5)
    fills = set()
    for i in range(40):
        token = mx.random.normal((1, 2, 1, 128), key=mx.random.key(100 + i)).astype(mx.float16)
        queries = mx.random.normal((1, 6, 1, 128), key=mx.random.key(300 + i)).astype(mx.float16)
        cache.update_and_fetch(token, mx.cos(token))
        h = cache._history()
        with mx.stream(mx.cpu):
            ref = engine.compiled_decode(h, queries, 0.088, compiled=False)
        h.settings = h.settings.replace(backend="emulator")
        out = partial.decode(h, queries, 0.088, chunk=partial.THREADS)
        fills.add((h.window_capacity, h.window))
        assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), atol=1e-3), i
    capacity = options.get("residual_length", 0) + 32
    assert {c for c, _ in fills} == {capacity} and len({w for _, w in fills}) > 20


@needs_cxx
def test_decode_steps_split_by_the_settings_not_the_environment(monkeypatch):
    """`EngineSettings.split_tokens` (resolved once per cache) sets the tokens per split of both
    compiled decode steps (turboquant_mse's and the formats'); the environment is read only when
    settings are resolved, never on the per-token path."""
    from veloxquant_mlx.kernels import partial, step
    from veloxquant_mlx.settings import EngineSettings

    monkeypatch.setenv("VELOXQUANT_SPLIT_TOKENS", "4096")  # ignored after resolve: the caches were made with 128
    assert launch.choose_chunk(1024, 8) != 4096 and launch.choose_chunk(1024, 8, chunk=256) == 256
    planned = []
    plan = launch.decode_partial_plan
    monkeypatch.setattr(launch, "decode_partial_plan", lambda *a, **k: planned.append(k["chunk"]) or plan(*a, **k))
    prepare = partial.prepare
    monkeypatch.setattr(partial, "prepare", lambda *a: planned.append(a[6]) or prepare(*a))  # a[6]: chunk
    step._step_fn.cache_clear()
    settings = EngineSettings.resolve(backend="emulator", split_tokens=128)
    queries = mx.random.normal((1, 4, 1, 128), key=mx.random.key(3))
    for method in ("turboquant_mse", "kivi"):
        cache = CompressedKVCache(KVCacheConfig(method=method, bits=4), settings=settings)
        keys = mx.random.normal((1, 2, 300, 128), key=mx.random.key(1))
        cache.update_and_fetch(keys, keys)
        cache.flush()
        h = cache._history()
        if method == "turboquant_mse":
            step.attend("emulator", h, queries, 0.1)
        else:
            partial.decode(h, queries, 0.1)
    assert planned == [128, 128]


def test_formats_decode_step_leaves_windows_beyond_the_merge_kernels_reach(monkeypatch):
    """The formats' compiled step hands the merge kernel the fp16 sinks and the whole window buffer;
    where they exceed what it attends to (MAX_PLAIN_TOKENS), the step does not take the call (the
    dequant-then-attention path does) instead of failing in the kernel's planning."""
    from veloxquant_mlx.settings import EngineSettings

    monkeypatch.setattr(kernels.check, "usable", lambda name: True)
    queries = mx.zeros((1, 4, 1, 64))
    taken = {}
    for residual in (64, ops.MAX_PLAIN_TOKENS):
        config = KVCacheConfig(method="kivi", bits=4, group_size=32, residual_length=residual, sink_tokens=4)
        cache = CompressedKVCache(config, settings=EngineSettings.resolve(backend="cuda", gpu_device=True))
        keys = mx.random.normal((1, 2, residual + 100, 64), key=mx.random.key(1))
        cache.update_and_fetch(keys, keys)
        cache.update_and_fetch(keys[..., :1, :], keys[..., :1, :])  # a decode token: the window is a buffer
        h = cache._history()
        assert h.window_capacity == residual + 32
        taken[residual] = kernels._format_step_supports(h, queries, None)
    assert taken == {64: True, ops.MAX_PLAIN_TOKENS: False}
