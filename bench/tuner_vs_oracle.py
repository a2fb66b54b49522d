"""The tuner against an oracle, in the simulator.

For each of the six scenarios of the field reports, the objective-bound workloads (a missed TPOT
with nothing waiting: prefill-stall, compute-bound, and issue 20's classify, summarise, chat-tight)
and a few random mixes:

* oracle: exhaustive search over a grid of configs, each replayed through the simulator on the
  evaluation trace (the workload's trace with seed 0); the best goodput is the oracle's;
* tuner: starts from the scenario's mis-tuned baseline (vLLM-like defaults with the scenario's knob
  set wrong; for the mixes, the plain defaults) and runs the operator's loop (``simulate_loop``) on
  production windows: fresh traces of the same workload (seeds 1, 2, ...; every trace, evaluation
  included, cut to the same share of the generator's length). Each window is "measured"
  by simulating it under the config in force with the true profile, recording its steps; the tuner
  fits its own step-cost model from those steps and predicts with it. Restart changes: cooldown of
  two windows, at most 3 in all;
* the tuned config is then replayed on the evaluation trace: tuned goodput / oracle goodput.

Regressions are judged on the evaluation trace (ground truth, not the tuner's own windows): an
applied change whose config is more than 10% worse than the config before it (goodput share of the
load; output throughput when both have next to no goodput) is a regression applied; one still in
force at the end (not rolled back), or an end state worse than the start, is a regression kept.

Goals (issue 5 section 6): tuned >= 0.95 of the oracle, within <= 3 restarts, no regression kept.

Runtime: each simulator replay takes 0.1-0.4 s of CPU; the oracle grids are 32-64 configs per
workload (block size x memory x max_num_seqs x token budget/chunked prefill, plus swap or prefix
caching where the workload needs them) and the tuner makes 10-30 predictions per window on a
shortened window, so the whole run is about 3 minutes of one core (``--only NAME`` for one).

    python bench/tuner_vs_oracle.py [--only seq-cap] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtune_engine.config import ConfigError, EngineConfig
from kvtune_engine.sim.profile import Profile
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS, mix
from kvtune_engine.sim.simulator import SLO, simulate
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.tuner.candidates import Bounds
from kvtune_operator.tuner.decide import Objectives, judge, knob_changes, window_figures
from kvtune_operator.tuner.loop import TunerSettings, simulate_loop

WINDOW_S = 300.0
THRESHOLD = 0.10


@dataclass
class Workload:
    name: str
    profile: str
    start: dict[str, Any]
    slo: tuple[float, float]
    make: Callable[[int], list[TraceRequest]]
    grid: dict[str, list[Any]]
    bounds: list[str] = field(default_factory=list)
    window_frac: float = 0.6         # windows: this share of a trace (keeps the tuner's predictions cheap)
    windows: int = 5


def _grid(**extra: list[Any]) -> dict[str, list[Any]]:
    g: dict[str, list[Any]] = {
        "block_size": [16, 32],
        "gpu_memory_utilization": [0.9, 0.95],
        "max_num_seqs": [64, 128, 256, 512],
        "budget": [(2048, True), (8192, True)],
    }
    g.update(extra)
    return g


def scenario_workloads() -> list[Workload]:
    out = []
    for name, sc in SCENARIOS.items():
        grid = _grid()
        bounds: list[str] = []
        if name == "shared-prefix":
            grid["gpu_memory_utilization"] = [0.7, 0.8, 0.95]
            grid["enable_prefix_caching"] = [True, False]
        elif name == "long-prompt":
            grid["budget"] = [(2048, True), (8192, True), (32768, False)]
        elif name == "block-waste":
            # a small co-located model: the user caps its memory (the GPU is shared)
            bounds = ["gpu-memory-utilization=0.02:0.05"]
            grid["gpu_memory_utilization"] = [0.04, 0.05]
            grid["block_size"] = [8, 16, 32, 128]
        elif name == "low-memory":
            grid["gpu_memory_utilization"] = [0.5, 0.7, 0.9, 0.95]
        elif name == "swap-full":
            grid["gpu_memory_utilization"] = [0.9, 0.95]
            grid["swap_space"] = [1.0, 4.0, 16.0]
        out.append(Workload(name, sc.profile, dict(sc.baseline), (sc.slo_ttft_s, sc.slo_tpot_s), sc.trace,
                            grid, bounds))
    return out


def objective_workloads() -> list[Workload]:
    """Workloads where the objectives are missed while nothing waits (issue 11), with the grid widened
    to the token budget, chunking and prefix caching:

    * prefill-stall: long prompts (2500 tokens) at a load one A100 carries, a 16k token budget: the
      queue is short, but the decodes sharing a step with a long prefill chunk miss a 35 ms TPOT;
    * compute-bound: the seq-cap trace at 3x its rate with a generous cap: one engine is saturated,
      no knob helps (the answer is replicas), and the tuner must not make things worse."""
    seq = SCENARIOS["seq-cap"]
    budgets = [(256, True), (512, True), (2048, True), (8192, True), (16384, True), (16384, False)]
    return [
        Workload("prefill-stall", "a100-llama3-8b", {"max_num_batched_tokens": 16384, "max_num_seqs": 256},
                 (5.0, 0.035),
                 lambda s: mix(requests=800, rate=2.0, prompt_mean=2500, prompt_sigma=0.7, output_mean=300,
                               output_sigma=0.5, seed=s),
                 {"max_num_seqs": [64, 128, 256], "budget": budgets, "enable_prefix_caching": [True, False]}),
        Workload("compute-bound", seq.profile, {"max_num_seqs": 1024}, (seq.slo_ttft_s, seq.slo_tpot_s),
                 lambda s: [TraceRequest(round(r.arrival_s / 3, 6), r.prompt_tokens, r.output_tokens)
                            for r in seq.trace(s)[:600]],
                 {"max_num_seqs": [256, 512, 1024], "budget": budgets[2:], "enable_prefix_caching": [True, False]}),
        *objective_bound_workloads(),
    ]


def objective_bound_workloads() -> list[Workload]:
    """Where the TPOT objective, not a queue, is the binding limit (issue 20), each from vLLM's default
    cap and budget (256, 8192): the steps that carry prefill chunks stall the decodes sharing them, and
    the grid (cap x a budget ladder down to 128) finds a much smaller budget:

    * classify: short prompts (200), very short outputs (5), 10/s on an L20, TPOT 80 ms;
    * summarise: long prompts (3000), 150-token summaries, 0.5/s on an L20, TPOT 50 ms;
    * chat-tight: chat lengths (500 in, 250 out), 10/s on an A100, TPOT 35 ms."""
    grid = {"max_num_seqs": [32, 64, 128, 256],
            "budget": [(t, True) for t in (128, 256, 512, 1024, 2048, 4096, 8192, 16384)]}
    start = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}

    def trace(**kw: Any) -> Callable[[int], list[TraceRequest]]:
        return lambda s: mix(seed=s, **kw)

    return [
        Workload("classify", "l20-qwen3-8b", start, (1.0, 0.08),
                 trace(requests=500, rate=10.0, prompt_mean=200, prompt_sigma=0.5, output_mean=5, output_sigma=0.5),
                 grid),
        Workload("summarise", "l20-qwen3-8b", start, (5.0, 0.05),
                 trace(requests=200, rate=0.5, prompt_mean=3000, prompt_sigma=0.4, output_mean=150,
                       output_sigma=0.5), grid),
        Workload("chat-tight", "a100-llama3-8b", start, (2.0, 0.035),
                 trace(requests=600, rate=10.0, prompt_mean=500, prompt_sigma=0.8, output_mean=250,
                       output_sigma=0.6), grid),
    ]


def mix_workloads(n: int = 3, seed: int = 2024) -> list[Workload]:
    """Random mixes from vLLM-like defaults: a random GPU profile, Poisson or bursty arrivals,
    lognormal lengths, sometimes shared prefixes; the rate puts the load near the card's capacity."""
    rng = random.Random(seed)
    # (profile, output tokens/s the card sustains at the defaults, roughly; SLO)
    cards = [("h200-qwen3-0.6b", 40000, (1.0, 0.05)), ("a100-llama3-8b", 3500, (2.0, 0.1)),
             ("l20-qwen3-8b", 1500, (4.0, 0.2))]
    out = []
    for i in range(n):
        prof, tput, slo = cards[i % len(cards)]
        prompt = rng.choice([200, 500, 1500])
        output = rng.choice([100, 300, 800])
        # prompt tokens cost about a tenth of an output token (prefill is batched)
        rate = tput / (output + 0.1 * prompt) * rng.uniform(0.7, 1.1)
        arrival = rng.choice(["poisson", "bursty"])
        groups = rng.choice([0, 0, 8])
        kw = dict(requests=500, rate=round(rate, 2), arrival=arrival, burstiness=2.0, prompt_mean=prompt,
                  output_mean=output,
                  max_tokens=8192, prefix_groups=groups, prefix_tokens=1000 if groups else 0)
        name = f"mix-{i}:{prof.split('-')[0]},{arrival},p{prompt},o{output},r{kw['rate']}" + (",prefix" if groups else "")
        out.append(Workload(name, prof, {}, slo, (lambda s, kw=kw: mix(seed=s, **kw)), _grid()))
    return out


def grid_configs(w: Workload, base: EngineConfig, profile: Profile, bounds: Bounds) -> list[EngineConfig]:
    keys = list(w.grid)
    out = []
    for values in itertools.product(*(w.grid[k] for k in keys)):
        ch = dict(zip(keys, values))
        if "budget" in ch:
            ch["max_num_batched_tokens"], ch["enable_chunked_prefill"] = ch.pop("budget")
        try:
            cfg = base.with_changes(**ch)
            profile.kv_cache_size(cfg)
        except ConfigError:
            continue
        if bounds.allows(cfg):
            out.append(cfg)
    return out


class Evaluator:
    def __init__(self, trace: list[TraceRequest], profile: Profile, slo: SLO) -> None:
        self.trace, self.profile, self.slo = trace, profile, slo
        self.cache: dict[str, dict] = {}

    def __call__(self, cfg: EngineConfig) -> dict:
        k = cfg.model_dump_json()
        if k not in self.cache:
            self.cache[k] = simulate(self.trace, cfg, self.profile, self.slo)
        return self.cache[k]

    def goodput(self, cfg: EngineConfig) -> float:
        return self(cfg)["goodput_requests_per_s"]


def run(w: Workload, verbose: bool = False) -> dict[str, Any]:
    t0 = time.process_time()
    profile = load_profile(w.profile)
    slo = SLO(*w.slo)
    start = EngineConfig.build(**w.start)
    bounds = Bounds.parse(w.bounds) if w.bounds else Bounds()
    def window(seed: int) -> list[TraceRequest]:
        tr = w.make(seed)
        return tr[: max(50, int(len(tr) * w.window_frac))]

    # the evaluation trace is one more window of the same workload (same length: a window replayed
    # from an empty engine shows less backlog than a longer one, so lengths must match)
    ev = Evaluator(window(0), profile, slo)

    # oracle
    t_or = time.process_time()
    grid = grid_configs(w, start, profile, bounds)
    best = max(grid, key=lambda c: (ev.goodput(c), ev(c)["output_tokens_per_s"]))
    oracle = ev.goodput(best)
    t_or = time.process_time() - t_or

    # tuner
    t_tu = time.process_time()
    # one more window than decisions: the last one only verifies the last change
    windows = [window(k) for k in range(1, w.windows + 2)]
    objectives = Objectives(slo_ttft_s=w.slo[0], slo_tpot_s=w.slo[1], cooldown_s=2 * WINDOW_S,
                            regression_threshold=THRESHOLD, max_restarts=3)
    settings = TunerSettings(bounds=bounds, objectives=objectives)

    def show(r):
        if not verbose:
            return
        rd = r.round
        line = f"    w{r.index} {rd.diagnosis.cause:<20} measured goodput {r.measured['goodput_requests_per_s']:.3g}"
        if rd.verdict is not None:
            line += f" | {'kept' if rd.verdict.keep else 'ROLLED BACK'}: {rd.verdict.reason}"
        if rd.decision is not None and rd.decision.action == "change":
            line += f" | change {rd.decision.changes} ({rd.decision.reason})"
        print(line, file=sys.stderr)

    sim_run = simulate_loop(windows, start, profile, settings, window_s=WINDOW_S, verify_last=True, on_round=show)
    t_tu = time.process_time() - t_tu
    tuned = ev.goodput(sim_run.final)

    # ground truth for every applied change: was it a regression on the evaluation trace? Judged
    # like the tuner's verification (goodput share of the load; throughput when both configs have
    # next to no goodput), on the evaluation trace rather than on the tuner's own windows.
    def worse(a: EngineConfig, b: EngineConfig) -> bool:
        return not judge(window_figures(ev(a)), window_figures(ev(b)), None, THRESHOLD).keep

    applied = regress_applied = regress_kept = 0
    for r in sim_run.windows:
        d = r.round.decision
        if d is None or d.action != "change":
            continue
        applied += 1
        if worse(d.current, d.config):
            regress_applied += 1
            if sim_run.final == d.config:
                regress_kept += 1
    start_g = ev.goodput(start)
    if worse(start, sim_run.final):  # the end state as a whole worse than the start
        regress_kept = max(regress_kept, 1)
    return {
        "workload": w.name, "profile": w.profile,
        "start_goodput": start_g, "tuned_goodput": tuned, "oracle_goodput": oracle,
        "ratio": tuned / oracle if oracle > 0 else (1.0 if tuned >= oracle else 0.0),
        "restarts": sim_run.restarts, "changes_applied": applied, "rolled_back": sim_run.rolled_back,
        "regressions_applied": regress_applied, "regressions_kept": regress_kept,
        "windows": len(sim_run.windows), "grid": len(grid),
        "start": knob_changes(EngineConfig(), start),
        "tuned": knob_changes(start, sim_run.final), "oracle": knob_changes(start, best),
        "cpu_s": round(time.process_time() - t0, 1), "cpu_oracle_s": round(t_or, 1), "cpu_tuner_s": round(t_tu, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="run only these workloads (scenario names or 'mix')")
    ap.add_argument("--mixes", type=int, default=3, help="number of random mixes [3]")
    ap.add_argument("--mix-seed", type=int, default=2024, help="seed of the random mixes [2024]")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every window's decision (stderr)")
    a = ap.parse_args(argv)
    workloads = scenario_workloads() + objective_workloads() + mix_workloads(a.mixes, a.mix_seed)
    if a.only:
        workloads = [w for w in workloads if any(w.name == o or w.name.startswith(o) for o in a.only)]
    t0 = time.process_time()
    rows = []
    hdr = (f"{'workload':<46} {'start':>9} {'tuned':>9} {'oracle':>9} {'ratio':>6} {'restarts':>8} "
           f"{'applied':>7} {'rolled':>6} {'regr.applied':>12} {'regr.kept':>9} {'cpu s':>6}")
    print(hdr)
    for w in workloads:
        if a.verbose:
            print(f"  {w.name}", file=sys.stderr)
        r = run(w, a.verbose)
        rows.append(r)
        print(f"{r['workload'][:46]:<46} {r['start_goodput']:>9.4g} {r['tuned_goodput']:>9.4g} "
              f"{r['oracle_goodput']:>9.4g} {r['ratio']:>6.2f} {r['restarts']:>8} {r['changes_applied']:>7} "
              f"{r['rolled_back']:>6} {r['regressions_applied']:>12} {r['regressions_kept']:>9} {r['cpu_s']:>6}",
              flush=True)
        if a.verbose:
            print(f"    tuned {r['tuned']}\n    oracle {r['oracle']}", file=sys.stderr)
    ok_ratio = sum(r["ratio"] >= 0.95 for r in rows)
    ok_restarts = sum(r["restarts"] <= 3 for r in rows)
    kept = sum(r["regressions_kept"] for r in rows)
    print(f"\n{ok_ratio}/{len(rows)} workloads at >= 0.95 of the oracle (min {min(r['ratio'] for r in rows):.2f}, "
          f"mean {sum(r['ratio'] for r in rows) / len(rows):.2f}); {ok_restarts}/{len(rows)} within 3 restarts "
          f"(max {max(r['restarts'] for r in rows)}); regressions applied "
          f"{sum(r['regressions_applied'] for r in rows)}, kept {kept}; "
          f"{time.process_time() - t0:.0f} s CPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
