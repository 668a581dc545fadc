"""`specdec analyze --html` (specdec/report.py): the page's data is analyze's, on synthetic traces whose answer is
known; the page is self-contained; a real browser renders it without a console error (skipped where no Chromium is
installed: CI installs one)."""
import json
import re
import shutil
import subprocess

import pytest
from test_policy_analyze import CASES, synthetic

from specdec.analyze import analyze
from specdec.cli import main
from specdec.report import report_data
from specdec.trace import read_trace, write_jsonl

CURVE = {"1": 60.0, "2": 61.0, "4": 64.0, "8": 90.0}  # the pass curve a server priced with (a trace's meta)


def page_data(path) -> dict:
    text = path.read_text()
    return json.loads(re.search(r'<script type="application/json" id="specdec-report">(.*?)</script>', text,
                                re.S).group(1).replace("<\\/", "</"))


@pytest.mark.parametrize("cause", ["draft_cost", "low_acceptance", "overhead", "none"])
def test_the_pages_data_is_analyzes(tmp_path, cause):
    path = tmp_path / f"{cause}.jsonl"
    write_jsonl(synthetic(**CASES[cause]), path, meta={"verify_curve": CURVE})
    records, meta = read_trace(path)
    rep = analyze(records, target_curve={int(k): v for k, v in CURVE.items()})
    data = report_data({str(path): (records, meta)})
    assert data["verdict"]["bottleneck"] == rep["bottleneck"] == cause
    assert (data["verdict"]["measured"], data["verdict"]["predicted"]) == (rep["speedup"]["measured"],
                                                                            rep["speedup"]["predicted"])
    assert data["acceptance_by_position"] == rep["acceptance_by_position"]
    fixed = {b["speedup"] for b in data["counterfactuals"]}
    assert {f["speedup_if_fixed"] for f in rep["findings"] if f["speedup_if_fixed"] is not None} <= fixed
    assert {"measured", "cost model", "no draft"} <= {b["what"] for b in data["counterfactuals"]}
    assert data["curve"]["priced"] == CURVE and data["curve"]["measured"] == rep["costs"]["verify_ms_by_tokens"]
    assert data["curve"]["operating_rows"] == round(1 + rep["summary"]["mean_proposed"], 3)
    (lane,) = data["lanes"]  # one request: its decode cycles end to end, each split as the trace says
    decode = records[1:]
    assert len(lane["cycles"]) == len(decode)
    last = lane["cycles"][-1]
    assert abs(last["start_ms"] - sum(r.cycle_ms for r in decode[:-1])) < 1e-6
    assert [c["accepted"] for c in lane["cycles"]] == [r.accepted for r in decode]
    assert [c["rows"] for c in lane["cycles"]] == [len(r.proposed) + 1 for r in decode]
    out = tmp_path / "report.html"
    assert main(["analyze", str(path), "--html", str(out)]) == 0
    assert page_data(out) == json.loads(json.dumps(data))
    assert "<script src=" not in out.read_text()  # nothing fetched when it opens: Plotly is inlined


def test_two_traces_side_by_side_and_clear_errors(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(synthetic(**CASES["none"]), a)
    write_jsonl(synthetic(**CASES["draft_cost"]), b)
    out = tmp_path / "cmp.html"
    assert main(["analyze", "--compare", str(a), str(b), "--html", str(out)]) == 0
    both = page_data(out)
    assert [both[str(p)]["verdict"]["bottleneck"] for p in (a, b)] == ["none", "draft_cost"]
    capsys.readouterr()
    assert main(["analyze", "--compare", str(a), str(b), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {str(a), str(b)}
    assert main(["analyze", str(a), "--compare", str(a), str(b)]) == 2
    assert main(["analyze"]) == 2
    assert main(["analyze", str(a), "--html", str(tmp_path / "no" / "r.html")]) == 2  # an unwritable page
    err = capsys.readouterr().err
    assert err.count("specdec: error:") == 3 and "Traceback" not in err


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (CI installs one)")
def test_the_page_renders_in_a_browser_without_console_errors(tmp_path):
    path, out = tmp_path / "t.jsonl", tmp_path / "r.html"
    write_jsonl(synthetic(**CASES["draft_cost"]), path, meta={"verify_curve": CURVE})
    assert main(["analyze", str(path), "--html", str(out)]) == 0
    run = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", "--virtual-time-budget=5000", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in run.stderr.splitlines() if "CONSOLE" in line and ("Error" in line or "error" in line)]
    assert not errors, errors
    assert run.stdout.count('class="main-svg"') >= 5  # every figure drew its plot
