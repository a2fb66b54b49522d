"""Scrapes the engine's /metrics every second: the live view's figures, the report's time series,
and the windows the tuner observes (the same MetricFigures the in-cluster reader builds)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from ..tuner.observation import MetricFigures


@dataclass
class Point:
    t: float                      # seconds since the demo started
    kv_usage: float
    running: float
    waiting: float
    tokens_per_s: float
    preemptions_per_s: float
    cause: str                    # waiting cause of the steps since the previous scrape (most frequent)


class Monitor:
    def __init__(self, url: Callable[[], str], t0: float, period_s: float = 1.0):
        self.url, self.t0, self.period_s = url, t0, period_s
        self.scrapes: list[tuple[float, MetricFigures]] = []
        self.points: list[Point] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def reset_baseline(self) -> None:
        """After an engine restart the counters start again: don't difference across it."""
        self._prev = None

    def window(self, since: float) -> MetricFigures:
        return MetricFigures.over_scrapes([f for t, f in self.scrapes if t >= since])

    def _run(self) -> None:
        self._prev = None
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.period_s):
                try:
                    text = client.get(f"{self.url()}/metrics").text
                except httpx.HTTPError:
                    self._prev = None
                    continue
                now = time.monotonic() - self.t0
                f = MetricFigures.from_prometheus_text(text)
                self.scrapes.append((now, f))
                self.points.append(self._point(now, f))
                self._prev = (now, f)

    def _point(self, now: float, f: MetricFigures) -> Point:
        tok = pre = 0.0
        cause = "none"
        if self._prev is not None:
            t, p = self._prev
            d = f.delta(p)
            dt = max(now - t, 1e-6)
            tok = (d.get("kvtune_generation_tokens_total") or 0.0) / dt
            pre = sum(v for _, v in d.series("kvtune_preemptions_total")) / dt
            by = {lab.get("reason"): v for lab, v in d.series("kvtune_scheduler_waiting_reason_steps_total")}
            blocked = {k: v for k, v in by.items() if k != "none" and v > 0}
            cause = max(blocked, key=blocked.get) if blocked else "none"
        return Point(now, f.get("kvtune_kv_usage_ratio") or 0.0, f.get("kvtune_requests", state="running") or 0.0,
                     f.get("kvtune_requests", state="waiting") or 0.0, tok, pre, cause)
