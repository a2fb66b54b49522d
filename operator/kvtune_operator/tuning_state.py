"""The tuner's memory kept in status.tuning, so that an operator restart continues exactly.

Invariant: the operator process holds no tuner state between ticks. Each tick rebuilds the pure
tuner's `TunerState` from a fresh read of the object (`state_from_status`) and writes the new one
(`state_status`) in the same status patch as the decision that changed it: the pending change
(with its window figures and prediction), the candidates rolled back and until when they are
barred, the restart count and time, the running prediction error and until when predictions are
distrusted. A restarted operator, or a replaced Deployment of it, reads
what its predecessor wrote and gives a pending change its verdict on its own window.
"""
from __future__ import annotations

import datetime as dt
import json
from typing import Any

from kvtune_engine.config import EngineConfig

from .model import REJECTED_LIMIT, PendingChange, RejectedCandidate, TuningStatus, to_camel_dict, to_engine_dict
from .render import restart_hash
from .tuner.decide import TunerState, knob_changes, values_key
from .tuner.decide import PendingChange as TunerPending


def _time(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc)


def _config(knobs: Any) -> EngineConfig:
    return EngineConfig.model_validate(to_engine_dict(knobs.dump()))


def _knobs(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in to_camel_dict(cfg).items() if v is not None}


def state_from_status(tuning: TuningStatus | None) -> TunerState:
    """The tuner's state as the last tick left it (an empty one for a new object)."""
    st = TunerState()
    if tuning is None:
        return st
    p = tuning.pending
    if p is not None:
        before, after = _config(p.before), _config(p.after)
        st.pending = TunerPending(
            before=before.model_dump(), after=after.model_dump(), changes=knob_changes(before, after),
            restart=p.restart, applied_at=p.applied_at.timestamp(), source=p.source,
            before_figures=dict(p.before_figures), predicted_figures=dict(p.predicted_figures))
        st.phase = "Verifying"
    for r in tuning.rejected or []:
        key = values_key(to_engine_dict(r.knobs.dump()))
        st.bad[key] = r.until.timestamp()
        st.bad_reasons[key] = (r.at.timestamp(), r.reason)
    st.restarts = tuning.restarts or 0
    st.last_restart_at = tuning.last_restart_time.timestamp() if tuning.last_restart_time else None
    st.prediction_error = tuning.prediction_error
    st.prediction_errors_high = tuning.prediction_errors_high or 0
    st.unreliable_until = tuning.predictions_unreliable_until.timestamp() \
        if tuning.predictions_unreliable_until else None
    return st


def state_status(st: TunerState) -> dict[str, Any]:
    """The state's fields of status.tuning, in wire form (None: the field is removed)."""
    pending = None
    if st.pending is not None:
        p = st.pending
        after = EngineConfig.model_validate(p.after)
        pending = PendingChange(
            applied_at=_time(p.applied_at), source=p.source, before=_knobs(p.before), after=_knobs(p.after),
            restart=p.restart, restart_hash=restart_hash(after) if p.restart else None,
            before_figures=p.before_figures, predicted_figures=p.predicted_figures).dump()
    rejected = []
    for key, until in sorted(st.bad.items(), key=lambda kv: kv[1]):
        at, reason = st.bad_reasons.get(key, (until, ""))
        rejected.append(RejectedCandidate(knobs=_knobs(json.loads(key)), at=_time(at), until=_time(until),
                                          reason=reason).dump())
    return {
        "pending": pending,
        "rejected": rejected[-REJECTED_LIMIT:] or None,
        "restarts": st.restarts or None,
        "lastRestartTime": _time(st.last_restart_at).strftime("%Y-%m-%dT%H:%M:%SZ")
        if st.last_restart_at is not None else None,
        "predictionError": round(st.prediction_error, 4) if st.prediction_error is not None else None,
        "predictionErrorsHigh": st.prediction_errors_high or None,
        "predictionsUnreliableUntil": _time(st.unreliable_until).strftime("%Y-%m-%dT%H:%M:%SZ")
        if st.unreliable_until is not None else None,
    }

