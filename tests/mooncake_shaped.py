"""A small Mooncake-shaped request trace, generated (never downloaded): the layout of Mooncake's
released traces (JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``: one
id per 512-token block, a new block a new consecutive id) and the structure that makes them matter
to a KV-cache tuner: a few popular system prompts (Zipf-like), multi-turn sessions whose next turn
repeats the previous prompt's full blocks and adds new ones, and one-off requests.

Run as a script to write one: ``python tests/mooncake_shaped.py OUT.jsonl [--requests N] [--seed S]``.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512


def mooncake_lines(requests: int = 160, seed: int = 0, rate_per_s: float = 2.0, systems: int = 4) -> list[dict]:
    """``requests`` Mooncake trace records in arrival order (deterministic in ``seed``)."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    sys_prompts = [new_ids(rng.randint(1, 4)) for _ in range(systems)]
    weights = [1.0 / (i + 1) for i in range(systems)]
    t_ms = 0.0
    live: list[dict] = []          # sessions with turns left: {"ids", "turns", "due_ms"}
    out: list[dict] = []
    while len(out) < requests:
        t_ms += rng.expovariate(rate_per_s) * 1000.0
        due = [s for s in live if s["due_ms"] <= t_ms]
        if due and rng.random() < 0.6:                      # a session's next turn
            s = due[0]
            ids = s["ids"][:-1] + new_ids(rng.randint(1, 3))   # the last, partial block changed
            s["turns"] -= 1
            if s["turns"] == 0:
                live.remove(s)
        elif rng.random() < 0.8:                            # a new session on a system prompt
            base = rng.choices(sys_prompts, weights)[0]
            ids = base + new_ids(rng.randint(1, 6))
            s = {"turns": rng.randint(0, 4)}
            if s["turns"]:
                live.append(s)
        else:                                               # a one-off request
            ids, s = new_ids(rng.randint(1, 8)), {}
        if s:
            s["ids"] = ids
            s["due_ms"] = t_ms + rng.uniform(5_000, 30_000)     # the user reads, then asks again
        out.append({"timestamp": int(t_ms), "input_length": len(ids) * BLOCK - rng.randint(0, BLOCK - 1),
                    "output_length": max(1, int(rng.lognormvariate(5.0, 0.6))), "hash_ids": ids})
    return out


def write_mooncake(path: str | Path, **kw) -> Path:
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in mooncake_lines(**kw)))
    return p


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_mooncake(a.out, requests=a.requests, seed=a.seed)
