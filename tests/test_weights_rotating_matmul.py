"""The LUT matmul with the input rotation in its prologue (`weights/rotating_matmul.py`), run
through the C++ emulator: it equals the two-launch forward, decode calls at batch 1 take it (one
launch per layer), other calls keep the two launches, and a failed first-use check warns."""

import mlx.core as mx
import pytest
from conftest import (assert_close_relative, compile_cuda_without_spills, emulate_gpu_kernels, llama_of_8b_form,
                      random_rows)

from veloxquant_mlx.kernels import emulator
from veloxquant_mlx.weights import QuantizedLinear, kernel, quantize_model, rotating_matmul, rotation_kernel

needs_cxx = pytest.mark.skipif(emulator.compiler() is None, reason="no C++20 compiler for the kernel emulator")




def test_plans_of_thellama_of_8b_form():
    """Llama-3.1-8B's 4096-wide inputs: 256 threads, 16 elements each in 3 passes; rows per warp
    chosen so that every layer keeps at least TARGET_BLOCKS blocks (more only where it has them)."""
    for out, rpw in ((4096, 1), (1024, 1), (14336, 4)):
        plan = rotating_matmul.plan(4096, out, 4, 1, "float16", "float16")
        t = dict(plan.template)
        assert (t["NT"], t["E"], t["LB"], t["PASSES"], t["RPW"]) == (256, 16, 4, 3, rpw)
        blocks = plan.grid[0] // plan.threadgroup[0]
        assert blocks * 8 * rpw >= out > (blocks - 1) * 8 * rpw
        assert blocks >= kernel.TARGET_BLOCKS or rpw == 1
    assert not rotating_matmul.supports(14336) and not rotating_matmul.supports(96)
    assert not rotating_matmul.supports(8192) and rotating_matmul.supports(64)
    with pytest.raises(ValueError, match="power-of-two"):
        rotating_matmul.plan(96, 8, 4, 1, "float32", "float32")


@needs_cxx
@pytest.mark.parametrize("case", rotating_matmul.CHECK_CASES + (
    (128, 72, 3, 32, "float16", 32, 4),   # groups, half precision, the overlapping last pass
    (512, 100, 4, None, "float32", 128, None),
    (256, 64, 2, 64, "float16", 64, 2)))
def test_kernel_equals_the_two_launch_forward(case):
    record = rotating_matmul.check_case("emulator", *case)
    assert record["ok"], record


@pytest.fixture
def emulated_gpu(monkeypatch):
    """The GPU routes with mx.fast.cuda_kernel replaced by the C++ emulation of the same kernel
    text (the first-use check on the small cases only); yields the names of the kernels launched."""
    launched = []
    emulate_gpu_kernels(monkeypatch, launched)
    monkeypatch.setattr(rotating_matmul, "_VERDICTS", {})
    monkeypatch.setattr(rotating_matmul, "GPU_CHECK_CASES", rotating_matmul.CHECK_CASES)
    monkeypatch.setattr(rotating_matmul, "GPU_GROUP_CHECK_CASES", rotating_matmul.GROUP_CHECK_CASES)
    monkeypatch.setattr(rotation_kernel, "_VERDICTS", {})
    yield launched


def test_one_row_takes_one_launch_and_more_rows_two(emulated_gpu, monkeypatch):
    layer = QuantizedLinear.from_weight(random_rows(40, 128, seed=4), 4, column_alpha=0.5)
    one, three = random_rows(1, 128, seed=6)[None], random_rows(3, 128, seed=6)[None]
    for x in (one, three):
        expected = layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales))
        assert_close_relative(layer(x), expected, 1e-5)
        emulated_gpu.clear()
        assert_close_relative(layer(x), expected, 1e-5)  # the kept route
        assert emulated_gpu == (["lut_matmul_rotating"] if x is one else ["lut_matmul"])
    monkeypatch.setattr(rotating_matmul, "ROTATING_MATMUL", False)
    off = QuantizedLinear.from_weight(random_rows(40, 128, seed=4), 4, column_alpha=0.5)
    emulated_gpu.clear()
    assert_close_relative(off(one), layer(one), 1e-5)
    assert emulated_gpu[0] == "lut_matmul"


def test_other_dimensions_and_rotated_inputs_keep_two_launches(emulated_gpu):
    hadamard_not_power_of_two = QuantizedLinear.from_weight(random_rows(24, 96, seed=4), 3)
    structured = QuantizedLinear.from_weight(random_rows(24, 176, seed=4), 3)
    for layer in (hadamard_not_power_of_two, structured):
        x = random_rows(1, layer.in_features, seed=6)
        assert_close_relative(layer(x), layer.tiled_matmul(layer.rotation.apply(x)), 1e-5)
    rotated = QuantizedLinear.from_weight(random_rows(24, 64, seed=4), 3).with_rotated_input()
    rotated(random_rows(1, 64, seed=6))
    assert "lut_matmul_rotating" not in emulated_gpu




def test_model_decode_logits_are_unchanged(emulated_gpu, monkeypatch):
    """A one-token step: q/k/v take one grouped launch, gate/up another, o_proj its own rotating
    launch and down_proj (28 * 8 wide) the rotation and the LUT matmul; the logits equal, bit for
    bit, one rotating launch per layer's, and the two-launch and CPU paths' within rounding."""
    token = mx.array([[14]])
    model = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    fused = model(token)
    emulated_gpu.clear()
    assert_close_relative(model(token), fused, 0.0)
    assert sorted(emulated_gpu) == sorted(2 * ["lut_matmul_rotating_3", "lut_matmul_rotating",
                                               "lut_matmul_rotating_2", "lut_matmul"])
    monkeypatch.setattr(rotating_matmul, "SIBLING_LAUNCH", False)
    single = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    emulated_gpu.clear()
    assert_close_relative(fused, single(token), 0.0)
    assert emulated_gpu.count("lut_matmul_rotating") == 2 * 6 and len(emulated_gpu) == 2 * 7
    monkeypatch.setattr(rotating_matmul, "ROTATING_MATMUL", False)
    two = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    emulated_gpu.clear()
    assert_close_relative(fused, two(token), 1e-4)
    assert not any(name.startswith("lut_matmul_rotating") for name in emulated_gpu)
    monkeypatch.undo()  # the CPU's own path (C++ LUT matmul and MLX ops)
    cpu = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    assert_close_relative(fused, cpu(token), 1e-4)


@needs_cxx
@pytest.mark.parametrize("case", rotating_matmul.GROUP_CHECK_CASES + (
    (128, (40, 8, 8), 4, None, "float16", 32, 2),
    (256, (64, 100), 2, 64, "float16", 64, 4)))
def test_sibling_launch_equals_each_layers_two_launch_forward(case):
    record = rotating_matmul.check_group_case("emulator", *case)
    assert record["ok"], record


def test_sibling_plan_gives_each_layer_whole_blocks():
    """The 8B shape's q/k/v and gate/up: each layer's blocks start after the one before's, and
    cover its rows."""
    for outs in ((4096, 1024, 1024), (14336, 14336)):
        plan = rotating_matmul.group_plan(4096, outs, 4, 1, "float16", "float16")
        t = dict(plan.template)
        per_block = t["NT"] // 32 * t["RPW"]
        starts = [t[f"B{i}"] for i in range(len(outs))] + [plan.grid[0] // plan.threadgroup[0]]
        assert starts[0] == 0 and "N" not in t
        for i, n in enumerate(outs):
            assert t[f"N{i}"] == n and (starts[i + 1] - starts[i] - 1) * per_block < n <= (starts[i + 1] - starts[i]) * per_block
    with pytest.raises(ValueError, match="sibling launch takes"):
        rotating_matmul.group_plan(64, (8, 8, 8, 8), 4, 1, "float32", "float32")


def test_siblings_take_their_outputs_only_for_the_same_input(emulated_gpu):
    """The first sibling called launches for all; a sibling called on the same array takes its
    own output; another input, or a layer called twice, launches again. Every output equals the
    layer's own forward."""
    from veloxquant_mlx.weights.siblings import SiblingLaunch

    layers = [QuantizedLinear.from_weight(random_rows(n, 64, seed=n), 4, seed=n, column_alpha=0.5) for n in (24, 8, 8)]
    group = SiblingLaunch(layers)
    for index, layer in enumerate(layers):
        layer.__dict__["_siblings"] = (group, index)
    x, y = random_rows(1, 64, seed=6), random_rows(1, 64, seed=7)

    def expected(layer, x):
        return layer.tiled_matmul(layer.rotation.apply(x, layer.input_scales))
    assert rotating_matmul.group_usable("cuda", "float32") and rotating_matmul.usable("cuda", "float32")
    emulated_gpu.clear()  # the first-use checks' launches
    for layer in layers:
        assert_close_relative(layer(x), expected(layer, x), 1e-5)
    assert emulated_gpu == ["lut_matmul_rotating_3"]
    assert_close_relative(layers[0](x), expected(layers[0], x), 1e-5)  # called twice: launches again
    assert_close_relative(layers[1](y), expected(layers[1], y), 1e-5)  # another input: launches again
    assert_close_relative(layers[2](y), expected(layers[2], y), 1e-5)  # a sibling of that launch: none
    assert emulated_gpu == ["lut_matmul_rotating_3"] * 3
    three = random_rows(3, 64, seed=8)  # more rows: each layer's own route
    emulated_gpu.clear()
    assert_close_relative(layers[1](three), expected(layers[1], three), 1e-5)
    assert emulated_gpu == ["lut_matmul"]


def test_a_failed_sibling_check_warns_and_keeps_one_launch_per_layer(emulated_gpu, monkeypatch):
    name = rotating_matmul.group_kernel_name(3)
    broken = dict(rotating_matmul.templates.KERNELS[name])
    broken["body"] = broken["body"].replace("v[r] * scale", "v[r] * scale * 2.0f")
    monkeypatch.setitem(rotating_matmul.templates.KERNELS, name, broken)
    model = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    token = mx.array([[14]])
    with pytest.warns(RuntimeWarning, match="lut_matmul_rotating_2 and lut_matmul_rotating_3 .* failed its first-use"):
        got = model(token)
    assert rotating_matmul.checked("cuda") is False
    emulated_gpu.clear()
    assert_close_relative(model(token), got, 0.0)
    assert emulated_gpu.count("lut_matmul_rotating") == 2 * 6 and name not in emulated_gpu


def test_a_failed_first_use_check_warns_and_keeps_two_launches(emulated_gpu, monkeypatch):
    broken = dict(rotating_matmul.templates.KERNELS[rotating_matmul.KERNEL_NAME])
    broken["body"] = broken["body"].replace("v[r] * scale", "v[r] * scale * 2.0f")
    monkeypatch.setitem(rotating_matmul.templates.KERNELS, rotating_matmul.KERNEL_NAME, broken)
    layer = QuantizedLinear.from_weight(random_rows(16, 64, seed=4), 4)
    x = random_rows(1, 64, seed=6)
    with pytest.warns(RuntimeWarning, match="cuda kernel lut_matmul_rotating .* failed its first-use check"):
        got = layer(x)
    assert_close_relative(got, layer.tiled_matmul(layer.rotation.apply(x)), 1e-5)
    assert rotating_matmul.checked("cuda") is False
    emulated_gpu.clear()
    layer(x)
    assert emulated_gpu == ["lut_matmul"]


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("outs, bits", [
    pytest.param((4096,), 4, marks=pytest.mark.slow), ((14336,), 3),
    # the sibling launches of q/k/v and gate/up
    ((4096, 1024, 1024), 4), pytest.param((14336, 14336), 4, marks=pytest.mark.slow),
], ids=["rotating4096", "rotating14336", "siblings-qkv", "siblings-gate-up"])
def test_cuda_source_compiles_with_nvcc_without_spills(outs, bits, tmp_path):
    """The translation units MLX would build for the 8B shape's 4096-wide layers compile for sm_90, no spills
    (each nvcc run costs seconds: `make test` compiles one single and one sibling launch, `make test-all` all)."""
    from veloxquant_mlx.kernels import templates

    if len(outs) == 1:
        plan = rotating_matmul.plan(4096, outs[0], bits, 1, "float16", "float16")
        kernel_name = rotating_matmul.KERNEL_NAME
        ins = {"x": "float16", "w": "float16", "codes": "uint32", "scales": "float16", "lut": "float32"}
        out_dtypes = {"out": "float16"}
    else:
        plan = rotating_matmul.group_plan(4096, outs, bits, 1, "float16", "float16")
        kernel_name, n = plan.kernel, len(outs)
        ins = {"x": "float16", **{f"w{i}": "float16" for i in range(n)}, **{f"codes{i}": "uint32" for i in range(n)},
               **{f"scales{i}": "float16" for i in range(n)}, "lut": "float32"}
        out_dtypes = {f"out{i}": "float16" for i in range(n)}
    src = tmp_path / "rotating.cu"
    src.write_text(templates.render_cuda(kernel_name, plan.template, ins, out_dtypes, mlx_header=False))
    compile_cuda_without_spills(src, tmp_path / "rotating.o")


@needs_cxx
def test_weights_selftest_runs_the_sibling_cases_in_the_emulator(capsys):
    from veloxquant_mlx.weights import selftest

    assert selftest.main(["--backend", "emulator", "--cases", ",".join(selftest.EMULATOR_SIBLING_CASES)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in selftest.EMULATOR_SIBLING_CASES) and "2/2 cases passed" in out


def test_siblings_are_linked_by_quantize_model_and_graft_reservoir_only_where_they_can_share(tmp_path):
    """q/k/v and gate/up of each recognised block get one SiblingLaunch, o_proj and down_proj none;
    a grafted reservoir is linked the same way; layers whose input the norm rotates
    (share_rotations) are not linked."""
    from veloxquant_mlx.weights import graft_reservoir, save_reservoir
    from veloxquant_mlx.weights.siblings import link_siblings

    def groups(model):
        found = {}
        for path, module in model.named_modules():
            linked = module.__dict__.get("_siblings") if isinstance(module, QuantizedLinear) else None
            if linked is not None:
                found.setdefault(id(linked[0]), []).append((linked[1], path.rsplit(".", 1)[-1]))
        return sorted(tuple(name for _, name in sorted(members)) for members in found.values())

    model = quantize_model(llama_of_8b_form(), 4, seed=0, progress=False)
    expected = 2 * [("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj")]
    assert groups(model) == sorted(expected)
    path = save_reservoir(model, tmp_path / "model.vqw")
    assert groups(graft_reservoir(llama_of_8b_form(), path)) == sorted(expected)
    shared = quantize_model(llama_of_8b_form(), 4, seed=0, share_rotations=True, progress=False)
    assert groups(shared) == [] and link_siblings(shared) == 0
