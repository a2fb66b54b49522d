"""Candidate configs around the current one, inside the user's bounds: all of the tuner's candidate
generation (single-knob moves from the diagnosis and the observation, their combinations, and the
live moves a restart makes room for).

A candidate never asks for more device memory than the measured picture allows (memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any, Iterable, Mapping

from kvtune_engine.config import BLOCK_SIZES, RESTART_KNOBS, ConfigError, EngineConfig
from kvtune_engine.knobs import BY_NAME, TABLE, knob

from .decide import knob_changes
from .memory import MemoryPicture, Safety, swap_needed_gib  # noqa: F401 - re-exported
from .observation import Observation

# ----------------------------------------------------------------------------------------------
# Bounds

#: CRD (camelCase) spelling of each knob, for messages users read next to their spec.
CAMEL = {k.name: k.camel for k in TABLE}


def knob_name(key: str) -> str:
    """The EngineConfig field of any spelling of a knob (ConfigError naming the knobs otherwise)."""
    try:
        return knob(key).name
    except KeyError as e:
        raise ConfigError(f"bounds: {e.args[0]}") from None


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float

    def clamp(self, v: float) -> float:
        return min(self.hi, max(self.lo, v))

    def __contains__(self, v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and self.lo - 1e-9 <= v <= self.hi + 1e-9

    def within(self, other: "Range") -> "Range":
        """The part of this range inside ``other``."""
        return Range(max(self.lo, other.lo), min(self.hi, other.hi))


def _search(name: str) -> Range:
    return Range(*BY_NAME[name].search)


@dataclass(frozen=True)
class Bounds:
    """What the tuner may set. Defaults are the knob table's search ranges; users narrow them
    (``spec.autotune.bounds``)."""
    block_size: tuple[int, ...] = BY_NAME["block_size"].choices
    gpu_memory_utilization: Range = _search("gpu_memory_utilization")
    swap_space: Range = _search("swap_space")
    max_num_seqs: Range = _search("max_num_seqs")
    max_num_batched_tokens: Range = _search("max_num_batched_tokens")
    enable_chunked_prefill: tuple[bool, ...] = BY_NAME["enable_chunked_prefill"].choices
    enable_prefix_caching: tuple[bool, ...] = BY_NAME["enable_prefix_caching"].choices
    watermark: Range | None = None          # None: never tuned

    def allows(self, cfg: EngineConfig) -> bool:
        return (cfg.block_size in self.block_size
                and cfg.gpu_memory_utilization in self.gpu_memory_utilization
                and cfg.swap_space in self.swap_space
                and cfg.max_num_seqs in self.max_num_seqs
                and cfg.max_num_batched_tokens in self.max_num_batched_tokens
                and cfg.enable_chunked_prefill in self.enable_chunked_prefill
                and cfg.enable_prefix_caching in self.enable_prefix_caching)

    def admits(self, name: str, value: Any) -> bool:
        """May knob ``name`` take ``value``? (A knob without bounds here, like max_model_len: no.)"""
        allowed = getattr(self, name, None)
        return allowed is not None and value in allowed

    def within(self, other: "Bounds") -> "Bounds":
        """These bounds inside ``other`` (the user's bounds inside the tuner's search ranges)."""
        ch: dict[str, Any] = {}
        for k, mine in vars(self).items():
            theirs = getattr(other, k)
            if isinstance(mine, Range) and isinstance(theirs, Range):
                ch[k] = mine.within(theirs)
            elif isinstance(mine, tuple) and isinstance(theirs, tuple):
                ch[k] = tuple(v for v in theirs if v in mine)
        return _replace(self, **ch)

    def violations(self, cfg: EngineConfig) -> list[str]:
        out = []
        for k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens"):
            r: Range = getattr(self, k)
            if getattr(cfg, k) not in r:
                out.append(f"{k}={getattr(cfg, k)} outside [{r.lo:g}, {r.hi:g}]")
        for k in ("block_size", "enable_chunked_prefill", "enable_prefix_caching"):
            if getattr(cfg, k) not in getattr(self, k):
                out.append(f"{k}={getattr(cfg, k)} not in {list(getattr(self, k))}")
        return out

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | Iterable[str] | None) -> "Bounds":
        """From the CRD's ``bounds`` mapping (``{blockSize: [16, 32], maxNumSeqs: {min: 32, max: 512}}``)
        or CLI strings (``max-num-seqs=32:512``, ``block-size=16,32``, ``enable-chunked-prefill=true``).

        A ``[lo, hi]`` pair or ``{min, max}`` is a range (for block size: the allowed sizes between);
        ``a,b,c`` lists allowed values; one value pins the knob.
        """
        if spec is None:
            return cls()
        items: list[tuple[str, Any]] = []
        if isinstance(spec, Mapping):
            items = list(spec.items())
        else:
            for s in spec:
                for part in str(s).split(";"):
                    part = part.strip()
                    if not part:
                        continue
                    if "=" not in part:
                        raise ConfigError(f"bounds: {part!r} is not KNOB=LO:HI or KNOB=V1,V2")
                    k, _, v = part.partition("=")
                    items.append((k, _parse_cli_value(v.strip())))
        vals: dict[str, Any] = {}
        for key, v in items:
            k = knob_name(key)
            if k in ("enable_chunked_prefill", "enable_prefix_caching"):
                vv = v if isinstance(v, (list, tuple)) else [v]
                vals[k] = tuple(_bool(x) for x in vv)
            elif k == "block_size":
                # a list is the set of allowed sizes (the CRD's blockSize: [16, 32]); {min, max} a range
                if isinstance(v, (list, tuple)):
                    listed = [float(_num(x)) for x in v]
                else:
                    lo, hi, listed = _span(v)
                if listed is not None:
                    bad = [b for b in listed if int(b) not in BLOCK_SIZES]
                    if bad:
                        raise ConfigError(f"bounds: block size {bad} not in {list(BLOCK_SIZES)}")
                    vals[k] = tuple(sorted(int(b) for b in listed))
                else:
                    vals[k] = tuple(b for b in BLOCK_SIZES if lo <= b <= hi)
                if not vals[k]:
                    raise ConfigError(f"bounds: no allowed block size in {v!r}")
            elif k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens",
                       "watermark"):
                lo, hi, listed = _span(v)
                if listed is not None:
                    lo, hi = min(listed), max(listed)
                if lo > hi:
                    raise ConfigError(f"bounds: {key} min {lo} > max {hi}")
                if k == "gpu_memory_utilization" and not (0 < lo and hi <= 1):
                    raise ConfigError(f"bounds: gpuMemoryUtilization must lie in (0, 1], got {lo}..{hi}")
                if lo < 0:
                    raise ConfigError(f"bounds: {key} must not be negative")
                vals[k] = Range(float(lo), float(hi))
            else:
                raise ConfigError(f"bounds: {key} is not a tuned knob")
        return cls(**vals)

    def clamp(self, cfg: EngineConfig) -> EngineConfig:
        """The nearest config inside the bounds (``cfg`` itself when it is inside)."""
        ch: dict[str, Any] = {}
        for k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens"):
            r: Range = getattr(self, k)
            v = getattr(cfg, k)
            if v not in r:
                c = r.clamp(v)
                ch[k] = int(c) if isinstance(v, int) else c
        for k in ("enable_chunked_prefill", "enable_prefix_caching"):
            if getattr(cfg, k) not in getattr(self, k):
                ch[k] = getattr(self, k)[0]
        if cfg.block_size not in self.block_size:
            ch["block_size"] = min(self.block_size, key=lambda b: (abs(b - cfg.block_size), b))
        if not ch:
            return cfg
        if ch.get("enable_chunked_prefill") is False:
            ch["max_num_batched_tokens"] = max(ch.get("max_num_batched_tokens", cfg.max_num_batched_tokens),
                                               cfg.max_model_len)
        try:
            return cfg.with_changes(**ch)
        except ConfigError:
            return cfg

    def freeze(self, cfg: EngineConfig, knobs: Iterable[str]) -> "Bounds":
        """Pin ``knobs`` (any spelling) to their value in ``cfg`` (``spec.autotune.frozenKnobs``)."""
        ch: dict[str, Any] = {}
        for key in knobs:
            k = knob_name(key)
            v = getattr(cfg, k)
            if k in ("block_size", "enable_chunked_prefill", "enable_prefix_caching"):
                ch[k] = (v,)
            elif k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens", "watermark"):
                ch[k] = Range(float(v), float(v))
        return _replace(self, **ch)

    def around(self, cfg: EngineConfig) -> "Bounds":
        """These bounds widened to contain ``cfg`` (so the user's baseline is always allowed)."""
        ch: dict[str, Any] = {}
        for k in ("block_size", "enable_chunked_prefill", "enable_prefix_caching"):
            if getattr(cfg, k) not in getattr(self, k):
                ch[k] = tuple(sorted(set(getattr(self, k)) | {getattr(cfg, k)}))
        for k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens"):
            r: Range = getattr(self, k)
            v = float(getattr(cfg, k))
            if v not in r:
                ch[k] = Range(min(r.lo, v), max(r.hi, v))
        return _replace(self, **ch) if ch else self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in ("block_size", "enable_chunked_prefill", "enable_prefix_caching"):
            out[k] = list(getattr(self, k))
        for k in ("gpu_memory_utilization", "swap_space", "max_num_seqs", "max_num_batched_tokens", "watermark"):
            r = getattr(self, k)
            if r is not None:
                out[k] = {"min": r.lo, "max": r.hi}
        return out


def _parse_cli_value(v: str) -> Any:
    if ":" in v:
        lo, _, hi = v.partition(":")
        return {"min": _num(lo) if lo else 0, "max": _num(hi) if hi else math.inf}
    if "," in v:
        return [_num(x) for x in v.split(",") if x.strip()]
    return _num(v)


def _num(x: Any) -> Any:
    if isinstance(x, (int, float, bool)):
        return x
    s = str(x).strip()
    if s.lower() in ("true", "false", "on", "off", "yes", "no"):
        return _bool(s)
    try:
        f = float(s)
    except ValueError:
        raise ConfigError(f"bounds: {s!r} is not a number") from None
    return int(f) if f.is_integer() and "." not in s else f


def _bool(x: Any) -> bool:
    if isinstance(x, bool):
        return x
    s = str(x).strip().lower()
    if s in ("true", "on", "yes", "1"):
        return True
    if s in ("false", "off", "no", "0"):
        return False
    raise ConfigError(f"bounds: {x!r} is not true or false")


def _span(v: Any) -> tuple[float, float, list[float] | None]:
    """(lo, hi, listed values or None) from {min,max}, [lo, hi], a list, or one value."""
    if isinstance(v, Mapping):
        return float(_num(v.get("min", 0))), float(_num(v.get("max", math.inf))), None
    if isinstance(v, (list, tuple)):
        nums = [float(_num(x)) for x in v]
        if not nums:
            raise ConfigError("bounds: empty list")
        if len(nums) == 2:
            return min(nums), max(nums), None
        return min(nums), max(nums), nums
    f = float(_num(v))
    return f, f, [f]


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
    * ``swap_space`` from the observed swap volume, when the window swapped.

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
