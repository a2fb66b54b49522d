"""The tuner: observe a window, name why requests wait, propose configs, predict them with the
simulator, choose, then verify the change and roll it back when it did not help.

Pure and cluster-free: the operator's timer and `kvtune tune` run the same code (``loop.Tuner``).
Imports the engine's config, core and simulator only (never torch, the model, the runner or the
server).

    step_sample  StepSample: one step's time and shape (what the fit reads, the observation carries)
    observation  Observation (one window) from a `kvtune sim --json` summary or from Prometheus-style
                 figures (MetricFigures) + the engine's state, trace and step log
    thresholds   Thresholds: every figure diagnosis and the candidate moves compare against, one record
    diagnose     diagnose(obs) -> Diagnosis(cause, message, figures, knob, suggestion)
    memory       Safety, MemoryPicture: the measured device memory and what a candidate would get
    candidates   Bounds, propose() (a table of movers, one per knob), combine(), restart_lookahead():
                 every candidate the tuner predicts
    fit          fit_step_cost(): the simulator's step-cost model from the engine's step timings
    backlog      the requests still in the engine as trace records (estimated output lengths)
    predict      Predictor (simulator replays), profile_for()/fitted() (the engine's own profile)
    decide       Objectives, Score, choose(), TunerState (verify / roll back / remember bad candidates)
    loop         Tuner.round() (observe -> verify -> diagnose -> candidates -> predict -> decide),
                 simulate_loop() (the loop with the simulator standing in for the engine)
"""
from __future__ import annotations

from .candidates import Bounds, Range
from .decide import Decision, Objectives, Score, TunerState, Verdict, choose, judge, knob_changes, window_figures
from .diagnose import CAUSES, Diagnosis, diagnose
from .thresholds import Thresholds
from .memory import MemoryPicture, Safety
from .fit import StepCostFit, fit_step_cost
from .loop import Round, SimRun, Tuner, TunerSettings, measure, simulate_loop, split_windows
from .observation import LengthStats, MetricFigures, Observation, StepSample
from .predict import Predictor, RecordingProfile, fitted, profile_for

__all__ = [
    "Bounds", "CAUSES", "Decision", "Diagnosis", "LengthStats", "MemoryPicture", "MetricFigures", "Objectives",
    "Observation", "Predictor", "Range", "RecordingProfile", "Round", "Safety", "Score", "SimRun", "StepCostFit",
    "StepSample", "Thresholds", "Tuner", "TunerSettings", "TunerState", "Verdict", "choose", "diagnose",
    "fit_step_cost", "fitted", "judge", "knob_changes", "measure", "profile_for", "simulate_loop",
    "split_windows", "window_figures",
]
