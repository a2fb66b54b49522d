"""Build and load the engine's C++ kernels (attention/cpu_paged.cpp, model/cpu_fused.cpp) on first use.

Why compiled here, not shipped: the kernels are built with the machine's compiler for its own CPU
(`-O3 -march=native`), by torch's C++ extension loader, into `$KVTUNE_EXT_DIR` (default
`~/.cache/kvtune/ext`) under a folder keyed by the source, the CPU's flags and torch's version, so a
cache shared by two kinds of CPU or two torch builds never mixes them. `make setup` builds them, so
no engine pays the compile (30-60 s) at its first step. Without a compiler or ninja a kernel is
unavailable, the reason is logged once, and its PyTorch path runs.

Invariant owned here: `NativeKernel.load()` returns the module or None and never raises.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("kvtune.native")

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
#: headers every kernel may include (next to this file), copied beside each source it builds
HEADERS = (Path(__file__).with_name("vec_math.h"),)


def _cpu_flags() -> bytes:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags")).encode()
    except (OSError, StopIteration):
        return b""


def ext_dir() -> Path:
    """Where built kernels are kept: ``$KVTUNE_EXT_DIR``, default ``~/.cache/kvtune/ext``."""
    return Path(os.environ.get("KVTUNE_EXT_DIR") or Path.home() / ".cache" / "kvtune" / "ext")


def _copy_into(f: Path, build: Path) -> None:
    """``f`` into ``build`` unless an identical copy is there (atomically: two processes may build)."""
    dst, data = build / f.name, f.read_bytes()
    if not dst.exists() or dst.read_bytes() != data:
        tmp = build / f".{f.name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, dst)


class NativeKernel:
    """One C++ source file built into one extension module, once per process."""

    def __init__(self, source: Path, what: str):
        self.source = Path(source)
        self.what = what  # for the log line: "CPU paged-attention kernel"
        self._lock = threading.Lock()
        self._mod = None
        self.failed: str | None = None

    def key(self) -> str:
        data = self.source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
        return hashlib.sha256(_cpu_flags() + data + torch.__version__.encode()).hexdigest()[:12]

    def _build(self):
        from torch.utils.cpp_extension import load  # the loader pulls in setuptools: only when building
        key, stem = self.key(), self.source.stem
        build = ext_dir() / f"{stem}_{key}"
        build.mkdir(parents=True, exist_ok=True)
        # compile a copy inside the build folder: ninja keys on the source's path, and two checkouts
        # (worktrees, an installed wheel) sharing one cache would otherwise rebuild each other's object
        for f in (self.source, *HEADERS):
            _copy_into(f, build)
        src = build / self.source.name
        return load(name=f"kvtune_{stem}_{key}", sources=[str(src)], build_directory=str(build),
                    extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)

    def load(self):
        """The compiled module, or None (the reason is logged once and kept in ``failed``)."""
        if self._mod is not None or self.failed is not None:
            return self._mod
        with self._lock:
            if self._mod is None and self.failed is None:
                try:
                    self._mod = self._build()
                except Exception as e:  # no compiler, no ninja, a broken toolchain: the PyTorch path runs
                    self.failed = f"{type(e).__name__}: {e}"
                    log.warning("%s unavailable, using the PyTorch path: %s", self.what, self.failed)
        return self._mod
