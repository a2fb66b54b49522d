"""The kopf handlers: the only module of kvtune that imports kopf. Thin by design.

`build_registry(settings, reconciler)` returns a kopf registry with:

* ``login``            credentials from the kubernetes client (in-cluster or kubeconfig)
* ``startup``          kopf's own settings (annotation storage under kvtune.io, no CRD/namespace scanning)
* ``reconcile``        on create / update / resume: `Reconciler.reconcile` (render + apply + status);
                       a failed apply raises kopf.TemporaryError with exponential backoff
* ``refresh``          a timer per InferenceDeployment every ``settings.status_interval``: the same
                       reconcile (idempotent: it re-observes pods and repairs drifted children)
* ``deleted``          on delete (optional: no finalizer; children go by garbage collection)
* ``health``           a liveness probe (kopf serves it at ``settings.liveness``)
* ``shards``           several replicas (``settings.shards`` > 0): the shard Leases kept from startup
                       to cleanup (leases.ShardKeeper); every handler above returns at once for an
                       object whose shard this replica does not hold (shards.py)

* ``tune``             a timer polling every ``settings.tune_poll_interval``; each deployment is tuned at
                       its own spec.autotune.interval by `tuning.TuningLoop` (Prometheus window ->
                       diagnose -> predict -> decide -> status.engine, conditions and events), at most
                       ``settings.tuning_rounds_at_once`` at once, the one due longest first (round_queue.py)
"""
from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import kopf

from kvtune_operator.leases import ShardKeeper, keeper_for
from kvtune_operator.model import GROUP, PLURAL, VERSION
from kvtune_operator import operator_metrics
from kvtune_operator.reconcile import Outcome, Reconciler
from kvtune_operator.round_queue import RoundQueue
from kvtune_operator.settings import Settings
from kvtune_operator.tuning import TuningLoop

ANNOTATION_PREFIX = "kvtune.io"
log = logging.getLogger("kvtune_operator")


def _log(namespace: str, name: str, outcome: Outcome) -> None:
    for ev in outcome.events:
        log.log(logging.WARNING if ev.type == "Warning" else logging.INFO, "%s/%s: %s: %s",
                namespace, name, ev.reason, ev.message)


def retry_delay(settings: Settings, retry: int) -> float:
    """Exponential backoff: backoff, 2x, 4x, ... capped at backoff_max."""
    return min(settings.retry_backoff * (2 ** max(retry, 0)), settings.retry_backoff_max)


def build_registry(settings: Settings, reconciler: Reconciler,
                   keeper: ShardKeeper | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    mine = keeper.owns if keeper is not None else (lambda namespace, name: True)
    reconciler.owns = keeper.owns if keeper is not None else None  # checked again right before each write
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL)
    started = dt.datetime.now(dt.timezone.utc)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)

    ours = settings

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf runs every sync handler in one thread pool, min(32, CPUs + 4) threads by default: on a
        # 2-CPU pod 6, of which up to tuning_rounds_at_once hold a round for seconds, and the fleet's
        # reconciles and timer polls queued behind them (a Ready seen late, due rounds offered late)
        settings.execution.max_workers = ours.tuning_rounds_at_once + ours.handler_threads
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
        # The CRD is installed before the operator (chart, crds/): no need to watch CRDs/namespaces.
        settings.scanning.disabled = True
        settings.peering.standalone = True
        # Our own Events tell the story; kopf adds only its warnings and errors.
        settings.posting.level = logging.WARNING
        settings.networking.request_timeout = 60
        # a timer running when its object is deleted is checked again this often (kopf's default,
        # 60 s, holds `kubectl delete infd` that long)
        settings.background.cancellation_polling = 1
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330

    handling = dict(registry=registry, backoff=settings.retry_backoff)

    @kopf.on.create(**resource, **handling, id="reconcile")
    @kopf.on.update(**resource, **handling, id="reconcile")
    @kopf.on.resume(**resource, **handling, id="reconcile")
    def reconcile(namespace: str, name: str, retry: int, **_: Any) -> None:
        if not mine(namespace, name):  # another replica's (its refresh picks up this change too)
            return
        outcome = reconciler.reconcile(namespace, name)
        _log(namespace, name, outcome)
        if outcome.retry:
            raise kopf.TemporaryError(outcome.retry, delay=retry_delay(settings, retry))

    @kopf.timer(**resource, **handling, id="refresh", interval=settings.status_interval,
                initial_delay=settings.status_interval)
    def refresh(namespace: str, name: str, **_: Any) -> None:
        if not mine(namespace, name):
            return
        outcome = reconciler.reconcile(namespace, name)
        _log(namespace, name, outcome)
        if outcome.retry:
            log.warning("%s/%s: will retry at the next refresh: %s", namespace, name, outcome.retry)

    loop = TuningLoop(reconciler, settings)
    queue = RoundQueue(settings.tuning_rounds_at_once, stale_after_s=3 * settings.tune_poll_interval)

    @kopf.timer(**resource, registry=registry, id="tune", interval=settings.tune_poll_interval,
                initial_delay=settings.tune_poll_interval)
    def tune(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        """Each deployment at its own spec.autotune.interval: gather, decide, write (tuning.py). kopf
        keeps the per-object memo; the tuner's state is in the object's status."""
        if not mine(namespace, name):
            return
        result = loop.maybe_tick(namespace, name, dict(body), memo, queue)
        if result is not None and keeper is not None:
            log.info("%s/%s: tuning round by replica %s", namespace, name, keeper.table.identity)
        if result is not None:
            for ev in result.events:
                log.info("%s/%s: %s: %s", namespace, name, ev.reason, ev.message)

    @kopf.on.delete(**resource, registry=registry, id="deleted", optional=True)
    def deleted(namespace: str, name: str, **_: Any) -> None:
        reconciler.forget(namespace, name)
        operator_metrics.forget(namespace, name)
        log.info("%s/%s: deleted; its children go by garbage collection", namespace, name)

    if keeper is not None:
        @kopf.on.startup(registry=registry)
        def take_shards(**_: Any) -> None:
            keeper.start()

        @kopf.on.cleanup(registry=registry)
        def hand_back_shards(**_: Any) -> None:
            keeper.stop()

    @kopf.on.probe(id="uptime_seconds", registry=registry)
    def health(**_: Any) -> float:
        return (dt.datetime.now(dt.timezone.utc) - started).total_seconds()

    return registry


def run(settings: Settings, *, kubeconfig: str | None = None) -> None:
    """Run the operator until interrupted (blocking)."""
    from kvtune_operator.kube import Kube

    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "DEBUG":  # kopf logs every timer tick at INFO; our own lines tell the story
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube.from_environment(kubeconfig, field_manager=settings.field_manager,
                                 connections=settings.tuning_rounds_at_once + settings.handler_threads + 1)  # + shards
    keeper = keeper_for(settings, kube.api)
    if keeper is not None:  # its Events name the replica that took the decision
        kube.instance = keeper.table.identity
    registry = build_registry(settings, Reconciler(kube, settings), keeper)
    if settings.metrics_port:
        operator_metrics.serve(settings.metrics_port)
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        liveness_endpoint=settings.liveness,
    )
