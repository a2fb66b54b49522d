"""Loading a model directory: every broken or missing file is a clear error naming it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from safetensors.torch import load_file, save_file

from kvtune_engine.model import ModelConfig, ModelLoadError, load_model, load_tokenizer
from kvtune_engine.model.linear import packing_enabled


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    def copy(arch="llama", **kw):
        d = tmp_path / arch
        shutil.copytree(tiny_model(arch, **kw), d)
        return d
    return copy


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_missing_directory_and_config(tmp_path, model_copy):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    d = model_copy()
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(d)


def test_bad_config(model_copy):
    d = model_copy()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_model(d)
    d = model_copy("qwen2")
    edit_json(d / "config.json", model_type="gpt2")
    with pytest.raises(ModelLoadError, match="model_type 'gpt2'.*not supported"):
        load_model(d)
    edit_json(d / "config.json", model_type="qwen2", num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="not a multiple of num_key_value_heads"):
        load_model(d)
    edit_json(d / "config.json", num_key_value_heads=2, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        load_model(d)


def test_shape_disagreeing_with_config_names_file_and_tensor(model_copy):
    d = model_copy()
    edit_json(d / "config.json", intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                             r"has shape \(128, 64\), config.json implies \(96, 64\)"):
        load_model(d)
    d2 = model_copy("qwen3")
    edit_json(d2 / "config.json", num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match="num_hidden_layers is 1 but the checkpoint has tensor 'model.layers.1"):
        load_model(d2)


def test_missing_tensor_and_missing_weights(model_copy):
    d = model_copy()
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'model.layers.1.self_attn.k_proj.weight' is missing"):
        load_model(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(d)


def test_sharded_index_errors(model_copy):
    d = model_copy("qwen2", shards=2)
    shard = d / "model-00002-of-00002.safetensors"
    t = load_file(shard)
    name = sorted(t)[0]
    del t[name]
    save_file(t, shard)
    with pytest.raises(ModelLoadError, match=f"model-00002-of-00002.safetensors lacks tensor '{name}'"):
        load_model(d)
    shard.unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors is missing: "
                                             "model.safetensors.index.json lists it"):
        load_model(d)


def test_tokenizer_errors(model_copy):
    d = model_copy()
    edit_json(d / "tokenizer_config.json", eos_token="<|nope|>")
    with pytest.raises(ModelLoadError, match="special token '<|nope|>'"):
        load_tokenizer(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        load_tokenizer(d)


def test_chat_template_file_overrides_and_missing_template(model_copy):
    d = model_copy()
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert load_tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"
    (d / "chat_template.jinja").unlink()
    edit_json(d / "tokenizer_config.json", chat_template=None)
    with pytest.raises(ModelLoadError, match="no chat template"):
        load_tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(tiny_model, dtype):
    m = load_model(tiny_model("qwen3", tie_embeddings=True), dtype=dtype)
    assert all(p.dtype == dtype for p in m.parameters())
    assert m.lm_head.weight.data_ptr() == m.embed.data_ptr()  # tied: one copy of the embedding
    if dtype == torch.float32 and packing_enabled("cpu", dtype):  # the other matmuls keep only the packed copy
        assert all(lin.weight is None and lin.packed is not None for lin in m.layers[0].linears())


def test_config_spellings():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_dict({**base, "dtype": "bfloat16", "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old == new and old.rope_theta == 5e5 and old.dtype == torch.bfloat16 and old.num_kv_heads == 2
    assert old.head_dim == 4 and not old.qkv_bias
    assert ModelConfig.from_dict({**base, "model_type": "qwen2"}).qkv_bias
    assert ModelConfig.from_dict({**base, "model_type": "qwen3"}).qk_norm
