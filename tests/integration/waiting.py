"""Polling until a condition holds, for tests against the real (eventually consistent) cluster."""
from __future__ import annotations

import time


def eventually(fn, timeout: float = 60, interval: float = 0.25, what: str = "condition"):
    """fn()'s first truthy result; exceptions count as 'not yet'. Fails with the last result at the deadline."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
