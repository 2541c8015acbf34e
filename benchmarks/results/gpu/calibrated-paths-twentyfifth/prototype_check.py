"""Every calibrated method (and smooth_keys) on this device's default paths against the generic path
in float32 on the CPU stream: a random-weight llama with head dim 128 (8 query / 2 kv heads), calibrated
here, 300-token prompt then 8 decode steps; compares the logits of every step and records the paths."""
import json, sys, tempfile, time
import mlx.core as mx
from mlx_lm.models import llama
from veloxquant_mlx import EngineSettings, KVCacheBuilder
from veloxquant_mlx.calibration import calibrate
from veloxquant_mlx.evaluation.specs import parse_method_spec

SPECS = ["vq3:smooth_keys=0.5", "turboquant_mse:3:smooth_keys=0.5", "turboquant_mse:3:outliers=8",
         "kivi:3:group=32,outliers=4", "ratequant:kbudget=2.5,vbudget=3.0", "spectralquant:3",
         "vecinfer:2:vbits=3", "commvq:2:vbits=3,sinks=4,window=32", "rabitq:3"]
if len(sys.argv) > 1:
    SPECS = sys.argv[1].split(";")

args = llama.ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=2, intermediate_size=2048,
                       num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                       rope_traditional=False)
mx.random.seed(0)
model = llama.Model(args)
mx.eval(model.parameters())
from mlx.utils import tree_flatten
weights32 = tree_flatten(model.parameters())
sequences = [mx.random.randint(0, 512, (256,), key=mx.random.key(s)) for s in range(2)]
tokens = mx.random.randint(0, 512, (308,), key=mx.random.key(9))


def run(config, settings, stream):
    with mx.stream(stream):
        caches = KVCacheBuilder(config).for_model(model).build(settings=settings)
        outs = [model(tokens[None, :300], cache=caches)[:, -1]]
        for i in range(300, 308):
            outs.append(model(tokens[None, i:i + 1], cache=caches)[:, -1])
        logits = mx.concatenate(outs).astype(mx.float32)
        mx.eval(logits)
    return logits, caches[1].last_path


results = {}
for spec in SPECS:
    record = {}
    try:
        config = parse_method_spec(spec).config
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            try:
                calibrate(model, config, sequences, d, progress=False)
                config = config.replace(artifact_dir=d)
                record["calibration_s"] = round(time.perf_counter() - t, 1)
            except Exception as e:  # a method without calibration
                record["calibration"] = f"{type(e).__name__}: {e}"[:200]
            fast, path = run(config, EngineSettings.resolve(), mx.default_device())
            ref, ref_path = run(config, EngineSettings.resolve(backend="portable", kernels=False), mx.cpu)
            model.set_dtype(mx.float16)
            fast16, _ = run(config, EngineSettings.resolve(), mx.default_device())
            ref16, _ = run(config, EngineSettings.resolve(backend="portable", kernels=False), mx.cpu)
            model.load_weights(weights32)
            record.update(fp16_max_abs_logit_diff=float(mx.max(mx.abs(fast16 - ref16))),
                          fp16_same_argmax=int(mx.sum(mx.argmax(fast16, -1) == mx.argmax(ref16, -1))))
            same_device, _ = run(config, EngineSettings.resolve(kernels=False), mx.default_device())
            record.update(fast_vs_generic_same_device=float(mx.max(mx.abs(fast - same_device))),
                          generic_device_vs_cpu=float(mx.max(mx.abs(same_device - ref))))
            record.update(path=path, ref_path=ref_path,
                          max_abs_logit_diff=float(mx.max(mx.abs(fast - ref))),
                          logit_scale=float(mx.max(mx.abs(ref))),
                          same_argmax=int(mx.sum(mx.argmax(fast, -1) == mx.argmax(ref, -1))))
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"[:400]
    results[spec] = record
    print(spec, json.dumps(record), flush=True)
print(json.dumps(results, indent=1))
