"""`kvtune make-tiny-model`: a small random Llama/Mistral/Qwen2/Qwen3 in a Hugging Face directory.

Tests and the demo need a real model directory without downloading one: random weights
(safetensors, optionally sharded with an index), a byte-level BPE tokenizer trained with `tokenizers`
on generated English-like text, a ChatML chat template, and a config.json that `transformers` loads
too (so tests compare logits against it). Weights are scaled so logits are peaked: greedy decoding is
then decided by clear margins, not by rounding noise.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import click

ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")

_WORDS = """the a an one two three some many every this that these those my your our their
cache block token request queue model engine server cluster node pod memory layer batch prefix
kernel tensor matrix vector prompt answer question user system assistant time step budget
limit reason cause metric chart value number string list table word sentence story river
mountain city garden window door light night morning water fire stone tree bird fish cat dog
runs waits grows shrinks reads writes sends holds frees moves tells asks answers serves sees finds
keeps makes takes gives learns builds checks counts computes schedules swaps evicts admits
quickly slowly quietly often never always again together almost nearly exactly rather
big small long short old new fast slow warm cold free full empty busy idle tiny huge
and or but because while when if then so after before during under over with without from to
in on at by for of about into through between""".split()


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic English-like lines, numbers, code-ish and chat-ish text for BPE training."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 5
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", "..."]))
        elif kind == 1:
            lines.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)} = {rng.randint(0, 99999)} "
                         f"# {' '.join(words[:5])}")
        elif kind == 2:
            lines.append(", ".join(f"{w} {rng.randint(1, 512)}" for w in words[:6]) + ";")
        elif kind == 3:
            lines.append(f"User: {' '.join(words)}?\nAssistant: {' '.join(reversed(words))}.")
        else:
            lines.append(" ".join(w.upper() if rng.random() < 0.1 else w for w in words) + "\n")
    return lines


def train_tokenizer(vocab_size: int, add_bos: bool, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed=seed), trainer)
    post = [processors.ByteLevel(trim_offsets=False)]
    if add_bos:
        bos = SPECIALS[3]
        post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                  special_tokens=[(bos, tok.token_to_id(bos))]))
    tok.post_processor = processors.Sequence(post)
    return tok


def make_tiny_model(out_dir: str | Path, arch: str = "llama", layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, vocab: int = 512, intermediate: int = 128,
                    head_dim: int | None = None, seed: int = 0, dtype: str = "float32", shards: int = 1,
                    tie_embeddings: bool = False, rope_theta: float = 10000.0,
                    rope_scaling: dict | None = None, max_position_embeddings: int = 4096) -> Path:
    """Write the model directory and return its path."""
    import torch
    from safetensors.torch import save_file

    from .config import parse_dtype

    if arch not in ARCH_CLASSES:
        raise click.BadParameter(f"arch {arch!r}: choose one of {sorted(ARCH_CLASSES)}")
    if vocab < 256 + len(SPECIALS):
        raise click.BadParameter(f"vocab {vocab} is too small for a byte-level tokenizer (>= {256 + len(SPECIALS)})")
    if heads % kv_heads:
        raise click.BadParameter(f"heads {heads} must be a multiple of kv_heads {kv_heads}")
    head_dim = head_dim or hidden // heads
    dt = parse_dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    add_bos = arch in ("llama", "mistral")
    tok = train_tokenizer(vocab, add_bos, seed)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    bos_id = ids["<|begin_of_text|>"] if add_bos else None
    eos_id = ids["<|im_end|>"]

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(dt)

    qs, kvs = heads * head_dim, kv_heads * head_dim
    qkv_bias = arch == "qwen2"
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = randn(hidden, std=0.1, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = randn(hidden, std=0.1, mean=1.0)
        for name, rows in (("q", qs), ("k", kvs), ("v", kvs)):
            t[p + f"self_attn.{name}_proj.weight"] = randn(rows, hidden, std=hidden ** -0.5)
            if qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = randn(rows, std=0.1)
        t[p + "self_attn.o_proj.weight"] = randn(hidden, qs, std=qs ** -0.5)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
            t[p + "self_attn.k_norm.weight"] = randn(head_dim, std=0.1, mean=1.0)
        t[p + "mlp.gate_proj.weight"] = randn(intermediate, hidden, std=hidden ** -0.5)
        t[p + "mlp.up_proj.weight"] = randn(intermediate, hidden, std=hidden ** -0.5)
        t[p + "mlp.down_proj.weight"] = randn(hidden, intermediate, std=intermediate ** -0.5)
    t["model.norm.weight"] = randn(hidden, std=0.1, mean=1.0)
    if tie_embeddings:  # tied: the embedding doubles as LM head; keep its logits peaked too
        t["model.embed_tokens.weight"] = randn(vocab, hidden, std=3 * hidden ** -0.5)
    else:
        t["lm_head.weight"] = randn(vocab, hidden, std=3 * hidden ** -0.5)

    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    names = list(t)
    if shards <= 1:
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        weight_map = {n: files[j * shards // len(names)] for j, n in enumerate(names)}
        for f in files:
            save_file({n: t[n] for n in names if weight_map[n] == f}, str(out / f), metadata={"format": "pt"})
        total = sum(x.numel() * x.element_size() for x in t.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    cfg = {
        "architectures": [ARCH_CLASSES[arch]], "model_type": arch, "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_parameters": rope, "tie_word_embeddings": tie_embeddings, "attention_bias": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": ids["<|endoftext|>"],
        "dtype": str(dt).removeprefix("torch."), "initializer_range": 0.02,
    }
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    if arch == "mistral":
        cfg["sliding_window"] = None
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, ids["<|endoftext|>"]]}, indent=2))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_position_embeddings,
          "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
          "bos_token": "<|begin_of_text|>" if add_bos else None, "clean_up_tokenization_spaces": False}
    if add_bos:
        tc["chat_template"] = "{{ bos_token }}" + CHATML
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return out


@click.command("make-tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(sorted(ARCH_CLASSES)), default="llama", show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--heads", default=4, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--head-dim", type=int, default=None, help="Default: hidden / heads.")
@click.option("--vocab", default=512, show_default=True, help="Model vocabulary (the BPE is trained up to it).")
@click.option("--intermediate", default=128, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--shards", default=1, show_default=True, help="Split the weights over N safetensors files.")
@click.option("--tie-embeddings/--no-tie-embeddings", default=False, show_default=True)
def make_tiny_model_cmd(out_dir, arch, layers, hidden, heads, kv_heads, head_dim, vocab, intermediate, seed,
                        dtype, shards, tie_embeddings):
    """Write a small random model with a real tokenizer to OUT_DIR (for tests and the demo)."""
    path = make_tiny_model(out_dir, arch=arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                           vocab=vocab, intermediate=intermediate, head_dim=head_dim, seed=seed, dtype=dtype,
                           shards=shards, tie_embeddings=tie_embeddings)
    click.echo(f"wrote {arch} model ({layers} layers, hidden {hidden}, vocab {vocab}) to {path}")
