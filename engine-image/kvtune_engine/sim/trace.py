"""Request traces: JSONL, one request per line, shapes only (never text).

    {"arrival_s": 0.013, "prompt_tokens": 812, "output_tokens": 190, "prefix_group": "sys-a", "prefix_tokens": 600}

    arrival_s      seconds since the start of the trace (number >= 0; lines need not be sorted)
    prompt_tokens  prompt length (integer >= 1)
    output_tokens  tokens generated (integer >= 1; the simulator generates exactly this many,
                   unless max_model_len cuts it short)
    prefix_group   optional: requests of one group share their first `prefix_tokens` prompt tokens
    prefix_tokens  with prefix_group: integer, 0 <= prefix_tokens <= prompt_tokens
    hash_ids       optional, the hierarchical prefix: one id (integer >= 0) per `hash_block`
                   tokens of the prompt, in order, the last one covering what is left; two requests
                   whose first k ids are equal have identical first k * hash_block tokens and differ
                   after (Mooncake's hash_ids). At most ceil(prompt_tokens / hash_block) ids;
                   tokens past the last id are the request's own
    hash_block     with hash_ids: tokens per id (integer >= 1, default 512, Mooncake's)

    {"arrival_s": 0.5, "prompt_tokens": 1300, "output_tokens": 40, "hash_ids": [7, 8, 31]}

A request carries prefix_group or hash_ids, not both: a group is the one-level form (old traces,
still read as they were), a chain the general one (a tree of shared prefixes, at any depth).
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
from typing import IO, Iterable, Sequence

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens", "hash_ids", "hash_block")
HASH_BLOCK = 512   # tokens per hash id unless a request says otherwise (Mooncake's block)


class TraceError(ValueError):
    """A malformed trace; the message starts with `file:line:`."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0
    hash_ids: tuple[int, ...] = ()
    hash_block: int = HASH_BLOCK

    def as_dict(self) -> dict:
        d = {"arrival_s": round(self.arrival_s, 6), "prompt_tokens": self.prompt_tokens,
             "output_tokens": self.output_tokens}
        if self.prefix_group is not None:
            d["prefix_group"] = self.prefix_group
            d["prefix_tokens"] = self.prefix_tokens
        if self.hash_ids:
            d["hash_ids"] = list(self.hash_ids)
            if self.hash_block != HASH_BLOCK:
                d["hash_block"] = self.hash_block
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
    if missing and "input_length" in obj:
        raise ValueError(f"missing {', '.join(missing)}: a Mooncake or Bailian line (input_length); "
                         "convert the file with `kvtune trace import` first")
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    a = obj["arrival_s"]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
        raise ValueError(f"arrival_s must be a number >= 0 (got {json.dumps(a)})")
    prompt = _int(obj, "prompt_tokens", 1)
    output = _int(obj, "output_tokens", 1)
    group = obj.get("prefix_group")
    if obj.get("hash_ids") is not None:
        if group is not None:
            raise ValueError("a request carries prefix_group or hash_ids, not both")
        ids, block = parse_chain(obj, prompt)
        return TraceRequest(float(a), prompt, output, hash_ids=ids, hash_block=block)
    if obj.get("hash_block") is not None:
        raise ValueError("hash_block needs hash_ids")
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


def parse_chain(obj: dict, prompt: int, ids_key: str = "hash_ids",
                block: int | None = None) -> tuple[tuple[int, ...], int]:
    """The (ids, tokens per id) of a hash chain in `obj`; ValueError naming the field and what is allowed."""
    if block is None:
        block = _int(obj, "hash_block", 1) if obj.get("hash_block") is not None else HASH_BLOCK
    ids = obj[ids_key]
    if not isinstance(ids, list):
        raise ValueError(f"{ids_key} must be a list of integers >= 0 (got {json.dumps(ids)[:40]})")
    for j, v in enumerate(ids):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{ids_key}[{j}] must be an integer >= 0 (got {json.dumps(v)[:40]})")
    most = -(-prompt // block)
    if len(ids) > most:
        raise ValueError(f"{ids_key} has {len(ids)} ids; a prompt of {prompt} tokens at {block} tokens "
                         f"per id holds at most {most}")
    return tuple(ids), block


def chain_sharing(chains: Iterable[tuple[Sequence[int], int, int]]) -> list[int]:
    """For each (hash_ids, hash_block, prompt_tokens), in order: how many of its prompt tokens an
    earlier request had too (the longest common leading ids, in tokens, within both prompts). The
    one reading of a chain's sharing that the import summary and the tuner's length statistics use."""
    root: dict = {}   # id -> [children, the longest prompt that went through this id]
    out = []
    for ids, block, prompt in chains:
        children, k, reach = root, 0, 0
        for h in ids:
            node = children.get(h)
            if node is None:
                break
            children, k, reach = node[0], k + 1, node[1]
        out.append(min(k * block, prompt, reach))
        children = root
        for h in ids:
            node = children.setdefault(h, [{}, 0])
            node[1] = max(node[1], prompt)
            children = node[0]
    return out


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
