"""``python -m tests.controlplane up|down|env|status|node`` - the test cluster for humans.

  up     start the control plane (and Prometheus) in the background, print how to use it;
         ``--foreground`` also runs the pod node and tears everything down on Ctrl-C
  node   run the pod node (engine pods -> local processes) in the foreground against ``up``'s cluster
  env    print ``export`` lines (KUBECONFIG, PATH with kubectl/helm, PROMETHEUS_URL, ...):
         ``eval "$(python -m tests.controlplane env)"``
  status show what runs
  down   stop everything ``up`` started

Run from the repository root with the project's venv (``.venv/bin/python -m tests.controlplane up``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
from pathlib import Path

from .harness import RUN_ROOT, ControlPlane, _group_alive, stop_detached
from .node import PodNode
from .prometheus import Prometheus

CLI_DIR = RUN_ROOT / "cli"
CP_DIR = CLI_DIR / "controlplane"
PROM_DIR = CLI_DIR / "prometheus"
NODE_DIR = CLI_DIR / "pod-node"


def _state(d: Path) -> dict | None:
    try:
        return json.loads((d / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _env_lines() -> list[str]:
    cp, prom = _state(CP_DIR), _state(PROM_DIR)
    if cp is None:
        raise SystemExit("no cluster is up (python -m tests.controlplane up)")
    lines = [f"export {k}={shlex.quote(v)}" for k, v in cp["env"].items()]
    if prom:
        lines.append(f"export PROMETHEUS_URL={shlex.quote(prom['url'])}")
        lines.append(f"export KVTUNE_PROMETHEUS_SD_FILE={shlex.quote(prom['sd_file'])}")
    return lines


def cmd_up(args: argparse.Namespace) -> int:
    if _state(CP_DIR):
        print("a cluster is already up; `python -m tests.controlplane down` first", file=sys.stderr)
        return 1
    detached = not args.foreground
    cp = ControlPlane(CP_DIR, gpu_nodes=args.nodes, detached=detached, keep_run_dir=True)
    cp.start()
    print(f"control plane ready in {cp.started_in:.1f}s: {cp.server}, nodes {', '.join(cp.nodes)}", file=sys.stderr)
    prom = None
    if not args.no_prometheus:
        prom = Prometheus(PROM_DIR, detached=detached, keep_run_dir=True).start()
        print(f"prometheus ready in {prom.started_in:.1f}s: {prom.url}", file=sys.stderr)
    print("\n".join(_env_lines()))
    if detached:
        print("# logs in " + str(CLI_DIR) + "; stop with: python -m tests.controlplane down", file=sys.stderr)
        return 0
    node = PodNode(cp.kubeconfig, NODE_DIR, sd_file=prom.sd_file if prom else None).start()
    print("pod node running; Ctrl-C stops everything", file=sys.stderr)
    _wait_for_signal()
    node.stop()
    if prom:
        prom.stop(remove=True)
    cp.stop(remove=True)
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    cp, prom = _state(CP_DIR), _state(PROM_DIR)
    if cp is None:
        raise SystemExit("no cluster is up (python -m tests.controlplane up)")
    node = PodNode(cp["kubeconfig"], NODE_DIR, sd_file=prom["sd_file"] if prom else None).start()
    print(f"pod node running (logs in {NODE_DIR}); Ctrl-C stops it", file=sys.stderr)
    _wait_for_signal()
    node.stop()
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    print("\n".join(_env_lines()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    for d in (CP_DIR, PROM_DIR):
        st = _state(d)
        if st is None:
            print(f"{d.name}: not running")
            continue
        procs = ", ".join(f"{n}({'up' if _group_alive(p) else 'DEAD'})" for n, p in st.get("pgids", {}).items())
        print(f"{d.name}: {st.get('server') or st.get('url')}  {procs}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    for d in (PROM_DIR, CP_DIR):
        if d.exists():
            stopped = stop_detached(d)
            print(f"{d.name}: stopped {', '.join(stopped) or 'nothing'}", file=sys.stderr)
    if NODE_DIR.exists():
        import shutil

        shutil.rmtree(NODE_DIR, ignore_errors=True)
    return 0


def _wait_for_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.controlplane", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster (and Prometheus)")
    up.add_argument("--nodes", type=int, default=3, help="fake GPU nodes (8 GPUs each)")
    up.add_argument("--no-prometheus", action="store_true")
    up.add_argument("--foreground", action="store_true", help="also run the pod node; Ctrl-C tears down")
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop everything").set_defaults(fn=cmd_down)
    sub.add_parser("env", help="print export lines").set_defaults(fn=cmd_env)
    sub.add_parser("status", help="what runs").set_defaults(fn=cmd_status)
    sub.add_parser("node", help="run the pod node in the foreground").set_defaults(fn=cmd_node)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
