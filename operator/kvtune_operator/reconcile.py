"""One reconcile of one InferenceDeployment: read it fresh, merge, render, apply, observe, write status.

Called by the kopf handlers (create/update/resume and the status timer) and, later, by the tuner.
It is idempotent: children are server-side applied by name, so running it twice, or after an
operator restart, changes nothing and duplicates nothing. A child that neither side changed since
this operator's last apply of it is not sent again (applied_memo).

Concurrency: kopf runs handlers and timers of one object concurrently, each in a worker thread.
All writes of one object (children and status) happen under one per-object lock, from a fresh
read of the object, and the status is patched synchronously (not through kopf's deferred patch):
a stale body can never roll back a newer spec or a tuned value.

The tuner's entry point is `Reconciler.reconcile(ns, name, status_update=..., conditions=...)`:
`status_update` is merged into the fresh status *before* the merge and rendering (so a new
``status.engine`` is applied to the children at once) and written with the rest.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from kvtune_engine.config import LIVE_KNOBS, RESTART_KNOBS, ConfigError
from kvtune_operator import conditions as c
from kvtune_operator.applied_memo import AppliedMemo
from kvtune_operator.canary_children import has_canary_pod, restart_canary, sync_canary
from kvtune_operator.effective import Effective, autotune_mode, effective_engine
from kvtune_operator.kube import KubeError, now_rfc3339
from kvtune_operator.model import KNOBS, KNOBS_BY_CAMEL, AutotuneMode, InferenceDeployment, TuningStatus
from kvtune_operator.ownership import apply_order, blockers, label, may_write, not_owned_message, owned_by
from kvtune_operator.render import (ANNOTATION_RESTART_HASH, admin_key_of, child_names, render_admin_secret,
                                    render_children, runtime_restart_hash, selector_string)
from kvtune_operator.render_vllm import DEFAULT_VLLM_IMAGE
from kvtune_operator.settings import Settings
from kvtune_operator.volume_policy import bound_volume_name, claim_refusal

log = logging.getLogger(__name__)

PODMONITOR = ("monitoring.coreos.com", "v1", "podmonitors")


@dataclasses.dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass
class Outcome:
    """What one reconcile did: the status it wrote, the events it posted, and an error worth a retry."""

    status: dict[str, Any] | None = None
    events: list[EventSpec] = dataclasses.field(default_factory=list)
    retry: str | None = None
    gone: bool = False
    #: nothing written, and why: another replica holds the object's shard, or the tuner's state
    #: changed since the round read it (several replicas only: `Reconciler.owns`)
    refused: str | None = None
    #: the status (with the tuner's update) is on the object: written now, or already so
    written: bool = False


@dataclasses.dataclass(frozen=True)
class Applied:
    """One child before and after its server-side apply."""

    obj: dict[str, Any]
    before: dict[str, Any] | None
    after: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.obj['kind']} {self.obj['metadata']['name']}"

    @property
    def created(self) -> bool:
        return self.before is None

    @property
    def changed(self) -> bool:
        rv = lambda o: (o or {}).get("metadata", {}).get("resourceVersion")  # noqa: E731
        return self.before is not None and rv(self.before) != rv(self.after)


def _fmt(v: Any) -> str:
    return "unset" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def knob_change_events(previous: dict[str, Any] | None, effective: Effective, configmap: str,
                       deployment: str) -> list[EventSpec]:
    """Events for knobs whose effective value changed since status.engine (camelCase) was written."""
    if not previous:
        return []
    new = {k: v for k, v in effective.config.model_dump().items() if k not in effective.omitted}  # as status says
    old = {KNOBS_BY_CAMEL[k]: v for k, v in previous.items() if k in KNOBS_BY_CAMEL
           # an earlier operator wrote the config's default for a knob left to the engine: nothing changed
           and not (KNOBS_BY_CAMEL[k] in effective.omitted and v == getattr(effective.config, KNOBS_BY_CAMEL[k]))}
    changed = [k for k in KNOBS if k in old and old.get(k) != new.get(k) or k not in old and new.get(k) is not None]

    def line(k: str) -> str:
        why = " (tuned)" if k in effective.tuned else f" ({effective.dropped[k]})" if k in effective.dropped \
            else " (spec.engine)"
        return f"{KNOBS[k]} {_fmt(old.get(k))} -> {_fmt(new.get(k))}{why}"

    events = []
    live = [k for k in changed if k in LIVE_KNOBS]
    restart = [k for k in changed if k in RESTART_KNOBS]
    if live:
        events.append(EventSpec("Normal", "EngineConfigChanged",
                                f"{'; '.join(map(line, live))}: live, ConfigMap {configmap} updated, no restart"))
    if restart:
        events.append(EventSpec("Normal", "RollingRestart",
                                f"{'; '.join(map(line, restart))}: needs a restart, rolling Deployment {deployment}"))
    return events


def child_events(applied: Iterable[Applied], *, knob_events: bool) -> list[EventSpec]:
    """Created/Updated/Scaled events for children that the apply created or changed."""
    events = []
    for a in applied:
        if a.created:
            events.append(EventSpec("Normal", "Created", f"Created {a.label}"))
            continue
        if not a.changed:
            continue
        kind = a.obj["kind"]
        if kind == "Deployment":
            old, new = a.before.get("spec", {}), a.after.get("spec", {})  # type: ignore[union-attr]
            if old.get("replicas") != new.get("replicas"):
                events.append(EventSpec("Normal", "Scaled",
                                        f"{a.label}: replicas {old.get('replicas')} -> {new.get('replicas')}"))
            tmpl_old, tmpl_new = old.get("template", {}), new.get("template", {})
            if tmpl_old != tmpl_new:
                ann = lambda t: (t.get("metadata") or {}).get("annotations", {}).get(ANNOTATION_RESTART_HASH)  # noqa: E731
                only_hash = ann(tmpl_old) != ann(tmpl_new) and {**tmpl_old, "metadata": None} == {**tmpl_new, "metadata": None}
                if not (only_hash and knob_events):
                    events.append(EventSpec("Normal", "Updated", f"{a.label}: pod template changed, rolling the engine pods"))
        elif kind == "ConfigMap":
            if not knob_events:
                events.append(EventSpec("Normal", "Updated", f"Updated {a.label}"))
        else:
            events.append(EventSpec("Normal", "Updated", f"Updated {a.label}"))
    return events


def admin_key_events(applied: Iterable[Applied]) -> list[EventSpec]:
    """A Warning when the admin key's Secret was created again under an existing Deployment: its pods
    read the old key at start-up, so they roll onto the new one (the key's hash on the pod template)."""
    by_kind = {a.obj["kind"]: a for a in applied}
    secret, dep = by_kind.get("Secret"), by_kind.get("Deployment")
    if secret is None or not secret.created or dep is None or dep.created:
        return []
    return [EventSpec("Warning", "AdminKeyRecreated",
                      f"{secret.label} was gone: created it again with a new admin key; rolling {dep.label} "
                      "so its pods use it")]


def _changes(old: Any, patch: Any) -> bool:
    """Would this JSON merge patch change `old`?"""
    if isinstance(patch, dict) and isinstance(old, dict):
        return any(_changes(old.get(k), v) if v is not None else k in old for k, v in patch.items())
    return old != patch


class Reconciler:
    """Reconciles InferenceDeployments through a `Kube` (or a fake with the same methods)."""

    def __init__(self, kube: Any, settings: Settings):
        self.kube = kube
        self.settings = settings
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        #: several replicas (shards.py): whether this replica holds the object's shard; None: one
        #: replica works on every object and writes as it always did
        self.owns: Callable[[str, str], bool] | None = None
        self.applied = AppliedMemo()

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        with self._locks_guard:
            self._locks.pop((namespace, name), None)
        self.applied.forget(namespace, name)

    def model_volume_refusal(self, namespace: str, infd: InferenceDeployment) -> c.Cond | None:
        """Unless allowHostPath: why the model volume's claim may not be mounted yet (missing, unbound,
        bound to a hostPath or local PersistentVolume, or not verifiable), else None (volume_policy)."""
        vol = infd.spec.weights_volume
        if self.settings.allow_host_path or vol is None or vol.persistent_volume_claim is None:
            return None
        claim = vol.persistent_volume_claim.claim_name
        try:
            pvc = self.kube.get_pvc(namespace, claim)
        except KubeError as e:
            return claim_refusal(claim, None, None, pvc_error=str(e))
        volume = bound_volume_name(pvc) if pvc is not None else None
        pv = pv_error = None
        if volume is not None:
            try:
                pv = self.kube.get_pv(volume)
            except KubeError as e:
                pv_error = str(e)
        return claim_refusal(claim, pvc, pv, pv_error=pv_error)

    def reconcile(self, namespace: str, name: str, *, status_update: dict[str, Any] | None = None,
                  conditions: Iterable[c.Cond] = (), events: Iterable[EventSpec] = (),
                  basis: dict[str, Any] | None = None) -> Outcome:
        """Render, apply and write status; `status_update`, `conditions` and `events` come from the
        tuner (written in the same status patch, events posted with the reconcile's own).

        Several replicas (`owns` set): nothing is written unless this replica holds the object's
        shard at this moment, and a tuner's write (``basis``: the status.tuning its round read) only
        if the object still has that tuner state, with the read's resourceVersion as precondition of
        the status patch: a round of a replica that lost the shard can never be recorded."""
        with self.lock(namespace, name):
            if self.owns is not None and not self.owns(namespace, name):
                return _refuse(namespace, name, basis, "another replica holds this object's shard")
            raw = self.kube.get_infd(namespace, name)
            if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
                return Outcome(gone=True)
            precondition = None
            if self.owns is not None and basis is not None:
                if ((raw.get("status") or {}).get("tuning") or {}) != basis:
                    return _refuse(namespace, name, basis, "the tuner's state changed since this round read it")
                precondition = (raw.get("metadata") or {}).get("resourceVersion")
            return self._reconcile(raw, status_update or {}, list(conditions), list(events), precondition)

    # -- the steps ------------------------------------------------------------------------------

    def _reconcile(self, raw: dict[str, Any], status_update: dict[str, Any], extra: list[c.Cond],
                   extra_events: list[EventSpec], precondition: str | None = None) -> Outcome:
        meta = raw["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
        old_status = dict(raw.get("status") or {})
        raw = {**raw, "status": {**old_status, **status_update}}
        now = now_rfc3339()
        outcome = Outcome(events=list(extra_events))
        config_error = apply_error = None
        errors: list[str] = []
        failed: list[str] = []  # kinds whose apply failed or was held back
        effective: Effective | None = None
        deployment: dict[str, Any] | None = None
        applied: list[Applied] = []
        not_owned: list[str] = []  # children of our names that exist and are not ours: left untouched
        held_back: list[str] = []  # children not applied because one they need is not in place
        before_of: dict[str, dict[str, Any] | None] = {}
        status: dict[str, Any] = dict(status_update)
        canary_args: tuple[str, str] | None = None  # (image, admin key): where a canary may be synced
        try:
            infd = InferenceDeployment.from_body(raw)
        except ValidationError as e:
            infd = None
            config_error = f"the resource does not match the operator's model: {e.errors()[0]['msg']}"
        mode = autotune_mode(infd.spec, self.settings.autotune_mode) if infd else AutotuneMode(self.settings.autotune_mode)
        if infd is not None:
            try:
                effective = effective_engine(infd.spec, infd.status, mode)
            except ConfigError as e:
                config_error = f"the engine refuses spec.engine: {e}"
            vol = infd.spec.weights_volume
            if vol is not None and vol.host_path is not None and not self.settings.allow_host_path:
                effective = None
                config_error = ("spec.model.volume.hostPath is not allowed by this operator (setting allowHostPath, "
                                "KVTUNE_ALLOW_HOST_PATH, is off: it would mount a node directory); use a "
                                "persistentVolumeClaim")
        volume_refusal = self.model_volume_refusal(namespace, infd) if infd is not None and effective is not None \
            else None
        if infd is not None and effective is not None:
            image = infd.spec.image or (DEFAULT_VLLM_IMAGE if infd.spec.runtime == "vllm" else self.settings.engine_image)
            pod_monitor = self.settings.pod_monitor == "auto" and self.kube.served(*PODMONITOR)
            uid = infd.metadata.uid
            secret_name = child_names(name).admin_secret
            # read every child first: which of our names are taken by somebody else's objects decides
            # what may be applied at all (a Secret of our name that is not ours holds no key of ours)
            read_errors: dict[str, str] = {}
            try:
                before_of["Secret"] = self.kube.get("v1", "Secret", namespace, secret_name)
            except KubeError as e:
                read_errors["Secret"] = f"reading Secret {secret_name} failed: {e}"
            secret = before_of.get("Secret")
            kept = admin_key_of(secret) if owned_by(secret, uid) else None
            key = kept or secrets.token_urlsafe(32)
            children = render_children(infd, effective.config, image=image, pod_monitor=pod_monitor,
                                       allow_namespaces=self.settings.network_allow_namespaces, admin_key=key)
            canary_args = None if volume_refusal is not None else (image, key)
            admin_secret = render_admin_secret(infd, key)
            # the key read is written back only onto the Secret read: one deleted since (a user rotating
            # the key) must not come back with the old key; the next pass makes a new one
            kept_version = (secret or {}).get("metadata", {}).get("resourceVersion") if kept else None
            objs = apply_order([admin_secret, *children])
            for obj in objs:
                kind, md = obj["kind"], obj["metadata"]
                if kind in before_of or kind in read_errors:
                    continue
                try:
                    before_of[kind] = self.kube.get(obj["apiVersion"], kind, md["namespace"], md["name"])
                except KubeError as e:
                    read_errors[kind] = f"reading {label(obj)} failed: {e}"
            refused = [o["kind"] for o in objs if o["kind"] in before_of and not may_write(before_of[o["kind"]], uid)]
            not_owned += [label(o) for o in objs if o["kind"] in refused]
            for obj in objs:
                kind = obj["kind"]
                if kind in refused:
                    continue
                if kind in read_errors:
                    errors.append(read_errors[kind])
                    failed.append(kind)
                    continue
                if kind == "Deployment" and volume_refusal is not None:  # no engine pods on that volume
                    failed.append(kind)
                    continue
                waits_for = blockers(kind, failed=failed, refused=refused)
                if waits_for:
                    held_back.append(label(obj))
                    failed.append(kind)
                    if any(k in failed for k in waits_for):
                        errors.append(f"{label(obj)} not applied: its "
                                      f"{' and '.join(k for k in waits_for if k in failed)} must be in place first")
                    continue
                try:
                    send = (lambda o: self.kube.update_if_current(o, kept_version)) \
                        if obj is admin_secret and kept_version else self.kube.apply
                    after = self.applied.apply(name, obj, before_of[kind], send)
                except KubeError as e:
                    errors.append(f"applying {label(obj)} failed: {e}")
                    log.warning("%s/%s: %s", namespace, name, errors[-1])
                    failed.append(kind)
                    continue
                applied.append(Applied(obj, before_of[kind], after))
                if kind == "Deployment":
                    deployment = after
            if not_owned:
                log.warning("%s/%s: %s", namespace, name, not_owned_message(not_owned, held_back))
            outcome.events += admin_key_events(applied)
            knob_events = knob_change_events(old_status.get("engine"), effective,
                                             children[0]["metadata"]["name"], children[1]["metadata"]["name"])
            outcome.events += child_events(applied, knob_events=bool(knob_events)) + knob_events
            status.update({
                "engine": effective.status_engine(),
                "baseline": effective.status_baseline(),
                "restartHash": runtime_restart_hash(infd, effective.config),
                "image": image,
            })
        if deployment is None:  # not applied (invalid spec, failed apply): observe what is there
            deployment = before_of["Deployment"] if "Deployment" in before_of else \
                self.kube.get("apps/v1", "Deployment", namespace, name)
            if infd is not None and deployment is not None and not owned_by(deployment, infd.metadata.uid):
                deployment = None  # somebody else's: its replicas are not ours to report
        if "NetworkPolicy" in failed and before_of.get("NetworkPolicy") is None and deployment is not None:
            errors.append(f"the running pods of Deployment {name} have no NetworkPolicy")
        apply_error = "; ".join(errors) or None

        # -- observe ------------------------------------------------------------------------------
        desired = infd.spec.replicas if infd else 0
        missing_pvc = None
        if infd and infd.spec.weights_volume and infd.spec.weights_volume.persistent_volume_claim \
                and self.settings.allow_host_path:  # else model_volume_refusal read it
            claim = infd.spec.weights_volume.persistent_volume_claim.claim_name
            if self.kube.get_pvc(namespace, claim) is None:
                missing_pvc = claim
        pods = self.kube.list_pods(namespace, selector_string(name))
        replicas = c.replicas_of(desired, deployment)
        old_engine, new_engine = old_status.get("engine") or {}, status.get("engine") or {}
        restarting = KNOBS if infd is not None and infd.spec.runtime == "vllm" else RESTART_KNOBS  # vLLM: every knob
        restart_changed = sorted(KNOBS[k] for k in restarting
                                 if old_engine and new_engine and old_engine.get(KNOBS[k]) != new_engine.get(KNOBS[k]))
        conds = list(old_status.get("conditions") or [])
        not_owned_msg = not_owned_message(not_owned, held_back) if not_owned else None
        new_conds = [
            c.ready_condition(desired, deployment, not_owned=not_owned_msg),
            c.progressing_condition(desired, deployment, restart_changed, not_owned=not_owned_msg),
            c.degraded_condition(config_error=config_error, apply_error=apply_error, missing_pvc=missing_pvc,
                                 deployment=deployment, pods=pods, not_owned=not_owned_msg,
                                 volume_refusal=volume_refusal),
            *c.tuner_conditions(conds, mode),
            *extra,
        ]
        progressing = new_conds[1].status == "True"
        for cond in new_conds:
            before_cond = c.get_condition(conds, cond.type)
            conds = c.set_condition(conds, cond, generation=generation, now=now)
            ev = c.transition_event(before_cond, c.get_condition(conds, cond.type),  # type: ignore[arg-type]
                                    progressing=progressing)
            if ev:
                outcome.events.append(EventSpec(*ev))
        tuning = dict(status.get("tuning") or {})
        old_phase = (old_status.get("tuning") or {}).get("phase")
        tuning["mode"] = mode.value
        if mode == AutotuneMode.OFF:
            tuning["phase"] = "Off"
        elif "phase" not in tuning and (old_phase is None or old_phase == "Off"):
            tuning["phase"] = "Pending"
        tuning = TuningStatus.checked(tuning)
        status.update({
            "replicas": replicas.current,
            "readyReplicas": replicas.ready,
            "updatedReplicas": replicas.updated,
            "replicaSummary": replicas.summary,
            "selector": selector_string(name),
            "tuning": tuning,
            "conditions": conds,
        })
        if not (config_error or apply_error or not_owned or volume_refusal):
            status["observedGeneration"] = generation
        outcome.status = status
        outcome.retry = apply_error
        try:
            if _changes(old_status, json.loads(json.dumps(status))):
                if precondition is None:
                    self.kube.patch_infd_status(namespace, name, status)
                else:  # refused (409) when anything wrote the object since the read
                    self.kube.patch_infd_status(namespace, name, status, resource_version=precondition)
            outcome.written = True
        except KubeError as e:
            outcome.retry = outcome.retry or f"status update failed: {e}"
            # the tuner's decision is not recorded, so it did not happen: its events would be repeated
            # when the next tick decides it again (after an apiserver outage, say)
            outcome.events = [ev for ev in outcome.events if ev not in extra_events]
        was_canary = (((old_status.get("tuning") or {}).get("pending") or {}).get("canary") or {}).get("deployment")
        if outcome.written and canary_args is not None and \
                (restart_canary(infd.status.tuning if infd.status else None) or was_canary or has_canary_pod(pods)):
            problem = sync_canary(self.kube, infd, effective.config, running=mode == AutotuneMode.APPLY,
                                  image=canary_args[0], admin_key=canary_args[1], applied=self.applied)
            if problem:
                log.warning("%s/%s: %s", namespace, name, problem)
                outcome.retry = outcome.retry or problem
        for ev in outcome.events:
            self.kube.event(raw, ev.type, ev.reason, ev.message)
        return outcome


def _refuse(namespace: str, name: str, basis: dict[str, Any] | None, why: str) -> Outcome:
    """Nothing written; a tuner's round (``basis``) says in the log that it was not recorded."""
    if basis is not None:
        log.warning("%s/%s: tuning round not recorded: %s", namespace, name, why)
    return Outcome(refused=why)


def engine_admin_key(kube: Any, namespace: str, name: str, uid: str | None = None) -> str | None:
    """The admin key of an InferenceDeployment's engines (the operator's own reads of /kvtune/v1/*),
    from the Secret it owns: a Secret of that name owned by anything else (`uid` when given, else any
    controller but an InferenceDeployment of that name) holds no key of ours."""
    try:
        secret = kube.get("v1", "Secret", namespace, child_names(name).admin_secret)
    except KubeError:
        return None
    refs = [r for r in ((secret or {}).get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")]
    ours = owned_by(secret, uid) if uid else \
        any(r.get("kind") == "InferenceDeployment" and r.get("name") == name for r in refs)
    return admin_key_of(secret) if ours else None
