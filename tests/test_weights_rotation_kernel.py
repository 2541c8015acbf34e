"""The fused input-rotation kernel (`weights/rotation_kernel.py`), run through the C++ emulator:
it equals `StructuredRotation.apply` and the shared norm's ops, the layers' GPU routes take it,
the model's logits are unchanged, and a failed first-use check warns."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import (assert_close_relative, compile_cuda_without_spills, emulate_gpu_kernels, llama_of_8b_form,
                      random_rows)

from veloxquant_mlx.kernels import emulator
from veloxquant_mlx.weights import QuantizedLinear, StructuredRotation, quantize_model, rotation_kernel
from veloxquant_mlx.weights.shared import RotatingRMSNorm, rotating_norms

needs_cxx = pytest.mark.skipif(emulator.compiler() is None, reason="no C++20 compiler for the kernel emulator")



def _scales(dim, seed=1):
    return mx.array(np.random.default_rng(seed).uniform(0.3, 3.0, dim).astype(np.float16))



def test_supported_dimensions_and_plans_of_thellama_of_8b_form():
    assert rotation_kernel.supports(4096) and rotation_kernel.supports(14336)
    assert not rotation_kernel.supports(576)  # not a Hadamard size: the structured rotation's ops
    assert not rotation_kernel.supports(8192)  # 2^k beyond the shared buffer
    assert not rotation_kernel.supports(28 * 1024)  # m > 1 takes one column per thread, at most 512 threads
    hidden = dict(rotation_kernel.plan(1, 4096, "float16", False).template)
    assert (hidden["MB"], hidden["NT"], hidden["CPT"], hidden["G"]) == (1, 1024, 4, 1)
    mlp = rotation_kernel.plan(8, 14336, "float16", True)
    template = dict(mlp.template)
    assert (template["MB"], template["P"], template["NT"], template["CPT"], template["G"]) == (28, 512, 512, 1, 7)
    assert mlp.grid == (512, 8, 1) and mlp.threadgroup == (512, 1, 1) and template["NORM"]
    with pytest.raises(ValueError, match="does not take dim 576"):
        rotation_kernel.plan(1, 576, "float32", False)


@needs_cxx
@pytest.mark.parametrize("dim,threads,buffer", [
    (64, 1024, 4096),  # m = 1, one pass
    (64, 16, 64),  # m = 1, 4 columns per thread (as 4096 with 1024 threads)
    (28 * 8, 1024, 4096),  # m = 28, the base mix
    (28 * 16, 16, 64),  # m = 28, 4 shared-memory passes of 4 rows (as 14336 = 28 * 512, 7 rows a pass)
    (12 * 16, 1024, 4096),
    (20 * 4, 1024, 4096),
])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_equals_structured_rotation_apply(dim, threads, buffer, scaled):
    rotation = StructuredRotation.seeded(dim, seed=dim)
    assert rotation._one_transform
    scale = _scales(dim) if scaled else None
    x = random_rows(3, dim, seed=dim)
    signs = rotation._signs(0, x.dtype, scale)
    got = rotation_kernel.rotate(x, signs, "emulator", threads=threads, buffer=buffer)
    assert_close_relative(got, rotation.apply(x, scale), 1e-5)
    # float16 inputs: the product rounded as the ops round it, the transform in float32
    half = x.astype(mx.float16)
    got = rotation_kernel.rotate(half, rotation._signs(0, mx.float16, scale), "emulator", threads=threads,
                                 buffer=buffer)
    assert got.dtype == mx.float16
    assert_close_relative(got, rotation.apply(half, scale), 4e-3)


@needs_cxx
@pytest.mark.parametrize("dim,threads,buffer", [(64, 16, 64), (28 * 16, 16, 64), (12 * 16, 1024, 4096)])
def test_kernel_with_the_norm_equals_the_rotating_norm(dim, threads, buffer):
    """T(rms_norm(x, folded)) = R (c * rms_norm(x, g)): the shared input of q/k/v or gate/up."""
    rotation = StructuredRotation.seeded(dim, seed=5)
    weight = mx.array(np.random.default_rng(2).uniform(0.5, 1.5, dim).astype(np.float32))
    norm = RotatingRMSNorm(weight, 1e-5, rotation, _scales(dim))
    x = random_rows(2, dim, seed=3) * 7.0
    got = rotation_kernel.rotate(x, norm.folded_weight, "emulator", eps=norm.eps, threads=threads, buffer=buffer)
    assert_close_relative(got, rotation.apply(mx.fast.rms_norm(x, weight, 1e-5), norm.column_scales), 1e-5)
    assert_close_relative(got, norm(x), 1e-5)


@pytest.fixture
def emulated_gpu(monkeypatch):
    """The GPU routes with mx.fast.cuda_kernel replaced by the C++ emulation of the same kernel
    text; yields the names of the kernels launched."""
    launched = []
    emulate_gpu_kernels(monkeypatch, launched)
    monkeypatch.setattr(rotation_kernel, "_VERDICTS", {})
    monkeypatch.setattr(rotation_kernel, "FUSED_ROTATION", True)  # opt-in
    yield launched


def test_layer_route_takes_one_rotation_launch(emulated_gpu, monkeypatch):
    layer = QuantizedLinear.from_weight(random_rows(40, 28 * 8, seed=4), 4, column_alpha=0.5)
    x = random_rows(3, 28 * 8, seed=6)[None]
    expected = layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales))
    assert_close_relative(layer(x), expected, 1e-5)
    emulated_gpu.clear()
    assert_close_relative(layer(x), expected, 1e-5)  # the kept route: one rotation, one matmul
    assert emulated_gpu == ["rotate_input", "lut_matmul"]
    monkeypatch.setattr(rotation_kernel, "FUSED_ROTATION", False)
    ops = QuantizedLinear.from_weight(random_rows(40, 28 * 8, seed=4), 4, column_alpha=0.5)
    emulated_gpu.clear()
    assert_close_relative(ops(x), expected, 1e-5)
    assert emulated_gpu == ["lut_matmul"]  # the multiply and mx.hadamard_transform as MLX ops


def test_non_hadamard_dimensions_keep_the_ops(emulated_gpu):
    layer = QuantizedLinear.from_weight(random_rows(24, 176, seed=4), 3)
    x = random_rows(2, 176, seed=6)
    assert_close_relative(layer(x), layer.tiled_matmul(layer.rotation.apply(x)), 1e-5)
    assert "rotate_input" not in emulated_gpu




@pytest.mark.parametrize("share", [False, True])
def test_model_logits_are_unchanged_through_the_fused_route(emulated_gpu, monkeypatch, share):
    tokens = mx.array([[3, 14, 15, 9]])  # 4 rows: a decode-sized route
    model = quantize_model(llama_of_8b_form(), 4, seed=0, share_rotations=share, progress=False)
    assert len(rotating_norms(model)) == (4 if share else 0)
    fused = model(tokens)
    checks = len(rotation_kernel.CHECK_CASES) + (3 if share else 2)  # and each (dim, norm, dtype) a route keeps
    assert emulated_gpu.count("rotate_input") == (2 * (2 + 2) if share else 2 * 7) + checks
    emulated_gpu.clear()
    assert_close_relative(model(tokens), fused, 0.0)
    # the kept routes: every layer with its own rotation and every rotating norm, one launch each
    assert emulated_gpu.count("rotate_input") == (2 * (2 + 2) if share else 2 * 7)
    monkeypatch.setattr(rotation_kernel, "FUSED_ROTATION", False)
    ops = quantize_model(llama_of_8b_form(), 4, seed=0, share_rotations=share, progress=False)
    emulated_gpu.clear()
    reference = ops(tokens)
    assert "rotate_input" not in emulated_gpu
    assert_close_relative(fused, reference, 1e-4)
    monkeypatch.undo()  # the CPU's own path (C++ LUT matmul and MLX ops)
    cpu = quantize_model(llama_of_8b_form(), 4, seed=0, share_rotations=share, progress=False)
    assert_close_relative(fused, cpu(tokens), 1e-4)


def test_a_failed_first_use_check_warns_and_keeps_the_ops(emulated_gpu, monkeypatch):
    broken = dict(rotation_kernel.templates.KERNELS[rotation_kernel.KERNEL_NAME])
    broken["body"] = broken["body"].replace("v[a][j] * scale", "v[a][j] * scale * 2.0f")
    monkeypatch.setitem(rotation_kernel.templates.KERNELS, rotation_kernel.KERNEL_NAME, broken)
    layer = QuantizedLinear.from_weight(random_rows(16, 64, seed=4), 4)
    x = random_rows(2, 64, seed=6)  # two rows: one row would take the rotating matmul (test_weights_rotating_matmul.py)
    with pytest.warns(RuntimeWarning, match="cuda kernel rotate_input .* failed its first-use check"):
        got = layer(x)
    assert_close_relative(got, layer.tiled_matmul(layer.rotation.apply(x)), 1e-5)
    emulated_gpu.clear()
    layer(x)
    assert emulated_gpu == ["lut_matmul"]


@needs_cxx
def test_weights_selftest_runs_the_rotation_cases_in_the_emulator(capsys):
    from veloxquant_mlx.weights import selftest

    assert selftest.main(["--backend", "emulator", "--cases", ",".join(selftest.EMULATOR_ROTATION_CASES)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in selftest.EMULATOR_ROTATION_CASES)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dim, norm, dtype", [pytest.param(4096, False, "float16", marks=pytest.mark.slow),
                                              (14336, True, "bfloat16")], ids=["4096-fp16", "14336-norm-bf16"])
def test_cuda_source_compiles_with_nvcc_without_spills(dim, norm, dtype, tmp_path):
    """The translation units MLX would build for the 8B shape's plans compile for sm_90, no spills (each
    nvcc run costs seconds: `make test` compiles the normed bfloat16 one, `make test-all` both)."""
    from veloxquant_mlx.kernels import templates

    plan = rotation_kernel.plan(8, dim, dtype, norm)
    ins = {"x": dtype, "w": dtype, "base": "float32", "params": "float32"}
    src = tmp_path / "rotate.cu"
    src.write_text(templates.render_cuda(rotation_kernel.KERNEL_NAME, plan.template, ins, {"out": dtype},
                                         mlx_header=False))
    compile_cuda_without_spills(src, tmp_path / "rotate.o")
