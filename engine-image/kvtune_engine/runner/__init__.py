"""Runners execute a scheduled Batch: the model runner here (torch), the simulated one in ../sim."""
from .model_runner import ModelRunner
from .sampler import Sampler, TokenLogprob

__all__ = ["ModelRunner", "Sampler", "TokenLogprob"]
