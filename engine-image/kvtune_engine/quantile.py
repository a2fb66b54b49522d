"""The one percentile of kvtune, and the histogram estimate of it, kept apart by name.

Invariant owned here: every exact percentile between measurement and verdict -- the simulator's
latency figures, the replica prediction's pooled figures, the tuner's window figures, the
observation's request-length figures -- is ``percentile`` (linear interpolation between closest
ranks, numpy's default), so the same samples give the same p95 wherever it is computed.
``bucket_quantile`` is something else: an *estimate* from cumulative histogram buckets
(Prometheus' ``histogram_quantile``), all that an engine's ``/metrics`` allow. A figure read from
buckets is only compared with a figure put through the same buckets (``bucket_counts``), never
silently with an exact percentile. A leaf: imports nothing of kvtune (engine core and operator both
use it).
"""
from __future__ import annotations

import bisect
import math
from typing import Iterable, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The exact q-quantile (0 <= q <= 1) of sorted samples: linear interpolation between closest
    ranks (numpy's default); None for no samples."""
    n = len(sorted_values)
    if not n:
        return None
    pos = (n - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bucket_counts(values: Iterable[float], bounds: Sequence[float]) -> list[tuple[float, float]]:
    """Samples as a histogram would hold them: cumulative (upper bound, count) pairs, +Inf last
    (a value equal to a bound counts in that bound's bucket, as Prometheus' ``le`` says)."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    out, acc = [], 0
    for b, c in zip((*bounds, math.inf), counts):
        acc += c
        out.append((float(b), float(acc)))
    return out


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """An *estimate* of the q-quantile from cumulative (upper bound, count) buckets, sorted by bound:
    Prometheus' ``histogram_quantile`` (linear inside the bucket holding rank q * count, from 0 for
    the first; the last finite bound when the rank falls in +Inf). 0 when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def check(values: Sequence[float]) -> None:
    """The invariant of ``percentile`` on ``values``: the ends are the extremes, it never decreases
    with q, and it never leaves the samples' range."""
    xs = sorted(values)
    if not xs:
        assert percentile(xs, 0.5) is None
        return
    assert percentile(xs, 0.0) == xs[0] and percentile(xs, 1.0) == xs[-1]
    qs = [percentile(xs, k / 100) for k in range(101)]
    assert all(a <= b for a, b in zip(qs, qs[1:])), "percentile decreased with q"
    assert all(xs[0] <= v <= xs[-1] for v in qs)
