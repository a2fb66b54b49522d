"""Watch a YAML config file (a mounted ConfigMap in a pod) and apply its live knobs.

Kubernetes updates a mounted ConfigMap by swapping a symlink (``..data`` -> a new timestamped
directory), which inotify on the file path does not see reliably; so the watcher *polls*: it
re-reads the file every ``interval_s`` and acts when the content's hash changes.

The file holds EngineConfig fields with underscores (``max_num_seqs: 128``); dashed names are
accepted too. Live knobs that differ from the running config are applied like a PATCH of
``/kvtune/v1/config``; restart-only knobs that differ, and live raises past the start-up
activation profile (``LLMEngine.beyond_profile``), are logged and reported in
the file's status (``view``, ``pending_restart``: they take effect when the pod restarts); unknown
keys are reported.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from ..config import LIVE_KNOBS, RESTART_KNOBS, ConfigError, EngineConfig

log = logging.getLogger("kvtune.config")

KNOWN = set(EngineConfig.model_fields)


class ConfigFileError(ValueError):
    pass


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's knobs, keys normalised to underscores. Raises ConfigFileError with the reason."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"config file {p} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {p} must hold a mapping of knob: value, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def split_known(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    known = {k: v for k, v in values.items() if k in KNOWN}
    return known, sorted(k for k in values if k not in KNOWN)


class ConfigFileWatcher:
    def __init__(self, path: str | Path, interval_s: float = 1.0):
        self.path = Path(path)
        self.interval_s = interval_s
        self._digest: bytes | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._aeng = None
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {"path": str(self.path), "last_check_unix_s": None,
                                        "last_change_unix_s": None, "applied": {}, "pending_restart": {},
                                        "unknown_keys": [], "error": None, "checks": 0}

    def prime(self, content_digest: bytes | None) -> None:
        """Mark the content already used at start-up, so it is not re-applied."""
        self._digest = content_digest

    @staticmethod
    def digest(path: str | Path) -> bytes | None:
        try:
            return hashlib.sha256(Path(path).read_bytes()).digest()
        except OSError:
            return None

    def _copy(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in self._status.items()}

    def start(self, async_engine: Any) -> None:
        self._aeng = async_engine
        self._thread = threading.Thread(target=self._run, name="kvtune-config-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watcher never dies
                log.exception("config file check failed")

    def check(self) -> bool:
        """Re-read the file; apply it if its content changed. Returns True when something was applied."""
        d = self.digest(self.path)
        with self._lock:
            self._status["checks"] += 1
            self._status["last_check_unix_s"] = time.time()
        if d is None:
            with self._lock:
                if self._status["error"] is None or "cannot read" not in str(self._status["error"]):
                    log.warning("config file %s is not readable (kept the running config)", self.path)
                self._status["error"] = f"cannot read config file {self.path}"
            return False
        if d == self._digest:
            return False
        self._digest = d
        try:
            values = read_config_file(self.path)
        except ConfigFileError as e:
            log.error("%s (kept the running config)", e)
            with self._lock:
                self._status["error"] = str(e)
            return False
        return self.apply(values)

    def apply(self, values: dict[str, Any]) -> bool:
        known, unknown = split_known(values)
        if unknown:
            log.warning("config file %s: unknown keys %s ignored", self.path, unknown)

        def on_engine(eng: Any):
            # the knobs and the file's status change under one lock, which `view` holds too: a reader
            # never sees the new knobs without the restart knobs the same file left pending
            with self._lock:
                changed, pending = _apply_on_engine(eng, known)
                self._record(changed, pending, unknown, None)
            return changed, pending

        fut = self._aeng.call_future(on_engine)
        try:
            changed, pending = fut.result(timeout=60)
        except Exception as e:  # noqa: BLE001 - nothing was applied: the engine refused or never answered
            changed, pending = {}, {}
            error = str(e) if isinstance(e, ConfigError) else f"could not apply: {e}"
            log.error("config file %s: %s (kept the running config)", self.path, error)
            with self._lock:
                self._record({}, {}, unknown, error)
        for k, (run, want) in pending.items():
            log.warning("config file %s: %s %r -> %r needs a restart; not applied (running %r)",
                        self.path, k, run, want, run)
        if changed:
            log.info("config file %s applied: %s", self.path,
                     ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        return bool(changed)

    def _record(self, changed: dict, pending: dict, unknown: list[str], error: str | None) -> None:
        """The outcome of one apply, under ``_lock``."""
        self._status.update(last_change_unix_s=time.time(), applied=changed,
                            pending_restart={k: {"running": a, "file": b} for k, (a, b) in pending.items()},
                            unknown_keys=unknown, error=error)

    def view(self, config: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(``config()``, the file's status) read at one instant: no apply in between."""
        with self._lock:
            return config(), self._copy()


def _apply_on_engine(eng: Any, known: dict[str, Any]):
    """On the engine thread: apply the live knobs; return (changed, pending restart knobs)."""
    cur: EngineConfig = eng.config
    # validate the file as a whole config first, so one bad value rejects the file, not half of it
    full = cur.with_changes(**known)
    pending = {k: (getattr(cur, k), getattr(full, k)) for k in known
               if k in RESTART_KNOBS and getattr(cur, k) != getattr(full, k)}
    # a live raise past the start-up activation profile waits for a restart too (it profiles again)
    over = eng.beyond_profile(full) if hasattr(eng, "beyond_profile") else {}
    pending.update({k: (getattr(cur, k), getattr(full, k)) for k in over})
    live = {k: v for k, v in known.items() if k in LIVE_KNOBS and k not in over}
    changed = eng.update_config(live) if live else {}
    return changed, pending
