"""The Metal source MLX would build for each kernel launch of the self-tests, type-checked by clang's
C++ front end against a declaration of the Metal Shading Language (tests/data/metal_stdlib_shim.h).

These kernels have not run on a Mac. A kernel that Apple's compiler rejects fails its first-use check there, and
its work goes to the portable path with a warning: slow, though never wrong. This catches, without a
Mac, what the shim models: names that are not MSL (a CUDA builtin in a snippet), types, template
parameters shadowed by a kernel's own names, pointers that cross address spaces, which MSL never
converts (MLX passes an input of fewer than 8 elements in `constant`, others in `device`), and pointers
declared or cast to without an address space, which MSL rejects. The
launches are recorded from the self-tests run on the "metal" back end with every kernel's output
replaced by zeros of its shape, so each signature is the one a real call would give MLX."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

from veloxquant_mlx.kernels import launch, templates

cindex = pytest.importorskip("clang.cindex", reason="libclang (the test extra installs it)")

SHIM = (Path(__file__).parent / "data" / "metal_stdlib_shim.h").read_text()


UNIT = "kernel.metal.cpp"


def _parse(text: str):
    """(libclang translation unit, its lines) of a Metal source from `templates.render_metal`."""
    # Two spellings clang's C++ does not take and MSL does: attributes on an explicit instantiation,
    # and threadgroup arrays declared in a kernel's scope (static here, so that they keep the address
    # space: clang allows none on automatic variables).
    text = re.sub(r'template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] ', "template ", text)
    text = text.replace("#define VQ_SHARED threadgroup", "#define VQ_SHARED static threadgroup")
    text = '#include "metal_stdlib_shim.h"\n' + text
    unit = cindex.Index.create().parse(
        UNIT, args=["-std=c++17", "-x", "c++", "-nostdinc", "-nostdinc++", "-I/shim", "-Wno-unknown-attributes",
                    "-ferror-limit=0"],
        unsaved_files=[(UNIT, text), ("/shim/metal_stdlib_shim.h", SHIM)])
    return unit, text.split("\n")


def _errors(unit, lines) -> list:
    return [f"{d.spelling} | {lines[d.location.line - 1].strip()[:160] if d.location.file and d.location.file.name == UNIT else d.location}"
            for d in unit.diagnostics if d.severity >= cindex.Diagnostic.Error]


def metal_errors(text: str) -> list:
    """clang's errors for a Metal translation unit from `templates.render_metal`, each with its line,
    and its pointers without an address space."""
    unit, lines = _parse(text)
    return _errors(unit, lines) + [f"pointer type must have explicit address space qualifier | {lines[line - 1].strip()[:160]}"
                                   for line in _unqualified_pointers(unit.cursor)]


_POINTER_SITES = ("VAR_DECL", "PARM_DECL", "FIELD_DECL", "TYPEDEF_DECL", "CSTYLE_CAST_EXPR", "CXX_STATIC_CAST_EXPR",
                  "CXX_REINTERPRET_CAST_EXPR")


def _unqualified_pointers(cursor) -> list:
    """Lines of the kernel's own text declaring or casting to a pointer without an address space, which
    MSL rejects ("pointer type must have explicit address space qualifier"; clang's C++ takes them)."""
    found = []
    for child in cursor.get_children():
        if child.location.file and child.location.file.name == UNIT:
            if child.kind.name in _POINTER_SITES:
                kind_type = child.underlying_typedef_type if child.kind.name == "TYPEDEF_DECL" else child.type
                canonical = kind_type.get_canonical()
                try:
                    pointer = canonical.kind == cindex.TypeKind.POINTER
                except ValueError:  # a type kind this libclang's Python bindings do not name: not a pointer
                    pointer = False
                if pointer and "address_space" not in canonical.get_pointee().spelling:
                    found.append(child.location.line)
            found += _unqualified_pointers(child)
    return found


def threadgroup_bytes(text: str, template) -> int:
    """Static threadgroup memory of a Metal translation unit from `templates.render_metal`: its
    threadgroup arrays' sizes, with the template constants made constants of the unit."""
    types = templates.C_TYPES["metal"]
    constants = "".join(f"using {n} = {types[v]};\n" if isinstance(v, str) else
                        f"constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {int(v)};\n" for n, v in template)
    text = re.sub(r"template <[^>]*>\n\[\[kernel\]\]", lambda _: constants + "[[kernel]]", text, count=1)
    unit, lines = _parse(re.sub(r"\ntemplate \[\[host_name.*\n", "\n", text))  # no template left to instantiate
    assert not _errors(unit, lines)

    def total(cursor) -> int:
        return sum((child.type.get_size() if child.kind.name == "VAR_DECL"
                    and "address_space(3)" in child.type.get_canonical().spelling else 0) + total(child)
                   for child in cursor.get_children()
                   if child.location.file is None or child.location.file.name == UNIT)

    return total(unit.cursor)


def _input_specs(kernel: str, inputs) -> dict:
    return {name: (launch.dtype_name(a.dtype), a.size, a.ndim) for name, a in zip(templates.KERNELS[kernel]["inputs"], inputs)}


def zero_outputs(plan, inputs, shapes=None) -> list:
    """A kernel's outputs as zeros of their shapes, computed from its first input (so that a graph
    keeps its shape and nothing runs before evaluation): what the recorded launches return."""
    anchor = inputs[0].reshape(-1)[:1].astype(mx.float32) * 0
    return [mx.zeros(s, launch._DTYPES[d]) + anchor.astype(launch._DTYPES[d])
            for s, d in zip(shapes or plan.output_shapes, plan.output_dtypes)]


def clear_kernel_caches():
    """Forget the first-use verdicts and what was built with the recording runner (encoders and
    compiled steps hold the runner they were made with), for the tests after these."""
    from veloxquant_mlx import engine
    from veloxquant_mlx.kernels import check, partial, step
    from veloxquant_mlx.weights import kernel as weights_kernel

    check.reset()
    weights_kernel.reset()
    for cached in (engine.row_encoder, engine.field_encoder, step._step_fn, partial._step_fn):
        cached.cache_clear()


@pytest.fixture(scope="module")
def metal_launches():
    return record_metal_launches()


def record_metal_launches() -> dict:
    """{(kernel, template, input specs, output dtypes): Metal source} of every distinct launch of the
    kernel and weight self-tests on the "metal" back end, with the kernels' outputs lazy zeros."""
    from veloxquant_mlx.cache import CompressedKVCache
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.kernels import _dequant_rows, check, selftest
    from veloxquant_mlx.rotating import CompressedRotatingKVCache
    from veloxquant_mlx.settings import EngineSettings
    from veloxquant_mlx.weights import kernel as weights_kernel
    from veloxquant_mlx.weights import selftest as weights_selftest

    launches = {}
    run_mlx = launch.run_mlx

    def record(dialect, plan, inputs, shapes=None):
        if dialect != "metal":
            return run_mlx(dialect, plan, inputs, shapes)
        specs = _input_specs(plan.kernel, inputs)
        outputs = dict(zip(templates.KERNELS[plan.kernel]["outputs"], plan.output_dtypes))
        key = (plan.kernel, tuple(plan.template), tuple(sorted(specs.items())), tuple(plan.output_dtypes))
        if key not in launches:
            launches[key] = templates.render_metal(plan.kernel, list(plan.template), specs, outputs, name="vq_kernel")
        return zero_outputs(plan, inputs, shapes)

    clear = clear_kernel_caches

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch.setattr(launch, "run_mlx", record)
        patch.setattr(check, "usable", lambda name: True)
        patch.setattr(check, "format_usable", lambda h: True)
        patch.setattr(check, "format_encode_usable", lambda *args: True)
        patch.setattr(weights_kernel, "usable", lambda dialect, dtype: True)
        clear()
        try:
            selftest.run_all("metal", safe=True)  # zeros fail its comparisons: only the launches count
            # bfloat16 models (MLX's default for many checkpoints): prefill, then decode steps, of
            # turboquant_mse plain and protected (the fused step, the window slide) and of two formats.
            for options in (dict(method="turboquant_mse", bits=3, value_bits=4),
                            dict(method="turboquant_mse", bits=3, value_bits=4, sink_tokens=4, residual_length=16,
                                 center=True, options={"renorm": True}),
                            dict(method="kivi", bits=4, group_size=32), dict(method="turboquant_rvq", bits=2)):
                cache = CompressedKVCache(KVCacheConfig(**options), settings=EngineSettings.resolve(backend="metal"))
                x = mx.random.normal((1, 2, 80, 128), key=mx.random.key(3)).astype(mx.bfloat16)
                cache.update_and_fetch(x, x)
                cache.attend(mx.random.normal((1, 8, 80, 128)).astype(mx.bfloat16), 0.088, mask="causal")
                for i in range(3):
                    cache.update_and_fetch(x[..., i : i + 1, :], x[..., i : i + 1, :])
                    mx.eval(cache.attend(mx.repeat(x[:, :1, i : i + 1, :], 8, axis=1), 0.088))
            # A sliding-window layer (Gemma 3) and a batch of two prompts.
            rotating = CompressedRotatingKVCache(KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4), max_size=64,
                                                 settings=EngineSettings.resolve(backend="metal"))
            batch = CompressedKVCache(KVCacheConfig(method="kivi", bits=2, group_size=32),
                                      settings=EngineSettings.resolve(backend="metal"))
            for cache, rows in ((rotating, 1), (batch, 2)):
                x = mx.random.normal((rows, 2, 100, 128), key=mx.random.key(4)).astype(mx.float16)
                cache.update_and_fetch(x, x)
                for i in range(3):
                    cache.update_and_fetch(x[..., i : i + 1, :], x[..., i : i + 1, :])
                    mx.eval(cache.attend(mx.repeat(x[:, :1, i : i + 1, :], 8, axis=1), 0.088))
            # The mse prefill's dequant kernel (a GPU-only path)
            for dtype in (mx.float16, mx.float32):
                cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3, value_bits=2),
                                          settings=EngineSettings.resolve(backend="metal"))
                cache.update_and_fetch(*(mx.random.normal((1, 2, 40, 128), key=mx.random.key(1)).astype(dtype),) * 2)
                cache.flush()
                _dequant_rows(cache._history(), "keys", dtype, 40)
            cases = (weights_selftest.CASES + weights_selftest.ROTATION_CASES + weights_selftest.ROTATING_CASES
                     + weights_selftest.SIBLING_CASES)
            runners = {weights_selftest.Case: weights_selftest.run_case,
                       weights_selftest.RotationCase: weights_selftest.run_rotation_case,
                       weights_selftest.RotatingCase: weights_selftest.run_rotating_case,
                       weights_selftest.SiblingCase: weights_selftest.run_sibling_case}
            small = set(weights_selftest.EMULATOR_CASES + weights_selftest.EMULATOR_ROTATION_CASES
                        + weights_selftest.EMULATOR_ROTATING_CASES + weights_selftest.EMULATOR_SIBLING_CASES)
            for case in cases:
                if case.name in small:
                    try:
                        runners[type(case)](case, "metal")
                    except Exception:  # noqa: BLE001 - zeros may fail a case's own checks
                        pass
        finally:
            clear()
    return launches


def test_every_metal_launch_of_the_self_tests_type_checks(metal_launches):
    kernels = {key[0] for key in metal_launches}
    families = {re.sub(r"_[0-9a-f]{16}$", "", k) for k in kernels}
    # Every kernel family the GPU paths launch: the mse kernels, the formats' rendered ones, the weights'.
    assert {"mse_encode", "mse_partial", "mse_dequant", "merge", "merge_encode", "merge_encode_slide",
            "dequant", "partial", "encode"} <= families, families
    # and the weights' (weights/kernel.py, rotating_matmul.py, rotation_kernel.py)
    assert {"lut_matmul", "lut_matmul_rotating", "rotate_input"} <= kernels, kernels
    assert len(metal_launches) > 100
    # Metal's buffer argument table holds 31 entries per kernel (Metal feature set tables): indices 0-30.
    assert max(int(i) for text in metal_launches.values() for i in re.findall(r"\[\[buffer\((\d+)\)\]\]", text)) <= 30
    # Apple GPUs have 32 KB of threadgroup memory; a kernel past it fails to build its pipeline.
    largest = max((threadgroup_bytes(text, key[1]), key[0]) for key, text in metal_launches.items())
    assert 8 * 1024 < largest[0] <= 32 * 1024, largest
    failures = {}
    for (kernel, *_), text in metal_launches.items():
        for error in metal_errors(text):
            failures.setdefault(f"{kernel}: {error}", 0)
            failures[f"{kernel}: {error}"] += 1
    assert not failures, "\n".join(f"{n}x {e}" for e, n in list(failures.items())[:20])


def _merge_text(vmap_elements: int) -> str:
    from veloxquant_mlx.kernels import ops

    plan = launch.merge_plan(1, 4, 128, 7, unrotate=False, plain=False, value_mean=False, out_dtype="float16",
                             unmap=1)
    inputs = {name: ("float32", 64, 1) for name in templates.KERNELS["merge"]["inputs"]}
    inputs.update(meta=("int32", 4, 1), pa_k=("float32", 64, 1), pa_v=("float32", 64, 1), pb_k=("float32", 64, 1),
                  pb_v=("float32", 64, 1), vmap=("float32", vmap_elements, 1))
    assert ops.templates is templates
    return templates.render_metal("merge", list(plan.template), inputs, {"out": "float16"})


def test_the_metal_type_check_fails_on_what_apples_compiler_rejects(monkeypatch):
    # The merge kernel's dense value map is read through a device pointer: a 1-element dummy in its
    # place (MLX: the constant address space) is the error every merge kernel had before the dummies
    # were made METAL_CONSTANT_ELEMENTS long.
    assert metal_errors(_merge_text(16384)) == []
    assert any("constant" in e and "vmap" in e for e in metal_errors(_merge_text(1)))
    # A CUDA builtin in a body, and a kernel name shadowing a template parameter.
    body = templates.KERNELS["merge"]["body"]
    monkeypatch.setitem(templates.KERNELS["merge"], "body", body.replace("VQ_SYNC();", "__syncthreads();", 1))
    assert any("__syncthreads" in e for e in metal_errors(_merge_text(16384)))
    monkeypatch.setitem(templates.KERNELS["merge"], "body", "  { constexpr int D = 3; (void)D; }\n" + body)
    assert any("shadows template parameter" in e for e in metal_errors(_merge_text(16384)))
    # turboquant_mse's partial kernel at head dim 256, K3/V4, GQA 4 (which Metal's paths refuse) is over
    # Apple GPUs' 32 KB of threadgroup memory, as `launch.partial_shared_bytes` counts it.
    plan = launch.partial_plan(1, 4, 256, 3, 4, 4096, 4096, rotate_query=True, q_dtype="float16")
    specs = {name: ("float32", 4096, 1) for name in templates.KERNELS["mse_partial"]["inputs"]}
    specs.update(q=("float16", 1024, 1), rows=("uint32", 4096, 1), meta=("int32", 4, 1), qscale=("float32", 1, 1))
    text = templates.render_metal("mse_partial", list(plan.template), specs, {"o": "float32", "ml": "float32"})
    assert threadgroup_bytes(text, plan.template) > 32 * 1024
    assert abs(threadgroup_bytes(text, plan.template) - launch.partial_shared_bytes(256, 4, 3, 4)) <= 64
    # A pointer without an address space, declared or cast to.
    monkeypatch.setitem(templates.KERNELS["merge"], "body", "  { float a_[2] = {0, 0}; float* p_ = a_; (void)p_; }\n" + body)
    assert any("explicit address space" in e for e in metal_errors(_merge_text(16384)))
    monkeypatch.setitem(templates.KERNELS["merge"], "body", "  (void)((const uint32_t*)o);\n" + body)
    assert any("explicit address space" in e for e in metal_errors(_merge_text(16384)))


def test_a_shape_over_metals_threadgroup_memory_takes_the_next_path(monkeypatch):
    """turboquant_mse at head dim 256, K3/V4, GQA 4 (35 KB of shared memory) keeps its own kernels on
    CUDA and, on Metal, warns and takes the formats' dequant kernel with MLX's attention."""
    from veloxquant_mlx.cache import CompressedKVCache
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.kernels import _warn_no_kernel, check
    from veloxquant_mlx.settings import EngineSettings

    monkeypatch.setattr(launch, "run_mlx", lambda dialect, plan, inputs, shapes=None: zero_outputs(plan, inputs, shapes))
    monkeypatch.setattr(check, "usable", lambda name: True)
    monkeypatch.setattr(check, "format_usable", lambda h: True)
    monkeypatch.setattr(check, "format_encode_usable", lambda *args: True)
    _warn_no_kernel.cache_clear()
    clear_kernel_caches()
    paths = {}
    try:
        for backend in ("cuda", "metal"):
            cache = CompressedKVCache(KVCacheConfig(method="turboquant_mse", bits=3, value_bits=4),
                                      settings=EngineSettings.resolve(backend=backend))
            x = mx.random.normal((1, 1, 100, 256), key=mx.random.key(6)).astype(mx.float16)
            cache.update_and_fetch(x, x)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cache.update_and_fetch(x[..., :1, :], x[..., :1, :])
                mx.eval(cache.attend(mx.repeat(x[:, :, :1, :], 4, axis=1), 0.0625))
            paths[backend] = (cache.last_path, [str(w.message) for w in caught])
    finally:
        clear_kernel_caches()
    assert paths["cuda"] == ("mse_fused_step", [])
    assert paths["metal"][0] == "format_kernel_decode"
    assert any("35488 bytes of shared memory (> 32768 on metal)" in m for m in paths["metal"][1])
