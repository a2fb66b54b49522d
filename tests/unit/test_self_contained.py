"""A user's clone holds the repository alone: no code, test, script or benchmark reads a path outside
the checkout (a sibling folder, an absolute path of a development machine). The data a test needs
lives in the repository (e.g. tests/vllm/reference/, captured by tests/vllm/capture_metrics.py)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: what reaches outside: an absolute path of a development machine, a parent of the checkout
OUTSIDE = re.compile(r"/work/|\.\./shared|parents\[(\d+)\]")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.splitlines() if p.endswith((".py", ".sh", ".j2", ".yaml", ".toml")) or
            p in ("Makefile", ".ci/run")]


def test_nothing_reads_outside_the_checkout():
    found = []
    for path in tracked():
        if path == Path(__file__) or not path.is_file():
            continue
        depth = len(path.relative_to(REPO).parts) - 1  # parents[depth] is the repo root
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in OUTSIDE.finditer(line):
                if m.group(1) is not None and int(m.group(1)) <= depth:
                    continue  # inside the checkout
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "reads outside the checkout:\n" + "\n".join(found)
