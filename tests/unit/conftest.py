"""Shared fixtures: tiny random models (written once per session by `make_tiny_model`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # shared test helpers: tests.infd
    sys.path.insert(0, str(_REPO))

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, intermediate=128)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **overrides) -> directory of a tiny random model, cached per argument set."""
    from kvtune_engine.model.tiny import make_tiny_model

    made: dict[tuple, Path] = {}

    def get(arch: str = "llama", **kw) -> Path:
        key = (arch, repr(sorted(kw.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(d, arch=arch, **{**TINY, **kw})
        return made[key]

    return get


@pytest.fixture(scope="session")
def drive():
    """drive(runner, config, requests | {step: [requests]}) -> (scheduler, {request_id: [TokenLogprob]}).

    The minimal engine loop (schedule -> runner.execute -> update) over the real scheduler;
    a dict schedules arrivals by step number (later arrivals can hit the prefix cache).
    """
    from kvtune_engine.core.scheduler import Scheduler

    def run(runner, config, requests, max_steps: int = 5000):
        arrivals = requests if isinstance(requests, dict) else {0: list(requests)}
        sched = Scheduler(config, runner.num_blocks, runner.num_swap_blocks)
        lps: dict[str, list] = {}
        step = 0
        while step <= max(arrivals) or sched.has_unfinished():
            for r in arrivals.get(step, []):
                sched.add_request(r)
                lps[r.request_id] = []
            batch = sched.schedule(float(step))
            out = runner.execute(batch)
            for s, lp in zip(batch.seqs, out.logprobs or []):
                if lp is not None:
                    lps[s.request.request_id].append(lp)
            sched.update(batch, out, float(step))
            step += 1
            assert step < max_steps, "engine loop did not finish"
        return sched, lps

    return run
