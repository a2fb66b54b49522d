"""Runners execute a scheduled Batch: the model runner here (torch), the simulated one in ../sim."""
from .model_runner import ModelRunner
from ..outputs import TokenLogprob
from .sampler import Sampler

__all__ = ["ModelRunner", "Sampler", "TokenLogprob"]
