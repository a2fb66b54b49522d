"""`kvtune tune --report DIR`: what a user looks at before changing production.

Writes, in DIR:

- ``report.png``: the throughput/latency front of every predicted config (p95 TTFT and p95 TPOT
  against output throughput, colored by goodput, the chosen and current configs marked) and, for
  each knob, goodput and p95 TTFT/TPOT as that knob alone moves away from the chosen config;
- ``report.html``: the diagnosis, the recommendation with its predicted effect and margins (SLO
  headroom, lead over the runner-up), every predicted candidate, the PNG (embedded) and the YAML;
- ``inferencedeployment.yaml``: an InferenceDeployment whose ``spec.engine`` applies the chosen config;
- ``report.json``: the same figures, for scripts.

The tuner's rounds do not hand out every (config, summary) they predicted, so the candidates shown
are re-predicted here with the same ``Predictor`` on the same trace: the chosen config, the current
one and a one-knob-at-a-time sweep around the chosen config within the bounds.
"""
from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import yaml
from pydantic import ValidationError

from kvtune_engine.config import RESTART_KNOBS, ConfigError, EngineConfig
from kvtune_engine.sim.profile import Profile
from kvtune_engine.sim.simulator import SLO
from kvtune_engine.sim.trace import TraceRequest

from .model import API_VERSION, KIND, KNOBS, InferenceDeployment, to_camel_dict
from .tuner.candidates import Bounds, Range
from .tuner.decide import TUNED_KNOBS, knob_changes
from .tuner.predict import Predictor

TEMPLATE = Path(__file__).with_name("templates") / "tune_report.html.j2"

#: knobs swept in the report, in the order of the panels
SWEPT = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "block_size", "swap_space",
         "enable_chunked_prefill", "enable_prefix_caching")
_FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0, 4.0)


@dataclass
class Candidate:
    config: EngineConfig
    summary: Mapping[str, Any]
    label: str
    changes: dict[str, Any] = field(default_factory=dict)
    on_front: bool = False

    def fig(self, key: str) -> float | None:
        v = self.summary.get(key)
        return None if v is None else float(v)


@dataclass
class TuneReport:
    current: Candidate
    chosen: Candidate
    sweeps: dict[str, list[Candidate]]
    candidates: list[Candidate]          # every distinct config predicted, best goodput first
    slo: SLO
    tune: Mapping[str, Any]              # tune_trace's result
    yaml_text: str = ""

    @property
    def runner_up(self) -> Candidate | None:
        others = [c for c in self.candidates if c.config != self.chosen.config]
        return others[0] if others else None


def sweep_values(knob: str, chosen: EngineConfig, bounds: Bounds, current: EngineConfig | None = None) -> list[Any]:
    """Values of one knob to predict, around the chosen config's, inside the bounds (and the
    current config's value, so the panel shows where the user starts)."""
    allowed = getattr(bounds, knob)
    v = getattr(chosen, knob)
    now = {getattr(current, knob)} if current is not None and bounds.admits(knob, getattr(current, knob)) else set()
    if isinstance(allowed, tuple):
        return sorted(set(allowed) | {v} | now)
    assert isinstance(allowed, Range)
    if allowed.hi - allowed.lo <= 1e-9:
        return [v]
    if knob in ("max_num_seqs", "max_num_batched_tokens"):
        vals = {int(allowed.clamp(round(v * f))) for f in _FACTORS}
    elif knob == "gpu_memory_utilization":
        vals = {round(allowed.lo + (allowed.hi - allowed.lo) * i / 4, 3) for i in range(5)}
    else:  # swap_space, GiB
        vals = {allowed.lo, allowed.hi, round((allowed.lo + allowed.hi) / 2, 1), round(allowed.clamp(v * 2), 1)}
    return sorted(vals | {v} | now)


def _with(cfg: EngineConfig, knob: str, value: Any) -> EngineConfig | None:
    try:
        return EngineConfig.model_validate({**cfg.model_dump(), knob: value})
    except (ValidationError, ConfigError, ValueError):
        return None


def _label(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_v(v)}" for k, v in changes.items()) or "(current)"


def _v(v: Any) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _front(cands: Sequence[Candidate], latency: str) -> list[Candidate]:
    """The configs no other beats on both output throughput (higher) and ``latency`` (lower)."""
    pts = [c for c in cands if c.fig(latency) is not None]
    out = []
    for c in pts:
        tp, lat = c.fig("output_tokens_per_s") or 0.0, c.fig(latency)
        if not any((o.fig("output_tokens_per_s") or 0.0) >= tp and o.fig(latency) <= lat and
                   ((o.fig("output_tokens_per_s") or 0.0) > tp or o.fig(latency) < lat) for o in pts):
            out.append(c)
    return sorted(out, key=lambda c: c.fig(latency))


def build(tune: Mapping[str, Any], trace: Sequence[TraceRequest], current: EngineConfig, chosen: EngineConfig,
          profile: Profile, slo: SLO, bounds: Bounds, *, name: str = "my-model") -> TuneReport:
    """Predict the candidates shown (current, chosen, one-knob sweeps) and assemble the report."""
    pred = Predictor(profile, slo)
    tr = list(trace)
    cands: dict[str, Candidate] = {}

    def add(cfg: EngineConfig) -> Candidate | None:
        key = cfg.model_dump_json()
        if key not in cands:
            s = pred.predict(tr, cfg)
            if s is None:
                return None
            ch = knob_changes(current, cfg)
            cands[key] = Candidate(cfg, s, _label(ch), ch)
        return cands[key]

    cur = add(current)
    ch = add(chosen)
    if cur is None or ch is None:
        raise ValueError("the current or the chosen config does not fit the profile's device")
    sweeps: dict[str, list[Candidate]] = {}
    for knob in SWEPT:
        pts = []
        for v in sweep_values(knob, chosen, bounds, current):
            cfg = _with(chosen, knob, v)
            c = add(cfg) if cfg is not None else None
            if c is not None:
                pts.append(c)
        if len(pts) > 1:
            sweeps[knob] = pts
    allc = sorted(cands.values(), key=lambda c: (-(c.fig("goodput_requests_per_s") or 0.0),
                                                 -(c.fig("output_tokens_per_s") or 0.0)))
    for c in _front(allc, "ttft_p95_s"):
        c.on_front = True
    rep = TuneReport(cur, ch, sweeps, allc, slo, tune)
    rep.yaml_text = deployment_yaml(current, chosen, slo, name=name, profile=profile.name)
    return rep


# ------------------------------------------------------------------------------------------------
# the InferenceDeployment


def _duration(s: float) -> str:
    return f"{s * 1000:g}ms" if s < 1 else f"{s:g}s"


def deployment_yaml(current: EngineConfig, chosen: EngineConfig, slo: SLO, *, name: str, profile: str) -> str:
    """An InferenceDeployment applying ``chosen`` (every knob written out; the changed ones say what
    they were). Checked against the CRD's model before it is returned."""
    knobs = {k: v for k, v in to_camel_dict(chosen.model_dump()).items() if v is not None}
    was = to_camel_dict(current.model_dump())
    changed = {KNOBS[k]: k in RESTART_KNOBS for k in knob_changes(current, chosen)}
    lines = [f"# kvtune tune --report: the engine config predicted best on the trace (profile {profile}).",
             "# Set model.path / model.volume to your model; spec.engine is the recommendation.",
             f"apiVersion: {API_VERSION}", f"kind: {KIND}", "metadata:", f"  name: {name}", "spec:", "  model:",
             f"    path: /models/{name}", "  engine:"]
    for k, v in knobs.items():
        text = json.dumps(v)
        note = ""
        if k in changed:
            note = f"  # was {json.dumps(was.get(k))} ({'restarts the pods' if changed[k] else 'live'})"
        lines.append(f"    {k}: {text}{note}")
    lines += ["  autotune:", "    mode: Recommend"]
    obj = []
    if slo.ttft_s is not None:
        obj.append(f"ttftP95: {_duration(slo.ttft_s)}")
    if slo.tpot_s is not None:
        obj.append(f"tpotP95: {_duration(slo.tpot_s)}")
    if obj:
        lines.append("    objectives: {" + ", ".join(obj) + "}")
    text = "\n".join(lines) + "\n"
    InferenceDeployment.model_validate(yaml.safe_load(text))
    return text


# ------------------------------------------------------------------------------------------------
# the figures


def _fmt_s(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def write_png(rep: TuneReport, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    knobs = list(rep.sweeps)
    ncols = 3
    nrows = 1 + math.ceil(len(knobs) / ncols)
    fig = plt.figure(figsize=(16, 4.4 * nrows), layout="constrained")
    gs = fig.add_gridspec(nrows, ncols)
    cands = rep.candidates
    good = [c.fig("goodput_requests_per_s") or 0.0 for c in cands]
    for col, (key, label, slo_v) in enumerate((("ttft_p95_s", "p95 TTFT (s)", rep.slo.ttft_s),
                                               ("tpot_p95_s", "p95 TPOT (s)", rep.slo.tpot_s))):
        ax = fig.add_subplot(gs[0, col])
        xs = [c.fig(key) for c in cands]
        keep = [i for i, x in enumerate(xs) if x is not None and x > 0]
        sc = ax.scatter([xs[i] for i in keep], [cands[i].fig("output_tokens_per_s") for i in keep],
                        c=[good[i] for i in keep], cmap="viridis", s=28, zorder=2)
        front = _front(cands, key)
        ax.plot([c.fig(key) for c in front], [c.fig("output_tokens_per_s") for c in front], color="tab:blue",
                lw=1.2, zorder=1, label="front")
        for c, mk, colr, lab in ((rep.current, "s", "tab:red", "current"), (rep.chosen, "*", "tab:orange", "chosen")):
            if c.fig(key):
                ax.scatter([c.fig(key)], [c.fig("output_tokens_per_s")], marker=mk, s=220 if mk == "*" else 90,
                           facecolors="none" if mk == "s" else colr, edgecolors=colr, linewidths=1.8, zorder=3,
                           label=lab)
        if slo_v is not None:
            ax.axvline(slo_v, color="grey", ls=":", lw=1, label="objective")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_s(v)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.set_title(f"throughput vs {label.split(' (')[0]}", fontsize=10)
        if col == 1:
            fig.colorbar(sc, ax=ax, label="goodput (req/s)", shrink=0.9)
    ax = fig.add_subplot(gs[0, 2])
    ax.axis("off")
    ax.text(0, 1, _summary_text(rep), va="top", family="monospace", fontsize=8.5, transform=ax.transAxes)
    for i, knob in enumerate(knobs):
        ax = fig.add_subplot(gs[1 + i // ncols, i % ncols])
        pts = rep.sweeps[knob]
        xs = [_v(getattr(c.config, knob)) for c in pts]
        pos = list(range(len(pts)))
        ax.plot(pos, [c.fig("goodput_requests_per_s") or 0.0 for c in pts], "o-", color="tab:green", lw=1.6,
                label="goodput")
        ax.set_ylabel("goodput (req/s)", color="tab:green")
        top = max(c.fig("goodput_requests_per_s") or 0.0 for c in pts)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)   # from zero: equal goodputs look equal
        ax.set_xticks(pos, xs)
        ax.set_xlabel(knob.replace("_", "-"))
        ax.grid(alpha=0.3)
        lat = ax.twinx()
        for key, colr, lab in (("ttft_p95_s", "tab:purple", "p95 TTFT"), ("tpot_p95_s", "tab:brown", "p95 TPOT")):
            lat.plot(pos, [c.fig(key) or float("nan") for c in pts], "s--", color=colr, lw=1, ms=4, label=lab)
        for v, colr in ((rep.slo.ttft_s, "tab:purple"), (rep.slo.tpot_s, "tab:brown")):
            if v is not None:
                lat.axhline(v, color=colr, ls=":", lw=0.8)
        lat.set_yscale("log")
        lat.set_ylabel("seconds (log)")
        cv = getattr(rep.chosen.config, knob)
        for j, c in enumerate(pts):
            if getattr(c.config, knob) == cv:
                ax.axvspan(j - 0.3, j + 0.3, color="tab:orange", alpha=0.18, lw=0)
            if getattr(c.config, knob) == getattr(rep.current.config, knob):
                ax.axvline(j, color="tab:red", ls=":", lw=1)
        restart = " (restart)" if knob in RESTART_KNOBS else " (live)"
        ax.set_title(f"{knob.replace('_', '-')}{restart}: chosen shaded, current dotted", fontsize=9)
        if i == 0:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = lat.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
    fig.suptitle("kvtune tune: predicted candidates, the throughput/latency front, and each knob around the "
                 "chosen config")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _summary_text(rep: TuneReport) -> str:
    c, b = rep.chosen, rep.current
    rows = [("req goodput/s", "goodput_requests_per_s", "{:.3g}"), ("output tok/s", "output_tokens_per_s", "{:.0f}"),
            ("ttft p95", "ttft_p95_s", None), ("tpot p95", "tpot_p95_s", None), ("queue p95", "queue_time_p95_s", None)]
    lines = ["chosen: " + (c.label if c.changes else "keep the current config"), "",
             f"{'':14}{'current':>11}{'chosen':>11}"]
    for lab, key, fmt in rows:
        f = (lambda v: fmt.format(v) if v is not None else "-") if fmt else _fmt_s
        lines.append(f"{lab:14}{f(b.fig(key)):>11}{f(c.fig(key)):>11}")
    lines.append("")
    lines += [m for m in margins(rep)]
    return "\n".join(_wrap(x, 52) for x in lines)


def _wrap(s: str, n: int) -> str:
    words, out, line = s.split(" "), [], ""
    for w in words:
        if len(line) + len(w) + 1 > n and line:
            out.append(line)
            line = "  " + w
        else:
            line = f"{line} {w}" if line else w
    out.append(line)
    return "\n".join(out)


def margins(rep: TuneReport) -> list[str]:
    """The chosen config's margins, in words: SLO headroom at p95 and lead over the runner-up."""
    out = []
    c = rep.chosen
    for lab, key, target in (("ttft", "ttft_p95_s", rep.slo.ttft_s), ("tpot", "tpot_p95_s", rep.slo.tpot_s)):
        v = c.fig(key)
        if target is not None and v is not None:
            head = (target - v) / target
            out.append(f"{lab} p95 {_fmt_s(v)} vs objective {_fmt_s(target)}: "
                       + (f"{head:.0%} headroom" if head >= 0 else f"misses by {-head:.0%}"))
    share = c.summary.get("requests", {})
    if share.get("total"):
        out.append(f"slo_attainment {share['meeting_slo'] / share['total']:.1%} "
                   f"(current {rep.current.summary['requests']['meeting_slo'] / share['total']:.1%})")
    bg, cg = rep.current.fig("goodput_requests_per_s") or 0.0, c.fig("goodput_requests_per_s") or 0.0
    if c.changes and bg > 0:
        out.append(f"predicted request goodput {cg / bg - 1:+.0%} vs current")
    ru = rep.runner_up
    if ru is not None:
        rg = ru.fig("goodput_requests_per_s") or 0.0
        if cg > 0:
            out.append(f"next best predicted: {ru.label} at {rg / cg - 1:+.1%} request goodput vs chosen")
    return out


# ------------------------------------------------------------------------------------------------
# the page


def _cells(c: Candidate) -> dict[str, str]:
    s = c.summary
    pre = s.get("preemptions") or {}
    req = s.get("requests") or {}
    return {"goodput": f"{c.fig('goodput_requests_per_s') or 0:.3g}",
            "share": f"{req.get('meeting_slo', 0) / req['total']:.0%}" if req.get("total") else "-",
            "throughput": f"{c.fig('output_tokens_per_s') or 0:.0f}", "ttft": _fmt_s(c.fig("ttft_p95_s")),
            "tpot": _fmt_s(c.fig("tpot_p95_s")), "queue": _fmt_s(c.fig("queue_time_p95_s")),
            "preemptions": str(int(pre.get("swap", 0)) + int(pre.get("recompute", 0))),
            "kv": f"{c.fig('kv_usage_mean') or 0:.0%}"}


def write_html(rep: TuneReport, path: Path, png: Path) -> Path:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    t = rep.tune
    rec = t.get("recommended") or {}
    flags = " ".join(f"--{k} {_v(v)}" for k, v in rec.items())
    page = env.get_template(TEMPLATE.name).render(
        diagnosis=t.get("diagnosis", {}), recommended=rec, flags=flags, restart=t.get("restart_required", False),
        chosen=rep.chosen, current=rep.current, chosen_cells=_cells(rep.chosen), current_cells=_cells(rep.current),
        margins=margins(rep), rows=[(c, _cells(c)) for c in rep.candidates], rounds=t.get("rounds", []),
        png_b64=base64.b64encode(png.read_bytes()).decode(), png_name=png.name, yaml_text=rep.yaml_text,
        profile=t.get("profile", ""), slo=rep.slo, fmt_s=_fmt_s, knobs=[k.replace("_", "-") for k in TUNED_KNOBS],
        n_requests=rep.current.summary.get("requests", {}).get("total", 0))
    path.write_text(page, encoding="utf-8")
    return path


def write_report(out_dir: str | Path, tune: Mapping[str, Any], trace: Sequence[TraceRequest], current: EngineConfig,
                 chosen: EngineConfig, profile: Profile, slo: SLO, bounds: Bounds, *, name: str = "my-model"
                 ) -> dict[str, Path]:
    """Predict, draw and write the report files; returns their paths by kind."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    rep = build(tune, trace, current, chosen, profile, slo, bounds, name=name)
    png = write_png(rep, d / "report.png")
    files = {"png": png, "html": write_html(rep, d / "report.html", png)}
    yml = d / "inferencedeployment.yaml"
    yml.write_text(rep.yaml_text, encoding="utf-8")
    files["yaml"] = yml
    js = d / "report.json"
    js.write_text(json.dumps({
        "chosen": {"config": rep.chosen.config.as_flags(), "changes": rep.chosen.changes},
        "current": {"config": rep.current.config.as_flags()},
        "margins": margins(rep),
        "candidates": [{"label": c.label, "changes": c.changes, "on_front": c.on_front,
                        **{k: c.summary.get(k) for k in ("goodput_requests_per_s", "output_tokens_per_s",
                                                          "ttft_p95_s", "tpot_p95_s", "queue_time_p95_s")}}
                       for c in rep.candidates],
    }, indent=1, default=str), encoding="utf-8")
    files["json"] = js
    return files
