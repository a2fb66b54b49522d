"""A test server whose port another process took between its choice and the server's bind starts
again on a new port (tests/vllm/server.py ``LoggedServer``): the vLLM fixture of two test workers
once failed with "Address already in use" (issue 18)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tests.vllm.server import LoggedServer

# a /health server on argv[1]'s port, as vLLM says it when the port is taken
SERVE = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
try:
    srv = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
except OSError as e:
    print(f"OSError: {e}", flush=True); sys.exit(1)
srv.serve_forever()
"""


class HealthServer(LoggedServer):
    what = "health server"

    def __init__(self, run_dir: Path, port: int, movable: bool = True):
        self.run_dir, self.movable, self.env = run_dir, movable, {}
        self.use_port(port, force=True)

    def use_port(self, port: int, force: bool = False) -> bool:
        if not (self.movable or force):
            return False
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-c", SERVE, str(port)]
        self.log_path = self.run_dir / f"health-{port}.log"
        return True


@pytest.fixture
def taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_is_replaced_by_a_free_one(tmp_path, taken):
    srv = HealthServer(tmp_path, taken).start(timeout_s=30)
    try:
        assert srv.port != taken and srv.proc.poll() is None
        assert "Address already in use" in (tmp_path / f"health-{taken}.log").read_text()
    finally:
        srv.stop()


def test_a_server_that_cannot_move_says_why_it_exited(tmp_path, taken):
    with pytest.raises(RuntimeError, match="Address already in use"):
        HealthServer(tmp_path, taken, movable=False).start(timeout_s=30)
