"""Tests with a real vLLM: the repo root on sys.path (``tests.vllm.server``), and the real-vLLM tests
marked ``vllm``. No ``__init__.py`` here on purpose: pytest would import this folder as a package
named ``vllm`` and shadow the real one."""
from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
