"""`Request`, `SamplingParams` and friends live in the leaf module `kvtune_engine.request` (so that the
KV layer and the scheduler never import each other); this name stays for existing imports."""
from ..request import GREEDY_EPS, FinishReason, Request, RequestStatus, SamplingParams

__all__ = ["GREEDY_EPS", "FinishReason", "Request", "RequestStatus", "SamplingParams"]
