"""native.NativeKernel: a kernel built once is imported as is by every later process, whatever venv or
checkout it runs from (torch's loader re-ran ninja under a lock, and rebuilt when the compile command
named another venv's include path: on CI an engine waited >120 s behind such a rebuild to start)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOURCE = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    int twice(int x) { return 2 * x; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
""")

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kvtune_engine.native import NativeKernel
    mod = NativeKernel(Path(sys.argv[1]), "test kernel").load()
    print(json.dumps({"twice": mod.twice(21), "file": mod.__file__,
                      "loader_imported": "torch.utils.cpp_extension" in sys.modules}))
""")


def _load_in_new_process(src: Path, ext: Path) -> dict:
    env = {**os.environ, "KVTUNE_EXT_DIR": str(ext)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(src)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_finished_build_is_imported_without_the_loader_even_if_the_build_command_changed(tmp_path):
    src, ext = tmp_path / "twice.cpp", tmp_path / "ext"
    src.write_text(SOURCE)
    first = _load_in_new_process(src, ext)
    assert first["twice"] == 42 and first["loader_imported"]
    build = Path(first["file"]).parent
    assert (build / "built").read_text() == Path(first["file"]).name
    # another checkout's venv writes another compile command; its engine must not rebuild (nor wait)
    ninja = build / "build.ninja"
    ninja.write_text(ninja.read_text().replace("-O3", "-O2"))
    so_mtime = Path(first["file"]).stat().st_mtime_ns
    second = _load_in_new_process(src, ext)
    assert second == {**first, "loader_imported": False}
    assert Path(first["file"]).stat().st_mtime_ns == so_mtime


def test_a_build_killed_before_it_finished_is_built_again(tmp_path):
    src, ext = tmp_path / "twice.cpp", tmp_path / "ext"
    src.write_text(SOURCE)
    first = _load_in_new_process(src, ext)
    build = Path(first["file"]).parent
    (build / "built").unlink()  # what a process killed mid-build leaves: the folder without its marker
    Path(first["file"]).write_bytes(b"half a library")
    again = _load_in_new_process(src, ext)
    assert again["twice"] == 42 and again["loader_imported"] and (build / "built").exists()
