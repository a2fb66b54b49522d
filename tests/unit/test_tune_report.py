"""`kvtune tune --report DIR` on a generated scenario trace, through the real CLI: the files a user
opens before changing production exist, name the chosen knobs, and the YAML is an InferenceDeployment."""
from __future__ import annotations

import json

import yaml
from click.testing import CliRunner

from kvtune_operator.cli import main
from kvtune_operator.model import InferenceDeployment


def test_tune_report_on_the_seq_cap_scenario(tmp_path):
    """Time (~15 s on two cores): the search replays the scenario's trace in the simulator once for each
    candidate it weighs, as `kvtune tune` does for a user."""
    runner = CliRunner()
    trace = tmp_path / "seq-cap.jsonl"
    r = runner.invoke(main, ["trace", "gen", "--scenario", "seq-cap", "-o", str(trace)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "report"
    r = runner.invoke(main, ["tune", "--trace", str(trace), "--profile", "a100-llama3-8b", "--max-num-seqs", "64",
                             "--slo-ttft", "2", "--slo-tpot", "0.1", "--json", "--report", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    rec = result["recommended"]
    assert "max-num-seqs" in rec and rec["max-num-seqs"] > 64          # the scenario's fix

    for name in ("report.html", "report.png", "inferencedeployment.yaml", "report.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    page = (out / "report.html").read_text()
    assert f"--max-num-seqs {rec['max-num-seqs']}" in page                # the chosen knob and value
    assert "<code>max-num-seqs</code>: 64 &rarr; <b>" in page
    assert "SequenceCap" in page and "live: no restart needed" in page
    assert "data:image/png;base64," in page                              # the PNG is embedded
    assert "headroom" in page                                            # the margins against the SLO

    doc = yaml.safe_load((out / "inferencedeployment.yaml").read_text())
    infd = InferenceDeployment.model_validate(doc)
    assert infd.kind == "InferenceDeployment"
    assert doc["spec"]["engine"]["maxNumSeqs"] == rec["max-num-seqs"]
    assert infd.spec.engine.max_num_seqs == rec["max-num-seqs"]
    assert doc["spec"]["autotune"]["objectives"] == {"ttftP95": "2s", "tpotP95": "100ms"}

    data = json.loads((out / "report.json").read_text())
    assert data["chosen"]["changes"] == {"max_num_seqs": rec["max-num-seqs"]}
    goodputs = [c["goodput_requests_per_s"] for c in data["candidates"]]
    assert goodputs == sorted(goodputs, reverse=True) and len(goodputs) > 10
    chosen = next(c for c in data["candidates"] if c["changes"] == data["chosen"]["changes"])
    current = next(c for c in data["candidates"] if c["changes"] == {})
    assert chosen["goodput_requests_per_s"] > 3 * current["goodput_requests_per_s"]
    assert any(c["on_front"] for c in data["candidates"])
