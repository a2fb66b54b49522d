"""`kvtune crd` and `kvtune operator run`. kopf is imported only when the operator runs."""
from __future__ import annotations

import os
import sys

import click

from kvtune_operator.model import AutotuneMode


@click.command("crd")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write to this file instead of standard output.")
def crd(output: str | None) -> None:
    """Print the InferenceDeployment CRD generated from the pydantic model."""
    from kvtune_operator.crd import render_crd

    text = render_crd()
    if output:
        with open(output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


@click.group("operator")
def operator() -> None:
    """Run the kvtune Kubernetes operator."""


@operator.command("run")
@click.option("-n", "--namespace", "namespaces", multiple=True,
              help="Namespace to watch (repeatable). Default: KVTUNE_NAMESPACES, else all namespaces.")
@click.option("-A", "--all-namespaces", is_flag=True, help="Watch all namespaces, whatever KVTUNE_NAMESPACES says.")
@click.option("--prometheus-url", help="Default Prometheus URL (KVTUNE_PROMETHEUS_URL).")
@click.option("--engine-image", help="Default engine image (KVTUNE_ENGINE_IMAGE).")
@click.option("--autotune-mode", type=click.Choice([m.value for m in AutotuneMode]),
              help="Default autotune mode (KVTUNE_AUTOTUNE_MODE).")
@click.option("--autotune-interval", help="Default autotune interval, e.g. 60s (KVTUNE_AUTOTUNE_INTERVAL).")
@click.option("--autotune-window", help="Default observation window, e.g. 5m (KVTUNE_AUTOTUNE_WINDOW).")
@click.option("--autotune-cooldown", help="Default cooldown between restarts, e.g. 15m (KVTUNE_AUTOTUNE_COOLDOWN).")
@click.option("--status-interval", type=float, help="Seconds between status refreshes (KVTUNE_STATUS_INTERVAL).")
@click.option("--pod-monitor", type=click.Choice(["auto", "never"]), help="PodMonitor creation (KVTUNE_POD_MONITOR).")
@click.option("--liveness", help="Liveness endpoint URL, '' to disable (KVTUNE_LIVENESS).")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="KVTUNE_LOG_LEVEL.")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False),
              help="Kubeconfig file (default: in-cluster credentials, else KUBECONFIG or ~/.kube/config).")
def run(namespaces: tuple[str, ...], all_namespaces: bool, kubeconfig: str | None, **flags: object) -> None:
    """Reconcile InferenceDeployments until interrupted."""
    from pydantic import ValidationError

    from kvtune_operator.settings import Settings

    try:
        settings = Settings.from_env(namespaces=namespaces or None, **flags)
        if all_namespaces:
            settings = settings.model_copy(update={"namespaces": ()})
    except ValidationError as e:
        raise click.UsageError(str(e)) from None
    if kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(kubeconfig)  # kopf's login reads it too
    from kvtune_operator.handlers import run as run_operator

    run_operator(settings, kubeconfig=kubeconfig)
