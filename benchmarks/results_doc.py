"""Write docs/results.md: the full tables of every results folder that the README and docs/ cite.

    PYTHONPATH=. python benchmarks/results_doc.py [--out docs/results.md]

Folders written by `veloxquant eval` / `veloxquant benchmark` are rendered by `veloxquant report`'s renderer;
folders written by a script of this directory are included as that script wrote them (its results.md, or the
Markdown files it left). Nothing is typed by hand: change SECTIONS below and run it again.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = "benchmarks/results"

# (heading, introduction, folders or Markdown files under benchmarks/results)
SECTIONS = [
    ("Quality: presets against mlx-lm's and llama.cpp's caches (SmolLM2-135M)",
     "Made by `benchmarks/quality_table.py` from the folders below it.",
     ["quality-table-summary", "quality-table-ppl", "quality-table-llama-cpp", "quality-table-needle-fp16",
      "quality-table-needle-vq3", "quality-table-needle-vq2", "needle-4k-8k-smollm2-vq3",
      "needle-4k-8k-smollm2-vq2"]),
    ("Quality: presets against mlx-lm's caches and KIVI (Gemma 3 270M)",
     "Made by `benchmarks/quality_table.py` from the folder below it.",
     ["quality-table-gemma3", "quality-table-ppl-gemma3", "needle-8k-gemma3"]),
    ("Presets over three and six windows", "",
     ["presets-ppl-3-windows", "unbiased-values-ppl"]),
    ("Every method at 2, 3 and 4 bits, and the protections", "",
     ["ppl-all-methods-smollm2-cpu", "ppl-smollm2-cpu", "rabitq-ppl-smollm2"]),
    ("How the presets were tuned", "WikiText-2 test from token 200000 on, which the reported windows never read.",
     ["presets-sweep/b4a", "presets-sweep/t1", "presets-sweep/t2"]),
    ("The rate-distortion floor", "Made by `benchmarks/rate_distortion_floor.py`.",
     ["rate-distortion-floor"]),
    ("keep_attended", "",
     ["keep-attended-ppl-3-windows", "keep-attended-ppl-windows-4-6", "keep-attended-ppl-6-windows-3bit-w20",
      "keep-attended-speed-cpu", "gpu/thirtyfourth-keep-kernels"]),
    ("Calibrated methods", "",
     ["calib-summary", "vecinfer-summary", "kv-quality-test", "calibrated-first-use-ppl"]),
    ("Gemma 3 270M", "",
     ["gemma3-ppl-cpu", "quality-table-ppl-gemma3-unbiased", "gemma3-kv-sweep/smooth-first-use", "gemma3-llama-cpp"]),
    ("Memory", "Made by `benchmarks/presets_bits.py`, `benchmarks/prompt_cache_size.py`.",
     ["presets-bits", "prompt-cache-smollm2-cpu"]),
    ("Speed on the CPU (SmolLM2-135M)", "",
     ["keep-attended-speed-cpu", "benchmark-calibrated-smollm2-cpu",
      "cpu/native8k/cpu_decode_float32.md"]),
    ("Speed on the GPU (H200, random-weight Llama-3.1-8B shape)", "",
     ["gpu/run49-slide-v2/e2e-presets", "gpu/twentyninth-selftest-and-tables/e2e-issue10",
      "gpu/twentyninth-selftest-and-tables/e2e-formats", "gpu/twentyninth-selftest-and-tables/e2e-calibrated",
      "gpu/run45-portable/e2e-4k-portable", "gpu/run51-prefill-sync/prefill-4k",
      "gpu/run51-prefill-sync/prefill-32k"]),
    ("Kernel self-test (H200)", "`python -m veloxquant_mlx.kernels.selftest --backend cuda`: every case against the "
     "portable path, the generic path and float64 attention.",
     ["gpu/thirtyfirst-selftest/selftest.txt"]),
    ("Serving", "Made by `benchmarks/serve_throughput.py`, `benchmarks/batch_decode_step.py` and "
     "`veloxquant benchmark serve`.",
     ["serve-throughput-smollm2-cpu", "batch-decode-step-smollm2-cpu", "batch-decode-step-smollm2-cpu/32-sequences",
      "benchmark-serve-smollm2-cpu-decode/8-clients-run1", "benchmark-serve-smollm2-cpu-decode/8-clients-run2",
      "benchmark-serve-smollm2-cpu-decode/mlxq4-8-clients",
      "benchmark-serve-smollm2-cpu-decode/budget-4-fp16-12-clients",
      "benchmark-serve-smollm2-cpu-decode/budget-4-fp16-12-clients-256-tokens/run1",
      "benchmark-serve-smollm2-cpu-decode/budget-4-fp16-12-clients-256-tokens/run2",
      "benchmark-serve-smollm2-cpu-decode/budget-4-fp16-12-clients-memory-trace/README.md",
      "benchmark-serve-llama8b-h100/one-call-band-4k-run1", "benchmark-serve-llama8b-h100/one-call-band-4k-run2",
      "benchmark-serve-llama8b-h100/batched-decode-32-clients-4k",
      "benchmark-serve-llama8b-h200/32-clients-4k-vq4", "benchmark-serve-llama8b-h200/32-clients-4k-vq3",
      "benchmark-serve-llama8b-h100/one-call-band-4k-vq3", "benchmark-serve-llama8b-h100/one-call-band-32k-vq4",
      "benchmark-serve-llama8b-h100/one-call-band-budget-8k",
      "benchmark-serve-llama8b-h100/budget-8k-memory-trace/README.md",
      "benchmark-serve-llama8b-h100/additive-band-4k", "benchmark-serve-llama8b-h100/prompts-32k-8-clients",
      "benchmark-serve-llama8b-h100/decode-throughput-4k-run1", "benchmark-serve-llama8b-h100/decode-throughput-4k-run2",
      "benchmark-serve-llama8b-h100/sequential-32-clients-4k", "benchmark-serve-llama8b-h100/budget-8k-32-clients",
      "benchmark-serve-llama8b-h100/prefill-rules-4k/decode-rule", "benchmark-serve-llama8b-h100/prefill-rules-4k/chunk-rule"]),
    ("Prefill under the chunk-invariant rule (H100)", "Made by `benchmarks/batch_prefill_layer.py` and "
     "`benchmarks/band_mask_attention.py`, `benchmarks/prefill_query_groups.py`.",
     ["prefill-query-groups-h100", "batch-prefill-layer-h100", "batch-prefill-layer-h100/additive-band-mask", "band-mask-attention-h100/band-4k",
      "band-mask-attention-h100/band-32k"]),
    ("MLX's own quantized formats", "Made by `veloxquant eval ppl`, `benchmarks/cpu_decode.py` and "
     "`benchmarks/mlx_native_decode.py`.",
     ["mlxq-kl-smollm2-cpu", "mlxq-decode-smollm2-cpu/run1/cpu_decode_float32.md",
      "mlxq-decode-smollm2-cpu/run2/cpu_decode_float32.md",
      "mlxq-decode-llama8b-h100/mlx-native-run1", "mlxq-decode-llama8b-h100/mlx-native-run2"]),
    ("Weights", "Made by `benchmarks/weights_quality.py` and `benchmarks/weights_gpu_model_decode.py`.",
     ["weights-quality-smollm2", "weights-quality-gaffine-smollm2", "gpu/weights-model-decode-blocks-third"]),
]

IMAGE = re.compile(r"^!\[[^\]]*\]\([^)]*\)\s*$", re.M)


def markdown_of(path: Path, link_dir: Path) -> str:
    from veloxquant_mlx.evaluation.report import RENDERERS, render_markdown

    if path.is_file():
        text = path.read_text(encoding="utf-8")
        return f"```\n{text.strip()}\n```" if path.suffix == ".txt" else text
    results_json = path / "results.json"
    if results_json.is_file():
        results = json.loads(results_json.read_text(encoding="utf-8"))
        if results.get("command") in RENDERERS:
            return render_markdown(results)
    if (path / "results.md").is_file():
        return (path / "results.md").read_text(encoding="utf-8")
    raise FileNotFoundError(f"{path}: no results.json that `veloxquant report` renders and no results.md")


def build(out: Path) -> str:
    link_dir = out.parent.resolve()
    lines = ["# Results", "",
             "Every table of the results folders that the README and docs/ cite, generated by "
             "`PYTHONPATH=. python benchmarks/results_doc.py` (tables of `veloxquant eval` / `benchmark` folders "
             "through `veloxquant report`'s renderer, script-made folders as their script wrote them). The commands "
             "that made each folder are in [benchmarks/README.md](../benchmarks/README.md) and its `results.json`.",
             ""]
    for heading, intro, folders in SECTIONS:
        lines += [f"## {heading}", ""]
        if intro:
            lines += [intro, ""]
        for folder in folders:
            path = ROOT / RESULTS / folder
            if not path.exists():
                raise FileNotFoundError(path)
            target = path if path.is_file() else (path / "results.md" if (path / "results.md").is_file() else path)
            link = Path(__import__("os").path.relpath(target, link_dir)).as_posix()
            body = IMAGE.sub("", markdown_of(path, link_dir)).strip()
            body = re.sub(r"^#+ ", "#### ", body, flags=re.M)
            lines += [f"### [`{folder}`]({link})", "", body, ""]
    return "\n".join(lines).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    args = parser.parse_args()
    out = Path(args.out)
    out.write_text(build(out), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
