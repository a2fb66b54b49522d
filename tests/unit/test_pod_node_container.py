"""The kubelet rules the test harness' pod node follows (tests/controlplane/container.py): its
restart back-off, the back-off in the kubelet's words, and the termination message taken from the
log. The pod node's behaviour on a real apiserver is tests/integration/test_pod_node_status.py."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.controlplane.container import (  # noqa: E402
    KUBELET_BACKOFF, BackOff, go_duration, termination_message,
)


def test_back_off_doubles_to_its_cap_and_starts_over_after_a_quiet_spell():
    b = BackOff(*KUBELET_BACKOFF)
    assert not b.in_backoff_since(0, 0)  # the first exit: restarted at once
    b.next(0)
    waits = []
    t = 0.0
    for _ in range(7):  # each run exits at once; the next start waits out the back-off
        t += 1
        assert b.in_backoff_since(t, t + b.current - 0.1) and not b.in_backoff_since(t, t + b.current)
        t += b.current
        waits.append(b.current)
        b.next(t)
    assert waits == [10, 20, 40, 80, 160, 300, 300]
    b.next(t + 601)  # more than twice the cap after the last exit: back to the start
    assert b.current == 10


def test_back_off_in_the_kubelets_words():
    assert [go_duration(s) for s in (1, 10, 20, 80, 160, 300, 0.5)] == \
        ["1s", "10s", "20s", "1m20s", "2m40s", "5m0s", "500ms"]


def test_termination_message_is_the_tail_of_this_run_on_error_only(tmp_path):
    log = tmp_path / "c.log"
    log.write_bytes(b"earlier run\n")
    offset = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"".join(b"%03d\n" % i for i in range(100)) + b"fatal: no room\n")
    msg = termination_message(log, offset, 1, "FallbackToLogsOnError")
    assert msg.splitlines() == [f"{i:03d}" for i in range(21, 100)] + ["fatal: no room"]  # the last 80 lines
    assert termination_message(log, offset, 0, "FallbackToLogsOnError") == ""  # exit 0: no message
    assert termination_message(log, offset, 1, "File") == ""  # the file itself is not simulated
    with open(log, "ab") as f:
        f.write(b"x" * 5000 + b"\n")
    assert termination_message(log, offset, 1, "FallbackToLogsOnError") == "x" * 2047 + "\n"  # at most 2048 bytes
