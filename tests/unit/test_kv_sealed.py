"""The KV layer is sealed: the scheduler and the simulator ask the KV manager (kv/kv_manager.py) for
what they need and never touch the block pool or the manager's tables; kv/ and core/ do not import
each other's packages in a cycle (Request lives in the leaf module kvtune_engine/request.py).

Read from the sources with `ast`, so a new reach-in fails here with the file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "engine-image" / "kvtune_engine"
KV_INTERNALS = {"pool", "tables", "host_tables", "_host_free", "_keys", "_published"}


def sources(*dirs: str):
    for d in dirs:
        yield from sorted((PKG / d).glob("*.py"))


def engine_imports(path: Path) -> set[str]:
    """Top-level kvtune_engine subpackages/modules a file imports (relative imports resolved)."""
    rel = path.relative_to(PKG).with_suffix("").parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-node.level]) + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("kvtune_engine"):
                base = node.module.split(".")[1:]
            else:
                continue
            if base:
                out.add(base[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_scheduler_and_simulator_never_reach_into_the_kv_layer():
    bad = []
    for f in sources("core", "sim"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in KV_INTERNALS:
                bad.append(f"{f.relative_to(PKG)}:{node.lineno}: .{node.attr}")
    assert not bad, "the scheduler/simulator read KV internals instead of asking the KV manager:\n" + "\n".join(bad)


def test_no_import_cycle_between_kv_and_core():
    for f in sources("kv"):
        assert "core" not in engine_imports(f), f"{f.relative_to(PKG)} imports core/"
    assert engine_imports(PKG / "request.py") == set(), "request.py must stay a leaf module"


def test_dead_code_is_gone():
    from kvtune_engine.core.batch import Batch
    from kvtune_engine.kv.block_pool import BlockPool
    assert not hasattr(BlockPool, "register")
    assert "copy" not in Batch.__dataclass_fields__
