"""`kvtune trace import`: the logs people have (Azure trace, BurstGPT, guidellm, inference-perf, Mooncake) become
our JSONL trace, through the real CLI; malformed files stop with FILE:LINE and exit status 1."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune_engine.sim.trace import read_trace
from kvtune_engine.sim.trace_import import detect_format, import_trace, parse_datetime
from kvtune_operator.cli import main
from tests.mooncake_shaped import mooncake_lines, write_mooncake

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2000000,879,0
2023-11-16 18:16:02.1000000,1024,311
"""

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,Conversation log
46,GPT-4,417,0,417,Conversation log
118,GPT-4,417,276,693,API log
"""


def _guidellm_v02() -> dict:
    # guidellm 0.2: per-request start_time/end_time (epoch seconds), prompt_tokens, output_tokens
    def req(i, start, p, o):
        return {"type_": "generative_text_response", "request_id": f"r{i}", "request_type": "text_completions",
                "prompt": "…", "output": "…", "prompt_tokens": p, "output_tokens": o, "start_time": start,
                "end_time": start + 2.0, "first_token_time": start + 0.1, "last_token_time": start + 2.0}
    return {"benchmarks": [{
        "type_": "generative_benchmark", "start_time": 1700000000.0, "end_time": 1700000010.0,
        "request_totals": {"successful": 3, "incomplete": 1, "errored": 1, "total": 5},
        "requests": {"successful": [req(0, 1700000000.5, 512, 128), req(1, 1700000000.0, 256, 64),
                                    req(2, 1700000003.25, 1024, 256)],
                     "incomplete": [{**req(3, 1700000009.0, 300, 10), "error": "cancelled"}],
                     "errored": [{**req(4, 1700000004.0, 200, 0), "error": "HTTP 500"}]}}]}


def _guidellm_v04() -> dict:
    # guidellm 0.4+: info.timings.request_start, input_metrics/output_metrics, computed fields dumped
    def req(i, start, p, o):
        return {"type_": "generative_request_stats", "request_id": f"r{i}", "request_type": "chat_completions",
                "info": {"timings": {"request_start": start, "request_end": start + 1.0, "resolve_end": start + 1.0}},
                "input_metrics": {"total_tokens": p, "text_tokens": p}, "output_metrics": {"total_tokens": o},
                "request_start_time": start, "prompt_tokens": p, "output_tokens": o}
    return {"metadata": {"version": 1}, "args": {}, "benchmarks": [
        {"type_": "generative_benchmark", "requests": {"successful": [req(0, 50.0, 100, 20), req(1, 51.0, 200, 40)],
                                                       "incomplete": [], "errored": []}},
        {"type_": "generative_benchmark", "requests": {"successful": [req(2, 60.0, 300, 60)],
                                                       "incomplete": [], "errored": []}}]}


def _inference_perf() -> list:
    # per_request_lifecycle_metrics.json, current (request_metrics/response_metrics) and older shapes
    return [
        {"start_time": 1000.25, "end_time": 1002.0, "request": "{...}", "response": "{...}",
         "info": {"request_metrics": {"text": {"input_tokens": 812}}, "input_tokens": 812,
                  "response_metrics": {"output_tokens": 190, "server_usage": {"completion_tokens": 191},
                                       "output_token_times": []}},
         "error": None},
        {"start_time": 1000.0, "end_time": 1001.0, "request": "{...}", "response": "{...}",
         "info": {"input_tokens": 100, "output_tokens": 50, "output_token_times": []}, "error": None},
        {"start_time": 1001.5, "end_time": 1001.6, "request": "{...}", "response": None,
         "info": {"input_tokens": 100, "response_info": {"output_tokens": 0}},
         "error": {"error_type": "ClientResponseError", "error_msg": "503"}},
        {"start_time": 1003.0, "end_time": 1004.0, "request": "{...}", "response": "{...}",
         "info": {"input_tokens": 64, "response_info": {"output_tokens": 32, "chunk_times": []}}, "error": None},
    ]


def _write(tmp_path: Path, name: str, content) -> Path:
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return p


def _run(*args: str):
    return CliRunner().invoke(main, ["trace", "import", *args])


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_azure_datetime_with_seven_fractional_digits():
    assert parse_datetime("2023-11-16 18:15:50.9951690") - parse_datetime("2023-11-16 18:15:46.6805900") == \
        pytest.approx(4.314579, abs=1e-6)
    assert parse_datetime("2024-05-10T00:00:01Z") - parse_datetime("2024-05-10 00:00:00") == pytest.approx(1.0)


def test_azure_csv_becomes_a_trace(tmp_path):
    src = _write(tmp_path, "AzureLLMInferenceTrace_conv.csv", AZURE)
    out = tmp_path / "t.jsonl"
    r = _run(str(src), "-o", str(out))
    assert r.exit_code == 0, r.output
    trace = read_trace(out)  # our own loader accepts what the import wrote
    assert [(t.arrival_s, t.prompt_tokens, t.output_tokens) for t in trace] == [
        (0.0, 374, 44), (4.314579, 396, 109), (pytest.approx(15.41941), 1024, 311)]
    assert "dropped 1 with no output tokens" in r.stderr


def test_burstgpt_failed_rows_are_dropped_and_model_filter(tmp_path):
    src = _write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    r = _run(str(src))
    assert r.exit_code == 0, r.output
    assert [(d["arrival_s"], d["prompt_tokens"], d["output_tokens"]) for d in _lines(r.stdout)] == [
        (0.0, 472, 18), (40.0, 1087, 230), (113.0, 417, 276)]
    assert "dropped 1 failed (Response tokens 0)" in r.stderr
    r = _run(str(src), "--model", "GPT-4")
    assert [d["output_tokens"] for d in _lines(r.stdout)] == [276]


def test_speedup_slice_and_limit(tmp_path):
    src = _write(tmp_path, "b.csv", BURSTGPT)
    r = _run(str(src), "--speedup", "10", "--start", "30", "--duration", "100")
    assert [d["arrival_s"] for d in _lines(r.stdout)] == [1.0, 8.3]  # t=35 and t=108 past the slice start, /10
    r = _run(str(src), "--limit", "1")
    assert len(_lines(r.stdout)) == 1
    r = _run(str(src), "--start", "500")
    assert r.exit_code == 1 and "no requests left of 4 read; dropped 1 failed (Response tokens 0), 3 outside the time slice" in r.output
    r = _run(str(src), "--speedup", "0")
    assert r.exit_code == 2 and "--speedup" in r.output


def test_guidellm_v02_report(tmp_path):
    src = _write(tmp_path, "benchmarks.json", _guidellm_v02())
    assert detect_format(src) == "guidellm"
    res = import_trace(src)
    assert [(t.arrival_s, t.prompt_tokens, t.output_tokens) for t in res.requests] == [
        (0.0, 256, 64), (0.5, 512, 128), (3.25, 1024, 256)]
    assert res.dropped == {"incomplete (output length unknown)": 1, "errored (output length unknown)": 1}


def test_guidellm_v04_report_and_benchmark_choice(tmp_path):
    src = _write(tmp_path, "benchmarks.json", _guidellm_v04())
    r = _run(str(src))
    assert r.exit_code == 0, r.output
    assert [(d["arrival_s"], d["prompt_tokens"]) for d in _lines(r.stdout)] == [(0.0, 100), (1.0, 200), (10.0, 300)]
    r = _run(str(src), "--benchmark", "2")
    assert [(d["arrival_s"], d["output_tokens"]) for d in _lines(r.stdout)] == [(0.0, 60)]
    r = _run(str(src), "--benchmark", "3")
    assert r.exit_code == 1 and "the report has 2 benchmark(s)" in r.output


def test_inference_perf_per_request(tmp_path):
    src = _write(tmp_path, "per_request_lifecycle_metrics.json", _inference_perf())
    assert detect_format(src) == "inference-perf"
    res = import_trace(src)
    # the server's completion_tokens wins over the client's re-tokenized count
    assert [(t.arrival_s, t.prompt_tokens, t.output_tokens) for t in res.requests] == [
        (0.0, 100, 50), (0.25, 812, 191), (3.0, 64, 32)]
    assert res.dropped == {"failed (error)": 1}


def test_kvtune_jsonl_passes_through_with_prefixes(tmp_path):
    src = _write(tmp_path, "t.jsonl", '{"arrival_s": 2.0, "prompt_tokens": 10, "output_tokens": 3, '
                                      '"prefix_group": "a", "prefix_tokens": 4}\n'
                                      '{"arrival_s": 4.0, "prompt_tokens": 12, "output_tokens": 5}\n')
    r = _run(str(src), "--speedup", "2")
    assert _lines(r.stdout) == [{"arrival_s": 0.0, "prompt_tokens": 10, "output_tokens": 3, "prefix_group": "a",
                                 "prefix_tokens": 4}, {"arrival_s": 1.0, "prompt_tokens": 12, "output_tokens": 5}]


@pytest.mark.parametrize("name,content,fmt,expect", [
    ("az.csv", AZURE.replace("396,109", "396,lots"), None, "az.csv:3: GeneratedTokens must be an integer >= 0 (got 'lots')"),
    ("az.csv", AZURE.replace("2023-11-16 18:15:50.9951690", "yesterday"), None, "az.csv:3: TIMESTAMP: not a datetime"),
    ("az.csv", AZURE.replace("1024,311", "1024"), None, "az.csv:5: 2 fields, the header has 3"),
    ("b.csv", BURSTGPT.replace("45,ChatGPT,1087", "45,ChatGPT,-3"), None, "b.csv:3: Request tokens must be an integer >= 0"),
    ("b.csv", BURSTGPT.replace("118,GPT-4", "soon,GPT-4"), None, "b.csv:5: Timestamp must be a number of seconds"),
    ("b.csv", "Timestamp,Model,Request tokens\n1,ChatGPT,3\n", "burstgpt", "b.csv:1: not a BurstGPT CSV: no column Response tokens"),
    ("u.csv", "when,what\n1,2\n", None, "u.csv:1: cannot tell the format"),
])
def test_malformed_csv_names_file_and_line(tmp_path, name, content, fmt, expect):
    src = _write(tmp_path, name, content)
    r = _run(str(src), *(["--format", fmt] if fmt else []))
    assert r.exit_code == 1
    assert r.output.startswith("Error: ") and expect in r.output, r.output


def test_malformed_json_names_file_and_line(tmp_path):
    doc = _guidellm_v02()
    del doc["benchmarks"][0]["requests"]["successful"][1]["output_tokens"]
    src = _write(tmp_path, "benchmarks.json", doc)
    r = _run(str(src))
    text = src.read_text().splitlines()
    line = int(r.output.split(":")[2])
    assert r.exit_code == 1 and "benchmarks[0].requests.successful[1]: no output token count" in r.output
    assert text[line - 1].strip() == "{" and '"request_id": "r1"' in "".join(text[line:line + 2])  # its own line

    recs = _inference_perf()
    recs[3]["info"]["input_tokens"] = 6.5
    src = _write(tmp_path, "per_request_lifecycle_metrics.json", recs)
    r = _run(str(src))
    assert r.exit_code == 1 and "[3]: input_tokens must be an integer >= 0 (got 6.5)" in r.output
    line = int(r.output.split(":")[2])
    assert '"start_time": 1003.0' in src.read_text().splitlines()[line]

    src = _write(tmp_path, "broken.json", '{"benchmarks": [\n  {"requests": }\n]}')
    r = _run(str(src), "--format", "guidellm")
    assert r.exit_code == 1 and "broken.json:2: not valid JSON" in r.output


# ---------------------------------------------------------------------- Mooncake (hash chains)
MOONCAKE = """{"timestamp": 0, "input_length": 1200, "output_length": 80, "hash_ids": [0, 1, 2]}
{"timestamp": 1500, "input_length": 1500, "output_length": 30, "hash_ids": [0, 1, 3]}
{"timestamp": 1500, "input_length": 700, "output_length": 0, "hash_ids": [0, 4]}
{"timestamp": 4250, "input_length": 400, "output_length": 12, "hash_ids": [5]}
"""


def test_mooncake_trace_keeps_its_prefix_sharing(tmp_path):
    src = _write(tmp_path, "mooncake_trace.jsonl", MOONCAKE)
    assert detect_format(src) == "mooncake"
    out = tmp_path / "t.jsonl"
    r = _run(str(src), "-o", str(out))
    assert r.exit_code == 0, r.output
    trace = read_trace(out)
    assert [(t.arrival_s, t.prompt_tokens, t.output_tokens, t.hash_ids, t.hash_block) for t in trace] == [
        (0.0, 1200, 80, (0, 1, 2), 512), (1.5, 1500, 30, (0, 1, 3), 512), (4.25, 400, 12, (5,), 512)]
    # the second shares 2 of its blocks (1024 of 1500 tokens) with the first: 1024 of 3100 chained tokens
    assert "33% of the chained prompt tokens shared" in r.stderr and "dropped 1 with no output tokens" in r.stderr
    r = _run(str(src), "--hash-block", "256")          # fewer tokens per id: the chain covers less, still valid
    assert r.exit_code == 0 and _lines(r.stdout)[0]["hash_block"] == 256
    r = _run(str(src), "--hash-block", "1024")         # 3 ids of 1024 tokens: more than a 1200-token prompt
    assert r.exit_code == 1 and "mooncake_trace.jsonl:1: hash_ids has 3 ids; a prompt of 1200 tokens at 1024" in r.output
    r = _run(str(src), "--hash-block", "0")
    assert r.exit_code == 2 and "--hash-block must be >= 1" in r.output
    r = _run(str(_write(tmp_path, "b.csv", BURSTGPT)), "--hash-block", "16")
    assert r.exit_code == 2 and "--hash-block: only Mooncake and Bailian traces" in r.output


def test_a_mooncake_shaped_trace_imports_with_its_sharing(tmp_path):
    src = write_mooncake(tmp_path / "mc.jsonl", requests=120, seed=3)
    res = import_trace(src)
    lines = mooncake_lines(requests=120, seed=3)
    assert res.format == "mooncake" and len(res.requests) == 120
    by_chain = sorted((tuple(d["hash_ids"]), d["input_length"]) for d in lines)
    assert sorted((r.hash_ids, r.prompt_tokens) for r in res.requests) == by_chain
    assert "of the chained prompt tokens shared" in res.summary("mc.jsonl")


@pytest.mark.parametrize("line, expect", [
    ('{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}',
     "m.jsonl:2: hash_ids has 3 ids; a prompt of 600 tokens at 512 tokens per id holds at most 2"),
    ('{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, "x"]}',
     "m.jsonl:2: hash_ids[1] must be an integer >= 0"),
    ('{"timestamp": "soon", "input_length": 600, "output_length": 5}', "m.jsonl:2: timestamp (ms) must be a number"),
    ('{"timestamp": -5, "input_length": 600, "output_length": 5}', "m.jsonl:2: timestamp must be >= 0 ms"),
    ('{"timestamp": 10, "input_length": 6.5, "output_length": 5}', "m.jsonl:2: input_length must be an integer >= 0"),
    ('{"timestamp": 10, "output_length": 5, "hash_ids": []}', "m.jsonl:2: not a Mooncake trace line: no input_length"),
    ('{"timestamp": 10, "input_length": 600,', "m.jsonl:2: not valid JSON"),
    ('[1, 2]', "m.jsonl:2: expected a JSON object, got list"),
])
def test_malformed_mooncake_lines_name_line_and_field(tmp_path, line, expect):
    src = _write(tmp_path, "m.jsonl", MOONCAKE.splitlines()[0] + "\n" + line + "\n")
    r = _run(str(src))
    assert r.exit_code == 1 and r.output.startswith("Error: ") and expect in r.output, r.output


# Alibaba's Qwen-Bailian usage trace layout (its README's record): timestamp in seconds, 16-token hash ids
BAILIAN = """{"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40, "output_length": 132, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]}
{"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 70, "output_length": 80, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1092, 1093, 1094]}
{"chat_id": 161, "parent_chat_id": -1, "timestamp": 63.0, "input_length": 20, "output_length": 9, "type": "search", "turn": 1, "hash_ids": [7, 8]}
"""


def test_bailian_trace_seconds_and_16_token_chains(tmp_path):
    src = _write(tmp_path, "qwen_traceA_blksz_16.jsonl", BAILIAN)
    assert detect_format(src) == "bailian"
    r = _run(str(src))
    assert r.exit_code == 0, r.output
    assert _lines(r.stdout) == [
        {"arrival_s": 0.0, "prompt_tokens": 40, "output_tokens": 132, "hash_ids": [1089, 1090, 1091], "hash_block": 16},
        {"arrival_s": 1.386, "prompt_tokens": 70, "output_tokens": 80, "hash_ids": [1089, 1090, 1092, 1093, 1094],
         "hash_block": 16},
        {"arrival_s": 1.886, "prompt_tokens": 20, "output_tokens": 9, "hash_ids": [7, 8], "hash_block": 16}]
    # turn 2 repeats turn 1's first 2 blocks: 32 of the 130 chained prompt tokens
    assert "25% of the chained prompt tokens shared" in r.stderr
    bad = _write(tmp_path, "b.jsonl", BAILIAN.replace('"input_length": 20,', '"input_length": 10,'))
    r = _run(str(bad))
    assert r.exit_code == 1 and "b.jsonl:3: hash_ids has 2 ids; a prompt of 10 tokens at 16 tokens per id" in r.output
    r = _run(str(_write(tmp_path, "t.jsonl", BAILIAN.replace('"timestamp": 62.5', '"timestamp": "later"'))))
    assert r.exit_code == 1 and "t.jsonl:2: timestamp (s) must be a number" in r.output
