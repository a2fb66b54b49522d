"""Fuzz the engine's real server with many more cases than ``make test`` runs.

    python bench/fuzz_server.py [--cases 3000] [--seed 1] [--concurrency 8]

Starts `kvtune serve`'s app on a tiny random model (built here), sends seeded random and mutated
requests to every endpoint interleaved with valid greedy ones (the generator is
``tests/unit/fuzz_requests.py``), and prints the status histogram and every problem found: a 5xx,
a 4xx outside OpenAI's error shape, a valid request answered differently than on an idle server, a
transport error, or KV blocks left in use. Exit status 1 when anything was found.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "unit"))

from conftest_engine import run_server  # noqa: E402
from fuzz_requests import cases, run_cases  # noqa: E402

from kvtune_engine.model.tiny import make_tiny_model  # noqa: E402

PROMPTS = ["hello", "the cat sat", "one two three four"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model(Path(d) / "tiny", arch="llama")
        with run_server(model, max_model_len=128, max_num_seqs=32) as s:
            refs = {p: httpx.post(s.url + "/v1/completions", timeout=60, json={
                "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
                for p in PROMPTS}
            t0 = time.monotonic()
            found = asyncio.run(run_cases(s.url, cases(a.seed, a.cases, s.engine.model_name, refs), a.concurrency))
            dt = time.monotonic() - t0
            st = s.wait_idle(60)
            b = st["blocks"]
            if b["used"] or b["free"] + b["cached"] + b["reserved"] != b["total"]:
                found.problems.append(f"blocks not all free at the end: {b}")
            if httpx.get(s.url + "/health").status_code != 200:
                found.problems.append("/health is not 200 at the end")
    print(f"{found.cases} cases in {dt:.1f} s, seed {a.seed}; status histogram: "
          f"{dict(sorted(found.by_status.items()))}")
    for p in found.problems:
        print("PROBLEM:", p)
    print(f"{len(found.problems)} problems")
    return 1 if found.problems else 0


if __name__ == "__main__":
    sys.exit(main())
