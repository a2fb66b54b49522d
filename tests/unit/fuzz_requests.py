"""A seeded generator of hostile HTTP requests for every endpoint of the engine's server, and the
checks a fuzz run makes (``tests/unit/test_server_fuzz.py`` runs a bounded number; ``bench/fuzz_server.py``
runs more).

Each case is a valid request body mutated one to three times: a field set to a hostile value (huge or
negative numbers, NaN, lone surrogates, wrong types, deep nesting), a field dropped, an unknown field
added, or the raw bytes cut, flipped or wrapped. Valid greedy requests are interleaved; they must come
back exactly as they did on an idle server.
"""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, -10**30,
    0.5, -0.5, 1e-39, 1e-45, -1e-40, 1e308, -1e308, 3.0, 100.5, "", "x", "\ud800", "\udfff tail", "a" * 3000,
    "hot", "１２", [], [1], [-5], [10**9], [2**64], [[1, 2]], [["x"]], {}, {"a": 1}, {"1": 2**70},
    {"5": 1e308}, {"99999999": 1}, {"-1": 1}, {"x": "y"}, [{"type": "text", "text": "hi"}],
    [{"type": "image_url"}], {"type": "json_object"}, "auto", {"include_usage": "yes"},
    {"continuous_usage_stats": True, "include_usage": True},
]
COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                 "stop_token_ids", "seed", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "logit_bias", "user", "cache_salt", "tools", "tool_choice",
                 "response_format", "reasoning_effort", "unknown_field", "best_of", "suffix"]
COMPLETION_FIELDS = COMMON_FIELDS + ["prompt", "logprobs", "echo"]
CHAT_FIELDS = COMMON_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "add_generation_prompt", "chat_template_kwargs"]
RAW_BODIES = [
    b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe\x00", b'{"prompt": NaN}', b'{"prompt": Infinity}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"messages": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"}",
    b'{"prompt": "\\ud800\\udc00\\ud800", "max_tokens": 2}',
]


@dataclass
class Case:
    method: str
    path: str
    body: bytes | None = None
    valid_reference: str | None = None   # a valid request: its expected response text
    stream: bool = False


@dataclass
class Findings:
    cases: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def valid_completion(rng: random.Random, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": rng.choice(["hello", "the cat sat", "one two three four"]),
            "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 99)}


def valid_chat(rng: random.Random, model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": rng.choice(["hi", "tell me", "ok?"])}],
            "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 1.0])}


def mutate(rng: random.Random, body: dict[str, Any], fields: list[str]) -> bytes:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.6:
            body[rng.choice(fields)] = rng.choice(HOSTILE_VALUES)
        elif op < 0.75 and body:
            body.pop(rng.choice(sorted(body)))
        elif op < 0.85:
            body[rng.choice(fields)] = _nest(rng.randint(2, 60))
        else:
            raw = json.dumps(body).encode()
            if rng.random() < 0.5:
                return raw[:rng.randint(0, len(raw))]
            i = rng.randrange(len(raw))
            return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    if body.get("max_tokens") is not None and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 24:
        body["max_tokens"] = rng.choice([body["max_tokens"], 24])   # keep the tiny engine's work bounded
    return json.dumps(body).encode()


def _nest(depth: int) -> Any:
    x: Any = 1
    for i in range(depth):
        x = [x] if i % 2 else {"k": x}
    return x


def cases(seed: int, n: int, model: str, references: dict[str, str]) -> list[Case]:
    rng = random.Random(seed)
    out: list[Case] = []
    for i in range(n):
        r = rng.random()
        if i % 5 == 0:
            prompt = rng.choice(sorted(references))
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            out.append(Case("POST", "/v1/completions", json.dumps(body).encode(), references[prompt]))
        elif r < 0.4:
            raw = mutate(rng, valid_completion(rng, model), COMPLETION_FIELDS)
            out.append(Case("POST", "/v1/completions", raw, stream=b'"stream": true' in raw))
        elif r < 0.8:
            raw = mutate(rng, valid_chat(rng, model), CHAT_FIELDS)
            out.append(Case("POST", "/v1/chat/completions", raw, stream=b'"stream": true' in raw))
        elif r < 0.86:
            out.append(Case("POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), rng.choice(RAW_BODIES)))
        elif r < 0.9:
            out.append(Case("GET", rng.choice(["/v1/models", f"/v1/models/{model}", "/v1/models/%ED%A0%80",
                                                "/v1/models/" + "x" * 3000, "/v1/models/a/b"])))
        elif r < 0.95:
            q = rng.choice(["", "?limit=-1", "?limit=abc", "?since_s=nan", "?since_s=1e999", "?format=xml",
                            "?limit=" + "9" * 5000, "?format=jsonl&limit=3", "?unfinished=maybe",
                            "?unfinished=true&since_s=nan", "?unfinished=true&format=jsonl"])
            out.append(Case("GET", rng.choice(["/kvtune/v1/trace", "/kvtune/v1/steps", "/kvtune/v1/state"]) + q))
        else:
            patch = rng.choice([{"bogus": 1}, {"max_num_seqs": rng.choice(HOSTILE_VALUES)},
                                {"block_size": rng.choice(HOSTILE_VALUES)}, {"watermark": rng.choice(HOSTILE_VALUES)},
                                {"enable_prefix_caching": rng.choice(HOSTILE_VALUES)}])
            if isinstance(patch.get("max_num_seqs"), int) and not isinstance(patch["max_num_seqs"], bool) \
                    and 0 < patch["max_num_seqs"] < 8:
                patch["max_num_seqs"] = 8   # a valid change, but not one that starves the run
            if patch.get("watermark") is not None and isinstance(patch["watermark"], (int, float)) \
                    and 0.05 < patch["watermark"] < 1:
                patch["watermark"] = 0.01
            out.append(Case("PATCH", "/kvtune/v1/config", json.dumps(patch).encode()))
    return out


async def run_case(c: httpx.AsyncClient, base: str, case: Case, f: Findings) -> None:
    headers = {"content-type": "application/json"} if case.body is not None else {}
    where = f"{case.method} {case.path[:120]} {case.body[:160] if case.body else b''!r}"
    async with c.stream(case.method, base + case.path, content=case.body, headers=headers) as r:
        raw = await r.aread()
    f.cases += 1
    f.by_status[r.status_code] = f.by_status.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        f.problems.append(f"{r.status_code} for {where}: {raw[:300]!r}")
        return
    if 400 <= r.status_code < 500:
        try:
            e = json.loads(raw)["error"]
            assert set(e) >= {"message", "type", "param", "code"}
        except Exception:  # noqa: BLE001
            f.problems.append(f"{r.status_code} not in OpenAI's error shape for {where}: {raw[:200]!r}")
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                if "error" in obj:
                    f.problems.append(f"error event in a 200 stream for {where}: {line[:300]}")
        return
    if case.valid_reference is not None:
        text = json.loads(raw)["choices"][0]["text"]
        if text != case.valid_reference:
            f.problems.append(f"valid request answered {text!r}, expected {case.valid_reference!r}")


async def run_cases(base: str, all_cases: list[Case], concurrency: int = 4) -> Findings:
    f = Findings()
    q: asyncio.Queue[Case] = asyncio.Queue()
    for case in all_cases:
        q.put_nowait(case)

    async def worker(c: httpx.AsyncClient) -> None:
        while not q.empty():
            case = q.get_nowait()
            try:
                await run_case(c, base, case, f)
            except httpx.HTTPError as e:
                f.problems.append(f"transport error {type(e).__name__} for {case.method} {case.path[:120]}: {e}")

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return f
