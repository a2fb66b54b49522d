"""Requests replayed per CPU-second by the simulator (figures, not a timed test).

The trace: `kvtune trace gen --mix --requests 10000` (Poisson arrivals at 10 requests/s,
lognormal prompts of mean 512 tokens and outputs of mean 256 tokens; --prefix-groups adds shared
prefixes), replayed on a100-llama3-8b with the default engine config. Goal (issue 2): >= 5,000
requests per CPU-second.

    python bench/sim_speed.py [--requests 10000] [--repeats 3] [--profile a100-llama3-8b] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import mix
from kvtune_engine.sim.simulator import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--prefix-groups", type=int, default=0)
    ap.add_argument("--prefix-tokens", type=int, default=0)
    ap.add_argument("--profile", default="a100-llama3-8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    trace = mix(requests=a.requests, rate=a.rate, prefix_groups=a.prefix_groups,
                prefix_tokens=a.prefix_tokens, seed=0)
    profile = load_profile(a.profile)
    config = EngineConfig()
    times = []
    for _ in range(a.repeats):
        t0 = time.process_time()
        s = simulate(trace, config, profile)
        times.append(time.process_time() - t0)
    med = statistics.median(times)
    row = {"requests": a.requests, "profile": a.profile, "cpu_s_median": med,
           "requests_per_cpu_s": a.requests / med, "requests_per_cpu_s_best": a.requests / min(times),
           "cpu_s_all": times, "steps": s["steps"],
           "output_tokens": s["output_tokens"], "virtual_s": s["duration_s"]}
    if a.json:
        print(json.dumps(row))
    else:
        print(f"{a.requests} requests, {s['output_tokens']} output tokens, {s['steps']} steps, "
              f"{s['duration_s']:.0f} s virtual: median {med:.2f} CPU-s "
              f"= {a.requests / med:.0f} requests per CPU-second (best of {a.repeats}: "
              f"{a.requests / min(times):.0f})")


if __name__ == "__main__":
    main()
