#!/usr/bin/env bash
# Build the test control plane from Go modules into tests/controlplane/bin/ (git-ignored):
#   etcd                      go.etcd.io/etcd/server/v3 (version pinned in go.mod)
#   kube-apiserver            k8s.io/kubernetes/cmd/kube-apiserver          v1.36.3
#   kube-controller-manager   k8s.io/kubernetes/cmd/kube-controller-manager v1.36.3
#   kube-scheduler            k8s.io/kubernetes/cmd/kube-scheduler          v1.36.3
#   kwok                      sigs.k8s.io/kwok/cmd/kwok (separate module kwok/go.mod: it needs
#                             newer otel/grpc than kubernetes does) + its stage files in bin/kwok-stages/
#
# Incremental: a binary whose recipe (go.mod, go.sum, this script, the Go version) did not change
# is not rebuilt at all (stamp file bin/.NAME.stamp; ~0.2 s for everything). Otherwise the Go build
# cache makes a rebuild a relink (~40 s for all five). FORCE=1 rebuilds regardless.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="$HERE/bin"
mkdir -p "$BIN"

K8S_VERSION=v1.36.3
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:--buildvcs=false} -trimpath"
# Go runs one compile per core by default; the machines have 2 cores.
LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=36 -X k8s.io/component-base/version.gitTreeState=clean"

log() { printf '[controlplane/build] %s\n' "$*" >&2; }

command -v go >/dev/null || { log "ERROR: go is not on PATH (Go >= 1.26 needed)"; exit 1; }
log "go: $(go version)"

# stamp = hash of the recipe; if it matches and the binary exists, skip the go build call.
recipe_hash() { { cat "$@" "$HERE/build.sh"; go version; } | sha256sum | cut -c1-16; }

build_one() { # moddir name pkg
    local moddir="$1" name="$2" pkg="$3"
    local stamp="$BIN/.$name.stamp" want
    want="$(recipe_hash "$moddir/go.mod" "$moddir/go.sum")"
    if [[ -z "${FORCE:-}" && -x "$BIN/$name" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        log "$name: up to date ($BIN/$name)"
        return
    fi
    log "$name: go build $pkg (module $moddir) ..."
    local t0=$SECONDS
    (cd "$moddir" && go build -ldflags "$LDFLAGS" -o "$BIN/$name.tmp" "$pkg")
    mv -f "$BIN/$name.tmp" "$BIN/$name"
    echo "$want" > "$stamp"
    log "$name: built in $((SECONDS - t0))s"
}

T0=$SECONDS
log "downloading modules (Go module proxy; cached in $(go env GOMODCACHE)) ..."
(cd "$HERE" && go mod download)
(cd "$HERE/kwok" && go mod download)

build_one "$HERE" etcd go.etcd.io/etcd/server/v3
build_one "$HERE" kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build_one "$HERE" kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
build_one "$HERE" kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build_one "$HERE/kwok" kwok sigs.k8s.io/kwok/cmd/kwok

# kwok >= 0.8 has no built-in stages: copy the ones we use from its module source.
KWOK_DIR="$(cd "$HERE/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
mkdir -p "$BIN/kwok-stages"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    cp -f "$KWOK_DIR/kustomize/stage/$f" "$BIN/kwok-stages/$(basename "$f")"
done
chmod -R u+w "$BIN/kwok-stages"
log "kwok stages copied to $BIN/kwok-stages"

log "done in $((SECONDS - T0))s:"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
    printf '  %-26s %s\n' "$b" "$(du -h "$BIN/$b" | cut -f1)" >&2
done
