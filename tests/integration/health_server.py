"""A stand-in for an engine container, run by the pod node: answers ``GET /health`` on
``$KVTUNE_PORT`` with 200, or with 503 while the file given as the first argument does not exist
(a pod that is up but not ready yet); every other path is 404. For tests that need pods to become
Ready (a kubelet only says so when the container answers its probe) without loading an engine."""
import http.server
import os
import sys

GATE = sys.argv[1] if len(sys.argv) > 1 else None


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path != "/health":
            code = 404
        else:
            code = 503 if GATE and not os.path.exists(GATE) else 200
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["KVTUNE_PORT"])), Handler).serve_forever()
