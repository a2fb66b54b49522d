"""Issue 23, in a shared cluster: the operator adopts nothing it does not own, the Secret and the
NetworkPolicy are in place before the Deployment, and a deleted admin-key Secret rolls the pods
onto the new key (against the in-memory fake of `Kube`; the real apiserver in
tests/integration/test_operator_cluster.py)."""
from __future__ import annotations

import copy

import pytest
from test_operator_reconcile import FakeKube, reasons, setup

from kvtune_operator.conditions import get_condition
from kvtune_operator.ownership import apply_order, blockers, may_write, owned_by
from kvtune_operator.reconcile import engine_admin_key
from kvtune_operator.render import ANNOTATION_ADMIN_KEY_HASH, admin_key_hash, admin_key_of

USER_OBJECTS = {  # what a user may already have under the names an InferenceDeployment "qwen" takes
    "NetworkPolicy": {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                      "metadata": {"name": "qwen", "namespace": "llm", "resourceVersion": "7"},
                      "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]}},
    "Service": {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "qwen", "namespace": "llm", "resourceVersion": "7"},
                "spec": {"selector": {"app": "old-qwen"}, "ports": [{"port": 80}]}},
    "ConfigMap": {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "qwen-engine", "namespace": "llm", "resourceVersion": "7"},
                  "data": {"settings": "mine"}},
    "Secret": {"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "qwen-admin-key", "namespace": "llm", "resourceVersion": "7"},
               "data": {"admin-key": "dXNlci1wYXNzd29yZA=="}},
    # an orphan of an earlier InferenceDeployment of the same name (another uid)
    "Deployment": {"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "qwen", "namespace": "llm", "resourceVersion": "7",
                                "ownerReferences": [{"apiVersion": "kvtune.io/v1alpha1",
                                                     "kind": "InferenceDeployment", "name": "qwen",
                                                     "uid": "uid-old", "controller": True}]},
                   "spec": {"replicas": 4}, "status": {"replicas": 4, "readyReplicas": 4}},
}


def user_object(kube: FakeKube, kind: str) -> dict:
    obj = copy.deepcopy(USER_OBJECTS[kind])
    kube.objects[(obj["apiVersion"], kind, "llm", obj["metadata"]["name"])] = obj
    return obj


def conds(kube):
    return kube.infd()["status"]["conditions"]


# -- the pure rules ---------------------------------------------------------------------------------

def test_ours_means_a_controller_reference_with_our_uid():
    ref = lambda uid, controller=True: {"metadata": {"ownerReferences": [  # noqa: E731
        {"kind": "InferenceDeployment", "name": "qwen", "uid": uid, "controller": controller}]}}
    assert owned_by(ref("uid-1"), "uid-1")
    assert not owned_by(ref("uid-2"), "uid-1")              # another (an earlier) resource's
    assert not owned_by(ref("uid-1", controller=False), "uid-1")
    assert not owned_by({"metadata": {}}, "uid-1") and not owned_by(ref("uid-1"), None)
    assert may_write(None, "uid-1") and not may_write({"metadata": {}}, "uid-1")


def test_secret_and_policy_come_before_the_deployment_which_needs_them():
    kinds = ["ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodMonitor", "Secret"]
    assert [o["kind"] for o in apply_order({"kind": k} for k in kinds)] == \
        ["Secret", "NetworkPolicy", "ConfigMap", "Deployment", "Service", "PodMonitor"]
    assert blockers("Deployment", failed=["NetworkPolicy"], refused=[]) == ["NetworkPolicy"]
    assert blockers("Deployment", failed=["Service"], refused=[]) == []  # a Service quota holds nothing back
    assert blockers("Deployment", failed=[], refused=["Service"]) == ["Service"]
    assert blockers("Service", failed=["NetworkPolicy"], refused=["Secret"]) == []


# -- adopt nothing we do not own --------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(USER_OBJECTS))
def test_a_users_object_of_a_child_name_is_left_untouched_and_no_deployment_is_made(kind):
    kube, rec = setup()
    theirs = user_object(kube, kind)
    name = theirs["metadata"]["name"]
    out = rec.reconcile("llm", "qwen")
    assert kube.objects[(theirs["apiVersion"], kind, "llm", name)] == theirs  # not a field changed, no owner added
    if kind != "Deployment":
        assert not [k for k in kube.objects if k[1] == "Deployment"]  # no engine pods
    deg = get_condition(conds(kube), "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "ChildNotOwned" and f"{kind} {name}" in deg["message"]
    ready = get_condition(conds(kube), "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ChildNotOwned"
    warnings = [m for t, r, m in kube.events if t == "Warning" and r == "ChildNotOwned"]
    assert len(warnings) == 1 and f"{kind} {name}" in warnings[0]
    assert kube.infd()["status"]["replicas"] == 0  # somebody else's Deployment is not reported as ours
    assert out.retry is None  # nothing to retry soon: the refresh timer looks again
    assert engine_admin_key(kube, "llm", "qwen", "uid-1") != "user-password"
    rec.reconcile("llm", "qwen")  # the next refresh: still untouched, no second warning
    assert kube.objects[(theirs["apiVersion"], kind, "llm", name)] == theirs
    assert reasons(kube).count("ChildNotOwned") == 1

    del kube.objects[(theirs["apiVersion"], kind, "llm", name)]  # the user renames or deletes theirs
    rec.reconcile("llm", "qwen")
    assert owned_by(kube.child("Deployment"), "uid-1")
    assert owned_by(next(v for k, v in kube.objects.items() if k[1] == kind and k[3] == name), "uid-1")
    assert get_condition(conds(kube), "Degraded")["status"] == "False" and "Recovered" in reasons(kube)


def test_a_users_secret_of_the_admin_key_name_is_never_read_as_the_key():
    kube, rec = setup()
    user_object(kube, "Secret")
    rec.reconcile("llm", "qwen")
    assert engine_admin_key(kube, "llm", "qwen", "uid-1") is None
    assert engine_admin_key(kube, "llm", "qwen") is None  # without the uid: no InferenceDeployment controls it


# -- the Secret and the NetworkPolicy before the Deployment ------------------------------------------

def test_a_service_quota_leaves_the_pods_with_their_policy():
    kube, rec = setup()
    kube.fail_kind = "Service"  # e.g. a ResourceQuota on services
    out = rec.reconcile("llm", "qwen")
    assert out.retry and "Service qwen" in out.retry
    np, dep = kube.child("NetworkPolicy"), kube.child("Deployment")
    assert owned_by(np, "uid-1") and dep
    assert np["spec"]["podSelector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()  # the policy selects the Deployment's pods
    assert get_condition(conds(kube), "Degraded")["reason"] == "ApplyFailed"


@pytest.mark.parametrize("kind", ["NetworkPolicy", "Secret"])
def test_no_deployment_without_its_policy_or_secret(kind):
    kube, rec = setup()
    kube.fail_kind = kind
    out = rec.reconcile("llm", "qwen")
    assert not [k for k in kube.objects if k[1] == "Deployment"]
    deg = get_condition(conds(kube), "Degraded")
    assert deg["reason"] == "ApplyFailed" and "Deployment qwen not applied" in deg["message"] and kind in deg["message"]
    assert out.retry
    kube.fail_kind = None
    rec.reconcile("llm", "qwen")
    assert kube.child("Deployment") and get_condition(conds(kube), "Degraded")["status"] == "False"


def test_a_running_deployment_whose_policy_is_gone_and_cannot_be_made_is_not_updated_and_says_so():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.rollout()
    rec.reconcile("llm", "qwen")
    del kube.objects[("networking.k8s.io/v1", "NetworkPolicy", "llm", "qwen")]
    kube.fail_kind = "NetworkPolicy"
    kube.edit_spec(replicas=3)
    rec.reconcile("llm", "qwen")
    assert kube.child("Deployment")["spec"]["replicas"] == 1  # not scaled up without its policy
    deg = get_condition(conds(kube), "Degraded")
    assert deg["status"] == "True" and "have no NetworkPolicy" in deg["message"]
    kube.fail_kind = None
    rec.reconcile("llm", "qwen")
    assert kube.child("Deployment")["spec"]["replicas"] == 3 and kube.child("NetworkPolicy")


# -- a deleted admin-key Secret ---------------------------------------------------------------------

def test_a_deleted_admin_key_secret_rolls_the_pods_onto_the_new_key():
    kube, rec = setup()
    rec.reconcile("llm", "qwen")
    kube.rollout()
    old_key = engine_admin_key(kube, "llm", "qwen", "uid-1")
    template = kube.child("Deployment")["spec"]["template"]
    assert template["metadata"]["annotations"][ANNOTATION_ADMIN_KEY_HASH] == admin_key_hash(old_key)
    del kube.objects[("v1", "Secret", "llm", "qwen-admin-key")]
    out = rec.reconcile("llm", "qwen")
    new_key = admin_key_of(kube.child("Secret", "qwen-admin-key"))
    assert new_key and new_key != old_key and engine_admin_key(kube, "llm", "qwen", "uid-1") == new_key
    new_template = kube.child("Deployment")["spec"]["template"]
    assert new_template["metadata"]["annotations"][ANNOTATION_ADMIN_KEY_HASH] == admin_key_hash(new_key)
    assert new_template != template  # a new pod template: the Deployment controller rolls the pods
    assert new_key not in str(kube.child("Deployment")) and old_key not in str(kube.child("Deployment"))
    assert "AdminKeyRecreated" in [e.reason for e in out.events]
    before = copy.deepcopy(kube.child("Deployment"))
    rec.reconcile("llm", "qwen")  # stable afterwards: no further roll
    assert kube.child("Deployment") == before
