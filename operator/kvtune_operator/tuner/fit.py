"""Fit the simulator's step-cost model from the engine's own step timings.

The simulator's profile charges one step (``kvtune_engine.sim.profile``)::

    t = c0 + max(weights_read, c_tok * batched_tokens) + c_ctx * decode_context + c_pair * prefill_pairs
        + swapped_bytes / swap_bandwidth

Written with a *knee* ``k = weights_read / c_tok`` (the batch size at which the dense layers stop
being bound by reading the weights) the model is ``c0 + c_tok * max(k, tokens) + ...``: linear in the
coefficients for a fixed knee. So the fit tries a grid of knees (0 = the plain linear model
``c0 + c_tok * tokens + c_ctx * context`` of issue 2) and, for each, solves weighted non-negative
least squares; it keeps the knee and coefficients with the least squared error. Swap copies are
subtracted first with the profile's bandwidth (a memory figure, not a fitted one). A term whose
figure is absent from every sample (e.g. prefill pairs, which the engine's step log may not carry)
is left out and reported as 0.

Samples are single steps or window means (a histogram's ``_sum / _count`` of duration, batched
tokens and context, weighted by ``_count``): the linear model holds for means too, the knee does not,
so a fit over means only is linear (knee 0).

Non-negative: every subset of the terms is solved and the best all-non-negative solution kept
(at most 15 tiny solves per knee, on the 5x5 Gram matrix: no numpy needed).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvtune_engine.sim.profile import SpeedTimeline

from .step_sample import StepSample

TERMS = ("c0", "c_tok", "c_ctx", "c_pair")


@dataclass(frozen=True)
class StepCostFit:
    c0: float
    c_tok: float
    c_ctx: float
    c_pair: float = 0.0
    knee_tokens: float = 0.0     # weights_read_s = c_tok * knee_tokens
    samples: int = 0
    rel_rmse: float = 0.0        # weighted RMS residual / weighted mean duration
    terms: tuple[str, ...] = ()  # the terms the fit kept

    @property
    def weights_read_s(self) -> float:
        return self.c_tok * self.knee_tokens

    def predict(self, batched_tokens: float, context_tokens: float = 0.0, prefill_pairs: float = 0.0) -> float:
        return (self.c0 + self.c_tok * max(self.knee_tokens, batched_tokens) + self.c_ctx * context_tokens
                + self.c_pair * prefill_pairs)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(x) for row in a for x in row), default=0.0) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, n + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def _knees(max_tokens: float) -> list[float]:
    ks, k = [0.0], 2.0
    while k < max_tokens:
        ks.append(k)
        k *= 1.25
    return ks


#: a step this many times longer than the fit charges it is a stall, not a cost of its shape
STALL_FACTOR = 5.0
#: at most this share of the samples is left out as stalls
MAX_STALL_SHARE = 0.01


def fit_step_cost(samples: Iterable[StepSample], *, knee: bool = True, swap_bandwidth: float | None = None,
                  min_samples: int = 3, max_rows: int = 3000) -> StepCostFit | None:
    """Weighted non-negative least squares of step duration (see the module docstring), robust to
    stalls: a step that took ``STALL_FACTOR`` times what the fit charges (the process descheduled, a
    first call's lazy set-up, a page-fault storm: seconds on a step that costs milliseconds) says
    nothing about the cost of its shape, and one of them in a window of small steps dominates the
    squared error (one 28 s step among 1,100 of 9 ms fitted 12 ms per token). So the fit is redone
    without the longest such steps, at most ``MAX_STALL_SHARE`` of the samples, until none is left.

    Returns None when there are fewer than ``min_samples`` usable samples or nothing is identifiable.
    """
    rows = [s for s in samples if s.weight > 0 and math.isfinite(s.duration_s) and s.duration_s >= 0]
    if len(rows) < min_samples:
        return None
    if len(rows) > max_rows:  # an even stride keeps the mix of decode and prefill steps
        step = len(rows) / max_rows
        rows = [rows[int(i * step)] for i in range(max_rows)]
    if knee and any(s.weight != 1 for s in rows):
        knee = False
    bw = swap_bandwidth if swap_bandwidth and swap_bandwidth > 0 else None
    budget = int(MAX_STALL_SHARE * len(rows))
    fit = _wnnls(rows, knee, bw)
    while fit is not None and budget > 0:
        over = sorted(((s.duration_s - (s.swapped_bytes / bw if bw else 0.0))
                       / max(fit.predict(s.batched_tokens, s.context_tokens, s.prefill_pairs), 1e-12), i)
                      for i, s in enumerate(rows))
        stalls = {i for r, i in over[-budget:] if r > STALL_FACTOR}
        if not stalls:
            break
        budget -= len(stalls)
        rows = [s for i, s in enumerate(rows) if i not in stalls]
        fit = _wnnls(rows, knee, bw) or fit
    return fit


def _wnnls(rows: Sequence[StepSample], knee: bool, bw: float | None) -> StepCostFit | None:
    """One weighted non-negative least-squares fit over ``rows`` (the knee grid when ``knee``)."""
    y = [s.duration_s - (s.swapped_bytes / bw if bw else 0.0) for s in rows]
    w = [s.weight for s in rows]
    tok = [s.batched_tokens for s in rows]
    sc = {  # column scales: keep the Gram matrix well conditioned (tokens ~1e3, pairs ~1e8)
        "c_tok": max(1.0, max(abs(t) for t in tok)),
        "c_ctx": max(1.0, max(abs(s.context_tokens) for s in rows)),
        "c_pair": max(1.0, max(abs(s.prefill_pairs) for s in rows)),
    }
    present = {"c0": True, "c_tok": any(tok), "c_ctx": any(s.context_tokens for s in rows),
               "c_pair": any(s.prefill_pairs for s in rows)}
    ctx = [s.context_tokens / sc["c_ctx"] for s in rows]
    pairs = [s.prefill_pairs / sc["c_pair"] for s in rows]
    wsum = sum(w)
    ymean = sum(wi * yi for wi, yi in zip(w, y)) / wsum
    yy = sum(wi * yi * yi for wi, yi in zip(w, y))
    best: tuple[float, float, dict[str, float]] | None = None

    def at(k: float) -> None:
        nonlocal best
        cols = {"c0": [1.0] * len(rows), "c_tok": [max(k, t) / sc["c_tok"] for t in tok],
                "c_ctx": ctx, "c_pair": pairs}
        names = [n for n in TERMS if present[n]]
        gram = {(p, q): sum(wi * a * b for wi, a, b in zip(w, cols[p], cols[q])) for p in names for q in names}
        rhs = {p: sum(wi * a * yi for wi, a, yi in zip(w, cols[p], y)) for p in names}
        for r in range(len(names), 0, -1):
            for subset in itertools.combinations(names, r):
                if k > 0 and "c_tok" not in subset:
                    continue  # a knee without the token term is the knee-0 model
                sol = _solve([[gram[p, q] for q in subset] for p in subset], [rhs[p] for p in subset])
                if sol is None or any(c < 0 for c in sol):
                    continue
                sse = yy - 2 * sum(c * rhs[p] for c, p in zip(sol, subset)) + sum(
                    ci * cj * gram[p, q] for ci, p in zip(sol, subset) for cj, q in zip(sol, subset))
                sse = max(0.0, sse)
                if best is None or sse < best[0] * (1 - 1e-9) - 1e-30:
                    best = (sse, k, dict(zip(subset, sol)))

    for k in (_knees(max(tok)) if knee else [0.0]):
        at(k)
    if best is not None and best[1] > 0:  # refine the knee between its grid neighbours
        k0 = best[1]
        for i in range(1, 10):
            at(k0 / 1.25 + (k0 * 1.25 - k0 / 1.25) * i / 10)
    if best is None:
        return None
    sse, k, coef = best
    c_tok = coef.get("c_tok", 0.0) / sc["c_tok"]
    return StepCostFit(
        c0=coef.get("c0", 0.0), c_tok=c_tok, c_ctx=coef.get("c_ctx", 0.0) / sc["c_ctx"],
        c_pair=coef.get("c_pair", 0.0) / sc["c_pair"], knee_tokens=k if c_tok > 0 else 0.0,
        samples=len(rows), rel_rmse=math.sqrt(sse / wsum) / ymean if ymean > 0 else 0.0,
        terms=tuple(n for n in TERMS if n in coef))


def samples_from_windows(rows: Sequence[tuple[float, float, float, float]]) -> list[StepSample]:
    """Rows of (mean duration, mean batched tokens, mean context tokens, step count) -- one per
    scrape interval, from the step histograms' ``_sum``/``_count`` increases -- as weighted samples."""
    return [StepSample(d, t, c, n) for d, t, c, n in rows if n > 0]


def samples_from_engine_steps(steps: Iterable[dict], block_bytes: float | None = None, *,
                              gaps: bool = True) -> list[StepSample]:
    """The engine's step log (``GET /kvtune/v1/steps``: ``t_s``, ``duration_s``, ``batched_tokens``,
    ``decode_context_tokens``, ``num_decodes``, ``swap_in_blocks``/``swap_out_blocks``, optionally
    ``prefill_pairs``) as samples; ``block_bytes`` turns swapped blocks into bytes.

    A sample's duration is the step's *wall* time: its own ``duration_s`` (scheduling, the forward,
    sampling, detokenization) plus the gap before the next step while the engine is busy -- the loop's
    work between steps (new requests, outputs handed to the server) and the time the server's threads
    and other processes take the CPU from the loop. On 2 CPU cores that gap is 10-20% of the busy time;
    the simulator, which steps back to back, must charge it or it predicts too much throughput. A gap
    after which the engine starts afresh (the next step has no decodes: it may have sat idle waiting for
    a request) counts as the median busy gap instead. ``gaps=False``: durations alone (the histogram's
    figure, what ``samples_from_windows`` gets)."""
    rows = []
    for s in steps:
        try:
            rows.append((float(s["duration_s"]), s))
        except (KeyError, TypeError, ValueError):
            continue
    extra = [0.0] * len(rows)
    if gaps and len(rows) > 1:
        try:
            ts = [float(s["t_s"]) for _, s in rows]
        except (KeyError, TypeError, ValueError):
            ts = None
        if ts is not None and all(b >= a for a, b in zip(ts, ts[1:])):
            idle_after = [(rows[i + 1][1].get("num_decodes") == 0) if "num_decodes" in rows[i + 1][1]
                          else False for i in range(len(rows) - 1)]
            gap = [max(0.0, ts[i + 1] - ts[i] - rows[i][0]) for i in range(len(rows) - 1)]
            busy = sorted(g for g, idle in zip(gap, idle_after) if not idle)
            typical = busy[len(busy) // 2] if busy else 0.0
            for i, (g, idle) in enumerate(zip(gap, idle_after)):
                extra[i] = min(g, typical) if idle else g
            extra[-1] = typical
    out = []
    for (d, s), e in zip(rows, extra):
        try:
            swapped = 0.0
            if block_bytes:
                swapped = (float(s.get("swap_in_blocks", 0) or 0) + float(s.get("swap_out_blocks", 0) or 0)) * block_bytes
            t = s.get("t_s")
            out.append(StepSample(d + e, float(s.get("batched_tokens", 0) or 0),
                                  float(s.get("decode_context_tokens", 0) or 0), 1.0,
                                  float(s.get("prefill_pairs", 0) or 0), swapped,
                                  None if t is None else float(t)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


#: the speed timeline's window: long enough that a window's factor is not one step's noise (a few
#: hundred steps on CPU: +-3%), short enough to follow the machine's swings (seconds to minutes)
SPEED_WINDOW_S = 2.0


def speed_timeline(samples: Iterable[StepSample], fit: StepCostFit, window_s: float = SPEED_WINDOW_S
                   ) -> SpeedTimeline | None:
    """How fast the machine ran, window by window, against ``fit``: each window's measured step time
    over what the fit charges for the same steps. One fitted cost model leaves a residual that is not
    per-step noise but slow and fast stretches of seconds (a shared machine; on the 2-core dev box
    windows of 2 s ran at 0.8-1.3x the fit within one run), which decide where a queue builds; the
    simulator replays the window with these factors (``Profile.speed``).

    A window with little measured busy time is pulled towards the run's mean factor (a pseudo-count of
    a tenth of a window of predicted time), so an idle stretch keeps about 1. None when the samples
    carry no times or the fit charges nothing."""
    rows = [(s.t_s, s.duration_s * s.weight, fit.predict(s.batched_tokens, s.context_tokens, s.prefill_pairs)
             * s.weight) for s in samples if s.t_s is not None and s.weight > 0 and math.isfinite(s.duration_s)]
    rows = [r for r in rows if math.isfinite(r[0])]
    total_pred = sum(p for _, _, p in rows)
    if not rows or total_pred <= 0 or window_s <= 0:
        return None
    mean = sum(w for _, w, _ in rows) / total_pred
    start = min(t for t, _, _ in rows)
    n = int((max(t for t, _, _ in rows) - start) // window_s) + 1
    meas, pred = [0.0] * n, [0.0] * n
    for t, w, p in rows:
        k = min(n - 1, int((t - start) // window_s))
        meas[k] += w
        pred[k] += p
    prior = 0.1 * window_s
    return SpeedTimeline(start_s=start, window_s=window_s,
                         factors=tuple((m + prior * mean) / (p + prior) for m, p in zip(meas, pred)))
