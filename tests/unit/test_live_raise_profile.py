"""A live raise past the start-up activation profile is refused (issue 23): the memory beside the
KV cache was sized for that step; a larger one can run out of device memory mid-step and fail
every request in flight. A restart profiles again; lowering, and raising back, is live."""
from __future__ import annotations

import httpx
import pytest
from conftest_engine import TEST_FLAGS, run_server, set_test_threads, tiny_llama  # noqa: F401  (fixture)

from kvtune_engine.config import EngineConfig
from kvtune_engine.engine import RestartRequired
from kvtune_engine.kv.sizing import LIVE_SEQS_HEADROOM, ActivationProfile
from kvtune_engine.server.config_watch import _apply_on_engine


@pytest.fixture(scope="module")
def device_engine(tiny_llama):  # noqa: F811
    """A CPU standing in for a 1 GiB device (``--device-memory``): sized, and profiled, as on a GPU."""
    from kvtune_engine.builder import build_engine
    set_test_threads()
    flags = {k: v for k, v in TEST_FLAGS.items() if k != "kv_cache_memory"}
    cfg = EngineConfig.build(**{**flags, "max_num_batched_tokens": 512, "max_num_seqs": 8})
    return build_engine(str(tiny_llama), cfg, device="cpu", seed=0, device_memory_gib=1.0)


def test_profile_shape():
    p = ActivationProfile.of(1024, 8)
    assert p.exceeded(1024, 8) == {} and p.exceeded(128, 4) == {}
    assert p.exceeded(2048, 8) == {"max_num_batched_tokens": (1024, 2048)}
    # the profile samples LIVE_SEQS_HEADROOM rows whatever the cap it started with: the usual live
    # fix, a higher sequence cap, fits; past the headroom it does not
    assert p.exceeded(1024, LIVE_SEQS_HEADROOM) == {}
    assert p.exceeded(1024, 300) == {"max_num_seqs": (LIVE_SEQS_HEADROOM, 300)}
    assert ActivationProfile.of(1024, 512).rows == 512
    # a step never has more sequences than tokens: the sampled rows are min(seqs, budget)
    assert ActivationProfile.of(16, 64).exceeded(16, 1024) == {}


def test_live_raise_past_profile_is_refused_with_a_restart_message(device_engine):
    eng = device_engine
    assert eng.activation_profile == ActivationProfile.of(512, 8)
    assert eng.snapshot()["activation_profile"] == {"max_num_batched_tokens": 512, "max_num_seqs": LIVE_SEQS_HEADROOM}
    before = eng.config.model_dump()
    for change in ({"max_num_batched_tokens": 65536}, {"max_num_seqs": LIVE_SEQS_HEADROOM + 1, "watermark": 0.05}):
        with pytest.raises(RestartRequired) as ei:
            eng.update_config(change)
        msg = str(ei.value)
        assert "restart" in msg.lower() and "profile" in msg and next(iter(change)) in msg
        assert set(ei.value.knobs) == {next(iter(change))}
        assert eng.config.model_dump() == before          # all or nothing: the watermark stayed too
    # lowering is live, and so is raising up to what was profiled, the sequence cap's headroom included
    assert eng.update_config({"max_num_batched_tokens": 128, "max_num_seqs": 4})
    assert eng.update_config({"max_num_batched_tokens": 512, "max_num_seqs": LIVE_SEQS_HEADROOM})
    assert eng.update_config({"max_num_seqs": 8})
    assert eng.config.model_dump() == before


def test_config_file_raise_past_profile_waits_for_restart(device_engine):
    eng = device_engine
    changed, pending = _apply_on_engine(eng, {"max_num_batched_tokens": 4096, "watermark": 0.02})
    assert pending == {"max_num_batched_tokens": (512, 4096)}
    assert changed == {"watermark": [0.01, 0.02]} and eng.config.max_num_batched_tokens == 512
    eng.update_config({"watermark": 0.01})


def test_patch_past_profile_is_409_restart_required(tiny_llama):  # noqa: F811
    with run_server(tiny_llama, max_num_seqs=4) as s:
        s.engine.runner.activation_profile = ActivationProfile.of(512, 4)   # as profiled on a device
        r = httpx.patch(s.url + "/kvtune/v1/config", json={"max_num_batched_tokens": 65536}, timeout=30)
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["error"]["type"] == "restart_required" and "restart" in body["error"]["message"].lower()
        assert body["restart_required"] == {"max_num_batched_tokens": {"running": 512, "requested": 65536}}
        assert s.engine.config.max_num_batched_tokens == 512
        assert httpx.patch(s.url + "/kvtune/v1/config", json={"max_num_seqs": 2}, timeout=30).status_code == 200
