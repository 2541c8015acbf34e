"""Chat, prompt-cache files, presets and the CLI numbers (tiny model; real-model checks are marked)."""

import io
import json

import mlx.core as mx
import pytest

from conftest import config_for, tiny_llama
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cli import build_parser, config_from_args, main, memory_report
from veloxquant_mlx.presets import KV_PRESETS, preset_config


def _filled(config, tokens, model=None):
    model = model or tiny_llama()
    caches = KVCacheBuilder(config).for_model(model).build()
    model(mx.arange(tokens)[None] % 500, cache=caches)
    return caches


def test_short_prompt_memory_counts_used_bytes_not_capacity():
    """Regression: 10 tokens in a 256-token store were reported as barely smaller than fp16."""
    caches = _filled(config_for("turboquant_mse", 4), 10)
    codec_bits = caches[0].key_codec.bits_per_token() + caches[0].value_codec.bits_per_token()
    expected = sum(c.batch * c.kv_heads * c.offset * codec_bits // 8 for c in caches)
    assert sum(c.used_nbytes for c in caches) == expected
    assert sum(c.nbytes for c in caches) > 10 * expected  # the capacity, still shown as "allocated"
    text = memory_report(caches)
    ratio = float(text.split(": ")[-1].split("x")[0])
    fp16 = sum(2 * c.kv_heads * c.offset * (c.key_dim + c.value_dim) for c in caches)
    assert ratio == pytest.approx(fp16 / expected, abs=0.01) and ratio > 3
    assert "allocated" in text and "10 tokens" in text


def test_memory_report_of_rotating_caches_compares_with_mlx_lms_rotating_cache():
    """Regression: with --max-kv-size the fp16 side read 0 MB (rotating caches were not counted)."""
    model = tiny_llama()
    caches = KVCacheBuilder(config_for("turboquant_mse", 4)).for_model(model).build(max_kv_size=32)
    model(mx.arange(50)[None] % 500, cache=caches)
    inner = caches[0].inner
    fp16 = len(caches) * 2 * inner.kv_heads * 32 * (inner.key_dim + inner.value_dim)  # mlx-lm keeps 32 tokens
    used = sum(c.used_nbytes for c in caches)
    ratio = float(memory_report(caches).split(": ")[-1].split("x")[0])
    assert ratio == pytest.approx(fp16 / used, abs=0.01) and ratio > 1


def test_used_bytes_of_block_formats_count_started_blocks():
    caches = _filled(config_for("kivi", 4, residual_length=0), 40)  # 32-token key groups
    for c in caches:
        assert 0 < c.used_nbytes <= c.nbytes
        rows = {name: buf for name, buf in c.store.buffers["keys"].items()}
        per_row = c.store.tokens_per_row["keys"]
        key_bytes = sum(buf.nbytes // buf.shape[2] * -(-c.encoded // per_row[n]) for n, buf in rows.items())
        assert key_bytes < c.used_nbytes


def test_presets_are_valid_and_flags_override_them():
    for name in KV_PRESETS:
        assert preset_config(name).method == KV_PRESETS[name]["method"]
    args = build_parser().parse_args(["generate", "--kv", "vq3", "--residual-length", "32", "--option", "renorm=false"])
    config = config_from_args(args)
    assert (config.bits, config.residual_length, config.sink_tokens, config.center) == (3, 32, 4, True)
    assert config.options["renorm"] is False
    plain = config_from_args(build_parser().parse_args(["generate"]))
    assert plain == KVCacheConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv", "vq9"])


@pytest.mark.parametrize("command", ["generate", "chat", "cache-prompt", "serve"])
def test_every_flag_has_help_and_a_visible_default(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, (command, action.dest)
        assert "default" in action.help or "required" in action.help, (command, action.dest, action.help)
    mirrored = {"--max-kv-size", "--kv", "--method", "--model"}
    if command != "cache-prompt":
        mirrored |= {"--max-tokens", "--temp", "--top-p"}
    if command in ("generate", "chat"):
        mirrored |= {"--chat-template-config", "--system-prompt", "--seed"}
    assert mirrored <= set(sub._option_string_actions)


def test_generate_help_lists_cache_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--prompt-cache-file", "--chat-template-config", "--max-kv-size", "KV cache:", "--kv PRESET"):
        assert flag in out


@pytest.mark.parametrize("command", ["chat", "cache-prompt"])
def test_max_kv_size_is_refused_where_it_cannot_work_not_ignored(command, capsys):
    extra = ["--prompt-file", "x.txt", "--out", "x.safetensors"] if command == "cache-prompt" else []
    assert main([command, "--max-kv-size", "512", *extra]) == 2
    assert "--max-kv-size is not supported by this command" in capsys.readouterr().err


class _Tokenizer:
    """A chat tokenizer over the tiny model's vocabulary (one token per character)."""

    chat_template = "tiny"
    eos_token_ids = {0}
    eos_token_id = 0
    bos_token = None

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, continue_final_message=False,
                            **template_kwargs):
        text = "".join(f"<{m['role']}>{m['content']}" + ("" if continue_final_message and i == len(messages) - 1
                                                        else "|") for i, m in enumerate(messages))
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=True):
        return [1 + ord(ch) % 400 for ch in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def get_vocab(self):
        return {chr(i): i for i in range(1, 401)}


def test_chat_prefills_only_new_tokens_and_saves(tmp_path):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from veloxquant_mlx.chat import ChatSession, run_chat

    model, tokenizer = tiny_llama(), TokenizerWrapper(_Tokenizer())
    config = config_for("turboquant_mse", 4)
    session = ChatSession(model, tokenizer, config, model_name="tiny")
    script = io.StringIO(f"hello\nand again\n/save {tmp_path / 'c.safetensors'}\n/reset\n"
                         f"/load {tmp_path / 'c.safetensors'}\nthird\n")
    out = io.StringIO()
    assert run_chat(session, max_tokens=5, sampler=None, stdin=script, stdout=out) == 3
    text = out.getvalue()
    assert text.count("[cache: ") == 3 and "saved to" in text and "loaded from" in text
    # The cache holds exactly the tokens the session says it holds, and each turn prefilled
    # only what followed the shared prefix.
    assert session.cache_tokens == len(session.cached_tokens)
    full = tokenizer.apply_chat_template(session.messages[:-1], add_generation_prompt=True)
    assert session.last_prefilled < len(full) / 2
    assert session.cached_tokens[: len(full) - session.last_prefilled] == full[: len(full) - session.last_prefilled]


def test_chat_turn_matches_a_fresh_prefill_of_the_whole_conversation():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from veloxquant_mlx.chat import ChatSession

    model, tokenizer = tiny_llama(), TokenizerWrapper(_Tokenizer())
    config = config_for("turboquant_mse", 4)
    session = ChatSession(model, tokenizer, config)
    list(session.turn("first message", max_tokens=4))
    second = "".join(session.turn("second", max_tokens=4))
    fresh = ChatSession(model, tokenizer, config)
    fresh.messages = session.messages[:-1]
    tokens = fresh._render()
    caches = KVCacheBuilder(config).for_model(model).build()
    from mlx_lm.generate import generate_step

    ids = [int(t) for (t, _), _ in zip(generate_step(mx.array(tokens), model, prompt_cache=caches), range(4))]
    assert len(second) > 0 and second == tokenizer.decode([i for i in ids if i != 0])[: len(second)]


def test_prompt_cache_file_answers_without_prefilling_the_document(tmp_path):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from veloxquant_mlx.prompt_cache import cache_prompt, document_tokens, load_document_cache, question_suffix

    model, tokenizer = tiny_llama(), TokenizerWrapper(_Tokenizer())
    config = config_for("turboquant_mse", 3)
    document = "a long document " * 20
    written = cache_prompt(model, tokenizer, document, config, tmp_path / "doc.safetensors", "tiny", step=64)
    caches, metadata = load_document_cache(tmp_path / "doc.safetensors", "tiny")
    assert caches[0].offset == written["tokens"] == len(document_tokens(tokenizer, document))
    assert json.loads(metadata["veloxquant_config"])["bits"] == 3
    suffix = question_suffix(tokenizer, "why?")
    whole = tokenizer.apply_chat_template([{"role": "user", "content": document + "why?"}],
                                          add_generation_prompt=True)
    assert document_tokens(tokenizer, document) + suffix == whole
    from_file = model(mx.array([suffix]), cache=caches)[0, -1]
    fresh = model(mx.array([whole]), cache=KVCacheBuilder(config).for_model(model).build())[0, -1]
    assert mx.allclose(from_file, fresh, atol=1e-4, rtol=1e-4).item()
    with pytest.raises(ValueError, match="model"):
        load_document_cache(tmp_path / "doc.safetensors", "another-model")


@pytest.mark.model
def test_chat_command_runs_a_script_on_the_default_model(tmp_path, monkeypatch, capsys, cli_shares_smollm2):
    script = f"My name is Ana.\n/save {tmp_path / 'chat.safetensors'}\nWhat is my name?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", "--max-tokens", "8", "--kv", "vq4"]) == 0
    out = capsys.readouterr().out
    assert out.count("[cache: ") == 2 and "tok/s" in out and (tmp_path / "chat.safetensors").is_file()


@pytest.mark.model
def test_cache_prompt_then_generate_from_the_file(tmp_path, capsys, cli_shares_smollm2):
    document = tmp_path / "doc.txt"
    document.write_text("The lighthouse on Gull Rock was kept by Ada Moss for forty years. " * 6)
    out = tmp_path / "doc.safetensors"
    assert main(["cache-prompt", "--prompt-file", str(document), "--out", str(out), "--kv", "vq3"]) == 0
    assert "MB file" in capsys.readouterr().out
    assert main(["generate", "--prompt-cache-file", str(out), "--prompt", "Who kept the lighthouse?",
                 "--max-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert "[prompt cache" in text and "turboquant_mse K3/V2" in text and "Prompt: " in text
    prompt_tokens = int(text.split("Prompt: ")[1].split(" tokens")[0])
    assert prompt_tokens < 30  # the question only: the document came from the file
    assert main(["generate", "--prompt-cache-file", str(out), "--prompt", "x", "--method", "kivi"]) == 2
