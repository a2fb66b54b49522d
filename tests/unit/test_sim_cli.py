"""`kvtune sim` and `kvtune trace gen` as a user runs them: output, determinism, and one clear
error (never a traceback) for bad input."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtune_operator.cli import main
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.trace import dumps, read_trace


@pytest.fixture()
def cli():
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(main, list(args), input=input, catch_exceptions=False)
    return invoke


@pytest.fixture()
def small_trace(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival_s": 0.0, "prompt_tokens": 120, "output_tokens": 20}\n'
                 '{"arrival_s": 0.1, "prompt_tokens": 300, "output_tokens": 8, "prefix_group": "a", '
                 '"prefix_tokens": 64}\n'
                 '{"arrival_s": 0.2, "prompt_tokens": 90, "output_tokens": 30, "prefix_group": "a", '
                 '"prefix_tokens": 64}\n')
    return str(f)


def test_help_lists_the_commands(cli):
    r = cli("--help")
    assert r.exit_code == 0 and "sim" in r.output and "trace" in r.output
    r = cli("sim", "--help")
    for flag in ("--block-size", "--gpu-memory-utilization", "--swap-space", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enable-chunked-prefill", "--watermark", "--slo-ttft",
                 "--slo-tpot", "--json"):
        assert flag in r.output


def test_trace_gen_is_deterministic_and_matches_the_scenario(cli, tmp_path):
    a = cli("trace", "gen", "--scenario", "seq-cap", "--seed", "3")
    b = cli("trace", "gen", "--scenario", "seq-cap", "--seed", "3")
    c = cli("trace", "gen", "--scenario", "seq-cap", "--seed", "4")
    assert a.exit_code == 0 and a.stdout == b.stdout != c.stdout
    assert a.stdout == dumps(SCENARIOS["seq-cap"].trace(3))
    assert "kvtune sim --trace FILE --profile a100-llama3-8b --max-num-seqs 64" in a.stderr
    out = tmp_path / "t.jsonl"
    r = cli("trace", "gen", "--scenario", "long-prompt", "-o", str(out))
    assert r.exit_code == 0 and r.stdout == ""
    assert read_trace(out) == SCENARIOS["long-prompt"].trace(0)
    assert f"--trace {out}" in r.stderr and "--no-enable-chunked-prefill" in r.stderr


def test_trace_gen_mix(cli, tmp_path):
    out = tmp_path / "m.jsonl"
    r = cli("trace", "gen", "--mix", "--requests", "200", "--rate", "40", "--arrival", "bursty",
            "--prompt-mean", "100", "--output-mean", "50", "--prefix-groups", "2", "--prefix-tokens", "32",
            "--prefix-share", "1", "--max-tokens", "512", "-o", str(out))
    assert r.exit_code == 0
    reqs = read_trace(out)
    assert len(reqs) == 200 and all(q.prefix_group in ("prefix-0", "prefix-1") for q in reqs)
    assert all(q.prompt_tokens + q.output_tokens <= 512 for q in reqs)


def test_sim_json(cli, small_trace):
    r = cli("sim", "--trace", small_trace, "--profile", "cpu-tiny", "--kv-cache-memory", "0.01",
            "--block-size", "32", "--max-num-seqs", "2", "--no-enable-prefix-caching", "--slo-ttft", "1",
            "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    for k in ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "queue_time_p50_s", "queue_time_p99_s", "preemptions",
              "waiting_cause_share", "kv_usage_mean", "internal_fragmentation_mean", "swap_usage_peak",
              "num_blocks", "config"):
        assert k in s
    assert s["config"]["block_size"] == 32 and s["config"]["max_num_seqs"] == 2
    assert s["config"]["enable_prefix_caching"] is False and s["slo"]["ttft_s"] == 1.0
    assert s["requests"]["finished"] == 3 and s["output_tokens"] == 58
    assert s["num_blocks"] == int(0.01 * 2**30) // (32 * 4096)  # cpu-tiny: 4096 bytes of K/V per token


def test_sim_report_names_the_dominant_cause(cli, small_trace, tmp_path):
    r = cli("sim", "--trace", small_trace, "--profile", "a100-llama3-8b", "--max-num-seqs", "1")
    assert r.exit_code == 0
    out = r.stdout
    for text in ("output tokens/s", "goodput", "TTFT", "TPOT", "queue time", "preemptions",
                 "KV usage mean", "internal fragmentation", "swap usage", "KV blocks of 16 tokens"):
        assert text in out
    cause_line = next(line for line in out.splitlines() if line.strip().startswith("max_num_seqs"))
    assert cause_line.endswith("<- dominant")


def test_sim_reads_stdin(cli, small_trace):
    with open(small_trace) as f:
        r = cli("sim", "--trace", "-", "--profile", "cpu-tiny", "--kv-cache-memory", "0.01", "--json",
                input=f.read())
    assert r.exit_code == 0 and json.loads(r.stdout)["requests"]["total"] == 3


@pytest.mark.parametrize("args, code, msg", [
    (["--block-size", "24"], 2, "--block-size 24 is not allowed; choose one of [8, 16, 32, 64, 128]"),
    (["--gpu-memory-utilization", "1.5"], 2, "--gpu-memory-utilization: Input should be less than or equal to 1"),
    (["--gpu-memory-utilization", "0"], 2, "--gpu-memory-utilization: Input should be greater than 0"),
    (["--swap-space", "-1"], 2, "--swap-space: Input should be greater than or equal to 0"),
    (["--max-num-batched-tokens", "8"], 2, "--max-num-batched-tokens 8 is smaller than one block"),
    (["--max-num-seqs", "many"], 2, "'many' is not a valid integer"),
    (["--slo-ttft", "0"], 2, "--slo-ttft must be > 0"),
    (["--profile", "nope"], 2, "unknown profile 'nope'"),
    (["--gpu-memory-utilization", "0.1"], 2, "no room for the KV cache"),
    (["--swap-space", "4096"], 2, "exceeds the host memory"),
])
def test_bad_flags_give_one_clear_error(cli, small_trace, args, code, msg):
    base = ["sim", "--trace", small_trace, "--profile", "a100-llama3-8b"]
    r = cli(*(base + args if "--profile" not in args else base[:3] + args))
    assert r.exit_code == code
    assert msg in r.output and "Traceback" not in r.output
    assert r.output.count("Error:") == 1


@pytest.mark.parametrize("content, msg", [
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n{"arrival_s": 1, "prompt_tokens": 5\n',
     "t.jsonl:2: not valid JSON"),
    ('\n\n{"arrival_s": 0, "prompt_tokens": -5, "output_tokens": 3}\n', "t.jsonl:3: prompt_tokens must be >= 1"),
    ("", "no requests in the trace"),
])
def test_malformed_traces_give_the_line_number(cli, tmp_path, content, msg):
    f = tmp_path / "t.jsonl"
    f.write_text(content)
    r = cli("sim", "--trace", str(f), "--profile", "cpu-tiny")
    assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output


def test_missing_trace_file(cli, tmp_path):
    r = cli("sim", "--trace", str(tmp_path / "nope.jsonl"), "--profile", "cpu-tiny")
    assert r.exit_code == 1 and "cannot open" in r.output


@pytest.mark.parametrize("args, msg", [
    ([], "give exactly one of --scenario NAME and --mix"),
    (["--scenario", "seq-cap", "--mix"], "give exactly one of"),
    (["--scenario", "seq-cap", "--rate", "3"], "--rate: only with --mix"),
    (["--scenario", "nope"], "Invalid value for '--scenario'"),
    (["--mix", "--rate", "-1"], "--rate must be > 0"),
    (["--mix", "--prefix-groups", "2"], "--prefix-groups and --prefix-tokens go together"),
])
def test_trace_gen_bad_flags(cli, args, msg):
    r = cli("trace", "gen", *args)
    assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
