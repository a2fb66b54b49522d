"""The live terminal view (rich) and, without a terminal, one progress line per change."""
from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .session import Demo


def bar(frac: float, width: int = 30) -> str:
    n = max(0, min(width, round(frac * width)))
    return "█" * n + "·" * (width - n)


def render(demo: Demo) -> Group:
    st, pts = demo.state, demo.monitor.points
    p = pts[-1] if pts else None
    top = Table.grid(padding=(0, 2))
    top.add_column(style="bold")
    top.add_column()
    cfg = st.config
    top.add_row("phase", f"{st.phase}   [dim]{demo.now():.0f}s[/dim]")
    top.add_row("engine", f"max_num_seqs {cfg.get('max_num_seqs')}  gpu_memory_utilization "
                          f"{cfg.get('gpu_memory_utilization')}  block_size {cfg.get('block_size')}  "
                          f"KV blocks {st.num_blocks}")
    if p is not None:
        top.add_row("KV usage", f"{bar(p.kv_usage)} {p.kv_usage:.0%}")
        top.add_row("queue", f"running {p.running:.0f}   waiting {p.waiting:.0f}")
        top.add_row("waiting on", Text(p.cause, style="bold red" if p.cause != "none" else "green"))
        top.add_row("output", f"{p.tokens_per_s:.0f} tokens/s   preemptions {p.preemptions_per_s:.1f}/s")
    if demo.load is not None:
        top.add_row("load", f"{demo.load.stats.ok} done, {demo.load.stats.sent - demo.load.stats.ok} in flight")
    if st.diagnosis:
        top.add_row("diagnosis", st.diagnosis)
    top.add_row("now", Text(st.status, style="italic"))
    log = Table(show_header=True, header_style="bold", expand=True)
    log.add_column("t", justify="right", width=5)
    log.add_column("phase", width=14)
    log.add_column("decision", width=9)
    log.add_column("what")
    for e in st.events[-8:]:
        style = {"Apply": "cyan", "Keep": "green", "RollBack": "red"}.get(e.kind, "dim")
        log.add_row(f"{e.t:.0f}s", e.phase, Text(e.kind + (" ↻" if e.restart else ""), style=style), e.text)
    return Group(Panel(top, title="kvtune demo: the KV cache tunes itself"), log)


def summary_table(demo: Demo) -> Table:
    t = Table(title="Before and after", header_style="bold")
    for col in ("phase", "", "engine flags", "goodput req/s", "tokens/s", "queue p99 s", "preemptions",
                "KV usage", "waiting on"):
        t.add_column(col)
    for w in demo.state.windows:
        f = w.figures
        flags = f"--max-num-seqs {w.config.get('max-num-seqs')} --gpu-memory-utilization " \
                f"{w.config.get('gpu-memory-utilization')}"
        t.add_row(w.phase, w.label, flags, f"{f['goodput_rps']:.2f}", f"{f['tokens_per_s']:.0f}",
                  f"{f['queue_p99_s']:.2f}", str(f["preemptions"]), f"{f['kv_usage']:.0%}", f["cause"])
    return t
