"""The tuner's block-size and prefix-caching choice on Mooncake-shaped traces against a grid (issue 20).

For each seed: a Mooncake-shaped trace (tests/mooncake_shaped.py) imported as `kvtune trace import`
does, a grid of `simulate` over every block size x prefix caching on/off, and `kvtune tune`'s loop
(tune_trace, the other tuned knobs pinned at the start's values) from mis-tuned starts. Prints the
grid's best, each start's choice and its goodput as a ratio of the best (the target: >= 0.95).

    .venv/bin/python bench/mooncake_tuning.py [--seeds 0,1,2] [--requests 160] [--rate 2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtune_engine.config import BLOCK_SIZES, EngineConfig  # noqa: E402
from kvtune_engine.knobs import TABLE  # noqa: E402
from kvtune_engine.sim.profiles import PROFILES  # noqa: E402
from kvtune_engine.sim.simulator import SLO, simulate  # noqa: E402
from kvtune_engine.sim.trace_import import import_trace  # noqa: E402
from kvtune_operator.tuner.candidates import Bounds  # noqa: E402
from kvtune_operator.tuner_cli import tune_trace  # noqa: E402
from tests.mooncake_shaped import write_mooncake  # noqa: E402

MOVED = ("block_size", "enable_prefix_caching")
STARTS = ((16, False), (128, False), (8, True), (32, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the generated trace")
    ap.add_argument("--profile", default="l20-qwen3-8b")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    a = ap.parse_args()
    p, slo = PROFILES[a.profile], SLO(ttft_s=a.slo_ttft)
    worst = 1.0
    with tempfile.TemporaryDirectory() as d:
        for seed in (int(s) for s in a.seeds.split(",")):
            src = write_mooncake(Path(d) / f"mc{seed}.jsonl", requests=a.requests, seed=seed, rate_per_s=a.rate)
            imp = import_trace(src)
            trace = imp.requests
            print(imp.summary(src.name))
            grid = {(bs, pc): simulate(trace, EngineConfig(block_size=bs, enable_prefix_caching=pc), p, slo)[
                "goodput_requests_per_s"] for bs in BLOCK_SIZES for pc in (True, False)}
            best_key = max(grid, key=grid.get)
            best = grid[best_key]
            off = max(v for (_, pc), v in grid.items() if not pc)
            print(f"  grid best {best:.4f} goodput req/s at block {best_key[0]}, caching {best_key[1]}; "
                  f"best with caching off {off:.4f} ({off / best:.2f} of best)")
            for bs, pc in STARTS:
                start = EngineConfig(block_size=bs, enable_prefix_caching=pc)
                pins = {k.name: getattr(start, k.name) for k in TABLE if k.bounded and k.name not in MOVED}
                out = tune_trace(trace, start, p, slo_ttft=a.slo_ttft, bounds=Bounds.parse(pins))
                chosen = (out["config"]["block-size"], out["config"]["enable-prefix-caching"])
                got = grid[chosen]
                worst = min(worst, got / best)
                print(f"  start block {bs}, caching {pc}: chose block {chosen[0]}, caching {chosen[1]}: "
                      f"{got:.4f} ({got / best:.3f} of best)")
    print(f"worst ratio {worst:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
