"""The offline API `LLM(model_dir, **engine_flags).generate(prompts, params)` and `kvtune serve`'s CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner
from conftest_engine import TEST_FLAGS, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.core.request import SamplingParams
from kvtune_engine.engine import InvalidRequest
from kvtune_engine.llm import LLM
from kvtune_operator.demo.engine import free_port


@pytest.fixture(scope="module")
def llm(tiny_llama):  # noqa: F811
    return LLM(str(tiny_llama), **TEST_FLAGS)


def test_generate_order_prompts_and_params(llm):
    prompts = ["Hello there", [1, 60, 61, 62], "A much longer prompt about nothing in particular " * 3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 5, 7]
    assert outs[1].prompt_token_ids == [1, 60, 61, 62]
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert all(isinstance(o.text, str) for o in outs)
    single = llm.generate("Hello there", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert single[0].token_ids == outs[0].token_ids


def test_greedy_same_alone_or_batched(llm):
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["the cat sat"], sp)[0].token_ids
    batched = llm.generate(["the cat sat", "on the mat", "x" * 40, "hello"], sp)[0].token_ids
    assert alone == batched


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate(["sample me"], sp)[0].token_ids
    b = llm.generate(["other", "sample me", "more"], [SamplingParams(max_tokens=4), sp,
                                                       SamplingParams(max_tokens=6)])[1].token_ids
    assert a == b


def test_logprobs_offline(llm):
    out = llm.generate(["logprobs please"], SamplingParams(max_tokens=4, temperature=0, logprobs=2,
                                                           ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tid, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tid and lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][0] == tid


def test_bad_request_raises(llm):
    with pytest.raises(InvalidRequest, match="max_model_len"):
        llm.generate(["x"], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_engine_flags_validated(tiny_llama):  # noqa: F811
    from kvtune_engine.config import ConfigError
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(tiny_llama), block_size=12)


# ---------------------------------------------------------------------------------------- kvtune serve

def _cli(*args, env=None):
    from kvtune_operator.cli import main
    return CliRunner().invoke(main, list(args), env=env)


def test_serve_bad_flags_one_clear_error(tiny_llama, tmp_path):  # noqa: F811
    r = _cli("serve", "--model", str(tiny_llama), "--block-size", "12")
    assert r.exit_code != 0 and "block_size 12 is not allowed" in r.output and "Traceback" not in r.output
    r = _cli("serve", "--model", str(tmp_path / "nope"), "--kv-cache-memory", "0.01")
    assert r.exit_code != 0 and "nope" in r.output and "Traceback" not in r.output
    r = _cli("serve", "--model", str(tiny_llama), "--max-num-seqs", "abc")
    assert r.exit_code == 2 and "max-num-seqs" in r.output
    r = _cli("serve", "--model", str(tiny_llama), "--gpu-memory-utilization", "1.5")
    assert r.exit_code != 0 and "gpu_memory_utilization" in r.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: [\n")
    r = _cli("serve", "--model", str(tiny_llama), "--config-file", str(cfg))
    assert r.exit_code != 0 and "YAML" in r.output
    r = _cli("serve", "--model", str(tiny_llama), env={"KVTUNE_PORT": "http"})
    assert r.exit_code != 0 and "KVTUNE_PORT" in r.output
    r = _cli("serve", "--help")
    for flag in ("--block-size", "--gpu-memory-utilization", "--swap-space", "--kv-cache-memory", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--watermark", "--enable-prefix-caching",
                 "--no-enable-chunked-prefill", "--served-model-name", "--api-key", "--config-file",
                 "--max-waiting", "--device", "--dtype", "--host", "--port"):
        assert flag in r.output, flag


@pytest.mark.slow
def test_serve_process_end_to_end(tiny_llama, tmp_path):  # noqa: F811
    """The real `kvtune serve` process: port from KVTUNE_PORT, key from VLLM_API_KEY, config file."""
    port = free_port()
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("max_num_seqs: 5\n")
    env = {**os.environ, "KVTUNE_PORT": str(port), "VLLM_API_KEY": "k1"}
    kvtune = os.path.join(os.path.dirname(sys.executable), "kvtune")
    p = subprocess.Popen([kvtune, "serve", "--model", str(tiny_llama),
                          "--host", "127.0.0.1", "--kv-cache-memory", "0.004", "--swap-space", "0.001",
                          "--max-model-len", "512", "--max-num-seqs", "3", "--served-model-name", "tiny",
                          "--config-file", str(cfg)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        import openai
        c = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        r = c.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        with urllib.request.urlopen(url + "/kvtune/v1/config", timeout=5) as r:
            assert json.loads(r.read())["config"]["max_num_seqs"] == 5  # the file wins over the flag
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
