"""`kvtune sim` and `kvtune trace gen`: click commands, loaded lazily by kvtune_operator.cli.

Bad input (an invalid flag value, an unknown profile, a malformed trace line) ends with one
`Error: ...` line and exit status 2 (usage) or 1 (input file), never a traceback.
"""
from __future__ import annotations

import json
import re
import sys

import click

from ..config import ConfigError, EngineConfig
from ..flags import engine_config, engine_options, flag_names

def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def render(s: dict) -> str:
    """The human-readable summary of `kvtune sim`."""
    c = s["config"]
    r = s["requests"]
    p = s["preemptions"]
    blocks = s["kv_blocks_mean_share"]
    slo = s["slo"]
    slo_txt = ", ".join(f"{k} <= {_fmt_s(v)}" for k, v in (("TTFT", slo["ttft_s"]), ("TPOT", slo["tpot_s"]))
                        if v is not None) or "none set: every finished request counts"
    lines = [
        f"profile {s['profile']}: {s['num_blocks']} KV blocks of {c['block_size']} tokens "
        f"({s['num_blocks'] * c['block_size']} tokens), swap pool {s['num_swap_blocks']} blocks",
        f"config  max_num_seqs={c['max_num_seqs']} max_num_batched_tokens={c['max_num_batched_tokens']} "
        f"max_model_len={c['max_model_len']} gpu_memory_utilization={c['gpu_memory_utilization']} "
        f"swap_space={c['swap_space']} watermark={c['watermark']} "
        f"prefix_caching={'on' if c['enable_prefix_caching'] else 'off'} "
        f"chunked_prefill={'on' if c['enable_chunked_prefill'] else 'off'}",
        f"requests  {r['finished']} finished of {r['total']} ({r['rejected']} rejected) "
        f"in {s['duration_s']:.1f} s of virtual time",
        "",
        f"throughput     {s['output_tokens_per_s']:.1f} output tokens/s, {s['requests_per_s']:.2f} requests/s",
        f"goodput        {s['goodput_requests_per_s']:.2f} requests/s meeting the SLO ({slo_txt})",
        f"TTFT           p50 {_fmt_s(s['ttft_p50_s'])}  p99 {_fmt_s(s['ttft_p99_s'])}",
        f"TPOT           p50 {_fmt_s(s['tpot_p50_s'])}  p99 {_fmt_s(s['tpot_p99_s'])}",
        f"queue time     p50 {_fmt_s(s['queue_time_p50_s'])}  p99 {_fmt_s(s['queue_time_p99_s'])}",
        f"preemptions    swap {p['swap']}, recompute {p['recompute']}; swap wanted but full {p['swap_full']}",
        "",
        "why the queue head waited (share of steps):",
    ]
    share = s["waiting_cause_share"]
    for cause in ("max_num_seqs", "token_budget", "kv_blocks", "watermark", "none"):
        mark = "  <- dominant" if cause == s["dominant_waiting_cause"] else ""
        lines.append(f"  {cause:<14} {share[cause] * 100:5.1f}%{mark}")
    lines += [
        "",
        f"KV usage mean  {s['kv_usage_mean'] * 100:.1f}% (used blocks / all; time-weighted)",
        f"blocks mean    used {blocks['used'] * 100:.1f}%, cached (idle) {blocks['cached'] * 100:.1f}%, "
        f"free {blocks['free'] * 100:.1f}%, watermark reserve {blocks['reserved'] * 100:.1f}%; "
        f"shared by several requests {s['shared_blocks_mean_share'] * 100:.1f}%",
        f"internal fragmentation mean {s['internal_fragmentation_mean'] * 100:.1f}% "
        f"(empty slots in allocated blocks)",
        f"prefix cache   hit rate {s['prefix_cache']['hit_rate'] * 100:.1f}% of prompt tokens",
        f"swap usage     peak {s['swap_usage_peak'] * 100:.1f}%",
        f"running        mean {s['running_mean']:.1f}, max {s['running_max']}; queued max {s['queued_max']}",
    ]
    m = s["memory_bytes"]
    gib = 1 << 30
    lines.append(f"memory (GiB)   device {m['device_total'] / gib:.1f}: weights {m['weights'] / gib:.1f}, "
                 f"activations {m['activations_peak'] / gib:.1f}, KV cache {m['kv_cache'] / gib:.1f}, "
                 f"unused {m['unused'] / gib:.1f}; host swap {m['swap'] / gib:.1f}")
    return "\n".join(lines)


def sim_inputs(trace_file: str, profile_name: str, slo_ttft: float | None, slo_tpot: float | None):
    """Check the SLO flags, load the profile and the trace: (profile, trace), or one clear error."""
    from .profile import ProfileError
    from .profiles import load_profile
    from .trace import TraceError, read_trace

    for name, v in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)):
        if v is not None and not v > 0:
            raise click.UsageError(f"{name} must be > 0 seconds (got {v})")
    try:
        profile = load_profile(profile_name)
    except ProfileError as e:
        raise click.UsageError(f"--profile: {e}") from None
    try:
        trace = read_trace(sys.stdin if trace_file == "-" else trace_file)
    except TraceError as e:
        raise click.ClickException(str(e)) from None
    return profile, trace


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--trace", "trace_file", required=True, metavar="FILE",
              help="JSONL request trace ('-' for stdin); see `kvtune trace gen`.")
@click.option("--profile", "profile_name", required=True, metavar="NAME|FILE",
              help="Cost profile: h200-qwen3-0.6b, a100-llama3-8b, l20-qwen3-8b, cpu-tiny, or a JSON file.")
@engine_options
@click.option("--slo-ttft", type=float, default=None, metavar="S", help="SLO on time to first token, seconds.")
@click.option("--slo-tpot", type=float, default=None, metavar="S", help="SLO on time per output token, seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
def sim(trace_file: str, profile_name: str, slo_ttft: float | None, slo_tpot: float | None,
        as_json: bool, **flags) -> None:
    """Replay a request trace through the engine's scheduler in virtual time, and report
    throughput, latency, preemptions and why requests waited."""
    from .simulator import SLO, simulate

    config = engine_config(flags)
    profile, trace = sim_inputs(trace_file, profile_name, slo_ttft, slo_tpot)
    try:
        summary = simulate(trace, config, profile, SLO(slo_ttft, slo_tpot))
    except ConfigError as e:
        raise click.UsageError(flag_names(str(e))) from None
    if as_json:
        click.echo(json.dumps(summary, indent=None, sort_keys=False))
    else:
        click.echo(render(summary))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def trace() -> None:
    """Request traces: generate scenario and synthetic traces, import logs (JSONL, one request per line)."""


@trace.command("gen")
@click.option("--scenario", type=click.Choice(["seq-cap", "shared-prefix", "long-prompt", "block-waste",
                                               "low-memory", "swap-full"]), default=None,
              help="One of the six scenarios of the field reports.")
@click.option("--mix", "use_mix", is_flag=True, help="A synthetic workload (the options below).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write here instead of stdout.")
@click.option("--requests", type=click.IntRange(min=1), default=None, help="--mix: number of requests [1000].")
@click.option("--rate", type=float, default=None, help="--mix: mean arrival rate, requests/s [10].")
@click.option("--arrival", type=click.Choice(["poisson", "bursty"]), default=None,
              help="--mix: arrival process [poisson].")
@click.option("--burstiness", type=float, default=None,
              help="--mix, bursty: coefficient of variation of the gaps [3].")
@click.option("--prompt-mean", type=float, default=None, help="--mix: mean prompt tokens (lognormal) [512].")
@click.option("--prompt-sigma", type=float, default=None, help="--mix: log-space sigma of prompts [1.0].")
@click.option("--output-mean", type=float, default=None, help="--mix: mean output tokens (lognormal) [256].")
@click.option("--output-sigma", type=float, default=None, help="--mix: log-space sigma of outputs [0.8].")
@click.option("--max-tokens", type=int, default=None, help="--mix: cap on prompt + output tokens [8192].")
@click.option("--prefix-groups", type=int, default=None, help="--mix: number of shared prefixes [0].")
@click.option("--prefix-tokens", type=int, default=None, help="--mix: tokens of each shared prefix [0].")
@click.option("--prefix-share", type=float, default=None,
              help="--mix: fraction of requests that use a shared prefix [0.5].")
def gen(scenario: str | None, use_mix: bool, seed: int, output: str | None, **mix_opts) -> None:
    """Write a deterministic trace: `--scenario NAME` or `--mix [options]` (same seed, same trace)."""
    from .scenarios import SCENARIOS, mix
    from .trace import write_trace

    given = {k: v for k, v in mix_opts.items() if v is not None}
    if (scenario is None) == (not use_mix):
        raise click.UsageError("give exactly one of --scenario NAME and --mix")
    if scenario is not None and given:
        raise click.UsageError(f"{', '.join('--' + k.replace('_', '-') for k in given)}: only with --mix")
    if scenario is not None:
        sc = SCENARIOS[scenario]
        requests = sc.trace(seed)
    else:
        try:
            requests = mix(seed=seed, **given)
        except ValueError as e:
            raise click.UsageError(_mix_flags(str(e))) from None
    if output is None:
        write_trace(requests, sys.stdout)
    else:
        try:
            write_trace(requests, output)
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None
    if scenario is not None:
        where = output or "FILE"
        click.echo(f"# {scenario}: {sc.symptom}\n# symptom:  {sc.sim_command(where)}\n"
                   f"# relieved: {sc.sim_command(where, fixed=True)}", err=True)


@trace.command("import")
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["azure", "burstgpt", "guidellm", "inference-perf", "mooncake",
                                                               "bailian", "kvtune"]),
              default=None, help="The source's format (default: detected from its header or structure).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write here instead of stdout.")
@click.option("--speedup", type=float, default=1.0, show_default=True,
              help="Divide every arrival time by this (2: the same requests twice as fast).")
@click.option("--start", "start_s", type=float, default=0.0, show_default=True,
              help="Skip the first S seconds of the source (its own clock, before --speedup).")
@click.option("--duration", "duration_s", type=float, default=None, help="Keep S seconds from --start on.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Keep at most N requests (the first).")
@click.option("--model", default=None, help="BurstGPT: keep only this Model's rows (ChatGPT, GPT-4).")
@click.option("--benchmark", type=click.IntRange(min=1), default=None,
              help="guidellm: only the Nth benchmark of the report (default: all, on their own clock).")
@click.option("--hash-block", type=int, default=None,
              help="Mooncake, Bailian: tokens per hash id when the file's ids are not the layout's "
                   "(Mooncake 512, Bailian 16).")
def import_(source: str, fmt: str | None, output: str | None, **opts) -> None:
    """Convert a request log (Azure LLM trace CSV, BurstGPT CSV, guidellm benchmarks JSON,
    inference-perf per_request_lifecycle_metrics.json, Mooncake or Alibaba Bailian JSONL with
    hash_ids) into a kvtune JSONL trace."""
    from .trace import TraceError, write_trace
    from .trace_import import import_trace

    try:
        res = import_trace(source, fmt, **opts)
    except TraceError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        raise click.UsageError(_import_flags(str(e))) from None
    if not res.requests:
        raise click.ClickException(res.summary(source))
    try:
        write_trace(res.requests, sys.stdout if output is None else output)
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None
    click.echo("# " + res.summary(source), err=True)


def _import_flags(msg: str) -> str:
    for f in ("speedup", "limit", "model", "benchmark", "hash_block"):
        msg = re.sub(rf"^{f}\b", "--" + f.replace("_", "-"), msg)
    return msg.replace("the slice", "--start/--duration")


def _mix_flags(msg: str) -> str:
    for f in ("requests", "rate", "burstiness", "prefix_share", "prefix_groups", "prefix_tokens", "max_tokens"):
        msg = re.sub(rf"\b{f}\b", "--" + f.replace("_", "-"), msg)
    return msg
