"""One InferenceDeployment body for the unit and integration tests: ``infd_body(name, **spec)``.

The body is what the apiserver stores (``InferenceDeployment.from_body(...)`` or ``yaml.safe_dump(...)``
for ``kubectl apply``): ``spec`` is ``{"model": {"path": model_path}, **spec}``, so a test names only
the fields it is about (a ``model=`` keyword replaces the whole model block)."""
from __future__ import annotations

from typing import Any

API_VERSION = "kvtune.io/v1alpha1"
KIND = "InferenceDeployment"


def infd_body(name: str = "qwen", *, namespace: str | None = None, uid: str | None = None,
              generation: int | None = None, model_path: str = "/models/qwen", status: dict | None = None,
              **spec: Any) -> dict:
    meta: dict[str, Any] = {"name": name}
    for key, value in (("namespace", namespace), ("uid", uid), ("generation", generation)):
        if value is not None:
            meta[key] = value
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
            "spec": {"model": {"path": model_path}, **spec}}
    if status is not None:
        body["status"] = status
    return body
