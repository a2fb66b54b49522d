"""Build and load the engine's C++ kernels (attention/cpu_paged.cpp, model/cpu_fused.cpp) on first use.

Why compiled here, not shipped: the kernels are built with the machine's compiler for its own CPU
(`-O3 -march=native`), by torch's C++ extension loader, into `$KVTUNE_EXT_DIR` (default
`~/.cache/kvtune/ext`) under a folder keyed by the source, the CPU's flags, torch's version and
Python's ABI, so a cache shared by two kinds of CPU or two torch builds never mixes them. `make setup`
builds them, so no engine pays the compile (30-60 s) at its first step. A folder whose build finished
(its `built` file names the library) is imported directly: torch's loader would re-run ninja under a
lock, and rebuild whenever the compile command differs (another checkout's venv puts another include
path in it), so two checkouts sharing the cache made each other's engines wait minutes to start.
Without a compiler or ninja a kernel is unavailable, the reason is logged once, and its PyTorch path runs.

Invariant owned here: `NativeKernel.load()` returns the module or None and never raises.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
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
        abi = f"{torch.__version__} {sys.implementation.cache_tag}".encode()
        return hashlib.sha256(_cpu_flags() + data + abi).hexdigest()[:12]

    def _import_built(self, name: str, build: Path):
        """The module a finished build left in ``build`` (None if there is none): no ninja, no lock."""
        marker = build / "built"
        lib = build / marker.read_text().strip() if marker.exists() else None
        if lib is None or not lib.exists():
            return None
        spec = importlib.util.spec_from_file_location(name, lib)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def _build(self):
        key, stem = self.key(), self.source.stem
        name, build = f"kvtune_{stem}_{key}", ext_dir() / f"{stem}_{key}"
        mod = self._import_built(name, build)
        if mod is not None:
            return mod
        build.mkdir(parents=True, exist_ok=True)
        with open(build / ".kvtune.lock", "w") as lock:  # released by the kernel if this process dies
            fcntl.flock(lock, fcntl.LOCK_EX)
            mod = self._import_built(name, build)  # another process finished it while this one waited
            if mod is not None:
                return mod
            from torch.utils.cpp_extension import load  # pulls in setuptools: only when building
            # compile a copy inside the build folder: ninja keys on the source's path, and two checkouts
            # (worktrees, an installed wheel) sharing one cache would otherwise rebuild each other's object
            for f in (self.source, *HEADERS):
                _copy_into(f, build)
            # no marker: whatever library is here may be the half a killed link wrote, newer than its inputs
            (build / f"{name}.so").unlink(missing_ok=True)
            mod = load(name=name, sources=[str(build / self.source.name)], build_directory=str(build),
                       extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
            (build / ".built.tmp").write_text(Path(mod.__file__).name)
            os.replace(build / ".built.tmp", build / "built")  # last: a build killed half-way leaves none
            return mod

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
