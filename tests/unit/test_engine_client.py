"""The one engine client (kvtune_operator.engine_client): typed records of the admin API, one total
deadline and byte cap, one error whose message never holds a response body, the admin key only to
the hosts it may go to; and the tuning loop, `kvtune demo` and `kvtune diagnose --url` all read the
engine through it (each run against a loopback server that sees the client's User-Agent and limits).
Loopback servers only."""
from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
from click.testing import CliRunner

from kvtune_engine.config import EngineConfig
from kvtune_engine.metrics import EngineMetrics
from kvtune_operator.engine_client import USER_AGENT, EngineClient, EngineError
from kvtune_operator.prometheus import MetricsUnavailable
from kvtune_operator.settings import Settings
from kvtune_operator.tuning import gather
from local_http import dripping, handling
from test_diagnose_engine import histograms, seq_cap_snapshot
from test_prometheus_safety import SPEC, _plan, _window

SECRET_TEXT = "bOdY-tExT-no-error-may-repeat"
TRACE = {"requests": [{"arrival_s": 100.0 + i, "prompt_tokens": 64, "output_tokens": 16} for i in range(10)],
         "unfinished": [{"arrival_s": 115.5, "prompt_tokens": 64, "output_tokens": 3}]}


def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "application/json",
          length: bool = True) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    if length:
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def engine(snap: dict | None = None, fail: dict[str, tuple[int, bytes]] | None = None):
    """A stand-in engine: /metrics, state, trace, steps, config (GET and PATCH); ``fail``: path ->
    (status, body) answered instead."""
    snap = snap or seq_cap_snapshot()
    cfg = dict(snap["config"])

    def handle(h: BaseHTTPRequestHandler) -> None:
        path = urlsplit(h.path).path
        if fail and path in fail:
            return _send(h, *fail[path])
        if path == "/metrics":
            return _send(h, 200, EngineMetrics(lambda: snap, histograms(), "m").render(), "text/plain")
        answers = {"/kvtune/v1/state": lambda: snap, "/kvtune/v1/trace": lambda: TRACE,
                   "/kvtune/v1/steps": lambda: {"steps": []}}
        if path == "/kvtune/v1/config":  # GET, or PATCH (the server keeps the body): the config it runs
            return _send(h, 200, json.dumps({"config": cfg, "changed": {}}).encode())
        if path in answers:
            return _send(h, 200, json.dumps(answers[path]()).encode())
        _send(h, 404, b'{"detail": "Not Found"}')

    return handling(handle)


# ------------------------------------------------------------------------------------------------
# the client


def test_typed_records_with_the_callers_parameters_and_headers():
    with engine() as (url, seen):
        c = EngineClient(url + "/", admin_key="k-1")
        st = c.state()
        assert st.uptime_s == 120.0 and st.num_blocks == 10_000 and st.config["max_num_seqs"] == 64
        assert st.raw["queues"]["waiting"] == 41
        tr = c.trace(since_s=90.0, limit=10000, unfinished=True)
        assert len(tr.requests) == 10 and len(tr.unfinished) == 1
        wt = tr.split(105.0)
        assert len(wt.finished) == 5 and len(wt.lead) == 5
        assert c.steps(limit=2000).steps == []
        assert c.config().config["max_num_seqs"] == 64
        assert c.set_config({"max_num_seqs": 96}).config["max_num_seqs"] == 64
        assert "# TYPE" in c.metrics_text()
    q = parse_qs(urlsplit(seen[1]["path"]).query)
    assert q == {"since_s": ["90.0"], "limit": ["10000"], "unfinished": ["true"]}
    assert parse_qs(urlsplit(seen[2]["path"]).query) == {"limit": ["2000"]}
    assert seen[4]["method"] == "PATCH" and json.loads(seen[4]["body"]) == {"max_num_seqs": 96}
    for r in seen:
        assert r["headers"]["User-Agent"] == USER_AGENT and r["headers"]["Authorization"] == "Bearer k-1"
    assert "k-1" not in repr(c)


def test_a_dripping_engine_is_cut_off_at_the_total_deadline():
    body = json.dumps(seq_cap_snapshot()).encode()

    with handling(dripping(body, 0.2)) as (url, _):
        t0 = time.monotonic()
        with pytest.raises(EngineError) as e:
            EngineClient(url, deadline_s=1.0).state()
        took = time.monotonic() - t0
    assert str(e.value) == "/kvtune/v1/state: no complete answer within 1s" and e.value.status is None
    assert took < 8, f"the read ran {took:.0f}s: no total deadline"


def test_an_oversized_answer_is_refused_at_the_cap():
    big = b'{"requests": [' + b" " * (2 << 20) + b"]}"
    for length in (True, False):
        with handling(lambda h: _send(h, 200, big, length=length)) as (url, _):
            with pytest.raises(EngineError) as e:
                EngineClient(url, max_bytes=1 << 20).trace()
        assert str(e.value) == "/kvtune/v1/trace: the response is larger than 1048576 bytes", length


@pytest.mark.parametrize("status,hint", [(401, "wants the engine's admin key"), (403, "refused the admin key"),
                                         (404, "is this the engine's admin port?"), (500, None)])
def test_an_error_answer_is_its_status_never_its_body(status, hint):
    body = json.dumps({"error": {"message": SECRET_TEXT}}).encode()
    with handling(lambda h: _send(h, status, body)) as (url, _):
        with pytest.raises(EngineError) as e:
            EngineClient(url, admin_key="k").steps()
    assert SECRET_TEXT not in str(e.value) and e.value.status == status
    assert str(e.value) == f"/kvtune/v1/steps: HTTP {status}" + (f" ({e.value.reason.split(' (', 1)[1]}" if hint else "")
    assert hint is None or hint in str(e.value)


def test_an_answer_that_is_no_engines_is_refused_without_its_text():
    fields = {k: SECRET_TEXT for k in ("config", "requests", "unfinished", "steps")}
    cases = [(SECRET_TEXT.encode(), "the answer is not JSON"), (json.dumps([SECRET_TEXT]).encode(), "not an engine's"),
             (json.dumps(fields).encode(), "not an engine's"), (b'{"steps": [1, 2]}', "not an engine's")]
    for body, why in cases:
        with handling(lambda h, b=body: _send(h, 200, b)) as (url, _):
            c = EngineClient(url)
            reads = (c.steps,) if b"[1, 2]" in body else (c.state, c.trace, c.steps, c.config)
            for read in reads:
                with pytest.raises(EngineError) as e:
                    read()
                assert SECRET_TEXT not in str(e.value) and why in str(e.value) and e.value.status is None, str(e.value)


def test_the_admin_key_goes_only_to_the_hosts_it_may():
    with engine() as (url, seen):
        with pytest.raises(EngineError) as e:
            EngineClient(url, admin_key="k", key_only_to={"10.0.0.1"}).state()
        assert "not contacted" in str(e.value) and not seen
        assert EngineClient(url, key_only_to={"10.0.0.1"}).state().uptime_s == 120.0  # no key: nothing to keep
        assert EngineClient(url, admin_key="k", key_only_to={"127.0.0.1"}).state().uptime_s == 120.0
    assert len(seen) == 2 and "Authorization" not in seen[0]["headers"]


# ------------------------------------------------------------------------------------------------
# the three callers read through it


def _prometheus_listing(instance: str):
    return handling(lambda h: _send(h, 200, _window(instance)))


def test_the_tuning_loop_reads_the_engine_through_the_client():
    with engine() as (eng, seen):
        with _prometheus_listing(eng.removeprefix("http://")) as (prom, _):
            allowed = Settings(prometheus_url=prom).prometheus_allowlist
            got = gather(_plan(prom), "ns", "chat", SPEC, None, allowed=allowed, pods={"127.0.0.1"},
                         admin_key="the-key")
    assert got.observation.config.max_num_seqs == 64 and got.window_start == 100.0
    assert [urlsplit(r["path"]).path for r in seen] == ["/kvtune/v1/state", "/kvtune/v1/trace", "/kvtune/v1/steps"]
    assert all(r["headers"]["User-Agent"] == USER_AGENT for r in seen)
    assert parse_qs(urlsplit(seen[1]["path"]).query)["unfinished"] == ["true"]


def test_the_tuning_loops_engine_errors_are_the_clients():
    for fail, want in (({"/kvtune/v1/state": (401, SECRET_TEXT.encode())}, "/kvtune/v1/state: HTTP 401 (the admin"),
                       ({"/kvtune/v1/trace": (200, SECRET_TEXT.encode())}, "/kvtune/v1/trace: the answer is not JSON")):
        with engine(fail=fail) as (eng, _):
            with _prometheus_listing(eng.removeprefix("http://")) as (prom, _):
                allowed = Settings(prometheus_url=prom).prometheus_allowlist
                with pytest.raises(MetricsUnavailable) as e:
                    gather(_plan(prom), "ns", "chat", SPEC, None, allowed=allowed, pods={"127.0.0.1"},
                           admin_key="the-key")
        assert e.value.reason == "EngineUnreachable" and want in str(e.value) and SECRET_TEXT not in str(e.value)


def test_the_demo_reads_and_retunes_the_engine_through_the_client(tmp_path):
    from kvtune_operator.demo.session import PHASES, Demo

    d = Demo(tmp_path, tmp_path, window_s=10.0, load_scale=1.0, rounds=1)
    with engine() as (eng, seen):
        d.engine = SimpleNamespace(url=eng)  # the engine process' one attribute the reads use
        obs, trace, lead, start = d.observe(d.now())
        cfg = EngineConfig.build(**PHASES[0].flags)
        d.apply(cfg, cfg.with_changes(max_num_seqs=4))  # a live knob: PATCH /kvtune/v1/config
    assert obs.config.max_num_seqs == 64 and start == 110.0 and len(trace) == 1 and len(lead) == 10
    assert d.state.config["max_num_seqs"] == 64  # what the engine answered, not what was asked
    assert [(r["method"], urlsplit(r["path"]).path) for r in seen] == [
        ("GET", "/kvtune/v1/state"), ("GET", "/kvtune/v1/trace"), ("GET", "/kvtune/v1/steps"),
        ("PATCH", "/kvtune/v1/config")]
    assert all(r["headers"]["User-Agent"] == USER_AGENT for r in seen)
    assert json.loads(seen[-1]["body"]) == {"max_num_seqs": 4}
    with engine(fail={"/kvtune/v1/config": (409, SECRET_TEXT.encode())}) as (eng, _):
        d.engine = SimpleNamespace(url=eng)
        with pytest.raises(EngineError) as e:
            d.apply(cfg, cfg.with_changes(max_num_seqs=4))
    assert e.value.status == 409 and SECRET_TEXT not in str(e.value)


def test_kvtune_diagnose_reads_the_engine_through_the_client():
    from kvtune_operator.cli import main
    from kvtune_operator.tuner_cli import read_engine

    with engine() as (url, seen):
        obs = read_engine(url, admin_key="k")
    assert obs.config.max_num_seqs == 64 and obs.lengths is not None
    assert [urlsplit(r["path"]).path for r in seen] == ["/metrics", "/kvtune/v1/state", "/kvtune/v1/state",
                                                        "/kvtune/v1/trace"]
    assert all(r["headers"]["User-Agent"] == USER_AGENT for r in seen)
    with engine(fail={"/kvtune/v1/state": (401, SECRET_TEXT.encode())}) as (url, _):
        r = CliRunner().invoke(main, ["diagnose", "--url", url, "--window", "0"])
    assert r.exit_code != 0 and "Traceback" not in r.output and SECRET_TEXT not in r.output
    assert f"the engine at {url} answered /kvtune/v1/state: HTTP 401 (the admin API wants" in r.output
