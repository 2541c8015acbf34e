"""Each calibrated method (and the smooth_keys / outliers options) on this device's default attention
paths against the generic path: a random-weight llama with head dim 128 (8 query / 2 kv heads, 2 layers),
calibrated on the CPU on two random 256-token sequences, then a 300-token prompt and 8 decode steps. The
logits of all 9 steps are compared with the generic path on the same device and with the generic path
in float32 on the CPU stream, in float32 and in float16. On a GPU this checks the paths that the CPU
tests cover only through the CPU (compiled_decode, sdpa_decode, the formats' kernels).

    python benchmarks/calibrated_paths_check.py --out DIR [--specs "vq3:smooth_keys=0.5;rabitq:3"]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant_mlx import EngineSettings, KVCacheBuilder
from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.evaluation.specs import parse_method_spec
from veloxquant_mlx.methods import get_method

SPECS = ("vq3:smooth_keys=0.5", "turboquant_mse:3:smooth_keys=0.5", "turboquant_mse:3:outliers=8",
         "kivi:3:group=32,outliers=4", "ratequant:kbudget=2.5,vbudget=3.0", "rabitq:3", "vecinfer:2:vbits=3",
         "commvq:2:vbits=3,sinks=4,window=32", "spectralquant:3")
PROMPT, STEPS = 300, 8


def random_llama():
    args = llama.ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=2, intermediate_size=2048,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           rope_traditional=False)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def logits_of(model, tokens, config, settings, stream):
    """The last-position logits of the prompt and of each decode step, and the path of the last step."""
    with mx.stream(stream):
        caches = KVCacheBuilder(config).for_model(model).build(settings=settings)
        outs = [model(tokens[None, :PROMPT], cache=caches)[:, -1]]
        for i in range(PROMPT, PROMPT + STEPS):
            outs.append(model(tokens[None, i:i + 1], cache=caches)[:, -1])
        logits = mx.concatenate(outs).astype(mx.float32)
        mx.eval(logits)
    return logits, caches[1].last_path


def check(model, spec, sequences, tokens):
    config = parse_method_spec(spec).config
    record = {"spec": spec}
    with tempfile.TemporaryDirectory() as directory:
        if get_method(config.method).calibrated or config.options.get("outliers") or config.options.get("smooth_keys"):
            start = time.perf_counter()
            with mx.stream(mx.cpu):  # what is checked is attention; on a GPU this skips compiling calibration's ops
                calibrate(model, config, sequences, directory, progress=False)
            config = config.replace(artifact_dir=directory)
            record["calibration_s"] = round(time.perf_counter() - start, 1)
        weights = tree_flatten(model.parameters())
        for dtype in (mx.float32, mx.float16):
            model.set_dtype(dtype)
            tag = "fp32" if dtype == mx.float32 else "fp16"
            fast, path = logits_of(model, tokens, config, EngineSettings.resolve(), mx.default_device())
            generic, _ = logits_of(model, tokens, config, EngineSettings.resolve(kernels=False), mx.default_device())
            cpu, _ = logits_of(model, tokens, config, EngineSettings.resolve(backend="portable", kernels=False), mx.cpu)
            record[tag] = {"path": path, "logit_scale": round(float(mx.max(mx.abs(cpu))), 3),
                           "fast_vs_generic": float(mx.max(mx.abs(fast - generic))),
                           "generic_vs_cpu": float(mx.max(mx.abs(generic - cpu))),
                           "same_top1_as_cpu": f"{int(mx.sum(mx.argmax(fast, -1) == mx.argmax(cpu, -1)))}/{STEPS + 1}"}
        model.load_weights(weights)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--specs", default=";".join(SPECS), help="method specs, separated by ';'")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = random_llama()
    sequences = [mx.random.randint(0, 512, (256,), key=mx.random.key(s)) for s in range(2)]
    tokens = mx.random.randint(0, 512, (PROMPT + STEPS,), key=mx.random.key(9))
    records = []
    rows = ["| spec | device | path (fp32 / fp16) | max abs logit diff, fast vs generic (fp32 / fp16) | generic vs CPU fp32 (fp32 / fp16) | same top-1 as CPU | calibration s |",
            "|---|---|---|---|---|---|---|"]
    device = str(mx.default_device())
    for spec in args.specs.split(";"):
        record = check(model, spec, sequences, tokens)
        records.append(record)
        a, b = record["fp32"], record["fp16"]
        rows.append(f"| `{spec}` | {device} | {a['path']} / {b['path']} | {a['fast_vs_generic']:.2g} / {b['fast_vs_generic']:.2g} | "
                    f"{a['generic_vs_cpu']:.2g} / {b['generic_vs_cpu']:.2g} | {a['same_top1_as_cpu']} / {b['same_top1_as_cpu']} | "
                    f"{record.get('calibration_s', '—')} |")
        print(rows[-1], flush=True)
        (out / "results.json").write_text(json.dumps({"device": device, "records": records}, indent=1))
        (out / "results.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
