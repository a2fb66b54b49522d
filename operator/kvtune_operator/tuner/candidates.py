"""Candidate configs around the current one, inside the user's bounds: all of the tuner's candidate
generation (single-knob moves from the diagnosis and the observation, their combinations, and the
live moves a restart makes room for).

A candidate never asks for more device memory than the measured picture allows (memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kvtune_engine.config import RESTART_KNOBS, ConfigError, EngineConfig

from .bounds import CAMEL, Bounds, Range, knob_name  # noqa: F401 - re-exported
from .decide import knob_changes
from .memory import MemoryPicture, Safety, swap_needed_gib  # noqa: F401 - re-exported
from .observation import Observation

# ----------------------------------------------------------------------------------------------
# Candidates


@dataclass
class CandidateSet:
    configs: list[EngineConfig] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)   # config json -> the move that made it

    def add(self, cfg: EngineConfig | None, why: str) -> None:
        if cfg is None:
            return
        key = cfg.model_dump_json()
        if key not in self.why:
            self.configs.append(cfg)
            self.why[key] = why


def _try(cfg: EngineConfig, bounds: Bounds, **changes: Any) -> EngineConfig | None:
    try:
        c = cfg.with_changes(**changes)
    except ConfigError:
        return None
    return c if bounds.allows(c) else None


def _round_seqs(v: float) -> int:
    v = max(1.0, v)
    return int(v) if v < 16 else int(round(v / 8.0) * 8)


def _round_tokens(v: float, block_size: int) -> int:
    # budgets are multiples of 256 above 512 (kernel friendly), of the block size below
    if v >= 512:
        return int(round(v / 256.0) * 256)
    return max(block_size, int(round(v / block_size) * block_size))


def seq_cap_fit(obs: Observation, cfg: EngineConfig | None = None, target_usage: float = 0.9) -> int | None:
    """How many sequences fit in the KV cache at the window's blocks per running sequence."""
    cfg = cfg or obs.config
    running = obs.running_mean or obs.running_peak
    if running <= 0 or obs.kv_usage_mean <= 0 or obs.num_blocks <= 0:
        return None
    blocks_per_seq = obs.kv_usage_mean * obs.num_blocks / running
    usable = obs.num_blocks * (1 - cfg.watermark) * target_usage
    return max(1, int(usable / blocks_per_seq))


def best_block_size(obs: Observation, allowed: Iterable[int], kernel_penalty: float = 0.0) -> int | None:
    """The allowed block size with the least tail waste for the observed lengths (ties: the larger,
    fewer blocks per sequence). None without a length distribution."""
    if obs.lengths is None or not obs.lengths.totals:
        return None
    scored = [(obs.lengths.tail_waste(b) + kernel_penalty * (16 / b), -b, b) for b in allowed]
    return min(scored)[2]


#: Knobs `propose` moves by their own rules (watermark: never; it is decode headroom, not a target)
_OWN_MOVES = frozenset({"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                        "block_size", "gpu_memory_utilization", "swap_space", "watermark"})


def propose(obs: Observation, bounds: Bounds, *, safety: Safety = Safety(), cause: str | None = None,
            memory: MemoryPicture | None = None, slo_tpot_s: float | None = None,
            exhaustive: bool = False, suggestion: Mapping[str, Any] | None = None) -> CandidateSet:
    """Single-knob moves around the current config, in bounds, where the window shows a reason;
    ``suggestion``: the knob values the diagnosis names (added last).

    Each knob is moved only when the window's figures point at it (``exhaustive`` moves every knob):

    * ``max_num_seqs`` up when the cap stopped the queue head or every slot was busy; down when
      sequences were preempted, blocks ran short or TPOT missed its target;
    * ``max_num_batched_tokens`` half and double always (cheap), more when the budget stopped the
      head; to the 95th-percentile prompt when prompts are long;
    * chunked prefill on/off; turning it on also tries smaller budgets (what makes it useful);
    * prefix caching off when its hit rate is low or its blocks pin the pool; on when prompts share
      prefixes;
    * block size: the neighbours and the least-waste size for the observed lengths, when blocks ran
      short or the tail waste is large;
    * ``gpu_memory_utilization`` up to the safe line when blocks ran short or sequences were
      preempted; down to the safe line when above it (always proposed);
    * ``swap_space`` from the observed swap volume, when the window swapped;
    * any other bounded knob (one new in the knob table): its neighbours, always.

    A current config outside the bounds is first brought inside them (that config is a candidate
    itself, and the moves start from it). Combinations of moves that each help are made by the loop
    after a first prediction round (``combine``).
    """
    out = CandidateSet()
    cfg = bounds.clamp(obs.config)
    if cfg != obs.config:
        out.add(cfg, "into the bounds")
    mem = memory or MemoryPicture.from_observation(obs)
    share = obs.waiting_cause_share
    seqs_blocked = share.get("max_num_seqs", 0.0)
    budget_blocked = share.get("token_budget", 0.0)
    blocks_blocked = share.get("kv_blocks", 0.0) + share.get("watermark", 0.0)
    pressure = exhaustive or blocks_blocked >= 0.02 or obs.preemptions > 0 or (obs.kv_usage_peak or 0) >= 0.95
    L = obs.lengths

    def move(why: str, **ch: Any) -> None:
        out.add(_try(cfg, bounds, **ch), why)

    # max_num_seqs
    seqs: set[float] = set()
    if exhaustive or seqs_blocked >= 0.02 or obs.running_peak >= cfg.max_num_seqs:
        seqs.update(cfg.max_num_seqs * f for f in (1.5, 2.0, 4.0))
        fit = seq_cap_fit(obs, cfg)
        if fit:
            seqs.add(fit)
    if pressure or (slo_tpot_s is not None and obs.tpot_p95_s > slo_tpot_s):
        seqs.update(cfg.max_num_seqs * f for f in (0.5, 0.75))
    for v in sorted(seqs):
        v = int(bounds.max_num_seqs.clamp(_round_seqs(v)))
        move(f"max_num_seqs {cfg.max_num_seqs} -> {v}", max_num_seqs=v)

    # max_num_batched_tokens (with chunked prefill off it must cover max_model_len)
    toks = {cfg.max_num_batched_tokens * 0.5, cfg.max_num_batched_tokens * 2.0}
    if cfg.enable_chunked_prefill:  # smaller prefill chunks: shorter stalls for the running decodes
        toks.add(cfg.max_num_batched_tokens * 0.25)
    if exhaustive or budget_blocked >= 0.02:
        toks.add(cfg.max_num_batched_tokens * 4.0)
        if L is not None and L.count:
            toks.add(L.prompt_p95 * 1.1)
    for v in sorted(toks):
        v = int(bounds.max_num_batched_tokens.clamp(_round_tokens(v, cfg.block_size)))
        move(f"max_num_batched_tokens {cfg.max_num_batched_tokens} -> {v}", max_num_batched_tokens=v)

    # TPOT misses its target: smaller batches need both fewer sequences and smaller prefill chunks
    # (either alone often moves the stall elsewhere), so these two move together
    if slo_tpot_s is not None and obs.tpot_p95_s > slo_tpot_s and cfg.enable_chunked_prefill:
        for fs, ft in ((0.25, 0.25), (0.5, 0.25), (0.5, 0.5)):
            v = int(bounds.max_num_seqs.clamp(_round_seqs(cfg.max_num_seqs * fs)))
            t = int(bounds.max_num_batched_tokens.clamp(_round_tokens(cfg.max_num_batched_tokens * ft, cfg.block_size)))
            move(f"smaller batches: max_num_seqs {cfg.max_num_seqs} -> {v}, max_num_batched_tokens "
                 f"{cfg.max_num_batched_tokens} -> {t}", max_num_seqs=v, max_num_batched_tokens=t)

    # chunked prefill
    if not cfg.enable_chunked_prefill and True in bounds.enable_chunked_prefill:
        for t in sorted({cfg.max_num_batched_tokens, 2048, 4096, 8192}):
            t = int(bounds.max_num_batched_tokens.clamp(t))
            move(f"enable_chunked_prefill -> True, max_num_batched_tokens -> {t}",
                 enable_chunked_prefill=True, max_num_batched_tokens=t)
    elif cfg.enable_chunked_prefill and False in bounds.enable_chunked_prefill:
        move("enable_chunked_prefill -> False", enable_chunked_prefill=False,
             max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len))

    # prefix caching
    if cfg.enable_prefix_caching and False in bounds.enable_prefix_caching:
        hit = obs.prefix_cache_hit_rate
        pinned = max(obs.cached_blocks_share or 0.0, obs.shared_blocks_share or 0.0)
        if exhaustive or (hit is not None and hit < 0.5) or (pressure and pinned >= 0.2):
            move("enable_prefix_caching -> False", enable_prefix_caching=False)
    elif not cfg.enable_prefix_caching and True in bounds.enable_prefix_caching:
        if exhaustive or (L is not None and L.prefix_share > 0.1):
            move("enable_prefix_caching -> True", enable_prefix_caching=True)

    # block size: neighbours, and the least-waste size for the observed lengths
    allowed = sorted(bounds.block_size)
    if pressure or obs.internal_fragmentation_mean >= 0.1:
        sizes = set()
        i = allowed.index(cfg.block_size)
        sizes.update(allowed[max(0, i - 1): i + 2])
        bb = best_block_size(obs, allowed, kernel_penalty=0.02)
        if bb:
            sizes.add(bb)
        for b in sorted(sizes - {cfg.block_size}):
            move(f"block_size {cfg.block_size} -> {b}", block_size=b)

    # gpu_memory_utilization: up to what the measured memory allows
    if mem is not None:
        umax = min(bounds.gpu_memory_utilization.hi, mem.max_utilization(safety))
        u = cfg.gpu_memory_utilization
        if u > umax + 1e-9:  # over the safe line: come down
            v = round(max(bounds.gpu_memory_utilization.lo, umax), 3)
            move(f"gpu_memory_utilization {u} -> {v} (over the safe line)", gpu_memory_utilization=v)
        elif pressure:
            for v in sorted({u + 0.05, u + 0.15, umax}):
                v = round(min(umax, v), 3)
                if v > u + 1e-9:
                    move(f"gpu_memory_utilization {u} -> {v}", gpu_memory_utilization=v)

    # swap space: from the observed swap volume
    if exhaustive or obs.preemptions_swap > 0 or obs.swap_full > 0:
        need = swap_needed_gib(obs, safety)
        sw = {cfg.swap_space * 2, cfg.swap_space * 4} if cfg.swap_space > 0 else {1.0, 4.0}
        if need is not None:
            sw.update({need, need * 2})
        for v in sorted(sw):
            v = bounds.swap_space.clamp(float(math.ceil(v * 2) / 2))  # half GiB steps
            if abs(v - cfg.swap_space) > 1e-9:
                move(f"swap_space {cfg.swap_space} -> {v}", swap_space=v)
    # a tuned knob the moves above do not know (one just added to the knob table): its neighbouring
    # choices, or half, double and the ends of its range; the prediction tells whether they help
    for k, b in bounds.items():
        if k.name in _OWN_MOVES:
            continue
        v = getattr(cfg, k.name)
        if isinstance(b, tuple):
            i = b.index(v) if v in b else 0
            opts = set(b[max(0, i - 1): i + 2])
        else:
            opts = {b.lo, b.hi, b.clamp(v * 0.5), b.clamp(v * 2)} if v is not None else {b.lo, b.hi}
        for o in sorted(opts - {v}):
            move(f"{k.name} {v} -> {o}", **{k.name: k.type(o)})
    if suggestion:  # on the observed config itself, as the diagnosis computed it
        out.add(_try(obs.config, bounds, **suggestion), f"diagnosis: {dict(suggestion)}")
    return out


def combine(base: EngineConfig, moves: list[EngineConfig], bounds: Bounds, *, limit: int = 8) -> list[EngineConfig]:
    """Pairs (and the union) of single-knob moves that each beat ``base``, one value per knob:
    the second round of the search. ``moves`` are in order of preference."""
    per_knob: dict[str, dict[str, Any]] = {}
    for m in moves:
        ch = knob_changes(base, m)
        if len(ch) == 1 or (len(ch) == 2 and "max_num_batched_tokens" in ch
                            and ("enable_chunked_prefill" in ch or "max_num_seqs" in ch)):
            key = "+".join(sorted(ch))
            per_knob.setdefault(key, ch)
    keys = list(per_knob)[:5]
    out: list[EngineConfig] = []
    seen = set()

    def add(changes: dict[str, Any]) -> None:
        c = _try(base, bounds, **changes)
        if c is not None and c.model_dump_json() not in seen:
            seen.add(c.model_dump_json())
            out.append(c)

    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            if set(per_knob[keys[i]]) & set(per_knob[keys[j]]):
                continue
            add({**per_knob[keys[i]], **per_knob[keys[j]]})
    if len(keys) >= 3:
        merged: dict[str, Any] = {}
        for k in keys:
            if not set(per_knob[k]) & set(merged):
                merged.update(per_knob[k])
        add(merged)
    return out[:limit]


def restart_lookahead(cfg: EngineConfig, ranked_restarts: Iterable[EngineConfig], bounds: Bounds,
                      *, top: int = 3) -> tuple[list[EngineConfig], list[EngineConfig]]:
    """Before spending a restart: the best few distinct restart settings (``ranked_restarts``, best
    first; each memory size once) with the current live knobs, and each with the live moves the
    restart makes room for (more memory -> more sequences, a smaller budget -> more KV), to be taken
    together in this one restart. Returns (restart settings, their live moves)."""
    seen: dict[str, EngineConfig] = {}
    for c in ranked_restarts:
        rk = {k: v for k, v in knob_changes(cfg, c).items() if k in RESTART_KNOBS}
        key = repr(sorted(rk.items()))
        if key not in seen:
            seen[key] = _try(cfg, bounds, **rk) or c
        if len(seen) >= top:
            break
    extra: list[EngineConfig] = []
    for c in seen.values():
        for ch in ({"max_num_seqs": int(c.max_num_seqs * 1.5)}, {"max_num_seqs": c.max_num_seqs * 2},
                   {"max_num_batched_tokens": c.max_num_batched_tokens // 2}):
            k, v = next(iter(ch.items()))
            n = _try(c, bounds, **{k: int(getattr(bounds, k).clamp(v))})
            if n is not None and n != c:
                extra.append(n)
    return list(seen.values()), extra
