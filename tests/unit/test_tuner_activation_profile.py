"""The tuner proposes no live raise past the engine's start-up activation profile (issue 23): the
engine refuses one (a bigger step may not fit in device memory); a restart change may raise."""
from __future__ import annotations

import dataclasses

from kvtune_engine.config import RESTART_KNOBS, EngineConfig
from kvtune_engine.kv.sizing import ActivationProfile
from kvtune_engine.sim.profiles import load_profile
from kvtune_engine.sim.scenarios import SCENARIOS
from kvtune_operator.tuner.decide import Objectives
from kvtune_operator.tuner.loop import Tuner, TunerSettings, engine_takes, measure
from kvtune_operator.tuner.observation import _activation_profile

SC = SCENARIOS["seq-cap"]
PROFILE = load_profile(SC.profile)
SETTINGS = TunerSettings(objectives=Objectives(slo_ttft_s=SC.slo_ttft_s, slo_tpot_s=SC.slo_tpot_s))


def test_engine_takes():
    cur = EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096)
    obs = dataclasses.replace(measure(SC.trace(1)[:50], cur, PROFILE, SETTINGS.slo),
                              activation_profile=ActivationProfile.of(4096, 64))
    assert engine_takes(obs, cur.with_changes(max_num_seqs=32, max_num_batched_tokens=2048))
    assert not engine_takes(obs, cur.with_changes(max_num_seqs=128))
    assert not engine_takes(obs, cur.with_changes(max_num_batched_tokens=65536))
    assert engine_takes(obs, cur.with_changes(max_num_seqs=128, block_size=32))   # a rollout profiles again
    assert engine_takes(dataclasses.replace(obs, activation_profile=None), cur.with_changes(max_num_seqs=512))
    assert _activation_profile({"max_num_batched_tokens": 4096, "max_num_seqs": 64}) == ActivationProfile.of(4096, 64)
    assert _activation_profile(None) is None


def test_a_sequence_cap_is_not_raised_live_past_the_profile():
    cur = EngineConfig.build(**SC.baseline)
    obs = measure(SC.trace(1)[:300], cur, PROFILE, SETTINGS.slo)
    free = Tuner(SETTINGS, base_profile=PROFILE).round(obs, SC.trace(1)[:300], 0.0, apply=False)
    assert free.decision.action == "change" and free.decision.config.max_num_seqs > cur.max_num_seqs  # unbounded
    bound = dataclasses.replace(obs, activation_profile=ActivationProfile.of(cur.max_num_batched_tokens,
                                                                             cur.max_num_seqs))
    r = Tuner(SETTINGS, base_profile=PROFILE).round(bound, SC.trace(1)[:300], 0.0, apply=False)
    d = r.decision
    if d.action == "change" and not RESTART_KNOBS & d.changes.keys():
        assert not bound.activation_profile.exceeded(d.config.max_num_batched_tokens, d.config.max_num_seqs), d.changes
