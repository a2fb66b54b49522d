"""Candidate configs around the current one, inside the user's bounds: all of the tuner's candidate
generation (single-knob moves from the diagnosis and the observation, their combinations, and the
live moves a restart makes room for). Each knob has one small mover (``MOVERS``), reading its
figures from the one ``Thresholds`` record diagnosis reads too.

A candidate never asks for more device memory than the measured picture allows (memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from kvtune_engine.config import RESTART_KNOBS, ConfigError, EngineConfig

from .bounds import CAMEL, Bounds, Range, knob_name  # noqa: F401 - re-exported
from .decide import knob_changes
from .memory import MemoryPicture, Safety, swap_needed_gib  # noqa: F401 - re-exported
from .observation import Observation
from .thresholds import Thresholds

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


def seq_cap_fit(obs: Observation, cfg: EngineConfig | None = None, target_usage: float = Thresholds.seq_fit_kv_usage) -> int | None:
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


# ----------------------------------------------------------------------------------------------
# Movers: one small function per knob (or cause), each yielding (why, changes) from the window.


@dataclass(frozen=True)
class Moves:
    """What every mover reads of one window, computed once. ``cfg`` is the config the moves start
    from (the observed one, brought inside the bounds)."""
    obs: Observation
    cfg: EngineConfig
    bounds: Bounds
    th: Thresholds
    safety: Safety
    mem: MemoryPicture | None
    exhaustive: bool
    tpot_missed: bool
    #: the p95 queue is short (Thresholds.short_queue_s): a missed TPOT is the objective binding
    queue_short: bool = True

    def blocked(self, *reasons: str) -> float:
        return sum(self.obs.waiting_cause_share.get(r, 0.0) for r in reasons)

    @property
    def pressure(self) -> bool:
        """Blocks ran short: the head waited for them, a request was preempted, or KV filled up."""
        o = self.obs
        return (self.exhaustive or self.blocked("kv_blocks", "watermark") >= self.th.try_share
                or o.preemptions > 0 or (o.kv_usage_peak or 0) >= self.th.kv_full)

    def seqs(self, v: float) -> int:
        return int(self.bounds.max_num_seqs.clamp(_round_seqs(v)))

    def tokens(self, v: float) -> int:
        return int(self.bounds.max_num_batched_tokens.clamp(_round_tokens(v, self.cfg.block_size)))


Move = tuple[str, dict[str, Any]]


def move_seqs(m: Moves) -> Iterable[Move]:
    """Up when the cap stopped the head or every slot was busy (try_share, seq_up, seq_fit_kv_usage);
    down under memory pressure or a missed TPOT (kv_full, seq_down)."""
    cfg, th, vs = m.cfg, m.th, set()
    if m.exhaustive or m.blocked("max_num_seqs") >= th.try_share or m.obs.running_peak >= cfg.max_num_seqs:
        vs.update(cfg.max_num_seqs * f for f in th.seq_up)
        fit = seq_cap_fit(m.obs, cfg, th.seq_fit_kv_usage)
        if fit:
            vs.add(fit)
    if m.pressure or m.tpot_missed:
        vs.update(cfg.max_num_seqs * f for f in th.seq_down)
    for v in map(m.seqs, sorted(vs)):
        yield f"max_num_seqs {cfg.max_num_seqs} -> {v}", {"max_num_seqs": v}


def tpot_budget_ladder(budget: int, th: Thresholds) -> list[float]:
    """Smaller token budgets to try when TPOT misses its objective: ``budget`` times tpot_budget_step,
    again and again, down to tpot_budget_floor (the floor itself when the steps skip it)."""
    out, v = [], budget * th.tpot_budget_step
    while v > th.tpot_budget_floor:
        out.append(v)
        v *= th.tpot_budget_step
    if budget > th.tpot_budget_floor:
        out.append(float(th.tpot_budget_floor))
    return out


def move_budget(m: Moves) -> Iterable[Move]:
    """Half and double always (budget_steps), smaller with chunked prefill (budget_chunked_step), and
    down to tpot_budget_floor when TPOT misses with a short queue (tpot_budget_ladder,
    short_queue_s); more, and the p95 prompt, when the budget stopped the head (try_share,
    budget_blocked_step, prompt_margin)."""
    cfg, th, L = m.cfg, m.th, m.obs.lengths
    ts = {cfg.max_num_batched_tokens * f for f in th.budget_steps}
    if cfg.enable_chunked_prefill:
        ts.add(cfg.max_num_batched_tokens * th.budget_chunked_step)
        if m.tpot_missed and m.queue_short:
            ts.update(tpot_budget_ladder(cfg.max_num_batched_tokens, th))
    if m.exhaustive or m.blocked("token_budget") >= th.try_share:
        ts.add(cfg.max_num_batched_tokens * th.budget_blocked_step)
        if L is not None and L.count:
            ts.add(L.prompt_p95 * th.prompt_margin)
    for v in map(m.tokens, sorted(ts)):
        yield f"max_num_batched_tokens {cfg.max_num_batched_tokens} -> {v}", {"max_num_batched_tokens": v}


def move_smaller_batches(m: Moves) -> Iterable[Move]:
    """TPOT misses its objective: fewer sequences and smaller prefill chunks together (smaller_batches)."""
    cfg = m.cfg
    if not (m.tpot_missed and cfg.enable_chunked_prefill):
        return
    for fs, ft in m.th.smaller_batches:
        v, t = m.seqs(cfg.max_num_seqs * fs), m.tokens(cfg.max_num_batched_tokens * ft)
        yield (f"smaller batches: max_num_seqs {cfg.max_num_seqs} -> {v}, max_num_batched_tokens "
               f"{cfg.max_num_batched_tokens} -> {t}", {"max_num_seqs": v, "max_num_batched_tokens": t})


def move_chunked_prefill(m: Moves) -> Iterable[Move]:
    """On, with the current and a few common budgets (chunk_budgets); off, with a budget that covers
    max_model_len (unchunked prefill must fit one step)."""
    cfg, b = m.cfg, m.bounds
    if not cfg.enable_chunked_prefill and True in b.enable_chunked_prefill:
        for t in sorted({cfg.max_num_batched_tokens, *m.th.chunk_budgets}):
            t = int(b.max_num_batched_tokens.clamp(t))
            yield (f"enable_chunked_prefill -> True, max_num_batched_tokens -> {t}",
                   {"enable_chunked_prefill": True, "max_num_batched_tokens": t})
    elif cfg.enable_chunked_prefill and False in b.enable_chunked_prefill:
        yield "enable_chunked_prefill -> False", {"enable_chunked_prefill": False,
                                                  "max_num_batched_tokens": max(cfg.max_num_batched_tokens,
                                                                                cfg.max_model_len)}


def move_prefix_caching(m: Moves) -> Iterable[Move]:
    """Off when hits are few (keep_hit_rate) or its blocks pin a short pool (cached_share); on when
    prompts share prefixes (prefix_try_share)."""
    obs, cfg, b, th, L = m.obs, m.cfg, m.bounds, m.th, m.obs.lengths
    if cfg.enable_prefix_caching and False in b.enable_prefix_caching:
        hit = obs.prefix_cache_hit_rate
        pinned = max(obs.cached_blocks_share or 0.0, obs.shared_blocks_share or 0.0)
        if m.exhaustive or (hit is not None and hit < th.keep_hit_rate) or (m.pressure and pinned >= th.cached_share):
            yield "enable_prefix_caching -> False", {"enable_prefix_caching": False}
    elif not cfg.enable_prefix_caching and True in b.enable_prefix_caching:
        if m.exhaustive or (L is not None and L.prefix_share > th.prefix_try_share):
            yield "enable_prefix_caching -> True", {"enable_prefix_caching": True}


def move_block_size(m: Moves) -> Iterable[Move]:
    """The neighbours and the least-waste size for the observed lengths (block_kernel_penalty), when
    blocks ran short or the tail waste is large (fragmentation)."""
    cfg, allowed = m.cfg, sorted(m.bounds.block_size)
    if not (m.pressure or m.obs.internal_fragmentation_mean >= m.th.fragmentation):
        return
    i = allowed.index(cfg.block_size)
    sizes = set(allowed[max(0, i - 1): i + 2])
    bb = best_block_size(m.obs, allowed, kernel_penalty=m.th.block_kernel_penalty)
    if bb:
        sizes.add(bb)
    for b in sorted(sizes - {cfg.block_size}):
        yield f"block_size {cfg.block_size} -> {b}", {"block_size": b}


def move_gpu_memory(m: Moves) -> Iterable[Move]:
    """Down to the safe line when over it (always); up towards it under pressure (gpu_steps)."""
    if m.mem is None:
        return
    r, u = m.bounds.gpu_memory_utilization, m.cfg.gpu_memory_utilization
    umax = min(r.hi, m.mem.max_utilization(m.safety))
    if u > umax + 1e-9:
        v = round(max(r.lo, umax), 3)
        yield f"gpu_memory_utilization {u} -> {v} (over the safe line)", {"gpu_memory_utilization": v}
    elif m.pressure:
        for v in sorted({*(u + s for s in m.th.gpu_steps), umax}):
            v = round(min(umax, v), 3)
            if v > u + 1e-9:
                yield f"gpu_memory_utilization {u} -> {v}", {"gpu_memory_utilization": v}


def move_swap_space(m: Moves) -> Iterable[Move]:
    """From the pool and the observed swap volume, when the window swapped (swap_steps,
    swap_first_gib, swap_need_steps, swap_step_gib)."""
    obs, cfg, th = m.obs, m.cfg, m.th
    if not (m.exhaustive or obs.preemptions_swap > 0 or obs.swap_full > 0):
        return
    need = swap_needed_gib(obs, m.safety)
    sw = {cfg.swap_space * f for f in th.swap_steps} if cfg.swap_space > 0 else set(th.swap_first_gib)
    if need is not None:
        sw.update(need * f for f in th.swap_need_steps)
    for v in sorted(sw):
        v = m.bounds.swap_space.clamp(float(math.ceil(v / th.swap_step_gib) * th.swap_step_gib))
        if abs(v - cfg.swap_space) > 1e-9:
            yield f"swap_space {cfg.swap_space} -> {v}", {"swap_space": v}


#: The movers, in the order their candidates are listed, each with the knobs it owns. Adding a
#: mover is one entry; a knob no mover owns gets ``move_other``.
MOVERS: tuple[tuple[frozenset[str], Callable[[Moves], Iterable[Move]]], ...] = (
    (frozenset({"max_num_seqs"}), move_seqs),
    (frozenset({"max_num_batched_tokens"}), move_budget),
    (frozenset(), move_smaller_batches),
    (frozenset({"enable_chunked_prefill"}), move_chunked_prefill),
    (frozenset({"enable_prefix_caching"}), move_prefix_caching),
    (frozenset({"block_size"}), move_block_size),
    (frozenset({"gpu_memory_utilization"}), move_gpu_memory),
    (frozenset({"swap_space"}), move_swap_space),
)
#: never moved: the watermark is decode headroom, not a target; the profiled budget follows the
#: budget (``loop.runnable`` sets it on a raise past the engine's start-up profile), never alone
NOT_MOVED = frozenset({"watermark", "profile_batched_tokens"})


def move_other(m: Moves) -> Iterable[Move]:
    """A tuned knob no mover owns (one just added to the knob table): its neighbouring choices, or
    the ends of its range and other_steps; the prediction tells whether they help."""
    owned = NOT_MOVED.union(*(knobs for knobs, _ in MOVERS))
    for k, b in m.bounds.items():
        if k.name in owned:
            continue
        v = getattr(m.cfg, k.name)
        if isinstance(b, tuple):
            i = b.index(v) if v in b else 0
            opts = set(b[max(0, i - 1): i + 2])
        else:
            opts = {b.lo, b.hi, *(b.clamp(v * f) for f in m.th.other_steps)} if v is not None else {b.lo, b.hi}
        for o in sorted(opts - {v}):
            yield f"{k.name} {v} -> {o}", {k.name: k.type(o)}


def propose(obs: Observation, bounds: Bounds, *, safety: Safety = Safety(), cause: str | None = None,
            memory: MemoryPicture | None = None, slo_tpot_s: float | None = None,
            slo_ttft_s: float | None = None, exhaustive: bool = False, suggestion: Mapping[str, Any] | None = None,
            thresholds: Thresholds = Thresholds()) -> CandidateSet:
    """Single-knob moves around the current config, in bounds, where the window shows a reason (each
    mover of ``MOVERS``, then ``move_other``; ``exhaustive`` moves every knob); ``suggestion``: the
    knob values the diagnosis names, on the observed config (added last).

    A current config outside the bounds is first brought inside them (that config is a candidate
    itself, and the moves start from it). Combinations of moves that each help are made by the loop
    after a first prediction round (``combine``).
    """
    out = CandidateSet()
    cfg = bounds.clamp(obs.config)
    if cfg != obs.config:
        out.add(cfg, "into the bounds")
    m = Moves(obs, cfg, bounds, thresholds, safety, memory or MemoryPicture.from_observation(obs), exhaustive,
              slo_tpot_s is not None and obs.tpot_p95_s > slo_tpot_s,
              obs.queue_time_p95_s <= thresholds.short_queue_s(slo_ttft_s))
    for mover in (*(f for _, f in MOVERS), move_other):
        for why, ch in mover(m):
            out.add(_try(cfg, bounds, **ch), why)
    if suggestion:
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
