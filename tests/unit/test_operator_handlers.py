"""The kopf wiring (handlers.py) and the commands (commands.py), without a cluster."""
from __future__ import annotations

from click.testing import CliRunner

from kvtune_operator.cli import main
from kvtune_operator.crd import render_crd
from kvtune_operator.handlers import build_registry, retry_delay
from kvtune_operator.reconcile import Reconciler
from kvtune_operator.settings import Settings


def test_registry_has_the_handlers():
    settings = Settings.from_env({"KVTUNE_STATUS_INTERVAL": "7"})
    registry = build_registry(settings, Reconciler(kube=None, settings=settings))
    changing = registry._changing.get_all_handlers()
    assert {(h.id, h.reason.value if h.reason else None) for h in changing} >= {
        ("reconcile", "create"), ("reconcile", "update"), ("deleted", "delete")}
    assert any(h.id == "reconcile" and h.initial for h in changing)  # on.resume: objects found at start-up
    assert next(h for h in changing if h.id == "deleted").requires_finalizer is False  # children go by GC
    timers = registry._spawning.get_all_handlers()
    assert [(h.id, h.interval) for h in timers] == [("refresh", 7.0), ("tune", settings.tune_poll_interval)]
    assert {h.id for h in registry._activities.get_all_handlers()} >= {"uptime_seconds"}


def test_startup_sizes_kopfs_handler_pool_for_the_rounds_and_the_reconciles():
    """kopf's default pool is min(32, CPUs + 4) threads (6 on two CPUs): with 4 rounds at once holding
    theirs for seconds, a fleet's reconciles and timer polls queued behind them."""
    import kopf

    settings = Settings.from_env({"KVTUNE_TUNING_ROUNDS_AT_ONCE": "8", "KVTUNE_HANDLER_THREADS": "5"})
    registry = build_registry(settings, Reconciler(kube=None, settings=settings))
    ops = kopf.OperatorSettings()
    next(h for h in registry._activities.get_all_handlers() if h.id.endswith("configure")).fn(settings=ops)
    assert ops.execution.max_workers == 13 and ops.execution.executor._max_workers == 13


def test_retry_backoff_doubles_and_caps():
    s = Settings.from_env({"KVTUNE_RETRY_BACKOFF": "2", "KVTUNE_RETRY_BACKOFF_MAX": "10"})
    assert [retry_delay(s, r) for r in range(5)] == [2, 4, 8, 10, 10]


def test_kvtune_crd_prints_the_committed_crd(tmp_path):
    res = CliRunner().invoke(main, ["crd"])
    assert res.exit_code == 0 and res.output == render_crd()
    out = tmp_path / "crd.yaml"
    assert CliRunner().invoke(main, ["crd", "-o", str(out)]).exit_code == 0
    assert out.read_text() == render_crd()


def test_operator_run_refuses_bad_settings():
    res = CliRunner().invoke(main, ["operator", "run", "--autotune-window", "soon"])
    assert res.exit_code == 2 and "autotune_window" in res.output
    assert "--all-namespaces" in CliRunner().invoke(main, ["operator", "run", "--help"]).output


def test_only_handlers_import_kopf_and_nothing_imports_torch():
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvtune_operator.model, kvtune_operator.crd, kvtune_operator.render, kvtune_operator.effective\n"
            "import kvtune_operator.conditions, kvtune_operator.reconcile, kvtune_operator.kube\n"
            "import kvtune_operator.settings, kvtune_operator.commands\n"
            "assert 'kopf' not in sys.modules, 'kopf imported outside handlers.py'\n"
            "import kvtune_operator.handlers\n"
            "assert 'torch' not in sys.modules, 'the operator imports torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
