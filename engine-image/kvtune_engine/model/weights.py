"""Read a checkpoint's tensors from local safetensors files (single file or sharded with an index).

Every failure names the file, and the tensor where one is at fault: a missing shard, a tensor the
index promises but the shard lacks, a shape that disagrees with config.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import ModelLoadError

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """name -> file map of a model directory; tensors are read one at a time (no full copy in memory)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX
        self.where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index}: not a valid safetensors index ({e!r})") from None
            for name, fname in weight_map.items():
                path = self.dir / fname
                if not path.is_file():
                    raise ModelLoadError(f"{path} is missing: {INDEX} lists it for tensor {name!r}")
                self.where[name] = path
            self._check_shards_hold_what_index_says()
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{self.dir}: no *.safetensors weights (and no {INDEX})")
            for path in files:
                for name in self._keys(path):
                    if name in self.where:
                        raise ModelLoadError(f"tensor {name!r} is in both {self.where[name]} and {path}")
                    self.where[name] = path

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None

    def _check_shards_hold_what_index_says(self) -> None:
        by_file: dict[Path, set[str]] = {}
        for name, path in self.where.items():
            by_file.setdefault(path, set()).add(name)
        for path, names in by_file.items():
            missing = names - set(self._keys(path))
            if missing:
                raise ModelLoadError(f"{path} lacks tensor {sorted(missing)[0]!r} that {INDEX} places in it "
                                     f"({len(missing)} missing)")

    def close(self) -> None:
        self._open.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> Iterator[str]:
        return iter(self.where)

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(f"{self.dir}: tensor {name!r} is missing from the checkpoint "
                                 f"(files: {sorted({p.name for p in self.where.values()})})")
        path = self.where[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        t = self._open[path].get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies "
                                 f"{tuple(shape)}")
        return t if dtype is None else t.to(dtype)
