"""One simulated engine, stepped: the engine's own Scheduler and block pool, a SimulatedRunner's cost.

Invariant owned here: whoever steps a simulated engine -- the offline replay (``simulate``), the
replica prediction (operator ``tuner.replicas``), a real-time simulated engine (``kvtune serve
--simulate``) -- gets the same requests for a trace (``SimEngine.request``) and the same step cost
(the profile's step time times the machine's speed at the step's start, ``Profile.speed``).

The clock is not here. ``SimEngine.step(now)`` runs the step that starts at ``now`` and says how
long it takes; the caller advances time: ``Replay`` in virtual time (the one arrival-and-step loop of
every virtual-time caller), a real-time engine by sleeping the cost.

Synthetic token ids: a request of prefix group g gets the group's shared tokens for its first
``prefix_tokens`` positions and tokens unique to the request after that, so the prefix cache sees
exactly the sharing the trace describes (prompts of one group share the prefix, nothing else).
A request with a hash chain (``hash_ids``) gets, for each id, ``hash_block`` tokens that start with
the id's own token (one per distinct id) and go on with a filler: two requests with the same first
k ids have identical first k * hash_block tokens and differ at the next id's first token, so at any
engine block size the cache shares exactly the whole blocks inside the common chain.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

from ..config import EngineConfig
from ..core.batch import Batch, Step, StepOutput
from ..core.scheduler import RequestRejected, Scheduler
from ..request import Request, SamplingParams
from .profile import Profile, SpeedTimeline
from .runner import SimulatedRunner
from .trace import TraceRequest

_UNIQUE_BASE = 1_000_000_000     # first token of request i's own part: _UNIQUE_BASE + i
_GROUP_BASE = 2_000_000_000      # first token of group j's prefix:     _GROUP_BASE + j
_HASH_BASE = 3_000_000_000       # first token of the n-th distinct hash id's block: _HASH_BASE + n

#: sees each step's batch and duration while its blocks are held (after schedule, before update)
Observer = Callable[[Batch, float], None]


def charge(runner: SimulatedRunner, speed: SpeedTimeline | None, batch: Batch | Step, at: float) -> StepOutput:
    """The step's output and cost: the profile's step time (``SimulatedRunner``) times the machine's
    speed at ``at`` (the step's start on the speed timeline's clock; factor 1 without a timeline).
    The one cost rule of every simulated engine, virtual-time and real-time alike."""
    out = runner.execute(batch)
    if speed is not None:   # the machine as fast as it was at this time of the fitted window
        out.duration_s *= speed.at(at)
    return out


class SimEngine:
    """A Scheduler sized by the profile for ``config``, charged the profile's step costs."""

    def __init__(self, config: EngineConfig, profile: Profile, *, admission: str = "chunk") -> None:
        self.config, self.profile = config, profile
        self.size = size = profile.kv_cache_size(config)
        self.sched = Scheduler(config, size.num_blocks, size.num_swap_blocks, admission=admission)
        self.runner = SimulatedRunner(profile, size.block_bytes)
        self._groups: dict[str, list[int]] = {}
        self._hash_tokens: dict[int, int] = {}   # hash id -> its block's first token
        self._speed = profile.speed   # (the profile is frozen)

    def request(self, i: int, r: TraceRequest) -> Request:
        """Trace request ``r``, the ``i``-th of its trace, as the engine would receive it (id ``r{i}``)."""
        if r.hash_ids:
            return self._chain_request(i, r)
        k = r.prefix_tokens if r.prefix_group is not None else 0
        rest = r.prompt_tokens - k
        prompt = [_UNIQUE_BASE + i] + [0] * (rest - 1) if rest > 0 else []
        if k:
            g = self._groups.get(r.prefix_group)
            if g is None or len(g) < k:
                j = len(self._groups) if g is None else g[0] - _GROUP_BASE
                g = self._groups[r.prefix_group] = [_GROUP_BASE + j] + [1] * (max(k, 4096) - 1)
            prompt = g[:k] + prompt
        return Request(prompt, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                       arrival_s=r.arrival_s, request_id=f"r{i}", prefix_group=r.prefix_group)

    def _chain_request(self, i: int, r: TraceRequest) -> Request:
        """A request whose prompt follows its hash chain (module docstring), its own tokens after it."""
        hb, tokens = r.hash_block, self._hash_tokens
        filler = [1] * (hb - 1)
        prompt: list[int] = []
        for h in r.hash_ids:
            t = tokens.get(h)
            if t is None:
                t = tokens[h] = _HASH_BASE + len(tokens)
            prompt.append(t)
            prompt += filler
        del prompt[r.prompt_tokens:]
        rest = r.prompt_tokens - len(prompt)
        if rest > 0:
            prompt += [_UNIQUE_BASE + i] + [0] * (rest - 1)
        return Request(prompt, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                       arrival_s=r.arrival_s, request_id=f"r{i}")

    def add(self, req: Request) -> bool:
        """Queue ``req``; False when the engine rejects it (it can never fit)."""
        try:
            self.sched.add_request(req)
        except RequestRejected:
            return False
        return True

    def busy(self) -> bool:
        return self.sched.has_unfinished()

    def step(self, now: float, observe: Observer | None = None) -> tuple[float, list[Request]]:
        """Run the step that starts at ``now``: (its duration, the requests that finish at its end).
        A step with nothing to run (its only request outgrew the cache and was cut) takes no time."""
        sched = self.sched
        batch = sched.schedule(now)
        if batch.empty:
            done = sched.update(batch, StepOutput([], 0.0), now)
            if not done:
                raise RuntimeError("the scheduler made no progress with requests pending (a bug)")
            return 0.0, done
        out = charge(self.runner, self._speed, batch, now)
        dt = out.duration_s
        if observe is not None:
            observe(batch, dt)
        return dt, sched.update(batch, out, now + dt)


class Replay:
    """A SimEngine fed trace arrivals in virtual time (the clock is ``now``).

    ``feed`` arrivals in arrival order; ``advance(t)`` runs every step that starts before ``t`` (a step
    starting at ``t`` may still admit an arrival at ``t``); ``advance()`` runs to the end. Hooks:
    ``on_admit(req, now)`` for each request queued, ``on_reject(i, r)`` for each refused,
    ``on_done(done, end)`` for the requests each step finishes, ``observe`` (``SimEngine.step``)."""

    def __init__(self, engine: SimEngine, *, observe: Observer | None = None,
                 on_done: Callable[[list[Request], float], None] | None = None,
                 on_admit: Callable[[Request, float], None] | None = None,
                 on_reject: Callable[[int, TraceRequest], None] | None = None) -> None:
        self.engine = engine
        self.observe, self.on_done, self.on_admit, self.on_reject = observe, on_done, on_admit, on_reject
        self.pending: deque[tuple[int, TraceRequest]] = deque()
        self.now: float | None = None      # None until the first arrival
        self.start: float | None = None

    def feed(self, i: int, r: TraceRequest) -> None:
        self.pending.append((i, r))

    def advance(self, t: float = math.inf) -> None:
        eng, pending = self.engine, self.pending
        busy, step, observe, on_done = eng.sched.has_unfinished, eng.step, self.observe, self.on_done
        now = self.now
        while True:
            if now is None:
                if not pending:
                    break
                now = self.start = pending[0][1].arrival_s
            if now >= t:
                break
            while pending and pending[0][1].arrival_s <= now:
                i, r = pending.popleft()
                req = eng.request(i, r)
                if eng.add(req):
                    if self.on_admit is not None:
                        self.on_admit(req, now)
                elif self.on_reject is not None:
                    self.on_reject(i, r)
            if not busy():
                if not pending:
                    break
                now = pending[0][1].arrival_s
                continue
            dt, done = step(now, observe)
            now += dt
            if done and on_done is not None:
                on_done(done, now)
        self.now = now
