"""A real loopback HTTP server for tests that stand in for an engine's endpoints (GET only)."""
from __future__ import annotations

import threading
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
