"""`kvtune demo --fleet N`: N simulated GPU engines, each mis-tuned its own way, tuned side by side.

Each engine is `kvtune serve --simulate PROFILE` (the real scheduler, block pool and prefix cache with
an A100's or H200's step costs in wall-clock time: no model, little CPU) under its own load, and goes
through one phase of the single demo's loop (`session.Demo`: observe a window, one round of the
operator's tuner, apply live by the admin API or by restarting the engine, verify, roll back what did
not help), all in parallel threads. The rates are the profiles', not this machine's: a simulated
engine runs at its profile's speed, so no calibration. At the end one table and one picture compare
every engine's goodput before and after, and a JSON holds the figures.

Not among the cases: the shared prefix (caching off under four 3,000-token system prompts). In this
demo's windows the tuner predicts the caching-off engine serving 3.2 req/s where it serves 0.2, so no
candidate beats it by the margin and it changes nothing: a gap between the prediction and the
simulated engine to find (the GPU-shaped loop test, 20-second windows and every knob free, tunes it).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune_engine.config import EngineConfig
from kvtune_engine.knobs import BOUNDED_KNOBS

from ..tuner.candidates import Bounds
from ..tuner.decide import Objectives
from ..tuner.loop import TunerSettings
from .session import Demo, Phase

#: the most engines one demo runs (each is a process, a load thread and a scraper thread)
MAX_FLEET = 32
_BASE = {"block_size": 16, "swap_space": 0.0, "enable_prefix_caching": False}


@dataclass(frozen=True)
class Case:
    name: str
    profile: str
    symptom: str
    start: dict[str, Any]      # the mis-tuned knobs (EngineConfig fields), over _BASE
    moves: dict[str, Any]      # what the tuner may move (spec.autotune.bounds)
    fixed: str                 # the knob the symptom names
    load: dict[str, Any]       # scenarios.mix arguments
    pinned: tuple[str, ...] = tuple(k for k in BOUNDED_KNOBS if k != "max_num_seqs")  # held at the start

    def phase(self) -> Phase:
        flags = {**_BASE, **self.start}
        cfg = EngineConfig.build(**flags)
        bounds = Bounds.parse(self.moves).freeze(cfg, [k for k in self.pinned if k not in self.moves])
        tuner = TunerSettings(bounds=bounds, objectives=Objectives(slo_ttft_s=1.0, cooldown_s=0.0))
        load = {"prompt_sigma": 0.0, "output_sigma": 0.0, "max_tokens": 8192,
                "requests": int(self.load["rate"] * 120), **self.load}
        return Phase(self.name, self.symptom, flags, load, profile=self.profile, tuner=tuner)


A100, H200 = "a100-llama3-8b", "h200-qwen3-0.6b"
CASES = (
    Case("a100-seqcap", A100, "maxNumSeqs 2 with the KV cache almost empty", {"max_num_seqs": 2},
         {"max_num_seqs": {"min": 1, "max": 32}}, "max_num_seqs", dict(rate=3.0, prompt_mean=200, output_mean=100)),
    Case("a100-lowmem", A100, "gpuMemoryUtilization 0.21: a few hundred KV blocks",
         {"max_num_seqs": 64, "gpu_memory_utilization": 0.21}, {"gpu_memory_utilization": {"min": 0.21, "max": 0.9}},
         "gpu_memory_utilization", dict(rate=3.0, prompt_mean=200, output_mean=300)),
    Case("h200-seqcap", H200, "maxNumSeqs 2 on an H200", {"max_num_seqs": 2},
         {"max_num_seqs": {"min": 1, "max": 32}}, "max_num_seqs", dict(rate=15.0, prompt_mean=200, output_mean=100)),
)


def fleet(n: int, out: Path, *, window_s: float, rounds: int) -> list[Demo]:
    """N engines, the cases in turn (engine i: ``CASES[i % len(CASES)]``), each its own Demo."""
    if not 1 <= n <= MAX_FLEET:
        raise ValueError(f"--fleet takes 1 to {MAX_FLEET} engines, not {n}")
    out.mkdir(parents=True, exist_ok=True)
    return [Demo(out, None, window_s=window_s, load_scale=1.0, rounds=rounds, phases=[CASES[i % len(CASES)].phase()],
                 name=f"{i + 1}-{CASES[i % len(CASES)].name}") for i in range(n)]


def run_fleet(demos: list[Demo]) -> dict[str, str]:
    """Run every demo in its own thread; on any exit (error, Ctrl-C) stop every engine and load.
    Returns {name: error} for the engines that failed (the others are tuned)."""
    errors: dict[str, str] = {}

    def one(d: Demo) -> None:
        try:
            d.run()
        except Exception as e:  # noqa: BLE001 - one engine's failure is reported, the others go on
            errors[d.name] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(d,), name=f"fleet-{d.name}", daemon=True) for d in demos]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    finally:
        # normally each demo stopped its own; after Ctrl-C this is the only stop. All at once: one after
        # the other, each load's end and each engine's drain (up to 10 s before a SIGKILL) added up, and
        # on a busy machine Ctrl-C took over a minute to return
        stoppers = [threading.Thread(target=d.stop, name=f"stop-{d.name}", daemon=True) for d in demos]
        for t in stoppers:
            t.start()
        deadline = time.monotonic() + 45
        for t in stoppers + threads:  # and each thread ends (an engine it was starting is stopped there)
            t.join(max(0.0, deadline - time.monotonic()))
    return errors


def summary(d: Demo) -> dict[str, Any]:
    """One engine's figures: its case, start and final knobs, goodput before and after, decisions."""
    case = next(c for c in CASES if d.name.endswith(c.name))
    before = next((w for w in d.state.windows if w.label == "before"), None)
    after = next((w for w in d.state.windows if w.label == "after"), None)
    start = {**_BASE, **case.start}
    final = dict(after.config) if after else {}
    return {"name": d.name, "profile": case.profile, "symptom": case.symptom, "knob": case.fixed,
            "start": {case.fixed: EngineConfig.build(**start).model_dump()[case.fixed]},
            "final": {case.fixed: final.get(case.fixed.replace("_", "-"))},
            "goodput_before": before.figures["goodput_rps"] if before else None,
            "goodput_after": after.figures["goodput_rps"] if after else None,
            "decisions": [{"kind": e.kind, "text": e.text, "restart": e.restart, "changes": e.changes}
                          for e in d.state.events if e.kind in ("Apply", "Keep", "RollBack")],
            "restarts": sum(1 for e in d.state.events if e.kind == "Apply" and e.restart),
            "engine_pids": list(d.pids)}


def write_fleet_report(rows: list[dict[str, Any]], path: Path) -> Path:
    """One picture: each engine's goodput before and after tuning, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows) + 2), 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["goodput_before"] or 0 for r in rows], 0.4, label="before (mis-tuned)")
    ax.bar([x + 0.2 for x in xs], [r["goodput_after"] or 0 for r in rows], 0.4, label="after (tuned)")
    ax.set_xticks(list(xs), [f"{r['name']}\n{r['knob']}" for r in rows], fontsize=8)
    ax.set_ylabel("goodput, requests/s within the TTFT objective")
    ax.set_title(f"kvtune demo --fleet {len(rows)}: simulated GPU engines, each mis-tuned its own way")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
