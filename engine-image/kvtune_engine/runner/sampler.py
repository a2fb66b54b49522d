"""Per-request sampling for a whole batch in a few tensor ops.

Rows differ in temperature, top_k, top_p, seed and logprobs; each filter runs once over the rows
that need it. Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), so a
seeded request draws its noise from its own torch.Generator, exactly V numbers per token: its
output depends on its seed only, never on which other requests share the batch. Logprobs are those
of the model's raw distribution (before temperature and filters), as vLLM reports them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..core.request import Request, SamplingParams


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives, best first (engine's field names)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        # a seeded request's generator lives as long as the request object
        self._gens: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()

    def _generator(self, req: Request) -> torch.Generator:
        g = self._gens.get(req)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(req.sampling.seed))
            self._gens[req] = g
        return g

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """logits [N, V] float32, one row per request -> sampled ids (and logprobs where asked)."""
        params: list[SamplingParams] = [r.sampling for r in requests]
        n, vocab = logits.shape
        greedy = [p.temperature <= 0.0 or p.top_k == 1 for p in params]
        tokens = logits.argmax(dim=-1)
        rows = [i for i in range(n) if not greedy[i]]
        if rows:
            tokens[rows] = self._sample_rows(logits[rows], [requests[i] for i in rows], vocab)
        ids = tokens.tolist()
        want = [p.logprobs is not None for p in params]
        if not any(want):
            return ids, None
        lp_rows = [i for i in range(n) if want[i]]
        logp = torch.log_softmax(logits[lp_rows], dim=-1)
        top_n = max(params[i].logprobs for i in lp_rows)
        chosen = logp.gather(1, tokens[lp_rows, None]).squeeze(1).tolist()
        top_v, top_i = (logp.topk(top_n, dim=-1) if top_n else (None, None))
        out: list[TokenLogprob | None] = [None] * n
        for j, i in enumerate(lp_rows):
            k = params[i].logprobs
            top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else []
            out[i] = TokenLogprob(ids[i], chosen[j], top)
        return ids, out

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request], vocab: int) -> torch.Tensor:
        params = [r.sampling for r in requests]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
        x = logits / temp[:, None]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(ks) < vocab:
            kmax = max(k for k in ks if k < vocab)
            kth = x.topk(kmax, dim=-1).values.gather(1, torch.tensor([min(k, kmax) - 1 for k in ks], device=dev)[:, None])
            off = torch.tensor([k >= vocab for k in ks], device=dev)[:, None]
            x = x.masked_fill((x < kth) & ~off, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        tps = [p.top_p for p in params]
        if min(tps) < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            before = sp.cumsum(dim=-1) - sp  # mass of the strictly better tokens
            drop = before > torch.tensor(tps, device=dev, dtype=probs.dtype)[:, None]
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.exponential_(generator=self.generator)
        for i in seeded:
            noise[i].exponential_(generator=self._generator(requests[i]))
        return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
