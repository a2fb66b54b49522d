"""The tuner: observe a window, name why requests wait, propose configs, predict them with the
simulator, choose, then verify the change and roll it back when it did not help.

Pure and cluster-free: the operator's timer and `kvtune tune` run the same code. Imports the engine's
config, core and simulator only (never torch, the model, the runner or the server).
"""
from __future__ import annotations
