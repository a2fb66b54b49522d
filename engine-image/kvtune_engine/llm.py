"""The offline API: ``LLM(model_dir, max_num_seqs=64).generate(prompts, params)``.

Invariant owned here: all prompts are checked before any is queued (one bad prompt queues
nothing), and outputs come back in the prompts' order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .builder import build_engine
from .config import EngineConfig
from .core.request import SamplingParams
from .engine import LLMEngine
from .outputs import RequestOutput


class LLM:
    """``engine_flags`` are EngineConfig fields (``block_size``, ``kv_cache_memory``, ...); ``device``
    and ``dtype`` choose where and how the model runs."""

    def __init__(self, model: str, *, device: str = "cpu", dtype: str | None = None,
                 served_model_name: str | None = None, **engine_flags: Any):
        cfg = EngineConfig.build(**{k.replace("-", "_"): v for k, v in engine_flags.items()})
        self.engine = build_engine(model, cfg, device=device, dtype=dtype, served_model_name=served_model_name)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        self = cls.__new__(cls)
        self.engine = engine
        return self

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Generate for all prompts (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [_copy_params(params or SamplingParams()) for _ in prompts]
        else:
            plist = [_copy_params(p) for p in params]
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        eng = self.engine
        encoded = [eng.inputs.process(p, sp) for p, sp in zip(prompts, plist)]
        order: dict[str, int] = {}
        for i, (ids, sp) in enumerate(zip(encoded, plist)):
            req = eng.add_request(ids, sp, checked=True)
            order[req.request_id] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        done = 0
        while done < len(prompts):
            if not eng.has_unfinished():
                raise RuntimeError(f"the engine stopped with {len(prompts) - done} requests unanswered")
            for out in eng.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    done += 1
                    if progress:
                        progress(done, len(prompts))
        return results  # type: ignore[return-value]


def _copy_params(p: SamplingParams) -> SamplingParams:
    return SamplingParams(**{k: (type(v)(v) if isinstance(v, (list, dict)) else v) for k, v in vars(p).items()})
