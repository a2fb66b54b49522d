"""`kvtune demo`: see session.py."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click


def ensure_model(out: Path) -> Path:
    from .session import MODEL_SHAPE

    model = out / "model"
    if not (model / "config.json").exists():
        args = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL_SHAPE.items()]
        subprocess.run([sys.executable, "-c", "from kvtune_operator.cli import main; main()", "make-tiny-model",
                        str(model), *args], check=True, capture_output=True)
    return model


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("out/demo"), show_default=True,
              help="Where the model, engine log, report PNG and JSON go.")
@click.option("--window", "window_s", type=click.FloatRange(min=3), default=12.0, show_default=True,
              help="Seconds of metrics per tuning round.")
@click.option("--load-scale", type=click.FloatRange(min=0.1), default=None,
              help="Multiply each phase's request rate by this  [default: this machine's speed, measured first]")
@click.option("--rounds", type=click.IntRange(min=2), default=3, show_default=True,
              help="Most tuning rounds per phase.")
@click.option("--fleet", "fleet_n", type=int, default=None, metavar="N",
              help="Instead: N simulated GPU engines (A100, H200 profiles), each mis-tuned its own way, tuned "
                   "side by side (1 to 32; no model, little CPU); one table, fleet.png and fleet.json in --out.")
def demo(out: Path, window_s: float, load_scale: float | None, rounds: int, fleet_n: int | None) -> None:
    """Watch the tuner fix a mis-tuned engine: the real engine on a tiny model on CPU, a load from a
    trace, a live view of KV usage, queue and waiting cause, then a before/after table and a PNG."""
    from rich.console import Console
    from rich.live import Live

    if fleet_n is not None:
        return fleet_demo(fleet_n, out, window_s, rounds)

    from .report import write_report
    from .session import Demo
    from .view import render, summary_table

    console = Console() if Console().is_terminal else Console(width=150)
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]kvtune demo[/bold]: building a tiny model in {out / 'model'} ...")
    model = ensure_model(out)
    seen = [0]

    def progress_lines() -> None:  # no terminal: one line per decision
        for e in d.state.events[seen[0]:]:
            console.print(f"{e.t:6.1f}s  {e.phase:<14} {e.kind:<9} {e.text}")
        seen[0] = len(d.state.events)

    d = Demo(out, model, window_s=window_s, load_scale=load_scale, rounds=rounds)
    try:
        if console.is_terminal:
            with Live(render(d), console=console, refresh_per_second=2) as live:
                d.on_update = lambda: live.update(render(d))
                d.run()
        else:
            d.on_update = progress_lines
            d.run()
    except (RuntimeError, OSError) as e:
        raise click.ClickException(f"demo failed: {e}") from None
    progress_lines() if not console.is_terminal else None
    console.print(summary_table(d))
    png = write_report(d, out / "report.png")
    (out / "demo.json").write_text(json.dumps({
        "events": [asdict(e) for e in d.state.events], "windows": [asdict(w) for w in d.state.windows],
    }, indent=2))
    console.print(f"report: {png}   figures: {out / 'demo.json'}   engine log: {out / 'engine.log'}")


def fleet_demo(n: int, out: Path, window_s: float, rounds: int) -> None:
    """`kvtune demo --fleet N` (fleet.py): progress lines, then one table, one PNG, one JSON."""
    from rich.console import Console
    from rich.table import Table

    from .fleet import fleet, run_fleet, summary, write_fleet_report

    console = Console() if Console().is_terminal else Console(width=160)
    try:
        demos = fleet(n, out, window_s=window_s, rounds=rounds)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--fleet") from None
    lock, t_seen = threading.Lock(), {d.name: 0 for d in demos}

    def progress(d: Any) -> None:
        with lock:
            for e in d.state.events[t_seen[d.name]:]:
                console.print(f"{e.t:6.1f}s  {d.name:<16} {e.kind:<9} {e.text}")
            t_seen[d.name] = len(d.state.events)

    for d in demos:
        d.on_update = (lambda d=d: progress(d))
    console.print(f"[bold]kvtune demo --fleet {n}[/bold]: {n} simulated engines, {window_s:.0f}s windows")
    errors = run_fleet(demos)
    rows = [summary(d) for d in demos]
    t = Table(title=f"{n} engines, tuned side by side")
    for col in ("engine", "profile", "symptom", "start", "tuned", "goodput req/s", "decisions", "restarts"):
        t.add_column(col)
    for r in rows:
        before, after = r["goodput_before"], r["goodput_after"]
        good = f"{before:.2f} -> {after:.2f}" if before is not None and after is not None else "-"
        t.add_row(r["name"], r["profile"], r["symptom"], _kv(r["start"]), _kv(r["final"]), good,
                  ", ".join(x["kind"] for x in r["decisions"]) or errors.get(r["name"], "none"), str(r["restarts"]))
    console.print(t)
    png = write_fleet_report(rows, out / "fleet.png")
    (out / "fleet.json").write_text(json.dumps({"engines": rows, "errors": errors}, indent=2))
    console.print(f"report: {png}   figures: {out / 'fleet.json'}   engine logs: {out}/*.log")
    if errors:
        raise click.ClickException("engines failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))


def _kv(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())
