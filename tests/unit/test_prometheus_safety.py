"""spec.metrics.prometheusUrl is written by any author of an InferenceDeployment, and the shared operator
fetches it: only allowlisted Prometheus base URLs are queried, every query has a total deadline and a
byte cap, no response body reaches a condition, and the engine admin key goes only to the resource's
own pods (the IPs the API lists), whatever addresses Prometheus names. Loopback servers only."""
from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

import pytest

from local_http import dripping, handling

from kvtune_operator.effective import AutotunePlan
from kvtune_operator.model import AutotuneMode, InferenceDeploymentSpec
from kvtune_operator.prometheus import MetricsUnavailable, read_window
from kvtune_operator.settings import DEFAULT_PROMETHEUS_URL, Settings
from kvtune_operator.tuning import gather

SPEC = InferenceDeploymentSpec.model_validate({"model": {"path": "/m"}})
SECRET_TEXT = "bOdY-tExT-the-operator-must-not-repeat"


def _answer(status: int, body: bytes, length: bool = True):
    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        if length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return handle


def _window(instance: str, now: float | None = None) -> bytes:
    """A Prometheus answer: 20 s of one engine's kvtune_steps_total, scraped every second."""
    now = time.time() if now is None else now
    values = [[now - 20 + i, str(10 * i)] for i in range(21)]
    series = [{"metric": {"__name__": "kvtune_steps_total", "instance": instance, "namespace": "ns",
                          "inference_deployment": "chat"}, "values": values}]
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": series}}).encode()


def _plan(url: str) -> AutotunePlan:
    return AutotunePlan(mode=AutotuneMode.APPLY, interval_s=60, window_s=20, cooldown_s=60, prometheus_url=url)


def test_a_dripping_prometheus_is_cut_off_at_a_total_deadline():
    """One byte every 0.3 s never trips a per-read timeout: the query still ends at its total deadline,
    well before the drip would finish (about 30 s), and the condition says it timed out."""
    body = _window("127.0.0.1:1")

    with handling(dripping(body, 0.3)) as (url, _):
        t0 = time.monotonic()
        with pytest.raises(MetricsUnavailable) as e:
            read_window(url, "ns", "chat", 20, timeout_s=2.0)
        took = time.monotonic() - t0
    assert e.value.reason == "PrometheusUnreachable" and "within 2s" in str(e.value)
    assert took < 15, f"the query ran {took:.0f}s: no total deadline"


def test_an_oversized_answer_is_refused_at_the_cap():
    """A body past the cap is refused, with or without a Content-Length that announces it."""
    big = b'{"status": "success", "data": {"result": [' + b" " * (3 << 20) + b"]}}"
    for length in (True, False):
        with handling(_answer(200, big, length=length)) as (url, _):
            with pytest.raises(MetricsUnavailable) as e:
                read_window(url, "ns", "chat", 20, max_bytes=1 << 20)
        assert e.value.reason == "PrometheusUnreachable" and "larger than 1048576 bytes" in str(e.value), length


def test_an_error_body_is_not_repeated_in_the_condition():
    """The status code and a short fixed reason reach the condition (and so the events); the body of
    an error (or of a non-JSON answer) never does."""
    for status, body in ((500, SECRET_TEXT.encode()), (400, json.dumps({"status": "error", "error": SECRET_TEXT}).encode()),
                         (200, SECRET_TEXT.encode())):
        with handling(_answer(status, body)) as (url, _):
            with pytest.raises(MetricsUnavailable) as e:
                read_window(url, "ns", "chat", 20)
        assert SECRET_TEXT not in str(e.value), str(e.value)
        assert e.value.reason == "PrometheusUnreachable"
        assert status == 200 or f"HTTP {status}" in str(e.value)


def test_a_prometheus_url_outside_the_allowlist_is_refused_unfetched():
    """Only the operator's own Prometheus URL (and the listed others) may be queried; the refusal names
    the allowlist; a URL with a query, fragment or userinfo is refused even on an allowed host."""
    with handling(_answer(200, _window("127.0.0.1:1"))) as (url, seen):
        default = Settings()
        with pytest.raises(MetricsUnavailable) as e:
            gather(_plan(url), "ns", "chat", SPEC, None, allowed=default.prometheus_allowlist, pods=set())
        assert e.value.reason == "PrometheusUrlNotAllowed"
        assert "prometheus-operated.monitoring.svc:9090" in str(e.value) and "prometheusAllowedUrls" in str(e.value)
        assert not seen, "the operator fetched a URL outside its allowlist"
        for bad in (f"{url}/api/v1/query?x=", f"{url}#x", url.replace("://", "://user:pw@")):
            with pytest.raises(MetricsUnavailable) as e:
                gather(_plan(bad), "ns", "chat", SPEC, None,
                       allowed=Settings(prometheus_allowed_urls=url).prometheus_allowlist, pods=set())
            assert e.value.reason in ("PrometheusUrlInvalid", "PrometheusUrlNotAllowed"), bad
        assert not seen
        # listed: it is queried (and a trailing slash or the host's case makes no difference)
        allowed = Settings.from_env({"KVTUNE_PROMETHEUS_ALLOWED_URLS": f"{url}/"}).prometheus_allowlist
        with pytest.raises(MetricsUnavailable):  # the engine it lists is no pod of ours
            gather(_plan(url.replace("127.0.0.1", "127.0.0.1")), "ns", "chat", SPEC, None, allowed=allowed, pods=set())
        assert seen and seen[0]["path"].startswith("/api/v1/query")
    with pytest.raises(ValueError):
        Settings(prometheus_url=DEFAULT_PROMETHEUS_URL + "/?x=")


def test_the_admin_key_goes_only_to_the_resources_own_pods():
    """Prometheus lists an engine address; the admin key is sent there only when that address is an
    IP of one of the InferenceDeployment's pods (as the API lists them), never on Prometheus' word."""
    with handling(_answer(404, b"")) as (engine, got):
        instance = engine.removeprefix("http://")
        with handling(_answer(200, _window(instance))) as (prom, _):
            allowed = Settings(prometheus_url=prom).prometheus_allowlist
            with pytest.raises(MetricsUnavailable) as e:
                gather(_plan(prom), "ns", "chat", SPEC, None, allowed=allowed, pods={"10.1.2.3"},
                       admin_key="the-admin-key")
            assert e.value.reason == "EngineUnreachable" and "not an IP of this InferenceDeployment's pods" in str(e.value)
            assert not got, "the operator contacted an address that is none of the resource's pods"
            with pytest.raises(MetricsUnavailable) as e:  # our pod: contacted with the key (it answers 404)
                gather(_plan(prom), "ns", "chat", SPEC, None, allowed=allowed, pods={"127.0.0.1"},
                       admin_key="the-admin-key")
            assert "HTTP 404" in str(e.value)
    assert got and got[0]["headers"].get("Authorization") == "Bearer the-admin-key"


def test_pod_ips_come_from_the_api():
    from kvtune_operator.prometheus import pod_host, pod_ips
    pods = [{"metadata": {}, "status": {"podIP": "10.0.0.1", "podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}},
            {"metadata": {}, "status": {"podIP": "10.0.0.2"}}, {"metadata": {}, "status": {}}]
    assert pod_ips(pods) == {"10.0.0.1", "10.0.0.2", "fd00::1"}
    assert pod_host("10.0.0.1:8001") == "10.0.0.1" and pod_host("http://[fd00::1]:8001") == "fd00::1"
    assert pod_host("engine.example:8001") is None
