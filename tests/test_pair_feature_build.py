"""benchmarks/pair.py's feature draft for the 1.5B is built in two runs of `specdec distill`: FEATURE_RECIPE, then
FEATURE_MORE on from that draft (--init-from); an interrupted build goes on from the run it stopped in."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks" / "suite"))
pair = pytest.importorskip("pair")


def test_the_feature_draft_is_built_in_two_runs_and_each_is_done_once(tmp_path, monkeypatch):
    import specdec.drafters.feature_files as files
    out = tmp_path / "draft"
    calls = []

    def distill(cmd, **kw):  # a run writes a draft whose recipe says whether it went on from another
        calls.append(cmd)
        out.mkdir(exist_ok=True)
        recipe = {"init_from": {"path": str(out)}} if "--init-from" in cmd else {}
        (out / files.MARKER).write_text(json.dumps({"type": "feature", "recipe": recipe}))

    monkeypatch.setattr(files, "installed_draft", lambda target: out)
    monkeypatch.setattr(pair.subprocess, "run", distill)
    assert pair.feature_draft(tmp_path / "coder15.gguf") == out
    first, second = calls
    assert first[first.index("--epochs") + 1] == "4" and "--init-from" not in first
    assert second[second.index("--init-from") + 1] == str(out)
    assert [second[second.index(f) + 1] for f in pair.FEATURE_MORE] == list(pair.FEATURE_MORE.values())
    assert second.count("--self-chat") == 1 and second.count("--lr") == 1
    pair.feature_draft(tmp_path / "coder15.gguf")
    assert len(calls) == 2  # built: nothing runs again
    (out / files.MARKER).write_text(json.dumps({"type": "feature", "recipe": {}}))  # stopped after the first run
    pair.feature_draft(tmp_path / "coder15.gguf")
    assert len(calls) == 3 and "--init-from" in calls[-1]
