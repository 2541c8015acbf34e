"""Integrity of saved caches and artifact dirs: fuzzing (flip, truncate, swap, edit) must end in a
clear error or in outputs bit-identical to the original's, for every method's format."""

import json
import random

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
import pytest
from conftest import ALL_METHODS, config_for, tiny_llama

from veloxquant_mlx import CompressedKVCache, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.artifacts import (ArtifactError, CodecSet, load_artifacts, metadata_digest, precompute,
                                      save_artifact_dir)
from veloxquant_mlx.cache import CacheFormatError

CASES = 200  # per format, in CI
DIM, TOKENS = 32, 48


def _filled_caches(config, layers=2, seed=0):
    caches = []
    mx.random.seed(seed)
    for i in range(layers):
        cache = CompressedKVCache(config)
        cache.layer, cache.model_identity = i, {"model_type": "test", "num_layers": layers, "args_sha256": "0"}
        keys = mx.random.normal((1, 2, TOKENS, DIM)).astype(mx.float16)
        values = mx.random.normal((1, 2, TOKENS, DIM)).astype(mx.float16)
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    return caches


def _outputs(caches):
    mx.random.seed(123)
    queries = mx.random.normal((1, 4, 1, DIM))
    outs = [c.attend(queries, scale=DIM**-0.5) for c in caches]
    mx.eval(outs)
    return [np.array(o) for o in outs]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _mutate_file(rng, data: bytes, path, tmp_path, config):
    """One random corruption of a saved cache; returns (kind, config to load with or None)."""
    kind = rng.choice(["flip", "flip", "truncate", "swap", "edit"])
    if kind == "flip":
        pos = rng.randrange(len(data))
        corrupted = bytearray(data)
        corrupted[pos] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(corrupted))
        return f"flip@{pos}", rng.choice([None, config])
    if kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
        return "truncate", None
    source = tmp_path / "source.safetensors"
    source.write_bytes(data)
    arrays, metadata = mx.load(str(source), return_metadata=True)
    if kind == "swap":
        names = sorted({k[2:] for k in arrays if k.startswith("0.")} & {k[2:] for k in arrays if k.startswith("1.")})
        if rng.random() < 0.3:
            moved = {(("1" if k[0] == "0" else "0") + k[1:] if k[0] in "01" else k): v for k, v in arrays.items()}
            arrays, label = moved, "swap layers"
        else:
            name = rng.choice([n for n in names if arrays["0." + n].shape == arrays["1." + n].shape])
            arrays["0." + name], arrays["1." + name] = arrays["1." + name], arrays["0." + name]
            label = f"swap {name}"
        mx.save_safetensors(str(path), arrays, metadata)
        return label, rng.choice([None, config])
    # edit a layer header's field, with or without a recomputed digest
    layer = rng.choice(["0", "1"])
    key = _entry(arrays, layer)
    header = json.loads("".join(chr(c) for c in arrays[key].tolist()))
    field = rng.choice(["bits", "value_bits", "seed", "group_size", "center", "sink_tokens", "residual_length",
                        "offset", "encoded", "layer", "artifact"])
    if field in header["config"]:
        value = header["config"][field]
        header["config"][field] = (not value) if isinstance(value, bool) else (value or 0) + rng.choice([1, 2, -1])
    elif field == "artifact":
        header[field] = "/nonexistent"
    else:
        header[field] = (header[field] or 0) + rng.choice([1, -1, 7])
    redigest = rng.random() < 0.5
    if redigest:  # a deliberate edit: only the caller's config can refuse it
        header["digest"] = metadata_digest(header)
    arrays[key] = mx.array([ord(c) for c in json.dumps(header)])
    mx.save_safetensors(str(path), arrays, metadata)
    return f"edit {field}{' redigested' if redigest else ''}", config if redigest else rng.choice([None, config])


def _entry(arrays, layer, pick=None) -> str:
    """The file key of layer `layer`'s header (its state's last entry), or with `pick` (names -> name) of the
    tensor `pick` chooses from the names the header lists in order."""
    last = f"{layer}.{max(int(k.split('.')[1]) for k in arrays if k.split('.')[0] == str(layer))}"
    if pick is None:
        return last
    names = json.loads("".join(chr(c) for c in arrays[last].tolist()))["arrays"]
    return f"{layer}.{names.index(pick(names))}"


@pytest.mark.parametrize("method", ALL_METHODS)
def test_fuzzed_cache_files_are_refused_or_identical(method, tmp_path):
    config = config_for(method, 3, sink_tokens=2, residual_length=8, center=method != "fp16")
    caches = _filled_caches(config)
    reference = _outputs(caches)
    original = tmp_path / "cache.safetensors"
    save_prompt_cache(original, caches)
    assert _same(_outputs(load_prompt_cache(original, config=config)), reference)
    data = original.read_bytes()
    rng = random.Random(f"fuzz-{method}")
    detected = identical = 0
    for case in range(CASES):
        path = tmp_path / f"fuzz{case % 4}.safetensors"
        kind, load_config = _mutate_file(rng, data, path, tmp_path, config)
        try:
            loaded = load_prompt_cache(path, config=load_config)
        except CacheFormatError as error:
            assert str(error), kind
            detected += 1
            continue
        outputs = _outputs(loaded)
        assert _same(outputs, reference), f"case {case} ({kind}) loaded silently with other outputs"
        identical += 1
    print(f"{method}: {CASES} corrupted files, {detected} refused, {identical} bit-identical")
    assert detected + identical == CASES and detected > CASES // 2


def test_mismatch_names_layer_and_tensor(tmp_path):
    config = config_for("turboquant_mse", 4)
    caches = _filled_caches(config)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    name = _entry(arrays, 1, lambda names: next(n for n in names if n.startswith("keys.")))
    data = np.array(arrays[name])
    flipped = data.reshape(-1).view(np.uint8).copy()
    flipped[0] ^= 1  # one bit
    arrays[name] = mx.array(flipped.view(data.dtype).reshape(data.shape))
    mx.save_safetensors(str(path), arrays, metadata)
    with pytest.raises(CacheFormatError, match=r"cache layer 1: tensor 'keys\.\w+' fails its checksum"):
        load_prompt_cache(path)


def test_swapped_layers_are_refused(tmp_path):
    """Regression: swapping two layers of a file loaded silently (logits changed by 0.83)."""
    config = config_for("kivi", 2)
    caches = _filled_caches(config)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, [caches[1], caches[0]])
    with pytest.raises(CacheFormatError, match="layer 0 holds the cache of layer 1"):
        load_prompt_cache(path)
    for cache in caches:  # caches made by hand have no layer index: the file's index still holds
        cache.layer = None
    save_prompt_cache(path, caches)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    swapped = {(("1" if k[0] == "0" else "0") + k[1:]): v for k, v in arrays.items() if k[0] in "01"}
    swapped.update({k: v for k, v in arrays.items() if k[0] not in "01"})
    mx.save_safetensors(str(path), swapped, metadata)
    with pytest.raises(CacheFormatError, match="not the layer saved in that position"):
        load_prompt_cache(path)


@pytest.mark.parametrize("field,value", [("bits", 3), ("seed", 1), ("group_size", 16)])
def test_edited_header_is_refused_with_and_without_config(tmp_path, field, value):
    """Regression: a header whose bits or seed were edited crashed deep inside (broadcast_shapes)
    or ran silently wrong (seed: logit change 5.63) when loaded without config=."""
    config = config_for("turboquant_mse", 4)
    caches = _filled_caches(config)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    key = _entry(arrays, 0)
    header = json.loads("".join(chr(c) for c in arrays[key].tolist()))
    header["config"][field] = value
    arrays[key] = mx.array([ord(c) for c in json.dumps(header)])
    mx.save_safetensors(str(path), arrays, metadata)
    with pytest.raises(CacheFormatError, match="fails its digest"):
        load_prompt_cache(path)
    header["digest"] = metadata_digest(header)  # a deliberate, self-consistent edit
    arrays[key] = mx.array([ord(c) for c in json.dumps(header)])
    mx.save_safetensors(str(path), arrays, metadata)
    with pytest.raises(CacheFormatError, match="written with .* not turboquant_mse K4/V4"):
        load_prompt_cache(path, config=config)
    # Without config: the codecs' checksums (seed), the codes' shapes (bits) or the file's
    # layer index (a setting this method ignores) refuse it.
    with pytest.raises(CacheFormatError, match="differ from those it was written with|has shape|not the layer saved"):
        load_prompt_cache(path)


def test_seed_mismatch_message_names_both_seeds(tmp_path):
    """Regression: a seed mismatch read "written with X, not X" (describe() left out the seed)."""
    config = config_for("turboquant_mse", 4)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, _filled_caches(config))
    with pytest.raises(CacheFormatError, match=r"written with turboquant_mse K4/V4 group=32, not .* seed=5"):
        load_prompt_cache(path, config=config.replace(seed=5))
    assert config.describe() != config.replace(group_size=16).describe()


def test_model_identity_is_checked(tmp_path):
    from veloxquant_mlx import make_prompt_cache

    model, other = tiny_llama(layers=2, hidden=64, heads=2, kv_heads=1), tiny_llama(layers=2, hidden=128, heads=2,
                                                                                      kv_heads=1)
    config = config_for("turboquant_mse", 4)
    caches = make_prompt_cache(model, config)
    model(mx.array([[1, 2, 3, 4]]), cache=caches)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    assert len(load_prompt_cache(path, config=config, model=model)) == 2
    with pytest.raises(CacheFormatError, match="another model"):
        load_prompt_cache(path, config=config, model=other)


# ---- artifact dirs ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    return tiny_llama(layers=2, hidden=64, heads=2, kv_heads=1)


def _params(codecs, entries):
    return {f"{r}.{d}.{k}": np.array(v) for r, d in entries for k, v in codecs.get(r, d).params().items()}


@pytest.mark.parametrize("method", ["turboquant_mse", "turboquant_prod", "polarquant", "qjl"])
def test_fuzzed_artifact_dirs_are_refused_or_identical(method, small_model, tmp_path):
    config = config_for(method, 3)
    root = precompute(small_model, config, tmp_path / "art")
    entries = [(e["role"], e["dim"]) for e in json.loads((root / "artifacts.json").read_text())["codecs"]]
    reference = _params(CodecSet(config), entries)
    assert reference, f"{method} has no constant arrays to fuzz"
    files = {name: (root / name).read_bytes() for name in ("artifacts.json", "codecs.safetensors")}
    rng = random.Random(f"artifacts-{method}")
    detected = identical = 0
    cases = CASES if method == "turboquant_mse" else CASES // 4
    for case in range(cases):
        for name, data in files.items():
            (root / name).write_bytes(data)
        name = rng.choice(sorted(files))
        data = files[name]
        kind = rng.choice(["flip", "flip", "truncate", "edit"] + (["swap"] if name.endswith("safetensors") else []))
        if kind == "flip":
            corrupted = bytearray(data)
            corrupted[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            (root / name).write_bytes(bytes(corrupted))
        elif kind == "truncate":
            (root / name).write_bytes(data[: rng.randrange(len(data))])
        elif kind == "swap":
            arrays = mx.load(str(root / name))
            same = [(a, b) for a in arrays for b in arrays if a < b and arrays[a].shape == arrays[b].shape
                    and arrays[a].dtype == arrays[b].dtype]
            if not same:
                continue
            a, b = rng.choice(same)
            arrays[a], arrays[b] = arrays[b], arrays[a]
            mx.save_safetensors(str(root / name), arrays)
        else:
            meta = json.loads(files["artifacts.json"])
            target = rng.choice(["bits", "seed", "group_size", "dim", "format"])
            if target == "dim":
                meta["codecs"][0]["dim"] += 1
            elif target == "format":
                meta["format"] = 1
            else:
                meta["config"][target] += 1
            if rng.random() < 0.5:
                meta["digest"] = metadata_digest(meta)
            (root / "artifacts.json").write_text(json.dumps(meta))
        try:
            codecs = load_artifacts(config.replace(artifact_dir=str(root)))
            loaded = _params(codecs, entries)
        except ArtifactError as error:
            assert str(error)
            detected += 1
            continue
        assert loaded.keys() == reference.keys() and all(
            loaded[k].tobytes() == reference[k].tobytes() for k in loaded), f"case {case} ({kind} {name})"
        identical += 1
    print(f"{method} artifacts: {detected + identical} corrupted dirs, {detected} refused, {identical} identical")
    assert detected > (detected + identical) // 2


def test_artifact_checksums_are_generic(tmp_path):
    """Any artifact kind written with save_artifact_dir gets verified checksums."""
    from veloxquant_mlx.artifacts import load_artifact_dir

    save_artifact_dir(tmp_path, {"a": mx.arange(10), "b": mx.ones((2, 3))}, {"kind": "test"})
    meta, arrays = load_artifact_dir(tmp_path)
    assert meta["kind"] == "test" and mx.array_equal(arrays["a"], mx.arange(10)).item()
    mx.save_safetensors(str(tmp_path / "codecs.safetensors"), {"a": mx.arange(10) + 1, "b": mx.ones((2, 3))})
    with pytest.raises(ArtifactError, match="tensor 'a' fails its checksum"):
        load_artifact_dir(tmp_path)


def test_cache_from_artifact_reloads_with_its_codecs(small_model, tmp_path):
    """Regression: a prompt cache built from a modified artifact reloaded with codecs rebuilt
    from the seed, silently ignoring the artifact dir."""
    config = config_for("turboquant_mse", 3)
    root = precompute(small_model, config, tmp_path / "art")
    meta = json.loads((root / "artifacts.json").read_text())
    arrays = mx.load(str(root / "codecs.safetensors"))
    name = next(k for k in arrays if k.startswith("keys.") and arrays[k].ndim == 1)
    arrays[name] = arrays[name] * 1.01  # another (e.g. calibrated) codebook
    save_artifact_dir(root, arrays, {k: v for k, v in meta.items() if k not in ("format", "tensors", "digest")})
    with_artifact = config.replace(artifact_dir=str(root))
    from veloxquant_mlx import make_prompt_cache

    caches = make_prompt_cache(small_model, with_artifact)
    small_model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=caches)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    reference = _outputs(caches)
    assert _same(_outputs(load_prompt_cache(path)), reference)  # the file names its artifact dir
    assert _same(_outputs(load_prompt_cache(path, config=with_artifact)), reference)
    with pytest.raises(CacheFormatError, match="differ from those it was written with"):
        load_prompt_cache(path, config=config)  # the caller's seed-built codecs are not the file's


# ---- single-byte flips, every format, whoever wrote it ------------------------------------------
# Each flip must be refused with the library's own error, or load to exactly what the intact file
# gives (a flip in padding, or in JSON whitespace); a silently different load fails the test.

FLIPS = 120


def _flip_sweep(files: dict, load, errors, label: str, flips: int = FLIPS):
    """Flip one random byte (seeded) of one of `files` ({path: bytes}) per case, `load()` it, and
    count refusals (`errors`) and loads identical to the intact files' (`load()` before any flip)."""
    reference = load()
    rng = random.Random(f"byteflip-{label}")
    refused = identical = 0
    wrong = []
    for case in range(flips):
        target = rng.choice(sorted(files, key=str))
        data = bytearray(files[target])
        position = rng.randrange(len(data))
        data[position] ^= rng.randrange(1, 256)
        target.write_bytes(bytes(data))
        try:
            loaded = load()
        except errors:
            refused += 1
        else:
            if loaded == reference:
                identical += 1
            else:
                wrong.append(f"{target.name}@{position}")
        finally:
            target.write_bytes(files[target])
    print(f"{label}: {flips} flips, {refused} refused, {identical} loaded identical, {len(wrong)} silently wrong")
    assert not wrong, f"{label}: flips loaded silently wrong: {wrong}"
    return refused, identical


def _cache_outputs(caches):
    return [o.tobytes() for o in _outputs(caches)] + [(c.offset, type(c).__name__) for c in caches]


@pytest.fixture(scope="module")
def flip_caches():
    config = config_for("turboquant_mse", 4, sink_tokens=2, residual_length=8)
    return config, _filled_caches(config)


def test_byte_flips_in_library_prompt_cache_files(flip_caches, tmp_path):
    config, caches = flip_caches
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches, {"model": "tiny", "note": "kept with the cache"})

    def load():
        loaded, metadata = load_prompt_cache(path, config=config, return_metadata=True)
        return _cache_outputs(loaded), metadata

    _flip_sweep({path: path.read_bytes()}, load, CacheFormatError, "library prompt-cache file")


def test_byte_flips_in_files_written_by_mlx_lm(flip_caches, tmp_path):
    """mlx-lm's save_prompt_cache writes the caches' `state` as it is: its checksums and digests
    protect the file as they do the library's own (its metadata, written by mlx-lm, has none)."""
    from mlx_lm.models.cache import save_prompt_cache as mlx_save

    config, caches = flip_caches
    path = tmp_path / "c.safetensors"
    mlx_save(str(path), caches)

    def load(**kwargs):
        loaded, metadata = load_prompt_cache(path, return_metadata=True, **kwargs)
        return _cache_outputs(loaded), metadata

    files = {path: path.read_bytes()}
    _flip_sweep(files, lambda: load(config=config), CacheFormatError, "mlx-lm-written file, with config")
    _flip_sweep(files, load, CacheFormatError, "mlx-lm-written file, no config", flips=FLIPS // 4)


def test_byte_flips_in_chat_saves(flip_caches, tmp_path):
    from veloxquant_mlx.chat import ChatSession

    config, caches = flip_caches
    session = ChatSession.__new__(ChatSession)
    session.model, session.config, session.model_name, session.caches = None, config, "tiny", caches
    session.messages = [{"role": "user", "content": "Where is the lighthouse?"},
                        {"role": "assistant", "content": "On the northern cape."}]
    session.cached_tokens = list(range(caches[0].offset))
    path = session.save(str(tmp_path / "chat"))
    assert path == tmp_path / "chat.safetensors" and path.exists()
    reader = ChatSession.__new__(ChatSession)
    reader.model, reader.config, reader.model_name = None, config, "tiny"

    def load():
        reader.load(str(path))
        return reader.messages, reader.cached_tokens, _cache_outputs(reader.caches)

    _flip_sweep({path: path.read_bytes()}, load, (CacheFormatError, ValueError), "chat save")


def test_byte_flips_in_artifact_dirs(small_model, tmp_path):
    config = config_for("turboquant_mse", 3)
    root = precompute(small_model, config, tmp_path / "art")
    entries = [(e["role"], e["dim"]) for e in json.loads((root / "artifacts.json").read_text())["codecs"]]

    def load():
        params = _params(load_artifacts(config.replace(artifact_dir=str(root))), entries)
        return {name: value.tobytes() for name, value in params.items()}

    files = {root / name: (root / name).read_bytes() for name in ("artifacts.json", "codecs.safetensors")}
    _flip_sweep(files, load, ArtifactError, "artifact folder")


def test_byte_flips_in_weight_folders(tmp_path):
    """A quantized-model folder: weights.json (its reservoir must hold the same description) and
    the reservoir (header under SHA-256, every tensor under CRC-32)."""
    from veloxquant_mlx.weights import ReservoirError, load_reservoir, quantize_model, save_reservoir
    from veloxquant_mlx.weights.directory import read_config, reservoir_path

    model = quantize_model(tiny_llama(layers=1, hidden=64, heads=2, kv_heads=1, vocab=64), 3, seed=1,
                           group_size=16, progress=False)
    config = {"format": "veloxquant-weights", "base_model": "tiny", "reservoir": "reservoir.vqw", "bits": 3}
    save_reservoir(model, tmp_path / "reservoir.vqw", meta=config)
    (tmp_path / "weights.json").write_text(json.dumps(config, indent=2))

    def load():
        layers, header = load_reservoir(reservoir_path(tmp_path, read_config(tmp_path)))
        return header, {f"{name}.{key}": np.array(value).tobytes()
                        for name, layer in layers.items() for key, value in tree_flatten(layer.parameters())}

    files = {tmp_path / name: (tmp_path / name).read_bytes() for name in ("weights.json", "reservoir.vqw")}
    _flip_sweep(files, load, ReservoirError, "weight folder (weights.json + reservoir)")


def test_model_identity_covers_arguments_and_weights(tmp_path):
    """Regression: a cache made with another rope_theta, or with the 4-bit copy of a model, loaded
    into the float model (logits off by up to 3.6): the identity hashed the arguments only."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    from veloxquant_mlx import make_prompt_cache

    def build(rope_theta=10000.0, quantized=False):
        args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                               num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=64,
                               rope_theta=rope_theta)
        mx.random.seed(0)
        model = llama.Model(args)
        if quantized:
            nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
        return model

    model = build()
    config = config_for("turboquant_mse", 4)
    caches = make_prompt_cache(model, config)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    assert len(load_prompt_cache(path, config=config, model=build())) == 2  # the same model, rebuilt
    with pytest.raises(CacheFormatError, match="other arguments"):
        load_prompt_cache(path, config=config, model=build(rope_theta=500000.0))
    with pytest.raises(CacheFormatError, match="other weights"):
        load_prompt_cache(path, config=config, model=build(quantized=True))


def _weight_folder(root):
    from veloxquant_mlx.weights import quantize_model, save_reservoir

    model = quantize_model(tiny_llama(layers=1, hidden=64, heads=2, kv_heads=1, vocab=64), 3, seed=1,
                           group_size=16, progress=False)
    root.mkdir(parents=True, exist_ok=True)
    config = {"format": "veloxquant-weights", "base_model": "tiny", "reservoir": "reservoir.vqw", "bits": 3}
    save_reservoir(model, root / "reservoir.vqw", meta=config)
    (root / "weights.json").write_text(json.dumps(config))
    return config


def test_weight_folder_reservoir_stays_inside_and_matches(tmp_path):
    """Regression: weights.json could name ../../q3/reservoir.vqw or an absolute path, and a q3
    reservoir copied into a q4 folder loaded as 3-bit while the folder said 4."""
    from veloxquant_mlx.weights import ReservoirError
    from veloxquant_mlx.weights.directory import read_config, reservoir_path

    config = _weight_folder(tmp_path / "q3")
    assert reservoir_path(tmp_path / "q3", read_config(tmp_path / "q3")) == (tmp_path / "q3" / "reservoir.vqw").resolve()
    folder = tmp_path / "q4"
    folder.mkdir()
    for name, match in [("../q3/reservoir.vqw", "not a file name inside"),
                        (str(tmp_path / "q3" / "reservoir.vqw"), "not a file name inside"),
                        ("link.vqw", "leads out of the folder")]:
        (folder / "link.vqw").unlink(missing_ok=True)
        (folder / "link.vqw").symlink_to(tmp_path / "q3" / "reservoir.vqw")
        with pytest.raises(ReservoirError, match=match):
            reservoir_path(folder, {**config, "reservoir": name})
    (folder / "reservoir.vqw").write_bytes((tmp_path / "q3" / "reservoir.vqw").read_bytes())
    with pytest.raises(ReservoirError, match=r"bits 4\) does not describe its reservoir \(bits 3"):
        reservoir_path(folder, {**config, "bits": 4})


def test_absurd_reservoir_header_is_a_reservoir_error(tmp_path):
    """Regression: a header (with a valid SHA-256) of a 2^60-element shape raised a bare ValueError."""
    import hashlib

    from veloxquant_mlx.weights import ReservoirError, load_reservoir
    from veloxquant_mlx.weights import reservoir as reservoir_module

    _weight_folder(tmp_path)
    path = tmp_path / "reservoir.vqw"
    data = path.read_bytes()
    header, start = reservoir_module.read_header(path)
    prefix = reservoir_module._PREFIX
    magic, version, length, _ = prefix.unpack(data[:prefix.size])
    for edit in ("shape", "offset", "dtype"):
        edited = json.loads(json.dumps(header))
        tensor = next(iter(next(iter(edited["layers"].values()))["tensors"].values()))
        tensor.update({"shape": [2**30, 2**30]} if edit == "shape" else {"offset": 2**62} if edit == "offset"
                      else {"dtype": "complex64"})
        text = json.dumps(edited, sort_keys=True).encode()
        body = prefix.pack(magic, version, len(text), hashlib.sha256(text).digest()) + text
        body += bytes(reservoir_module._align(len(body)) - len(body)) + data[start:]
        path.write_bytes(body)
        with pytest.raises(ReservoirError, match=f"tensor .*{edit if edit != 'offset' else 'outside'}"):
            load_reservoir(path)
