"""A real loopback HTTP server for tests that stand in for an engine's endpoints (GET only)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serving(answer: Callable[[str], tuple[bytes, str] | None]) -> Iterator[str]:
    """Yields the server's base URL; each GET gets ``answer(path)`` (the path without its query):
    (body, content type) with 200, or None for 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            got = answer(self.path.split("?")[0])
            if got is None:
                self.send_response(404)
                self.end_headers()
                return
            body, ctype = got
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


@contextmanager
def handling(handle: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[tuple[str, list[dict]]]:
    """A loopback server whose every GET and PATCH is answered by ``handle(request handler)`` (status,
    headers, body: all its own, so it can drip, flood or fail); yields (base URL, the requests it
    got: method, path, headers, body)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                         "body": self.rfile.read(n) if n else b""})
            try:
                handle(self)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_PATCH = _any  # noqa: N815

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def dripping(body: bytes, every_s: float, content_type: str = "application/json") -> Callable[[BaseHTTPRequestHandler], None]:
    """A ``handling`` answer that announces ``body`` whole, then sends it a byte every ``every_s``
    (for at most 100 bytes): a server that pins a reader without a total deadline."""
    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        for i in range(min(100, len(body))):
            h.wfile.write(body[i:i + 1])
            h.wfile.flush()
            time.sleep(every_s)
    return handle
