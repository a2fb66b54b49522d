"""The PNG report: the engine's figures over time, with every decision marked."""
from __future__ import annotations

from pathlib import Path

from .session import Demo


def write_report(demo: Demo, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = demo.monitor.points
    t = [p.t for p in pts]
    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    series = [("output tokens/s", [p.tokens_per_s for p in pts]),
              ("waiting (running dashed)", [p.waiting for p in pts]),
              ("KV usage %", [100 * p.kv_usage for p in pts]),
              ("preemptions/s", [p.preemptions_per_s for p in pts])]
    for ax, (label, ys) in zip(axes, series):
        ax.plot(t, ys, lw=1.4)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].plot(t, [p.running for p in pts], lw=1, ls="--")
    colors = {"Apply": "tab:blue", "Keep": "tab:green", "RollBack": "tab:red", "Note": "grey"}
    marked = [e for e in demo.state.events if e.kind != "Note" or e.text.startswith("start")]
    notes = []
    for i, e in enumerate(marked, 1):
        for ax in axes:
            ax.axvline(e.t, color=colors.get(e.kind, "grey"), ls=":" if e.kind == "Note" else "-", lw=1)
        tag = axes[0].text(e.t, 1.02, str(i), transform=axes[0].get_xaxis_transform(), ha="center", va="bottom",
                           fontsize=9, fontweight="bold", color=colors.get(e.kind, "grey"))
        tag.set_in_layout(False)
        kind = "" if e.kind == "Note" else f"{e.kind}{' (restart)' if e.restart else ''}: "
        notes.append(f"{i}. {e.t:.0f}s  [{e.phase}] {kind}{e.text}"[:150])
    axes[-1].set_xlabel("seconds")
    fig.suptitle("kvtune demo: metrics over time, decisions marked")
    fig.tight_layout(rect=(0, 0.03 + 0.022 * len(notes), 1, 0.97))
    fig.text(0.01, 0.01, "\n".join(notes), fontsize=8, va="bottom", family="monospace")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
