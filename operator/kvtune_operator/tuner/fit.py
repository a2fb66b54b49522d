"""Fit the simulator's step-cost model from the engine's own step timings.

Model (issue 2 section 4): ``t = c0 + c_tok * batched_tokens + c_ctx * decode_context_tokens``.

Samples are single steps or window means (a histogram's ``_sum / _count`` for duration, batched tokens
and context, weighted by ``_count``): the model is linear, so the mean of the steps obeys it too and
both kinds mix in one least-squares problem. Coefficients are non-negative (a step never gets faster
with more work): the fit solves the weighted normal equations on every subset of the three terms and
keeps the best subset whose coefficients are all >= 0 (7 tiny solves, no numpy needed).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .observation import StepSample


@dataclass(frozen=True)
class StepCostFit:
    c0: float
    c_tok: float
    c_ctx: float
    samples: int
    rel_rmse: float          # weighted RMS residual / weighted mean duration
    terms: tuple[str, ...]   # the terms the fit kept

    def predict(self, batched_tokens: float, context_tokens: float = 0.0) -> float:
        return self.c0 + self.c_tok * batched_tokens + self.c_ctx * context_tokens


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_step_cost(samples: Iterable[StepSample], *, min_samples: int = 3) -> StepCostFit | None:
    """Weighted non-negative least squares of step duration on (1, batched tokens, context tokens).

    Returns None when there are too few samples, or too little spread to tell the terms apart and
    no single-term fit is possible either.
    """
    rows = [s for s in samples if s.weight > 0 and s.duration_s >= 0 and math.isfinite(s.duration_s)]
    if len(rows) < min_samples:
        return None
    # scale columns so the normal equations stay well conditioned (tokens ~1e3, durations ~1e-2)
    sc_tok = max(1.0, max(abs(s.batched_tokens) for s in rows))
    sc_ctx = max(1.0, max(abs(s.context_tokens) for s in rows))
    cols = {
        "c0": [1.0] * len(rows),
        "c_tok": [s.batched_tokens / sc_tok for s in rows],
        "c_ctx": [s.context_tokens / sc_ctx for s in rows],
    }
    y = [s.duration_s for s in rows]
    w = [s.weight for s in rows]
    wsum = sum(w)
    ymean = sum(wi * yi for wi, yi in zip(w, y)) / wsum
    best: tuple[float, dict[str, float]] | None = None
    names = list(cols)
    for k in range(len(names), 0, -1):
        for subset in itertools.combinations(names, k):
            if subset != ("c0",) and all(max(cols[n]) - min(cols[n]) < 1e-12 for n in subset if n != "c0") \
                    and "c0" in subset:
                continue  # a constant column next to the intercept: not identifiable
            if any(all(v == 0 for v in cols[n]) for n in subset):
                continue
            a = [[sum(wi * cols[p][i] * cols[q][i] for i, wi in enumerate(w)) for q in subset] for p in subset]
            b = [sum(wi * cols[p][i] * y[i] for i, wi in enumerate(w)) for p in subset]
            sol = _solve(a, b)
            if sol is None or any(c < 0 for c in sol):
                continue
            coef = dict(zip(subset, sol))
            sse = sum(wi * (yi - sum(coef[n] * cols[n][i] for n in subset)) ** 2
                      for i, (wi, yi) in enumerate(zip(w, y)))
            if best is None or sse < best[0] - 1e-18 * max(1.0, best[0]):
                best = (sse, coef)
    if best is None:
        return None
    sse, coef = best
    rel = math.sqrt(sse / wsum) / ymean if ymean > 0 else 0.0
    return StepCostFit(
        c0=coef.get("c0", 0.0), c_tok=coef.get("c_tok", 0.0) / sc_tok, c_ctx=coef.get("c_ctx", 0.0) / sc_ctx,
        samples=len(rows), rel_rmse=rel, terms=tuple(sorted(coef)))


def samples_from_buckets(durations: Sequence[tuple[float, float, float, float]]) -> list[StepSample]:
    """Rows of (mean duration, mean batched tokens, mean context tokens, step count) -- e.g. one per
    scrape interval, from the histograms' ``_sum``/``_count`` increases -- as weighted samples."""
    return [StepSample(d, t, c, n) for d, t, c, n in durations if n > 0]
