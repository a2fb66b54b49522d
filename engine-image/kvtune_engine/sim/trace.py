"""Request traces: JSONL, one request per line, shapes only (never text).

    {"arrival_s": 0.013, "prompt_tokens": 812, "output_tokens": 190, "prefix_group": "sys-a", "prefix_tokens": 600}

    arrival_s      seconds since the start of the trace (number >= 0; lines need not be sorted)
    prompt_tokens  prompt length (integer >= 1)
    output_tokens  tokens generated (integer >= 1; the simulator generates exactly this many,
                   unless max_model_len cuts it short)
    prefix_group   optional: requests of one group share their first `prefix_tokens` prompt tokens
    prefix_tokens  with prefix_group: integer, 0 <= prefix_tokens <= prompt_tokens

Blank lines and lines starting with `#` are skipped; other keys are ignored (forward compatible).
Errors name the file and the line number.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens")


class TraceError(ValueError):
    """A malformed trace; the message starts with `file:line:`."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0

    def as_dict(self) -> dict:
        d = {"arrival_s": round(self.arrival_s, 6), "prompt_tokens": self.prompt_tokens,
             "output_tokens": self.output_tokens}
        if self.prefix_group is not None:
            d["prefix_group"] = self.prefix_group
            d["prefix_tokens"] = self.prefix_tokens
        return d


def _int(obj: dict, key: str, low: int) -> int:
    v = obj[key]
    if not ((isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())):
        raise ValueError(f"{key} must be an integer (got {json.dumps(v)})")
    if v < low:
        raise ValueError(f"{key} must be >= {low} (got {json.dumps(v)})")
    return int(v)


def parse_request(obj: object) -> TraceRequest:
    """One decoded JSON line -> TraceRequest (ValueError with the reason)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in FIELDS[:3] if k not in obj]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    a = obj["arrival_s"]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
        raise ValueError(f"arrival_s must be a number >= 0 (got {json.dumps(a)})")
    prompt = _int(obj, "prompt_tokens", 1)
    output = _int(obj, "output_tokens", 1)
    group = obj.get("prefix_group")
    if group is None:
        if obj.get("prefix_tokens") not in (None, 0):
            raise ValueError("prefix_tokens needs a prefix_group")
        return TraceRequest(float(a), prompt, output)
    if not isinstance(group, str) or not group:
        raise ValueError(f"prefix_group must be a non-empty string (got {json.dumps(group)})")
    if "prefix_tokens" not in obj:
        raise ValueError("prefix_group needs prefix_tokens")
    k = _int(obj, "prefix_tokens", 0)
    if k > prompt:
        raise ValueError(f"prefix_tokens {k} > prompt_tokens {prompt}")
    return TraceRequest(float(a), prompt, output, group, k)


def read_trace(source: str | Path | IO[str]) -> list[TraceRequest]:
    """Read a JSONL trace from a path or an open text file; TraceError names file and line."""
    if isinstance(source, (str, Path)):
        name = str(source)
        try:
            f = open(source, encoding="utf-8")
        except OSError as e:
            raise TraceError(f"{name}: cannot open: {e.strerror or e}") from None
    else:
        name, f = getattr(source, "name", "<trace>"), source
    out = []
    try:
        with f if isinstance(source, (str, Path)) else contextlib.nullcontext(f):
            for lineno, line in enumerate(f, 1):
                s = line.strip()
                if not s or s.startswith("#"):
                    continue
                try:
                    out.append(parse_request(json.loads(s)))
                except json.JSONDecodeError as e:
                    raise TraceError(f"{name}:{lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
                except ValueError as e:
                    raise TraceError(f"{name}:{lineno}: {e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{name}: not UTF-8 text: {e.reason}") from None
    if not out:
        raise TraceError(f"{name}: no requests in the trace")
    return out


def dumps(requests: Iterable[TraceRequest]) -> str:
    buf = io.StringIO()
    write_trace(requests, buf)
    return buf.getvalue()


def write_trace(requests: Iterable[TraceRequest], dest: str | Path | IO[str]) -> None:
    if isinstance(dest, (str, Path)):
        with open(dest, "w", encoding="utf-8") as f:
            write_trace(requests, f)
        return
    for r in requests:
        dest.write(json.dumps(r.as_dict(), separators=(", ", ": ")) + "\n")
