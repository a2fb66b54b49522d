"""The engine loop on one background thread, handing requests and outputs to asyncio.

HTTP handlers (asyncio) -> a thread-safe command queue -> the engine thread (add, abort, config
calls, then one ``engine.step()``) -> outputs delivered to each request's ``asyncio.Queue`` with
one ``call_soon_threadsafe`` per step. Every mutation of the engine happens on the engine thread;
scrapes and the admin API read under ``engine.lock``.

Invariant owned here: an error in one command (add, abort, call) fails that command alone; an
error in ``engine.step()`` itself cannot be pinned on one request, so the loop stops, every stream
gets the error, and ``on_fatal`` is called (the server exits non-zero and Kubernetes restarts the
pod) instead of answering 503 forever.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.request import SamplingParams
from ..engine import InvalidRequest, LLMEngine
from ..outputs import RequestOutput

log = logging.getLogger("kvtune.server")

_IDLE_WAIT_S = 0.5


class RequestStream:
    """Outputs of one request, in order; the last one has ``finished`` set (or an exception)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_fatal = on_fatal
        self.max_waiting = max_waiting
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self.error: BaseException | None = None
        self.steps = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvtune-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ handler side (asyncio)
    def num_waiting(self) -> int:
        """Waiting requests, counting those handed over but not yet taken by the engine thread."""
        return self.engine.num_waiting + self._pending_adds

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               cache_salt: str | None = None) -> RequestStream:
        """Queue a request already checked by ``engine.inputs.process``; returns its output stream."""
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", field="request_id")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        with self._pending_lock:
            self._pending_adds += 1
        # the request's clock starts now, not when the engine thread next takes it in: queue time and
        # TTFT include the wait for the step in flight, as a client sees them
        self._cmds.put(("add", (prompt_ids, params, request_id, self.engine.clock(), cache_salt)))
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine thread frees the request's blocks at its next turn."""
        self._streams.pop(request_id, None)
        self._cmds.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (between steps) and return its result."""
        return await asyncio.wrap_future(self.call_future(fn))

    def call_future(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine loop is not running"))
            return fut
        self._cmds.put(("call", (fn, fut)))
        return fut

    def _deliver(self, outs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        for out in outs:
            if isinstance(out, tuple):
                rid, exc = out
                st = self._streams.pop(rid, None)
                if st is not None:
                    st.queue.put_nowait(exc)
                continue
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            st.queue.put_nowait(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, st in list(self._streams.items()):
            st.queue.put_nowait(exc)
        self._streams.clear()

    # ------------------------------------------------------------------ engine thread
    def _post(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _handle(self, kind: str, payload: Any, posts: list) -> None:
        eng = self.engine
        if kind == "add":
            prompt_ids, params, rid, arrival_s, salt = payload
            with self._pending_lock:
                self._pending_adds -= 1
            try:
                eng.add_request(prompt_ids, params, request_id=rid, arrival_s=arrival_s, cache_salt=salt,
                                checked=True)
            except InvalidRequest as e:
                posts.append((rid, e))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.exception("adding request %s failed", rid)
                eng.abort(rid)
                posts.append((rid, RuntimeError(f"internal error while queueing this request: {e}")))
        elif kind == "abort":
            try:
                eng.abort(payload)
            except Exception:  # noqa: BLE001
                log.exception("aborting request %s failed", payload)
        elif kind == "call":
            fn, fut = payload
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(eng))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                posts: list = []
                if not eng.has_unfinished():
                    try:
                        kind, payload = self._cmds.get(timeout=_IDLE_WAIT_S)
                    except queue.Empty:
                        continue
                    self._handle(kind, payload, posts)
                while True:
                    try:
                        kind, payload = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(kind, payload, posts)
                if eng.has_unfinished():
                    outs = eng.step()
                    self.steps += 1
                    posts.extend(outs)
                    if eng.last_step_empty and not outs:
                        time.sleep(0.001)  # nothing schedulable this instant (e.g. swap pool busy)
                self._post(posts)
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            log.exception("engine loop failed")
            self.error = e
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(self._fail_all, RuntimeError(f"engine loop failed: {e}"))
                except RuntimeError:
                    pass
            # answer pending calls so no handler waits forever
            while True:
                try:
                    kind, payload = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if kind == "call":
                    payload[1].set_exception(RuntimeError(f"engine loop failed: {e}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
