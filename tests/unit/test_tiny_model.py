"""`kvtune make-tiny-model`: a complete HF directory that both our loader and `transformers` read."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtune_engine.model import load_model, load_tokenizer
from kvtune_engine.model.tiny import make_tiny_model_cmd


def test_cli_writes_sharded_model(tmp_path):
    out = tmp_path / "m"
    r = CliRunner().invoke(make_tiny_model_cmd, [str(out), "--arch", "qwen2", "--layers", "3", "--hidden", "32",
                                                 "--heads", "4", "--kv-heads", "1", "--vocab", "300",
                                                 "--shards", "3", "--seed", "7"])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    m = load_model(out)
    assert (m.cfg.num_layers, m.cfg.hidden_size, m.cfg.num_kv_heads, m.cfg.vocab_size) == (3, 32, 1, 300)
    assert m.cfg.qkv_bias and not m.cfg.o_bias


def test_cli_rejects_bad_shapes(tmp_path):
    r = CliRunner().invoke(make_tiny_model_cmd, [str(tmp_path / "m"), "--heads", "4", "--kv-heads", "3"])
    assert r.exit_code != 0 and "multiple of kv_heads" in r.output
    r = CliRunner().invoke(make_tiny_model_cmd, [str(tmp_path / "m"), "--vocab", "100"])
    assert r.exit_code != 0 and "too small" in r.output


def test_tokenizer_round_trip_and_specials(tiny_model):
    tok = load_tokenizer(tiny_model("llama"))
    text = "The cache runs quickly, and 42 requests wait: ünïcode too!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # llama's post-processor adds BOS
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert len(tok.encode("the cache the queue the model")) < len("the cache the queue the model")  # merges
    assert tok.eos_token_ids[0] == tok.tokenizer.token_to_id("<|im_end|>")
    assert tok.tokenizer.token_to_id("<|endoftext|>") in tok.eos_token_ids
    q = load_tokenizer(tiny_model("qwen3"))
    assert q.bos_token_id is None and q.encode("hi")[0] != q.tokenizer.token_to_id("<|begin_of_text|>")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chat_template_matches_transformers(tiny_model, arch):
    import transformers
    d = tiny_model(arch)
    ours = load_tokenizer(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How big is the cache?"},
            {"role": "assistant", "content": "Small."}, {"role": "user", "content": "Why?"}]
    for gen in (True, False):
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == text
        assert ours.encode_chat(msgs, add_generation_prompt=gen) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode("plain text") == hf("plain text")["input_ids"]


def test_transformers_loads_config_and_weights(tiny_model):
    import transformers
    for arch, cls in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                      ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")):
        m, info = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model(arch)), output_loading_info=True)
        assert type(m).__name__ == cls
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert m.config.num_hidden_layers == 2 and m.config.vocab_size == 512
