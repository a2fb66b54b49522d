"""`kvtune serve` against real vLLM (CPU build) on this machine: same model, same requests, same client.

The model is bench/engine_vs_hf.py's random Llama (8 layers, hidden 512, 8 heads / 4 KV heads,
head_dim 64 as vLLM's CPU attention needs >= 32, intermediate 1536, vocab 8192, 8192 positions),
fp32 (``--dtype bfloat16``: bf16 in both), 2 threads, 2 GiB of KV cache, max_num_seqs 256,
max_num_batched_tokens 2048, prefix caching and chunked prefill on in both, and each engine's own
default KV block size (128 on CPU in both; ``--block-size`` gives both another). Requests are
token-id prompts, greedy, EOS ignored, through /v1/completions with one aiohttp client; the
workload (``--workload``):

  random         256 prompts of 32-512 tokens, 16-256 output tokens (max_model_len 2048)
  shared-prefix  256 prompts: one of 8 system prompts of 1,000 tokens, then a 80-120-token suffix
                 of its own; 16-128 output tokens (prefix-cache hits: max_model_len 2048)
  long-prompt    48 prompts of 2,000-4,000 tokens, 8-32 output tokens (max_model_len 4096: chunked
                 prefill in both at a 2048-token budget)

and the modes:

  all-at-once  every request sent at once, not streamed: output tokens / wall time
  streamed     64 other requests of the workload (long-prompt: 32) streamed at concurrency 32: output
               tok/s, TTFT and ITL (gaps between SSE chunks) p50/p99

The two servers run one after the other, never together, in both orders (kvtune then vLLM, vLLM then
kvtune); peak RSS is the largest sum over each server's process tree, sampled every 0.2 s. The
machine's fp32 GEMM peak at the model's shapes is measured in the same run (before and after the
servers) with torch.mm and oneDNN's linear (torch._C._nn.mkldnn_linear on prepacked mkldnn tensors).

vLLM comes from tests/vllm/setup.sh (installed into .venv-vllm/ if missing; --no-setup refuses
instead) and is started by tests/vllm/server.py.

    .venv/bin/python bench/engine_vs_vllm.py                    # both orders, 20-30 minutes
    .venv/bin/python bench/engine_vs_vllm.py --runs 2 --json    # two consecutive runs of both orders
    .venv/bin/python bench/engine_vs_vllm.py --only kvtune      # kvtune alone (no vLLM needed)
    .venv/bin/python bench/engine_vs_vllm.py --workload shared-prefix --dtype bfloat16

Measured (2026-12-06; 2 cores of a Xeon with AMX and avx512_bf16; random workload, each engine's
default block size, one run of both orders, kvtune first / vLLM first), kvtune / vLLM output tok/s:
float32 1.05 / 1.11 all at once (845 / 848 against 808 / 764), 1.08 / 1.03 streamed; bfloat16
0.66 / 0.70 all at once (1200 / 1298 against 1822 / 1863), 0.83 / 0.81 streamed. Useful GFLOP/s in
bf16: vLLM 328-335, kvtune 216-234 (the peak printed is float32's, 345-377; the bf16 peak is not
measured here): the bf16 step is where kvtune falls behind.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "0")  # for the GEMM peak in this process; see engine_vs_hf.py

import aiohttp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.vllm.server import LoggedServer, VllmNotInstalled, VllmServer, free_port, vllm_bin  # noqa: E402

MODEL = dict(arch="llama", layers=8, hidden=512, heads=8, kv_heads=4, vocab=8192, intermediate=1536,
             max_position_embeddings=8192)
NAME = "bench"
#: block_size None: each engine's default; dtype: both engines'
ENGINE = dict(kv_gib=2, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048, block_size=None,
              dtype="float32")
#: per workload: requests, streamed requests, max_model_len
WORKLOADS = {"random": (256, 64, 2048), "shared-prefix": (256, 64, 2048), "long-prompt": (48, 32, 4096)}


# ---------------------------------------------------------------- the machine's GEMM peak
def gemm_peak(threads: int, seconds_per_case: float = 0.4) -> dict:
    """GFLOP/s per backend at the model's shapes (M tokens x K -> N), best over the shapes."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    h, i, v, q, kv = 512, 1536, 8192, 512, 256
    shapes = [(m, k, n) for m in (256, 2048) for k, n in ((h, q + 2 * kv), (h, 2 * i), (i, h), (h, v))]
    out: dict = {}

    def bench(fn, flops):
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds_per_case:
            fn()
            reps += 1
        return flops * reps / (time.perf_counter() - t0) / 1e9

    with torch.inference_mode():
        for m, k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            f = 2 * m * k * n
            xm, wm = x.to_mkldnn(), w.to_mkldnn()
            row = {"torch.mm": bench(lambda: torch.mm(x, w.t()), f),
                   "F.linear": bench(lambda: F.linear(x, w), f),
                   "onednn_linear": bench(lambda: torch._C._nn.mkldnn_linear(xm, wm, None), f)}
            out[f"{m}x{k}->{n}"] = {b: round(g, 1) for b, g in row.items()}
    best = {b: max(r[b] for r in out.values()) for b in ("torch.mm", "F.linear", "onednn_linear")}
    return {"per_shape": out, "best": best}


# ---------------------------------------------------------------- process-tree memory
def tree_rss_bytes(root: int) -> int:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class RssSampler:
    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._stop.wait(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


# ---------------------------------------------------------------- the servers
class KvtuneServer(LoggedServer):
    what = "kvtune serve"

    def __init__(self, model_dir: Path, run_dir: Path, threads: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / f"kvtune-{self.port}.log"
        self.argv = [str(REPO / ".venv" / "bin" / "kvtune"), "serve", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", NAME,
                     "--dtype", ENGINE["dtype"], "--kv-cache-memory", str(ENGINE["kv_gib"]), "--swap-space", "0",
                     "--max-num-seqs", str(ENGINE["max_num_seqs"]),
                     "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
                     "--max-model-len", str(ENGINE["max_model_len"]), *block_size_flag(),
                     "--enable-prefix-caching", "--enable-chunked-prefill", "--log-level", "warning"]
        # a crash in native code (or a kill) must leave a trace in the log
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONFAULTHANDLER": "1"}
        self.proc = None


def block_size_flag() -> list[str]:
    """``--block-size N`` where one is given to both, else nothing: each engine's default."""
    return [] if ENGINE["block_size"] is None else ["--block-size", str(ENGINE["block_size"])]


# ---------------------------------------------------------------- the client
def workload(kind: str, n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request; see the module's docstring."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(k)]
    if kind == "random":
        return [(ids(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(n)]
    if kind == "shared-prefix":
        prefixes = [ids(1000) for _ in range(8)]
        return [(rng.choice(prefixes) + ids(rng.randint(80, 120)), rng.randint(16, 128)) for _ in range(n)]
    if kind == "long-prompt":
        return [(ids(rng.randint(2000, 4000)), rng.randint(8, 32)) for _ in range(n)]
    raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(WORKLOADS)}")


def body(prompt, max_tokens, stream):
    b = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    return b


async def one_plain(session, url, prompt, max_tokens) -> int:
    async with session.post(url + "/v1/completions", json=body(prompt, max_tokens, False)) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        return data["usage"]["completion_tokens"]


async def one_stream(session, url, prompt, max_tokens) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    async with session.post(url + "/v1/completions", json=body(prompt, max_tokens, True)) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                line = event.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices"):
                    times.append(time.perf_counter())
    n = usage["completion_tokens"] if usage else len(times)
    return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": n,
            "chunks": len(times)}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def measure(url: str, reqs, stream_reqs, concurrency: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    # a fresh connection per request, for both servers: vLLM's keep-alive timer (5 s) closes idle pooled
    # connections, and one reused just as it closes ends the run with "Server disconnected"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        await asyncio.gather(*(one_plain(s, url, p[:64], 4) for p, _ in reqs[:4]))  # warm-up
        t0 = time.perf_counter()
        toks = await asyncio.gather(*(one_plain(s, url, p, o) for p, o in reqs))
        dt_all = time.perf_counter() - t0
        assert sum(toks) == sum(o for _, o in reqs), "a server returned a different number of tokens"
        sem = asyncio.Semaphore(concurrency)

        async def bounded(p, o):
            async with sem:
                return await one_stream(s, url, p, o)
        sub = stream_reqs
        t0 = time.perf_counter()
        res = await asyncio.gather(*(bounded(p, o) for p, o in sub))
        dt_stream = time.perf_counter() - t0
    gaps = [g for r in res for g in r["gaps"]]
    ttft = [r["ttft"] for r in res]
    n_stream = sum(r["tokens"] for r in res)
    return {"all_at_once_tok_s": sum(toks) / dt_all, "all_at_once_s": dt_all,
            "stream_tok_s": n_stream / dt_stream, "stream_s": dt_stream,
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(gaps, 50) * 1e3, "itl_p99_ms": pct(gaps, 99) * 1e3,
            "stream_tokens_per_chunk": n_stream / max(1, sum(r["chunks"] for r in res))}


def run_engine(which: str, model_dir: Path, run_dir: Path, reqs, stream_reqs, a) -> dict:
    if which == "kvtune":
        srv = KvtuneServer(model_dir, run_dir, a.threads)
    else:
        srv = VllmServer(model_dir, run_dir / "vllm", kv_cache_gib=ENGINE["kv_gib"], args=[
            "--served-model-name", NAME, "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--max-model-len", str(ENGINE["max_model_len"]), "--dtype", ENGINE["dtype"], *block_size_flag(),
            "--enable-prefix-caching", "--enable-chunked-prefill"],
            threads_bind="0-1" if a.threads == 2 else f"0-{a.threads - 1}")
        srv.start_timeout_s = 1800.0  # its first start compiles the model: 7+ minutes on a busy machine
    t0 = time.perf_counter()
    srv.start()
    startup = time.perf_counter() - t0
    sampler = RssSampler(srv.proc.pid)
    try:
        r = asyncio.run(measure(srv.url, reqs, stream_reqs, a.concurrency))
    except Exception:
        print(f"{which} failed; the last lines of its log {srv.log_path}:", file=sys.stderr)
        print(srv.log_tail(40), file=sys.stderr)
        raise
    finally:
        r_peak = sampler.stop()
        srv.stop()
    r |= {"engine": which, "startup_s": startup, "peak_rss_mib": r_peak / 2**20}
    print(f"  {which:<7} all-at-once {r['all_at_once_tok_s']:7.1f} tok/s | streamed {r['stream_tok_s']:7.1f} tok/s"
          f" | TTFT p50/p99 {r['ttft_p50_ms']:6.0f}/{r['ttft_p99_ms']:6.0f} ms | ITL p50/p99 "
          f"{r['itl_p50_ms']:5.0f}/{r['itl_p99_ms']:5.0f} ms | peak RSS {r['peak_rss_mib']:6.0f} MiB"
          f" | start-up {startup:.0f}s", flush=True)
    return r


def table(orders: list[dict]) -> str:
    rows = [("output tok/s, all requests at once", "all_at_once_tok_s", "{:.0f}"),
            ("output tok/s, streamed at concurrency 32", "stream_tok_s", "{:.0f}"),
            ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
            ("ITL p50 (ms)", "itl_p50_ms", "{:.0f}"), ("ITL p99 (ms)", "itl_p99_ms", "{:.0f}"),
            ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}")]
    out = ["| | vLLM | kvtune | ratio kvtune/vLLM |", "| --- | --- | --- | --- |"]
    for title, key, fmt in rows:
        v = [o["vllm"][key] for o in orders]
        k = [o["kvtune"][key] for o in orders]
        ratio = " / ".join(f"{b / x:.2f}" for x, b in zip(v, k))
        out.append(f"| {title} | {' / '.join(fmt.format(x) for x in v)} | "
                   f"{' / '.join(fmt.format(x) for x in k)} | {ratio} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="random")
    ap.add_argument("--requests", type=int, default=None, help="default: the workload's (256; long-prompt 48)")
    ap.add_argument("--stream-requests", type=int, default=None, help="default: the workload's (64; long-prompt 32)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1, help="consecutive runs of both orders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or create) the model here")
    ap.add_argument("--only", choices=["kvtune", "vllm"], default=None)
    ap.add_argument("--no-setup", action="store_true", help="do not install vLLM if it is missing")
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size of both engines (default: each engine's own, 128 on CPU in both)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines' dtype")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    n_req, n_stream, max_len = WORKLOADS[a.workload]
    a.requests = n_req if a.requests is None else a.requests
    a.stream_requests = n_stream if a.stream_requests is None else a.stream_requests
    ENGINE.update(block_size=a.block_size, dtype=a.dtype, max_model_len=max_len)

    if a.only != "kvtune":
        try:
            vllm_bin()
        except VllmNotInstalled:
            if a.no_setup:
                raise
            subprocess.run(["bash", str(REPO / "tests" / "vllm" / "setup.sh")], check=True)
    from kvtune_engine.model.tiny import make_tiny_model
    tmp = tempfile.TemporaryDirectory(prefix="kvtune-vs-vllm-")
    run_dir = Path(tmp.name)
    model_dir = a.model_dir or run_dir / "llama-34m"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, **MODEL)
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 0)
    if positions < ENGINE["max_model_len"]:
        raise SystemExit(f"{model_dir}: max_position_embeddings {positions} < the {a.workload} workload's "
                         f"max_model_len {ENGINE['max_model_len']}; give another --model-dir (one is made there)")
    # the streamed requests are others of the same workload (the same system prompts): re-sent, the
    # all-at-once requests would be prefix-cache hits in both engines, prompt and all
    both = workload(a.workload, a.requests + a.stream_requests, a.seed, MODEL["vocab"])
    reqs, stream_reqs = both[:a.requests], both[a.requests:]
    n_prompt, n_out = sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)
    print(f"workload {a.workload}: {a.requests} requests ({a.stream_requests} streamed): prompts sum {n_prompt} "
          f"tokens, outputs sum {n_out}; {a.threads} threads; {a.dtype}; KV block size "
          f"{a.block_size or 'each engine default'}; load average {os.getloadavg()}", flush=True)
    peak0 = gemm_peak(a.threads)
    print(f"GEMM peak at the model's shapes before (GFLOP/s): {peak0['best']}", flush=True)
    order_list = [["kvtune", "vllm"], ["vllm", "kvtune"]] if a.only is None else [[a.only]]
    results = []
    for run in range(a.runs):
        for order in order_list:
            print(f"run {run + 1}, order {' then '.join(order)}:", flush=True)
            results.append({e: run_engine(e, model_dir, run_dir, reqs, stream_reqs, a) for e in order}
                           | {"order": order})
    peak1 = gemm_peak(a.threads)
    print(f"GEMM peak at the model's shapes after  (GFLOP/s): {peak1['best']}", flush=True)
    flop_per_token = 2 * (MODEL["layers"] * (512 * 1024 + 512 * 512 + 512 * 3072 + 1536 * 512) + 512 * 8192)
    if a.only is None:
        for run in range(a.runs):
            both = results[2 * run:2 * run + 2]
            print(f"\nrun {run + 1} (orders: kvtune first / vLLM first)")
            print(table(both))
        for r in results:
            for e in ("kvtune", "vllm"):
                x = r[e]
                x["useful_gflop_s"] = flop_per_token * (n_prompt + n_out) / x["all_at_once_s"] / 1e9
        print("\nuseful GFLOP/s, all at once (every prompt and output token, "
              f"{flop_per_token / 1e6:.0f} MFLOP each): " + "; ".join(
                  f"{'/'.join(r['order'])}: kvtune {r['kvtune']['useful_gflop_s']:.0f}, vLLM "
                  f"{r['vllm']['useful_gflop_s']:.0f}" for r in results))
    print(f"GEMM peak (best of before/after): " + ", ".join(
        f"{b} {max(peak0['best'][b], peak1['best'][b]):.0f}" for b in peak0["best"]) + " GFLOP/s")
    print(f"load average at the end: {os.getloadavg()}")
    if a.json:
        print(json.dumps({"runs": results, "gemm_peak_before": peak0, "gemm_peak_after": peak1,
                          "workload": a.workload, "dtype": a.dtype, "block_size": a.block_size,
                          "requests": a.requests, "prompt_tokens": n_prompt, "output_tokens": n_out},
                         indent=2, default=str))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
