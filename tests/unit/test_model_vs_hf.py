"""Same tiny weights, same tokens: our engine against Hugging Face `transformers` (pinned 5.x in
pyproject; 5.24 when written), for every architecture.

Tolerances, float32: logits and logprobs within 1e-4 absolute (the logits' std is about 3; the
differences come only from summation order in attention and matmuls), greedy tokens identical.
bfloat16: logits within 0.1 absolute of transformers' own bfloat16 forward (8 mantissa bits; the
argmax at each prompt position agrees wherever transformers' top-2 margin exceeds that).
"""
from __future__ import annotations

import pytest
import torch

from kvtune_engine.config import EngineConfig
from kvtune_engine.core.batch import ScheduledSeq
from kvtune_engine.core.request import Request, SamplingParams
from kvtune_engine.runner import ModelRunner

import transformers  # noqa: E402  (the test extra pins it)

FP32_ATOL = 1e-4
BF16_ATOL = 0.1
ARCHS = [("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"tie_embeddings": True}),
         ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                    "rope_theta": 500000.0})]
IDS = ["llama", "mistral", "qwen2", "qwen3", "qwen3-tied", "llama3-rope"]


def config(**kw):
    return EngineConfig(**{**dict(block_size=16, kv_cache_memory=0.002, swap_space=0.0, max_model_len=256,
                                  max_num_batched_tokens=256, max_num_seqs=8), **kw})


def hf_model(d, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).eval()


def prompts(n_list, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_list]


@torch.inference_mode()
def prompt_logits(runner, ids):
    """Our logits at every prompt position (one prefill through the paged cache)."""
    req = Request(list(ids))
    bt = list(range(-(-len(ids) // runner.block_size)))
    tok, pos, meta, _, _ = runner.prepare([ScheduledSeq(req, 0, len(ids), bt, True)])
    return runner.model.compute_logits(runner.model(tok, pos, runner.kv_caches, meta))


@pytest.mark.parametrize("arch,kw", ARCHS, ids=IDS)
def test_greedy_tokens_and_logprobs_match_transformers(tiny_model, drive, arch, kw):
    d = tiny_model(arch, **kw)
    cfg = config()
    runner = ModelRunner(d, cfg, seed=0)
    hf = hf_model(d)
    ps = prompts([3, 17, 40, 70], seed=len(arch))
    with torch.inference_mode():
        for p in ps[2:]:
            ref = hf(torch.tensor([p])).logits[0]
            torch.testing.assert_close(prompt_logits(runner, p), ref, atol=FP32_ATOL, rtol=0)
    reqs = [Request(p, SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)) for p in ps]
    _, lps = drive(runner, cfg, reqs)
    for r in reqs:
        # teacher forcing on our output: if every token is transformers' argmax given the same
        # prefix, transformers' greedy decoding produces exactly this sequence
        with torch.inference_mode():
            logp = torch.log_softmax(hf(torch.tensor([r.all_token_ids])).logits[0].float(), -1)
        n = r.num_prompt_tokens
        got = lps[r.request_id]
        assert [x.token_id for x in got] == r.output_token_ids and len(got) == 24
        assert r.output_token_ids == logp[n - 1:-1].argmax(-1).tolist()
        for j, x in enumerate(got):
            row = logp[n - 1 + j]
            assert abs(x.logprob - row[x.token_id].item()) < FP32_ATOL
            top_v, top_i = row.topk(5)
            assert [i for i, _ in x.top] == top_i.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in x.top]), top_v, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_close_to_transformers_bfloat16(tiny_model, arch):
    d = tiny_model(arch)
    runner = ModelRunner(d, config(), dtype="bfloat16", seed=0)
    hf = hf_model(d, torch.bfloat16)
    p = prompts([50], seed=3)[0]
    with torch.inference_mode():
        ours = prompt_logits(runner, p)
        ref = hf(torch.tensor([p])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=BF16_ATOL, rtol=0)
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > BF16_ATOL
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_decodes_close_to_transformers_bfloat16(tiny_model, drive, arch):
    """Decodes in bf16 through the paged cache (bf16 KV read by the CPU kernel, summed in float32),
    teacher-forced against transformers' bf16 forward on the same tokens. Tolerance: logprobs within
    2 x BF16_ATOL, since a logprob is a logit minus the row's logsumexp, each within BF16_ATOL (bf16
    rounds every layer's output to 8 bits: ~0.4% of the logits' std of about 3 per rounding); the
    greedy token is transformers' argmax wherever its top-2 margin exceeds that."""
    d = tiny_model(arch)
    cfg = config()
    runner = ModelRunner(d, cfg, dtype="bfloat16", seed=0)
    assert runner.k_cache.dtype == torch.bfloat16
    hf = hf_model(d, torch.bfloat16)
    reqs = [Request(p, SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True))
            for p in prompts([5, 30, 70], seed=7)]
    _, lps = drive(runner, cfg, reqs)
    for r in reqs:
        with torch.inference_mode():
            logp = torch.log_softmax(hf(torch.tensor([r.all_token_ids])).logits[0].float(), -1)
        n = r.num_prompt_tokens
        rows = logp[n - 1:-1]
        got = lps[r.request_id]
        ours = torch.tensor([x.logprob for x in got])
        theirs = rows[torch.arange(len(got)), torch.tensor(r.output_token_ids)]
        torch.testing.assert_close(ours, theirs, atol=2 * BF16_ATOL, rtol=0)
        top2 = rows.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_ATOL
        assert torch.equal(torch.tensor(r.output_token_ids)[clear], rows.argmax(-1)[clear])


def test_same_text_as_transformers_generate(tiny_model, drive):
    """End to end through the tokenizers: text in, greedy text out, as `generate` gives."""
    from kvtune_engine.model import load_tokenizer
    d = tiny_model("qwen2")
    tok = load_tokenizer(d)
    ids = tok.encode_chat([{"role": "user", "content": "Why does the queue wait?"}])
    runner, cfg = ModelRunner(d, config(), seed=0), config()
    r = Request(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    drive(runner, cfg, [r])
    hf = hf_model(d)
    x = torch.tensor([ids])
    want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert r.output_token_ids == want
    assert tok.decode(r.output_token_ids) == transformers.AutoTokenizer.from_pretrained(str(d)).decode(
        want, skip_special_tokens=True)
