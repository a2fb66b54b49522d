"""Where the tuner may set each knob: a range per ranged knob, a set per choice knob, made from the
knob table (`bounds_class`), so a knob added there is bounded, parsed, clamped and frozen here with
no edit. Defaults are the table's search ranges (inside its allowed ranges: `knobs.check`); users
narrow them (``spec.autotune.bounds``, the CLI).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass
from dataclasses import replace as _replace
from typing import Any, Iterable, Mapping

from kvtune_engine.config import ConfigError, EngineConfig
from annotated_types import Gt, Le, Lt

from kvtune_engine.knobs import TABLE, Knob, knob, limits_text

#: CRD (camelCase) spelling of each knob, for messages users read next to their spec.
CAMEL = {k.name: k.camel for k in TABLE}


def knob_name(key: str, table: tuple[Knob, ...] = TABLE) -> str:
    """The EngineConfig field of any spelling of a knob (ConfigError naming the knobs otherwise)."""
    try:
        return knob(key, table).name
    except KeyError as e:
        raise ConfigError(f"bounds: {e.args[0]}") from None


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float

    def clamp(self, v: float) -> float:
        return min(self.hi, max(self.lo, v))

    def __contains__(self, v: object) -> bool:
        """None is an optional knob left unset (it follows another: ``profile_batched_tokens`` the
        budget): inside every range."""
        return v is None or isinstance(v, (int, float)) and not isinstance(v, bool) and self.lo - 1e-9 <= v <= self.hi + 1e-9

    def within(self, other: "Range") -> "Range":
        """The part of this range inside ``other``."""
        return Range(max(self.lo, other.lo), min(self.hi, other.hi))


def default_bound(k: Knob) -> Range | tuple | None:
    """A knob's bound before anyone narrows it: its choices, its search range, or None (never tuned)."""
    return k.choices if k.choices else Range(*k.search) if k.search else None


class _Bounds:
    """What the tuner may set: one field per tuned knob of ``TABLE`` (a Range, a tuple of allowed
    values, or None: the knob is never tuned)."""

    TABLE: tuple[Knob, ...] = TABLE

    def items(self) -> list[tuple[Knob, Any]]:
        """(knob, bound) of every bounded knob."""
        return [(k, getattr(self, k.name)) for k in self.TABLE if k.tuned and getattr(self, k.name) is not None]

    def allows(self, cfg: EngineConfig) -> bool:
        return all(getattr(cfg, k.name) in b for k, b in self.items())

    def admits(self, name: str, value: Any) -> bool:
        """May knob ``name`` take ``value``? (A knob without bounds here, like max_model_len: no.)"""
        allowed = getattr(self, name, None)
        return allowed is not None and value in allowed

    def within(self, other: Any) -> Any:
        """These bounds inside ``other`` (the user's bounds inside the tuner's search ranges)."""
        ch: dict[str, Any] = {}
        for k, mine in self.items():
            theirs = getattr(other, k.name)
            if isinstance(mine, Range) and isinstance(theirs, Range):
                ch[k.name] = mine.within(theirs)
            elif isinstance(mine, tuple) and isinstance(theirs, tuple):
                ch[k.name] = tuple(v for v in theirs if v in mine)
        return _replace(self, **ch)  # type: ignore[type-var]

    def violations(self, cfg: EngineConfig) -> list[str]:
        out = []
        for k, b in self.items():
            v = getattr(cfg, k.name)
            if v not in b:
                out.append(f"{k.name}={v} outside [{b.lo:g}, {b.hi:g}]" if isinstance(b, Range)
                           else f"{k.name}={v} not in {list(b)}")
        return out

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | Iterable[str] | None) -> Any:
        """From the CRD's ``bounds`` mapping (``{blockSize: [16, 32], maxNumSeqs: {min: 32, max: 512}}``)
        or CLI strings (``max-num-seqs=32:512``, ``block-size=16,32``, ``enable-chunked-prefill=true``).

        A ``[lo, hi]`` pair or ``{min, max}`` is a range (for a choice knob: the choices between);
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
        fields = {k.name: k for k in cls.TABLE if k.tuned}
        vals: dict[str, Any] = {}
        for key, v in items:
            k = fields.get(knob_name(key, cls.TABLE))
            if k is None:
                raise ConfigError(f"bounds: {key} is not a tuned knob")
            vals[k.name] = _parse_one(k, key, v)
        return cls(**vals)

    def clamp(self, cfg: EngineConfig) -> EngineConfig:
        """The nearest config inside the bounds (``cfg`` itself when it is inside)."""
        ch: dict[str, Any] = {}
        for k, b in self.items():
            v = getattr(cfg, k.name)
            if v in b:
                continue
            if isinstance(b, Range):
                c = b.clamp(v)
                ch[k.name] = int(c) if isinstance(v, int) else c
            elif k.type is bool:
                ch[k.name] = b[0]
            else:
                ch[k.name] = min(b, key=lambda x: (abs(x - v), x))
        if not ch:
            return cfg
        if ch.get("enable_chunked_prefill") is False:
            ch["max_num_batched_tokens"] = max(ch.get("max_num_batched_tokens", cfg.max_num_batched_tokens),
                                               cfg.max_model_len)
        try:
            return cfg.with_changes(**ch)
        except ConfigError:
            return cfg

    def freeze(self, cfg: EngineConfig, knobs: Iterable[str]) -> Any:
        """Pin ``knobs`` (any spelling) to their value in ``cfg`` (``spec.autotune.frozenKnobs``)."""
        fields = {k.name: k for k in self.TABLE if k.tuned}
        ch: dict[str, Any] = {}
        for key in knobs:
            k = fields.get(knob_name(key, self.TABLE))
            if k is not None:
                v = getattr(cfg, k.name)
                ch[k.name] = None if v is None else (v,) if k.choices else Range(float(v), float(v))
        return _replace(self, **ch)  # type: ignore[type-var]

    def around(self, cfg: EngineConfig) -> Any:
        """These bounds widened to contain ``cfg`` (so the user's baseline is always allowed)."""
        ch: dict[str, Any] = {}
        for k, b in self.items():
            v = getattr(cfg, k.name)
            if v in b:
                continue
            ch[k.name] = (Range(min(b.lo, float(v)), max(b.hi, float(v))) if isinstance(b, Range)
                          else tuple(sorted(set(b) | {v})))
        return _replace(self, **ch) if ch else self  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        return {k.name: {"min": b.lo, "max": b.hi} if isinstance(b, Range) else list(b) for k, b in self.items()}


def bounds_class(table: tuple[Knob, ...]) -> type[_Bounds]:
    """The frozen dataclass of a knob table's bounds: a field per tuned knob, its default bound."""
    fields = [(k.name, Any, field(default=default_bound(k))) for k in table if k.tuned]
    return make_dataclass("Bounds", fields, bases=(_Bounds,), frozen=True,
                          namespace={"TABLE": table, "__doc__": _Bounds.__doc__, "__module__": __name__})


Bounds = bounds_class(TABLE)


def _parse_one(k: Knob, key: str, v: Any) -> Any:
    if k.type is bool:
        return tuple(_bool(x) for x in (v if isinstance(v, (list, tuple)) else [v]))
    if k.choices:
        # a list is the set of allowed values (the CRD's blockSize: [16, 32]); {min, max} a range
        if isinstance(v, (list, tuple)):
            listed: list[float] | None = [float(_num(x)) for x in v]
        else:
            lo, hi, listed = _span(v)
        if listed is not None:
            bad = [x for x in listed if x not in k.choices]
            if bad:
                raise ConfigError(f"bounds: {k.name.replace('_', ' ')} {bad} not in {list(k.choices)}")
            out = tuple(sorted(k.type(x) for x in listed))
        else:
            out = tuple(c for c in k.choices if lo <= c <= hi)
        if not out:
            raise ConfigError(f"bounds: no allowed {k.name.replace('_', ' ')} in {v!r}")
        return out
    lo, hi, listed = _span(v)
    if listed is not None:
        lo, hi = min(listed), max(listed)
    if lo > hi:
        raise ConfigError(f"bounds: {key} min {lo} > max {hi}")
    # the engine's limits, but for a closed lower end (``:512`` means "no lower limit", read as 0)
    if any(isinstance(m, Gt) and lo <= m.gt or isinstance(m, Le) and hi > m.le or isinstance(m, Lt) and hi >= m.lt
           for m in k.limits):
        raise ConfigError(f"bounds: {k.camel} must lie in {limits_text(k)}, got {lo}..{hi}")
    if lo < 0:
        raise ConfigError(f"bounds: {key} must not be negative")
    return Range(float(lo), float(hi))


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
