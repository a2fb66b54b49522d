"""Import the request logs people have into our JSONL trace (`kvtune trace import`).

Users have logs, not our format. Each reader keeps only what a trace holds (arrival time, prompt
and output token counts) and never any text:

    azure           Azure LLM inference trace CSV (AzurePublicDataset, 2023 and 2024):
                    TIMESTAMP (a datetime, e.g. 2023-11-16 18:15:46.6805900: any number of
                    fractional digits), ContextTokens, GeneratedTokens
    burstgpt        BurstGPT CSV: Timestamp (seconds since the trace began), Model, Request tokens,
                    Response tokens, Total tokens, Log Type
    guidellm        guidellm's benchmarks JSON report: benchmarks[].requests.{successful,incomplete,
                    errored}[]; tokens in prompt_tokens / output_tokens (or input_metrics /
                    output_metrics .total_tokens), the start in start_time (v0.2),
                    scheduler_info.request_timings.request_start (v0.3) or request_start_time /
                    info.timings.request_start (v0.4 and later)
    inference-perf  inference-perf's per_request_lifecycle_metrics.json: a list of {start_time,
                    end_time, info, error}; prompt tokens in info.input_tokens (or
                    info.request_metrics.text.input_tokens), output tokens in
                    info.response_metrics.server_usage.completion_tokens (the server's count),
                    info.response_metrics.output_tokens, info.response_info.output_tokens or
                    info.output_tokens, by version
    mooncake        Mooncake's request trace JSONL (FAST'25 release, and the tools that write its
                    layout): timestamp (ms since the trace began), input_length, output_length,
                    hash_ids (one id per 512-token block; equal leading ids = a shared prefix), kept
                    as our hash_ids so the prefix sharing replays (`hash_block` if a file's ids
                    cover another block size)
    bailian         Alibaba's Qwen-Bailian usage traces (qwen-bailian-usagetraces-anon, e.g.
                    qwen_traceA_blksz_16.jsonl): the same fields with timestamp in seconds and
                    hash_ids of 16 tokens each (chat_id, parent_chat_id, type, turn: not needed,
                    the chain already holds the session's shared context)
    kvtune          our own JSONL (to slice, rescale or cap it)

Not read: ServeGen (Alibaba) publishes per-client distributions of rates and lengths, not a request
log.

Failed requests are dropped and counted, never replayed: a BurstGPT row with Response tokens 0 (its
README: the failures), a guidellm request that errored or was cut off (incomplete: its output
length is unknown), an inference-perf record with an error. A row with no prompt or no output
tokens (0) is dropped the same way: our trace needs both >= 1. Anything malformed (a missing
column, a count that is not an integer >= 0, a timestamp that does not parse) stops the import with
`FILE:LINE: what is wrong`, like our own loader.

Arrivals are re-based to the first request kept, then sliced (`start_s`, `duration_s`: seconds of
the source's clock), capped (`limit`) and divided by `speedup` (2 replays twice as fast).
"""
from __future__ import annotations

import bisect
import calendar
import csv
import json
import json.decoder
import json.scanner
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .trace import HASH_BLOCK, TraceError, TraceRequest, chain_sharing, parse_chain, read_trace

FORMATS = ("azure", "burstgpt", "guidellm", "inference-perf", "mooncake", "bailian", "kvtune")
#: the block-chain JSONL layouts: (seconds per timestamp unit, tokens per hash id, the unit's name)
CHAIN_LAYOUTS = {"mooncake": (0.001, HASH_BLOCK, "ms"), "bailian": (1.0, 16, "s")}

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclass
class Imported:
    """What an import produced: the requests (arrival order), the format read, and what was dropped."""
    requests: list[TraceRequest]
    format: str
    read: int = 0
    dropped: Counter = field(default_factory=Counter)

    def summary(self, name: str) -> str:
        """One line for the user: how much came in, what was dropped, the load it describes."""
        r = self.requests
        drop = "; dropped " + ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) if self.dropped else ""
        if not r:
            return f"{name} ({self.format}): no requests left of {self.read} read{drop}"
        span = r[-1].arrival_s - r[0].arrival_s
        rate = f", {(len(r) - 1) / span:.3g} requests/s" if span > 0 else ""
        pm = sum(x.prompt_tokens for x in r) / len(r)
        om = sum(x.output_tokens for x in r) / len(r)
        return (f"{name} ({self.format}): {len(r)} requests of {self.read} read over {span:.1f} s{rate}; "
                f"mean prompt {pm:.0f} tokens, mean output {om:.0f} tokens{_sharing(r)}{drop}")


def _sharing(reqs: list[TraceRequest]) -> str:
    """How much of the chains' prompts an earlier request already had (the prefix sharing kept)."""
    chained = [r for r in reqs if r.hash_ids]
    total = sum(r.prompt_tokens for r in chained)
    shared = sum(chain_sharing((r.hash_ids, r.hash_block, r.prompt_tokens) for r in chained))
    return f"; {shared / total:.0%} of the chained prompt tokens shared with an earlier request" if total else ""


@dataclass(frozen=True)
class _Row:
    t: float
    prompt: int
    output: int
    group: str | None = None            # one-level prefix (kvtune traces)
    prefix: int = 0
    ids: tuple[int, ...] = ()           # hash chain (Mooncake, kvtune)
    block: int = HASH_BLOCK


class _Bad(ValueError):
    """A malformed record: `where` is a line number (CSV) or a JSON path (located afterwards)."""

    def __init__(self, where: int | tuple, msg: str) -> None:
        super().__init__(msg)
        self.where = where


# ------------------------------------------------------------------------------------------------
# detection


def detect_format(path: str | Path) -> str:
    """The format of a file, from its header (CSV) or its structure (JSON); TraceError when unknown."""
    name = str(path)
    head = _head(name)
    s = head.lstrip("\ufeff \t\r\n")
    if s.startswith("{") or s.startswith("["):
        first = s.splitlines()[0].strip()
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and "arrival_s" in obj:
            return "kvtune"
        if isinstance(obj, dict) and {"input_length", "output_length"} <= obj.keys():
            return "bailian" if "chat_id" in obj else "mooncake"
        if s.startswith("["):
            return "inference-perf" if '"start_time"' in head else _unknown(name, "a JSON list")
        if re.search(r'"benchmarks"\s*:', head):
            return "guidellm"
        if "arrival_s" in head:
            return "kvtune"
        return _unknown(name, "a JSON object")
    header = next(csv.reader([s.splitlines()[0] if s else ""]), [])
    cols = {c.strip() for c in header}
    if set(AZURE_COLUMNS) <= cols:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= cols:
        return "burstgpt"
    return _unknown(name, f"a header {', '.join(header[:8]) or '(empty)'}")


def _unknown(name: str, what: str) -> str:
    raise TraceError(f"{name}:1: cannot tell the format from {what}; expected an Azure trace CSV "
                     f"({', '.join(AZURE_COLUMNS)}), a BurstGPT CSV ({', '.join(BURSTGPT_COLUMNS)}), a guidellm "
                     "benchmarks JSON, inference-perf's per_request_lifecycle_metrics.json, a Mooncake or Bailian JSONL trace "
                     f"({', '.join(MOONCAKE_FIELDS)}, hash_ids) or a kvtune JSONL "
                     "trace (--format forces one)")


def _head(name: str, n: int = 65536) -> str:
    try:
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read(n)
    except OSError as e:
        raise TraceError(f"{name}: cannot open: {e.strerror or e}") from None


def _text(name: str) -> str:
    try:
        with open(name, encoding="utf-8-sig") as f:
            return f.read()
    except OSError as e:
        raise TraceError(f"{name}: cannot open: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{name}: not UTF-8 text: {e.reason}") from None


# ------------------------------------------------------------------------------------------------
# field parsing


def _count(v: Any, what: str, where: Any) -> int:
    """A token count: an integer >= 0 (JSON number or CSV text such as '812' or '812.0')."""
    if isinstance(v, str):
        s = v.strip()
        try:
            v = int(s) if re.fullmatch(r"[+-]?\d+", s) else float(s)
        except ValueError:
            raise _Bad(where, f"{what} must be an integer >= 0 (got {v!r})") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()) or v < 0:
        raise _Bad(where, f"{what} must be an integer >= 0 (got {json.dumps(v)})")
    return int(v)


def _seconds(v: Any, what: str, where: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise _Bad(where, f"{what} must be a number of seconds (got {v!r})") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(where, f"{what} must be a number of seconds (got {json.dumps(v)})")
    return float(v)


_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?")


def parse_datetime(text: str) -> float:
    """Seconds since the epoch of `2023-11-16 18:15:46.6805900` (any number of fractional digits,
    optional `T`, optional `Z` or `+hh:mm`; naive times read as UTC: only differences matter)."""
    m = _DATETIME.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a datetime like 2023-11-16 18:15:46.6805900 (got {text!r})")
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        base = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0))
        if not (1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1] and h < 24 and mi < 60 and s < 61):
            raise ValueError
    except ValueError:
        raise ValueError(f"not a valid date and time (got {text!r})") from None
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    tz = m.group(8)
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        hh, mm = int(tz[1:3]), int(tz[-2:])
        base -= sign * (hh * 3600 + mm * 60)
    return base + frac


# ------------------------------------------------------------------------------------------------
# CSV readers


def _csv_rows(name: str, required: tuple[str, ...], fmt: str) -> Iterable[tuple[int, dict[str, str]]]:
    text = _text(name)
    reader = csv.reader(text.splitlines(keepends=True))
    header = None
    for row in reader:
        if not row or not "".join(row).strip():
            continue
        if header is None:
            header = [c.strip() for c in row]
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{name}:{reader.line_num}: not a {fmt} CSV: no column {', '.join(missing)} "
                                 f"(the header has {', '.join(header)})")
            continue
        if len(row) != len(header):
            raise TraceError(f"{name}:{reader.line_num}: {len(row)} fields, the header has {len(header)}")
        yield reader.line_num, dict(zip(header, row))
    if header is None:
        raise TraceError(f"{name}: empty file: no {fmt} header")


def read_azure(name: str, out: Imported) -> list[_Row]:
    rows = []
    for line, r in _csv_rows(name, AZURE_COLUMNS, "Azure LLM inference trace"):
        try:
            t = parse_datetime(r["TIMESTAMP"])
        except ValueError as e:
            raise _Bad(line, f"TIMESTAMP: {e}") from None
        rows.append(_Row(t, _count(r["ContextTokens"], "ContextTokens", line),
                         _count(r["GeneratedTokens"], "GeneratedTokens", line)))
    out.read = len(rows)
    return rows


def read_burstgpt(name: str, out: Imported, model: str | None = None) -> list[_Row]:
    rows = []
    for line, r in _csv_rows(name, BURSTGPT_COLUMNS, "BurstGPT"):
        out.read += 1
        t = _seconds(r["Timestamp"], "Timestamp", line)
        prompt = _count(r["Request tokens"], "Request tokens", line)
        output = _count(r["Response tokens"], "Response tokens", line)
        if model is not None and r.get("Model", "").strip() != model:
            out.dropped[f"other model than {model}"] += 1
            continue
        if output == 0:
            out.dropped["failed (Response tokens 0)"] += 1
            continue
        rows.append(_Row(t, prompt, output))
    return rows


# ------------------------------------------------------------------------------------------------
# JSONL readers


def read_chain_jsonl(name: str, out: Imported, fmt: str, hash_block: int | None = None) -> list[_Row]:
    """Mooncake's or Bailian's layout, one request a line: timestamp, lengths, an optional hash chain."""
    per_unit, default_block, unit = CHAIN_LAYOUTS[fmt]
    hash_block = hash_block or default_block
    label = "Mooncake" if fmt == "mooncake" else "Bailian"
    rows = []
    for line, raw in enumerate(_text(name).splitlines(), 1):
        s = raw.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise _Bad(line, f"not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _Bad(line, f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in MOONCAKE_FIELDS if k not in obj]
        if missing:
            raise _Bad(line, f"not a {label} trace line: no {', '.join(missing)}")
        out.read += 1
        t = _seconds(obj["timestamp"], f"timestamp ({unit})", line)
        if t < 0:
            raise _Bad(line, f"timestamp must be >= 0 {unit} (got {json.dumps(obj['timestamp'])})")
        prompt = _count(obj["input_length"], "input_length", line)
        output = _count(obj["output_length"], "output_length", line)
        ids: tuple[int, ...] = ()
        if obj.get("hash_ids") is not None and prompt > 0:
            try:
                ids, _ = parse_chain(obj, prompt, block=hash_block)
            except ValueError as e:
                raise _Bad(line, str(e)) from None
        rows.append(_Row(t * per_unit, prompt, output, ids=ids, block=hash_block))
    if not rows:
        raise TraceError(f"{name}: no requests in the {label} trace")
    return rows


# ------------------------------------------------------------------------------------------------
# JSON readers


def _get(obj: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(obj, dict) or k not in obj:
            return None
        obj = obj[k]
    return obj


def _first(obj: dict, *paths: tuple[str, ...]) -> Any:
    for p in paths:
        v = _get(obj, *p)
        if v is not None:
            return v
    return None


def read_guidellm(doc: Any, out: Imported, benchmark: int | None = None) -> list[_Row]:
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise _Bad((), "not a guidellm report: no benchmarks list")
    benches = list(enumerate(doc["benchmarks"]))
    if benchmark is not None:
        if not 1 <= benchmark <= len(benches):
            raise _Bad(("benchmarks",), f"--benchmark {benchmark}: the report has {len(benches)} benchmark(s)")
        benches = [benches[benchmark - 1]]
    rows = []
    for bi, b in benches:
        reqs = _get(b, "requests")
        if not isinstance(reqs, dict):
            raise _Bad(("benchmarks", bi), "no requests (per-request results) in this benchmark")
        for status in ("successful", "incomplete", "errored"):
            items = reqs.get(status) or []
            if not isinstance(items, list):
                raise _Bad(("benchmarks", bi, "requests", status), "must be a list of requests")
            for ri, r in enumerate(items):
                where = ("benchmarks", bi, "requests", status, ri)
                out.read += 1
                if not isinstance(r, dict):
                    raise _Bad(where, "a request must be a JSON object")
                start = _first(r, ("start_time",), ("request_start_time",), ("info", "timings", "request_start"),
                               ("scheduler_info", "request_timings", "request_start"))
                if start is None:
                    raise _Bad(where, "no start time (start_time, request_start_time or info.timings.request_start)")
                t = _seconds(start, "start time", where)
                if status != "successful":
                    out.dropped[f"{status} (output length unknown)"] += 1
                    continue
                p = _first(r, ("prompt_tokens",), ("input_metrics", "total_tokens"))
                o = _first(r, ("output_tokens",), ("output_metrics", "total_tokens"))
                if p is None:
                    raise _Bad(where, "no prompt token count (prompt_tokens or input_metrics.total_tokens)")
                if o is None:
                    raise _Bad(where, "no output token count (output_tokens or output_metrics.total_tokens)")
                rows.append(_Row(t, _count(p, "prompt_tokens", where), _count(o, "output_tokens", where)))
    return rows


def read_inference_perf(doc: Any, out: Imported) -> list[_Row]:
    if not isinstance(doc, list):
        raise _Bad((), "not inference-perf per-request output: expected a JSON list of requests")
    rows = []
    for i, r in enumerate(doc):
        where = (i,)
        out.read += 1
        if not isinstance(r, dict):
            raise _Bad(where, "a request must be a JSON object")
        if "start_time" not in r:
            raise _Bad(where, "no start_time")
        t = _seconds(r["start_time"], "start_time", where)
        if r.get("error"):
            out.dropped["failed (error)"] += 1
            continue
        info = r.get("info")
        if not isinstance(info, dict):
            raise _Bad(where, "no info object (the token counts)")
        p = _first(info, ("input_tokens",), ("request_metrics", "text", "input_tokens"))
        o = _first(info, ("response_metrics", "server_usage", "completion_tokens"), ("response_metrics", "output_tokens"),
                   ("response_info", "output_tokens"), ("output_tokens",))
        if p is None:
            raise _Bad(where, "no prompt token count (info.input_tokens or info.request_metrics.text.input_tokens)")
        if o is None:
            raise _Bad(where, "no output token count (info.response_metrics.output_tokens or info.output_tokens)")
        rows.append(_Row(t, _count(p, "input_tokens", where), _count(o, "output_tokens", where)))
    return rows


class _Located(dict):
    """A JSON object that knows the line it starts on."""
    line = 0


def _locate(text: str, path: tuple) -> int:
    """The line of the JSON value at `path` (re-parsed with a position-keeping decoder: only when
    reporting an error, so the common case keeps the fast C parser)."""
    newlines = [m.start() for m in re.finditer("\n", text)]
    dec = json.JSONDecoder()

    def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        s, end = s_and_end
        obj, new_end = json.decoder.JSONObject(s_and_end, strict, scan_once, None, None, memo)
        located = _Located(obj)
        located.line = bisect.bisect_right(newlines, end - 1) + 1
        return located, new_end

    dec.parse_object = parse_object
    dec.scan_once = json.scanner.py_make_scanner(dec)
    node = dec.decode(text)
    line = node.line if isinstance(node, _Located) else 1
    for k in path:
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(node, _Located):
            line = node.line
    return line


def _json_doc(name: str) -> tuple[str, Any]:
    text = _text(name)
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{name}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None


def _where(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


# ------------------------------------------------------------------------------------------------
# the import


def import_trace(path: str | Path, fmt: str | None = None, *, speedup: float = 1.0, start_s: float = 0.0,
                 duration_s: float | None = None, limit: int | None = None, model: str | None = None,
                 benchmark: int | None = None, hash_block: int | None = None) -> Imported:
    """Read `path` (format `fmt`, or detected) into trace requests; TraceError names file and line."""
    name = str(path)
    if not speedup > 0 or not math.isfinite(speedup):
        raise ValueError(f"speedup must be > 0 (got {speedup})")
    if start_s < 0 or (duration_s is not None and not duration_s > 0):
        raise ValueError("the slice needs start >= 0 and duration > 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (got {limit})")
    fmt = fmt or detect_format(name)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if model is not None and fmt != "burstgpt":
        raise ValueError("model: only BurstGPT traces name a model per request")
    if benchmark is not None and fmt != "guidellm":
        raise ValueError("benchmark: only guidellm reports hold several benchmarks")
    if hash_block is not None and fmt not in CHAIN_LAYOUTS:
        raise ValueError("hash_block: only Mooncake and Bailian traces carry hash ids without their block size")
    if hash_block is not None and hash_block < 1:
        raise ValueError(f"hash_block must be >= 1 token per id (got {hash_block})")
    out = Imported([], fmt)
    text = None
    try:
        if fmt == "azure":
            rows = read_azure(name, out)
        elif fmt == "burstgpt":
            rows = read_burstgpt(name, out, model)
        elif fmt in CHAIN_LAYOUTS:
            rows = read_chain_jsonl(name, out, fmt, hash_block)
        elif fmt == "kvtune":
            reqs = read_trace(name)
            out.read = len(reqs)
            rows = [_Row(r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_group, r.prefix_tokens,
                         r.hash_ids, r.hash_block) for r in reqs]
        else:
            text, doc = _json_doc(name)
            rows = read_guidellm(doc, out, benchmark) if fmt == "guidellm" else read_inference_perf(doc, out)
    except _Bad as e:
        if isinstance(e.where, int):
            raise TraceError(f"{name}:{e.where}: {e}") from None
        line = _locate(text, e.where) if text is not None else 1
        where = _where(e.where)
        raise TraceError(f"{name}:{line}: {where + ': ' if where else ''}{e}") from None
    kept = []
    for r in rows:
        if r.prompt < 1:
            out.dropped["with no prompt tokens"] += 1
        elif r.output < 1:
            out.dropped["with no output tokens"] += 1
        else:
            kept.append(r)
    kept.sort(key=lambda x: x.t)
    if not kept:
        out.requests = []
        return out
    t0 = kept[0].t + start_s
    end = t0 + duration_s if duration_s is not None else math.inf
    sliced = [x for x in kept if t0 <= x.t < end]
    if len(sliced) < len(kept):
        out.dropped["outside the time slice"] += len(kept) - len(sliced)
    if limit is not None and len(sliced) > limit:
        out.dropped[f"beyond the first {limit}"] += len(sliced) - limit
        sliced = sliced[:limit]
    out.requests = [TraceRequest(round((r.t - t0) / speedup, 6), r.prompt, r.output, r.group,
                                 r.prefix if r.group is not None else 0, r.ids, r.block)
                    for r in sliced]
    return out
