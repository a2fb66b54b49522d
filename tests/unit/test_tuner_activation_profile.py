"""The tuner proposes no live raise past the engine's start-up activation profile (issue 23): the
engine refuses one (a bigger step may not fit in device memory); such a raise is a restart change
that profiles the new step (``profile_batched_tokens``), and the pods roll for it."""
from __future__ import annotations

import dataclasses

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.kv.sizing import ActivationProfile
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_engine.sim.simulator import SLO
from kvtune_engine.sim.trace import TraceRequest
from kvtune_operator.tuner.bounds import Bounds
from kvtune_operator.tuner.decide import Objectives
from kvtune_operator.tuner.loop import Tuner, TunerSettings, engine_takes, measure
from kvtune_operator.model import to_engine_dict
from kvtune_operator.render import restart_hash
from kvtune_operator.tuner.observation import _activation_profile
from kvtune_operator.tuner.predict import Predictor

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
SETTINGS = TunerSettings(objectives=Objectives(slo_ttft_s=SC.slo_ttft_s, slo_tpot_s=SC.slo_tpot_s))


def test_engine_takes():
    cur = EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096)
    obs = dataclasses.replace(measure(SC.trace(1)[:50], cur, PROFILE, SETTINGS.slo),
                              activation_profile=ActivationProfile(4096, 64))  # as an engine reports it
    assert engine_takes(obs, cur.with_changes(max_num_seqs=32, max_num_batched_tokens=2048))
    assert not engine_takes(obs, cur.with_changes(max_num_seqs=128))
    assert not engine_takes(obs, cur.with_changes(max_num_batched_tokens=65536))
    assert engine_takes(obs, cur.with_changes(max_num_seqs=128, block_size=32))   # a rollout profiles again
    assert engine_takes(dataclasses.replace(obs, activation_profile=None), cur.with_changes(max_num_seqs=512))
    assert _activation_profile({"max_num_batched_tokens": 4096, "max_num_seqs": 64}) == ActivationProfile(4096, 64)
    assert _activation_profile(None) is None


def test_a_sequence_cap_is_not_raised_live_past_the_profile():
    cur = EngineConfig.build(**SC.baseline)
    obs = measure(SC.trace(1)[:300], cur, PROFILE, SETTINGS.slo)
    free = Tuner(SETTINGS, base_profile=PROFILE).round(obs, SC.trace(1)[:300], 0.0, apply=False)
    assert free.decision.action == "change" and free.decision.config.max_num_seqs > cur.max_num_seqs  # unbounded
    bound = dataclasses.replace(obs, activation_profile=ActivationProfile(cur.max_num_batched_tokens,
                                                                          cur.max_num_seqs))
    r = Tuner(SETTINGS, base_profile=PROFILE).round(bound, SC.trace(1)[:300], 0.0, apply=False)
    d = r.decision
    if d.action == "change" and not RESTART_KNOBS & d.changes.keys():
        assert not bound.activation_profile.exceeded(d.config.max_num_batched_tokens, d.config.max_num_seqs), d.changes


# ------------------------------------------------------------------ the operator's tick (tuning.tick)

def _profiled(g, seqs: int = 64):
    from kvtune_operator.tuning import Gathered
    obs = g.observation
    return Gathered(obs.with_(activation_profile=ActivationProfile(obs.config.max_num_batched_tokens, seqs)),
                    g.trace, g.window_s)


def test_tick_rolls_back_a_live_change_the_engines_refuse_instead_of_waiting_for_it():
    """A pending live raise the engines keep pending a restart (a tuner change made before the
    engine told its profile) would leave the tick in Applying forever: it is rolled back, barred."""
    from test_operator_tuning import PROFILE as P, infd, plan_of, window

    from kvtune_operator.effective import effective_engine
    from kvtune_operator.model import AutotuneMode
    from kvtune_operator.tuning import tick
    obj = infd("Apply")
    plan = plan_of(obj)
    g = window(effective_engine(obj.spec, None, AutotuneMode.APPLY).config)
    first = tick(obj.spec, obj.status, plan, g, now=1_000_000.0, base_profile=P)   # no profile told
    assert first.status_update["engine"]["maxNumSeqs"] > 64
    after = infd("Apply", {k: first.status_update[k] for k in ("engine", "baseline", "tuning")})
    res = tick(after.spec, after.status, plan, _profiled(g), now=1_000_200.0, base_profile=P)  # still 64
    t = res.status_update["tuning"]
    assert t["phase"] == "RolledBack" and "refused" in t["message"] and "restart" in t["message"]
    assert res.status_update["engine"]["maxNumSeqs"] == 64
    # told the profile from the start, the tuner raises the cap only with a rollout that profiles it
    again = tick(obj.spec, obj.status, plan, _profiled(g), now=1_000_000.0, base_profile=P)
    eng = again.status_update.get("engine", {})
    if eng.get("maxNumSeqs", 64) > 64:
        last = again.status_update["tuning"]["lastChange"]
        assert last["restart"] and eng["profileBatchedTokens"] >= eng["maxNumBatchedTokens"], (last, eng)
        assert restart_hash(EngineConfig.build(**to_engine_dict(eng))) != restart_hash(g.observation.config)
        assert not ActivationProfile.of(eng["profileBatchedTokens"], eng["maxNumSeqs"]).exceeded(
            eng["maxNumBatchedTokens"], eng["maxNumSeqs"])  # the new pods' profile covers the new step


def test_tick_says_a_spec_raise_past_the_profile_needs_a_restart():
    from test_operator_tuning import PROFILE as P, infd, plan_of, window

    from kvtune_operator.tuning import tick
    obj = infd("Apply", status={"engine": {"maxNumSeqs": 128}, "baseline": {"maxNumSeqs": 64}})
    g = window(EngineConfig(max_num_seqs=64, gpu_memory_utilization=0.9, max_model_len=8192))
    res = tick(obj.spec, obj.status, plan_of(obj), _profiled(g), now=1_000_000.0, base_profile=P)
    t = res.status_update["tuning"]
    assert t["phase"] == "Applying" and "without a restart" in t["message"] and "max_num_seqs 128" in t["message"]
    assert {c.type: c.reason for c in res.conditions}["Tuned"] == "NeedsRestart"


def test_a_live_budget_cut_is_predicted_on_the_kv_cache_the_engine_has():
    # the gpu-shaped loop's a100-lowmem start: gpuMemoryUtilization just above the weights, the default
    # 8192-token budget. The engine sized its cache for an 8192-token step; a live cut to 2048 keeps
    # that cache (96 blocks), only a restart with the smaller profile would get the 2048 step's ~400
    cur = EngineConfig(block_size=16, swap_space=0, enable_prefix_caching=False, max_num_seqs=64,
                       gpu_memory_utilization=0.21)
    prof, slo = load_profile("a100-llama3-8b"), SLO(ttft_s=1.0)
    trace = [TraceRequest(i / 3.0, 200, 300) for i in range(60)]
    backlog = [TraceRequest(0.0, 200, 300)] * 100
    pred = Predictor(prof, slo, backlog=backlog, running=cur)
    base = pred.predict(trace, cur)
    cut = pred.predict(trace, cur.with_changes(max_num_batched_tokens=2048))
    more = pred.predict(trace, cur.with_changes(gpu_memory_utilization=0.3))
    assert cut["num_blocks"] == base["num_blocks"] == prof.kv_cache_size(cur).num_blocks
    restarted = cur.with_changes(max_num_batched_tokens=2048, profile_batched_tokens=2048)
    assert prof.kv_cache_size(restarted).num_blocks > 3 * base["num_blocks"]  # what the cut looked like
    assert more["num_blocks"] > 10 * base["num_blocks"]
    # so the tuner fixes the memory (a restart) and does not take the cut as a live memory fix
    obs = measure(trace, cur, prof, slo)
    settings = TunerSettings(objectives=Objectives(slo_ttft_s=1.0),
                             bounds=Bounds.parse({"gpuMemoryUtilization": {"min": 0.21, "max": 0.9},
                                                      "blockSize": [16]}))
    rnd = Tuner(settings, base_profile=prof).round(obs, trace, 0.0, apply=False)
    assert rnd.decision.action == "change" and rnd.decision.restart, rnd.decision.reason
    assert rnd.decision.config.gpu_memory_utilization > 0.21, rnd.decision.changes
