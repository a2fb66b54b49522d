"""How often a verdict on a change is wrong on a noisy workload: before/after vs canary, in the simulator.

The workload is chat traffic (300-token prompts, 400-token answers, seq-cap's shape) to a deployment
of ``--replicas`` engines, whose arrival rate moves by up to +-``--swing`` (default 30%) from one
window to the next, with Poisson arrivals inside each window. Each trial draws a current config A and
a changed one B (one knob, max_num_seqs or max_num_batched_tokens, moved to a neighbouring value of
its grid, as the tuner moves them: some changes help, some hurt, some do nothing), then two
consecutive windows w0 and w1 of the workload:

* truth: w1 replayed on every engine under A and under B (each engine its share of w1); the change
  is good unless its slo attainment falls more than 10% (today's regression threshold; output
  throughput when neither has any goodput), i.e. ``decide.judge`` of B against A on the same window;
* before/after + cf (today's rule, as the tuner runs it): ``decide.judge`` of the fleet's w1 under B
  against its w0 under A, with the counterfactual (A replayed on w1). The counterfactual is a
  prediction: it replays with the cost model's speed off by ``--cf-speed-error`` (default 5%, the
  tuner's least assumed spread, Thresholds.speed_spread_min) one way or the other;
* before/after + exact cf: the same with the true profile (the counterfactual is then the truth's
  own replay: an upper bound, no real tuner has it);
* before/after, no cf: the same without the counterfactual, the load's change left in;
* canary: during w1 one engine runs B and the others A, the requests split as a Service (kube-proxy)
  balances them (each to a random engine); ``canary.judge_canary`` with the default gates
  (goodputRatioMin 0.9: today's rule) on the per-pod figures, read once ("one window as read") and
  as the operator reads it ("noise allowed"): while the gate is within its sampling noise, another
  window (w2, w3: their own rates and splits) is added to canary and controls, up to maxWindows 3.

A verdict is wrong when it keeps a change the truth finds bad (false keep) or reverts one it finds
good (false revert).

Measured (60 s windows, 3 replicas, 4 requests/s per engine on average, +-30%, seed 0; 200 trials
took 9 minutes on a 2-core machine):

    python bench/verdict_noise.py                       (200 trials; 166 changes good, 34 bad)
    verdict                          wrong   false keep   false revert
    before/after + cf (5% off)        1.5%        0/200          3/200
    before/after + exact cf           0.0%        0/200          0/200
    before/after, no cf               8.5%        0/200         17/200
    canary, one window as read        7.5%        1/200         14/200
    canary, noise allowed (<=3 w)     5.5%        0/200         11/200
    canary windows: mean 1.28, 170 trials 1, 4 trials 2, 26 trials 3

    python bench/verdict_noise.py --trials 100 --cf-speed-error 0.15   (the first 100 of the same trials,
    before the noise allowance)
    before/after + cf (15% off)       4.0%        0/100          4/100
    before/after, no cf               7.0%        0/100          7/100
    canary vs controls                6.0%        0/100          6/100

What this says: the load's +-30% swing alone makes a plain before/after verdict wrong 8.5% of the
time (all false reverts: a heavier window after a good change); the counterfactual, replaying the
old config on the window after, removes most of that while its speed error stays small (1.5% at 5%
off, 4.0% at 15% off). The canary sees no load swing but has a sampling noise of its own: its
requests are a random third of the window's, and a 60 s window gives it about 240, so a change
within the 10% gate often reads as just beyond it. Allowing for that noise (a gate within 1.645
standard errors of its limit measures on, up to 3 windows: 15% of the trials here) takes the canary
from 7.5% to 5.5% wrong, at 1.28 windows per verdict on average; what is left are verdicts still
within the noise at the third window, decided by the point estimate (all false reverts of good
changes). The canary stays behind the counterfactual in this simulator, whose cost model is the
truth's own; what it buys is a verdict that needs no replay (restart knobs, a model the simulator
does not know).

    python bench/verdict_noise.py [--trials 200] [--replicas 3] [--swing 0.3] [--seed 0]
                                  [--cf-speed-error 0.05] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "engine-image"), str(ROOT / "operator")]

from kvtune_engine.config import EngineConfig  # noqa: E402
from kvtune_engine.sim.profile import Profile  # noqa: E402
from kvtune_engine.sim.profiles import load_profile  # noqa: E402
from kvtune_engine.sim.scenarios import mix  # noqa: E402
from kvtune_engine.sim.simulator import SLO, simulate  # noqa: E402
from kvtune_engine.sim.trace import TraceRequest  # noqa: E402
from kvtune_operator.tuner.canary import Gates, PodFigures, judge_canary, pooled  # noqa: E402
from kvtune_operator.tuner.confidence import scaled_costs  # noqa: E402
from kvtune_operator.tuner.decide import judge  # noqa: E402

PROFILE = load_profile("a100-llama3-8b")
SLO_ = SLO(2.0, 0.1)
THRESHOLD = 0.10                      # Objectives.regression_threshold
SEQS = (8, 16, 32, 64, 128, 256)
BUDGETS = (512, 2048, 8192)
PER_ENGINE_RATE = 4.0                 # requests/s per engine at the workload's mean
WINDOW_S = 60.0


def window(rate: float, seed: int) -> list[TraceRequest]:
    n = max(2, int(rate * WINDOW_S))
    return mix(requests=n, rate=rate, prompt_mean=300, prompt_sigma=0.6, output_mean=400, output_sigma=0.5,
               max_tokens=4096, seed=seed)


def split(trace: list[TraceRequest], replicas: int, rng: random.Random) -> list[list[TraceRequest]]:
    """Each request to a random engine, as a Service (kube-proxy) balances them."""
    out: list[list[TraceRequest]] = [[] for _ in range(replicas)]
    for r in trace:
        out[rng.randrange(replicas)].append(r)
    return out


def run(trace: list[TraceRequest], cfg: EngineConfig, profile: Profile = PROFILE) -> PodFigures:
    s = simulate(trace, cfg, profile, SLO_) if trace else {}
    req = s.get("requests") or {}
    return PodFigures("", float(len(trace)), float(req.get("meeting_slo", 0)), float(s.get("output_tokens", 0)),
                      float(req.get("rejected", 0)), s.get("ttft_p99_s"))


def fleet(pods: list[PodFigures]) -> dict[str, float]:
    """The window figures a before/after verdict compares (decide.window_figures' shape)."""
    n = sum(p.requests for p in pods)
    return {"goodput_share": sum(p.good for p in pods) / n if n else 0.0,
            "output_tokens_per_s": sum(p.output_tokens for p in pods) / WINDOW_S}


@dataclass
class Tally:
    false_keep: int = 0
    false_revert: int = 0

    def add(self, keep: bool, truth: bool) -> None:
        self.false_keep += keep and not truth
        self.false_revert += truth and not keep

    def wrong(self, n: int) -> float:
        return (self.false_keep + self.false_revert) / n if n else 0.0


def trial(rng: random.Random, replicas: int, swing: float, seed: int, cf_error: float) -> dict[str, bool]:
    a = EngineConfig(max_num_seqs=rng.choice(SEQS), max_num_batched_tokens=rng.choice(BUDGETS))
    b = a
    while b == a:  # one move, as the tuner makes them: one knob to a neighbouring value of its grid
        knob, grid = rng.choice((("max_num_seqs", SEQS), ("max_num_batched_tokens", BUDGETS)))
        i = grid.index(getattr(a, knob)) + rng.choice((-1, 1))
        if 0 <= i < len(grid):
            b = a.with_changes(**{knob: grid[i]})
    mean = PER_ENGINE_RATE * replicas
    w0 = window(mean * rng.uniform(1 - swing, 1 + swing), seed)
    w1 = window(mean * rng.uniform(1 - swing, 1 + swing), seed + 1)
    s0, s1 = split(w0, replicas, rng), split(w1, replicas, rng)
    before = fleet([run(t, a) for t in s0])
    under_a = [run(t, a) for t in s1]
    under_b = [run(t, b) for t in s1]
    truth = judge(fleet(under_a), fleet(under_b), None, THRESHOLD).keep
    after, cf = fleet(under_b), fleet(under_a)
    # the tuner's counterfactual is a prediction: its cost model's speed is off by the fit's spread
    model = scaled_costs(PROFILE, 1 + rng.choice((-1, 1)) * cf_error)
    cf_model = fleet([run(t, a, model) for t in s1])
    canary = PodFigures("canary", under_b[0].requests, under_b[0].good, under_b[0].output_tokens,
                        under_b[0].errors, under_b[0].ttft_p99_s)
    controls = [PodFigures(f"control-{i}", p.requests, p.good, p.output_tokens, p.errors, p.ttft_p99_s)
                for i, p in enumerate(under_a[1:], 1)]
    return {"truth": truth,
            "before_after_oracle": judge(before, after, None, THRESHOLD, cf).keep,
            "before_after": judge(before, after, None, THRESHOLD, cf_model).keep,
            "before_after_no_cf": judge(before, after, None, THRESHOLD).keep,
            "canary_one_window": judge_canary(canary, controls, Gates(max_windows=1)).promote,
            **dict(zip(("canary", "canary_windows"), measured_on(canary, controls, a, b, replicas, mean, swing, seed)))}


def measured_on(canary: PodFigures, controls: list[PodFigures], a: EngineConfig, b: EngineConfig, replicas: int,
                mean: float, swing: float, seed: int):
    """The canary verdict as the operator reaches it: while the goodput gate reads within its sampling
    noise, one more window (its own rate, its own random split) is added to canary and controls, up
    to Gates().max_windows. The extra windows draw from their own generator, so every trial's
    other verdicts stay those of the runs without it."""
    rng = random.Random(seed + 7_777_777)
    j, k = judge_canary(canary, controls), 1
    while not j.settled and k < Gates().max_windows:
        shares = split(window(mean * rng.uniform(1 - swing, 1 + swing), seed + 1_000_000 * k), replicas, rng)
        canary = pooled([canary, run(shares[0], b)])
        controls = [pooled([c, run(t, a)]) for c, t in zip(controls, shares[1:])]
        j, k = judge_canary(canary, controls), k + 1
    return j.promote, k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--swing", type=float, default=0.3, help="window-to-window rate change, +- share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cf-speed-error", type=float, default=0.05,
                    help="the counterfactual replay's cost-model speed error, +- share (Thresholds.speed_spread_min)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.replicas < 2:
        ap.error("--replicas must be >= 2: a canary needs a control")
    if not 0 <= args.swing < 1:
        ap.error("--swing must be within [0, 1)")
    rng = random.Random(args.seed)
    names = ("before_after", "before_after_oracle", "before_after_no_cf", "canary_one_window", "canary")
    tallies = {k: Tally() for k in names}
    good, extra = 0, []
    t0 = time.time()
    for i in range(args.trials):
        r = trial(rng, args.replicas, args.swing, args.seed * 100_000 + 2 * i, args.cf_speed_error)
        good += r["truth"]
        extra.append(r["canary_windows"])
        for k in names:
            tallies[k].add(r[k], r["truth"])
        if (i + 1) % 25 == 0:
            print(f"  {i + 1} trials: " + ", ".join(f"{k} {tallies[k].false_keep}+{tallies[k].false_revert} wrong"
                                                     for k in names), file=sys.stderr, flush=True)
    n = args.trials
    labels = {"before_after": f"before/after + cf ({args.cf_speed_error:.0%} off)",
              "before_after_oracle": "before/after + exact cf", "before_after_no_cf": "before/after, no cf",
              "canary_one_window": "canary, one window as read",
              "canary": f"canary, noise allowed (<={Gates().max_windows} w)"}
    print(f"{n} trials, {args.replicas} replicas, rate +-{args.swing:.0%} window to window; "
          f"{good} changes good, {n - good} bad by the truth ({time.time() - t0:.0f}s)")
    print(f"{'verdict':32}{'wrong':>6}{'false keep':>13}{'false revert':>15}")
    for k in names:
        t = tallies[k]
        print(f"{labels[k]:32}{t.wrong(n):>6.1%}{t.false_keep:>9}/{n}{t.false_revert:>11}/{n}")
    print(f"canary windows: mean {sum(extra) / n:.2f}, " + ", ".join(
        f"{extra.count(k)} trials {k}" for k in sorted(set(extra))))
    ba, ca = tallies["before_after"].wrong(n), tallies["canary"].wrong(n)
    print(f"before/after (cf) / canary: {ba / ca:.1f}x" if ca > 0 else "canary: no wrong verdict")
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": n, "good": good, **{
            k: {"wrong": tallies[k].wrong(n), "false_keep": tallies[k].false_keep,
                "false_revert": tallies[k].false_revert} for k in names}, "canary_windows": extra}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
