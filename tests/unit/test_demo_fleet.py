"""`kvtune demo --fleet 3` as a user runs it: three simulated GPU engines (A100 and H200 profiles),
each mis-tuned its own way, tuned side by side. Time (~45 s, more on a busy machine): the engines
start in a second (no model), then each needs a window before its change and one after it for the
verdict (15 s each), and the lowmem engine a restart; the three run at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

# Not `wallclock`: twice in two fresh-clone runs the demo was still alive 60 s after its Ctrl-C (the
# engines had been stopped); the cause is not found yet (open in issue 18): the test now dumps its threads.
pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not yet reaped
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.alone
def test_fleet_demo_tunes_each_engine_in_the_knob_its_symptom_names(tmp_path):
    out = tmp_path / "fleet"
    res = subprocess.run([sys.executable, "-c", "from kvtune_operator.cli import main; main()", "demo",
                          "--fleet", "3", "--window", "15", "--out", str(out)], capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "fleet.json").read_text())
    rows = {r["name"]: r for r in data["engines"]}
    assert sorted(rows) == ["1-a100-seqcap", "2-a100-lowmem", "3-h200-seqcap"] and not data["errors"]
    for name in rows:
        assert name in res.stdout                                   # the table names every engine
    for r in rows.values():
        knob = r["knob"]
        assert r["final"][knob] > r["start"][knob], r               # moved the knob its symptom names
        assert r["goodput_after"] > r["goodput_before"], r          # and it served more within the objective
        kinds = [d["kind"] for d in r["decisions"]]
        assert kinds[:2] == ["Apply", "Keep"] and "RollBack" not in kinds, r
    assert rows["2-a100-lowmem"]["restarts"] == 1                   # memory: a restart, the caps live
    assert rows["1-a100-seqcap"]["restarts"] == rows["3-h200-seqcap"]["restarts"] == 0
    assert (out / "fleet.png").stat().st_size > 10_000
    pids = [p for r in rows.values() for p in r["engine_pids"]]
    assert len(pids) == 4 and not [p for p in pids if _alive(p)]  # four engines ran (one restarted); none is left


def test_fleet_size_outside_its_range_is_refused_with_the_range(tmp_path):
    res = subprocess.run([sys.executable, "-c", "from kvtune_operator.cli import main; main()", "demo",
                          "--fleet", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "1 to 32" in res.stderr, res.stderr


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(") ", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_ctrl_c_leaves_no_engine_behind(tmp_path):
    """Ctrl-C while the engines serve: the demo exits and every engine it started is gone (each runs
    in a session of its own, so the terminal's SIGINT never reaches them: the demo must stop them)."""
    # -X faulthandler: if it outlives its Ctrl-C, SIGABRT makes it print every thread's stack (the failure
    # says where it hangs). SIGINT as in a terminal: a process inherits an ignored SIGINT from a shell that
    # ran its parent in the background (`(make test &)`, a CI runner's), and Python then keeps ignoring it,
    # as it should, so the demo ran on past this test's Ctrl-C (fresh-clone runs started that way failed
    # here). The child takes Python's own Ctrl-C handler first, as a foreground process has it.
    script = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "from kvtune_operator.cli import main; main()")
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", script,
                             "demo", "--fleet", "2", "--window", "30", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # both engines up and under load: each says "start: <symptom>"
            seen.append(line)
            if sum("start:" in x for x in seen) == 2:
                break
        engines = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            rest = proc.communicate(timeout=30)[0]
            pytest.fail(f"the demo was alive 60 s after its Ctrl-C; its output since, and its threads:\n{rest[-12000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sum("start:" in x for x in seen) == 2, "".join(seen)
    assert len(engines) == 2 and not [p for p in engines if _alive(p)], engines
