"""What one tuning round writes back, and the history entries it records: the leaf both the
before/after round (tuning.py) and the canary round (tuning_canary.py) build their results from.

Invariant: every history entry goes through the status model (``TuningDecision``), and a merge patch
of status built here replaces what it replaces (``replacing``), never leaving a field of the entry
before it.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import conditions as c
from .model import CanaryStatus, Figures, TuningDecision, to_camel_dict
from .reconcile import EventSpec


@dataclass
class TickResult:
    """What one round writes back: status (a merge patch), conditions, events, knobs, a replica count."""
    status_update: dict[str, Any] = field(default_factory=dict)
    conditions: list[c.Cond] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    applied: dict[str, Any] = field(default_factory=dict)  # knob -> value written to status.engine
    scale: int | None = None  # replicas to set through the scale subresource (compute-bound, Apply mode)
    #: (the canary pod's address, live knobs) to send it once this status (pending.canary) is written
    canary_call: tuple[str, dict[str, Any]] | None = None


def stamp(t: float) -> dt.datetime:
    """A status timestamp: whole seconds, UTC (what kubectl shows)."""
    return dt.datetime.fromtimestamp(int(t), dt.timezone.utc)


def quoted_figures(f: Mapping[str, float] | None) -> Figures | None:
    """The window figures a decision quotes, by the field's names: request and token goodput, slo
    attainment, ttft, tpot and e2el p95 in ms (where the window has them), throughput, p95 queue
    time; a prediction's utilization and goodput range too."""
    if not f:
        return None
    get = lambda k: round(float(f[k]), 3) if f.get(k) is not None else None  # noqa: E731
    ms = lambda k: round(1000 * float(f[k]), 1) if f.get(k) is not None else None  # noqa: E731
    low, high = get("goodput_low_requests_per_s"), get("goodput_high_requests_per_s")
    out = Figures(goodput_requests_per_second=get("goodput_requests_per_s"),
                  goodput_tokens_per_second=get("goodput_tokens_per_s"),
                  slo_attainment=get("goodput_share"),
                  ttft_p95_ms=ms("ttft_p95_s"), tpot_p95_ms=ms("tpot_p95_s"), e2el_p95_ms=ms("e2el_p95_s"),
                  throughput_tokens_per_second=get("output_tokens_per_s"),
                  queue_time_p95_seconds=get("queue_time_p95_s"),
                  utilization=get("utilization"),
                  goodput_range_requests_per_second=[low, high] if low is not None and high is not None else None)
    return out if out.dump() else None


def quoted_prediction(f: Mapping[str, float] | None) -> Figures | None:
    """A prediction's figures; None for a decision that had none (a kvtune.io/try candidate is not
    simulated: its pending figures are all zero)."""
    out = quoted_figures(f)
    if out is None or not (out.goodput_requests_per_second or out.throughput_tokens_per_second):
        return None
    return out


def decision_entry(now: float, action: str, message: str, *, cause: str | None = None, restart: bool = False,
              before: dict[str, Any] | None = None, after: dict[str, Any] | None = None,
              predicted: Figures | None = None, measured: Figures | None = None,
              prediction_error_ratio: float | None = None, canary: CanaryStatus | None = None) -> dict[str, Any]:
    """One entry of status.tuning.history (and lastChange), through the status model."""
    return TuningDecision(time=stamp(now), action=action, cause=cause, message=message, restart=restart,
                          before=camel(before) if before else None, after=camel(after) if after else None,
                          predicted=predicted, measured=measured,
                          prediction_error_ratio=round(prediction_error_ratio, 4)
                          if prediction_error_ratio is not None else None, canary=canary).dump()


def replacing(old: Any, new: Any) -> Any:
    """``new`` as a JSON merge patch that replaces ``old``: keys of ``old`` that ``new`` lacks become
    None (deleted), at every depth. The status is written by merge patch, which merges nested objects:
    without this, a RollBack in tuning.lastChange would keep the before/after/restart of the Apply it
    replaced, and a diagnosis the figures of an earlier one."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = {k: replacing(old.get(k), v) for k, v in new.items()}
        out.update({k: None for k in old if k not in new})
        return out
    return new


def camel(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in to_camel_dict(d).items() if v is not None}


def record(out: TickResult, tuning: dict[str, Any], history: list[dict[str, Any]], entry: dict[str, Any],
            event_type: str) -> None:
    """One decision (a `decision_entry`): into the history, as tuning.lastChange, and as an Event."""
    history.append(entry)
    tuning["lastChange"] = entry
    out.events.append(EventSpec(event_type, f"Tuning{entry['action']}", entry["message"]))
