"""`kvtune demo`: the tuner fixing a mis-tuned engine, live, on this machine.

Two phases on the real engine (a tiny random Llama on CPU, standing in for a device of
`DEVICE_MEMORY_GIB`): first the sequence cap binds (max_num_seqs 2 while the KV cache is nearly
empty), then the KV cache is too small (a low gpu_memory_utilization: preemptions under load). Each
phase observes a window, runs one round of the same loop the operator runs (diagnose -> predict
candidates with the simulator on the engine's own trace and step costs -> choose), applies the
decision (a live knob by the admin API, a restart knob by restarting the engine), and verifies it
over the next window, rolling back what did not help.

The phases' request rates are sized for a reference machine; the demo first measures what this
machine's engine serves and scales them by it (unless `--load-scale` is given): a fixed rate that a
slow machine cannot serve even once tuned leaves the queue full after the fix, which shows nothing.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvtune_engine.config import EngineConfig
from kvtune_engine.sim.scenarios import mix

from ..engine_client import EngineClient
from ..tuner.candidates import Bounds, Range
from ..tuner.decide import Objectives, knob_changes, window_figures
from ..tuner.loop import Round, Tuner, TunerSettings
from ..tuner.observation import Observation
from .engine import EngineProcess
from .load import LoadGenerator, measure_tokens_per_s
from .monitor import Monitor

DEVICE_MEMORY_GIB = 0.25
#: the simulated engine's byte tokenizer: token ids below 256
SIMULATED_VOCAB = 256
MODEL_SHAPE = dict(arch="llama", layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096, intermediate=768)


#: the calibration: requests sent at once to the first phase's engine with its cap lifted to match
CALIBRATION = dict(requests=32, prompt_tokens=64, output_tokens=48)
#: what CALIBRATION measures (output tokens/s) on the reference machine, two quiet Zen 3 cores, where
#: the rates below load the tuned engine to about half (the sequence cap) and a quarter (the low memory);
#: a machine measuring x times this gets x times the rates
REFERENCE_TOKENS_PER_S = 1400.0


@dataclass
class Phase:
    name: str
    symptom: str
    flags: dict[str, Any]         # the mis-tuned start (EngineConfig fields)
    load: dict[str, Any]          # the workload (kvtune_engine.sim.scenarios.mix arguments)
    profile: str | None = None    # a simulated engine of this profile (the fleet demo); None: the tiny model
    tuner: TunerSettings | None = None  # bounds and objectives; None: ``settings()``


# Block size 16 in both phases, as the demo's bounds hold it: the phases' figures (~50 blocks at 0.09) and the
# cpu-tiny profile are for it, not for the engine's CPU default of 128 (knobs.CPU_BLOCK_SIZE).
PHASES = [
    Phase("Sequence cap", "max_num_seqs 2 while the KV cache is almost empty",
          {"block_size": 16, "max_num_seqs": 2, "gpu_memory_utilization": 0.9, "max_model_len": 1024,
           "max_num_batched_tokens": 1024, "swap_space": 0.0},
          # offered ~2.3x what two sequences at a time serve (they serve ~23% of CALIBRATION's rate):
          # the window before stays capped well below it on a machine whose speed drifts from its calibration
          dict(rate=15.0, prompt_mean=64, output_mean=48)),
    Phase("Low KV memory", "gpu_memory_utilization 0.09 leaves ~50 KV blocks: preemptions under load",
          {"block_size": 16, "max_num_seqs": 32, "gpu_memory_utilization": 0.09, "max_model_len": 1024,
           "max_num_batched_tokens": 1024, "swap_space": 0.0},
          dict(rate=6.0, prompt_mean=256, output_mean=64)),
]


@dataclass
class Event:
    t: float
    phase: str
    kind: str                     # Apply | Keep | RollBack | Note
    text: str
    restart: bool = False
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass
class WindowFigures:
    phase: str
    label: str                    # before | after
    config: dict[str, Any]
    figures: dict[str, Any]


@dataclass
class DemoState:
    """What the live view shows and the report draws."""
    phase: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    num_blocks: int = 0
    diagnosis: str = ""
    cause: str = ""
    events: list[Event] = field(default_factory=list)
    windows: list[WindowFigures] = field(default_factory=list)
    status: str = ""


def settings() -> TunerSettings:
    bounds = Bounds(block_size=(16,), gpu_memory_utilization=Range(0.05, 0.9), swap_space=Range(0.0, 0.0),
                    max_num_seqs=Range(1, 64), max_num_batched_tokens=Range(256, 2048),
                    enable_chunked_prefill=(True,), enable_prefix_caching=(True,))
    return TunerSettings(bounds=bounds, objectives=Objectives(slo_ttft_s=1.0, slo_tpot_s=0.2, cooldown_s=0.0))


class Demo:
    """One engine through ``phases`` (the single demo's two; one of a fleet demo's engines)."""

    def __init__(self, out: Path, model_dir: Path | None, *, window_s: float, load_scale: float | None, rounds: int,
                 on_update: Callable[[], None] = lambda: None, phases: list[Phase] = PHASES, name: str = "engine"):
        self.out, self.model_dir, self.window_s, self.load_scale, self.rounds = out, model_dir, window_s, load_scale, rounds
        self.on_update, self.phases, self.name = on_update, phases, name
        self.profile: str | None = None   # the running phase's simulated profile
        self.pids: list[int] = []         # every engine process started (none may outlive the demo)
        self.settings = settings()        # the running phase's bounds and objectives
        self._stopped = threading.Event()  # ``stop``: no engine may start after it
        self._starting: EngineProcess | None = None  # an engine on its way up (``stop`` stops it too)
        self.t0 = time.monotonic()
        self.state = DemoState()
        self.engine: EngineProcess | None = None
        self.monitor = Monitor(lambda: self.engine.url if self.engine else "http://127.0.0.1:9", self.t0)
        self.load: LoadGenerator | None = None

    @property
    def served_name(self) -> str:
        """The model name requests carry: the tiny model's directory, or the simulated engine's profile."""
        return self.profile if self.profile else self.model_dir.name if self.model_dir else self.name

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---------------------------------------------------------------- engine
    def start_engine(self, cfg: EngineConfig) -> None:
        self.state.status = "starting the engine"
        self.on_update()
        flags = {k: v for k, v in cfg.model_dump().items() if v is not None}
        eng = EngineProcess(self.model_dir, flags, device_memory_gib=DEVICE_MEMORY_GIB,
                            log_path=self.out / f"{self.name}.log", simulate=self.profile)
        self._starting = eng
        try:
            eng.start()
        finally:
            self._starting = None
        self.pids.append(eng.proc.pid)
        if self._stopped.is_set():  # stopped from another thread while this one started: never left behind
            eng.stop()
            raise RuntimeError("the demo was stopped")
        old, self.engine = self.engine, eng
        if old is not None:
            old.stop()
        self.monitor.reset_baseline()
        st = self.admin().state()
        self.state.config, self.state.num_blocks = st.config, st.num_blocks

    def admin(self) -> EngineClient:
        """The running engine's admin API (on loopback: the demo's engine has no admin key)."""
        return EngineClient(self.engine.url if self.engine else "http://127.0.0.1:9")

    def apply(self, current: EngineConfig, new: EngineConfig) -> None:
        changes = knob_changes(current, new)
        if current.restart_changes(new):
            self.start_engine(new)  # restart knobs: a new engine process (a rollout in a cluster)
        else:
            self.state.config = self.admin().set_config(changes).config

    def calibrate(self) -> float:
        """This machine's speed against the reference one: the factor for every phase's request rate."""
        self.state.phase = "Calibration"
        self.start_engine(EngineConfig.build(**{**PHASES[0].flags, "max_num_seqs": CALIBRATION["requests"]}))
        self.state.status = f"measuring this machine: {CALIBRATION['requests']} requests at once"
        self.on_update()
        tps = measure_tokens_per_s(self.engine.url, model=self.model_dir.name, vocab=MODEL_SHAPE["vocab"],
                                   **CALIBRATION)
        scale = tps / REFERENCE_TOKENS_PER_S
        self.event("Calibration", "Note", f"this machine serves {tps:.0f} output tokens/s "
                                          f"({REFERENCE_TOKENS_PER_S:.0f} on the reference): request rates x{scale:.2f}")
        return scale

    # ---------------------------------------------------------------- observing
    def observe(self, since: float) -> tuple[Observation, list[dict], list[dict], float]:
        """The window's observation and trace, the trace of the window before it (the backlog the
        window inherited is in it) and where the window starts, in the trace's clock."""
        engine = self.admin()
        state = engine.state()
        start = max(0.0, state.uptime_s - self.window_s)
        wt = engine.trace(since_s=max(0.0, start - self.window_s), unfinished=True).split(start)
        steps = engine.steps(limit=4000).steps
        s = self.settings.objectives
        obs = Observation.from_metrics(self.monitor.window(since), state=state.raw, trace=wt.finished,
                                       window_s=self.now() - since, slo_ttft_s=s.slo_ttft_s, slo_tpot_s=s.slo_tpot_s)
        return obs.with_engine_steps(steps), wt.trace, wt.lead, start

    def wait_window(self) -> float:
        start = self.now()
        while self.now() - start < self.window_s:
            if self._stopped.is_set():
                raise RuntimeError("the demo was stopped")
            self.state.status = f"observing a {self.window_s:.0f}s window ({self.now() - start:.0f}s)"
            self.on_update()
            time.sleep(0.5)
        return start

    def figures(self, obs: Observation) -> dict[str, Any]:
        cause, share = obs.dominant_cause()
        return {"goodput_rps": obs.goodput_requests_per_s, "tokens_per_s": obs.output_tokens_per_s,
                "queue_p99_s": obs.queue_time_p99_s, "preemptions": obs.preemptions,
                "kv_usage": obs.kv_usage_mean, "running": obs.running_mean, "waiting": obs.waiting_mean,
                "waiting_cause_share": dict(obs.waiting_cause_share),
                "cause": f"{cause} ({share:.0%})" if cause and share >= 0.005 else "none"}

    # ---------------------------------------------------------------- the loop
    def run_phase(self, phase: Phase) -> None:
        self.state.phase = phase.name
        self.profile, self.settings = phase.profile, phase.tuner or settings()
        cfg = EngineConfig.build(**phase.flags)
        if self.load is not None:
            self.load.stop()
        self.start_engine(cfg)
        args = {**phase.load, "rate": phase.load["rate"] * self.load_scale}
        trace = mix(**{"requests": 400, "prompt_sigma": 0.5, "output_sigma": 0.5, "max_tokens": 512, "seed": 7, **args})
        self.load = LoadGenerator(lambda: self.engine.url, trace, vocab=SIMULATED_VOCAB if self.profile else
                                  MODEL_SHAPE["vocab"], model=self.served_name)
        self.load.start()
        self.event(phase.name, "Note", f"start: {phase.symptom}")
        tuner = Tuner(self.settings)
        first = True
        for _ in range(self.rounds):
            since = self.wait_window()
            obs, trace, lead, start = self.observe(since)
            if first:
                self.state.windows.append(WindowFigures(phase.name, "before", cfg.as_flags(), self.figures(obs)))
            self.state.status = "diagnosing and predicting candidates in the simulator"
            self.on_update()
            rnd: Round = tuner.round(obs, trace, self.now(), lead=lead, window_start=start)
            self.state.diagnosis, self.state.cause = rnd.diagnosis.message, rnd.diagnosis.cause
            if rnd.verdict is not None:
                v = rnd.verdict
                self.event(phase.name, "Keep" if v.keep else "RollBack", v.reason)
                if not v.keep:
                    self.apply(cfg, rnd.config)
                    cfg = rnd.config
            d = rnd.decision
            if d is not None and d.action == "change":
                pred = window_figures(d.predicted or {})
                self.event(phase.name, "Apply",
                           f"{rnd.diagnosis.cause}: {_flags(d.changes)} "
                           f"(predicted goodput {pred.get('goodput_requests_per_s', 0):.1f} req/s)", restart=d.restart,
                           changes=d.changes)
                self.apply(cfg, d.config)
                cfg = d.config
            else:
                self.event(phase.name, "Note", f"{rnd.diagnosis.cause}: no change ({rnd.note or (d.reason if d else '')})")
            if (d is None or d.action != "change") and (rnd.verdict is not None or not first):
                self.state.windows.append(WindowFigures(phase.name, "after", cfg.as_flags(), self.figures(obs)))
                break
            first = False
        else:
            since = self.wait_window()
            obs = self.observe(since)[0]
            self.state.windows.append(WindowFigures(phase.name, "after", cfg.as_flags(), self.figures(obs)))

    def event(self, phase: str, kind: str, text: str, restart: bool = False,
              changes: dict[str, Any] | None = None) -> None:
        self.state.events.append(Event(self.now(), phase, kind, text, restart, dict(changes or {})))
        self.on_update()

    def run(self) -> None:
        self.monitor.start()
        try:
            if self.load_scale is None:
                self.load_scale = self.calibrate()
            for phase in self.phases:
                self.run_phase(phase)
        finally:
            self.stop()
            self.monitor.stop()

    def stop(self) -> None:
        """Stop the load and the engine, and let no other engine start (callable from another thread:
        the fleet demo's Ctrl-C)."""
        self._stopped.set()
        if self.load is not None:
            self.load.stop()
        for eng in (self._starting, self.engine):
            if eng is not None:
                eng.stop()


def _flags(changes: dict[str, Any]) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
