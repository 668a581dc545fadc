"""`serve --pass-log`: one JSON line per target pass (batch/pass_log.py), whose drafts and tokens are the requests'
own, over real HTTP; its summary prices drafts as the module says; a path it cannot write is refused in one line."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from specdec import SpecDecoder, models
from specdec.batch.pass_log import FIELDS, PassLog, by_load, read, summary
from specdec.errors import InvalidRequest
from specdec.server import create_app
from specdec.trace import read_jsonl


def test_a_servers_passes_are_logged_with_its_requests_drafts(tiny_dirs, tmp_path):
    """Two requests at once on ngram drafts (a repeating prompt, rows priced cheap so that it drafts): the log's
    draft rows and accepted tokens are the traces' proposed and accepted tokens, pass for pass in sum, and every
    emitted token came from a logged pass."""
    from test_server import LiveServer
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    sd = SpecDecoder.from_models(model, tok, draft="ngram", tau=3)
    log, traces = tmp_path / "passes.jsonl", tmp_path / "traces"
    srv = LiveServer(create_app(sd, model_name="tiny", pass_log=str(log), trace_dir=str(traces)))
    try:
        srv.price_rows_cheap()
        with httpx.Client(timeout=60) as client:
            for _ in range(2):
                r = client.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "abc abc abc abc abc abc",
                                                                     "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200, r.text
    finally:
        srv.stop()
    passes = read(str(log))
    records = [rec for path in sorted(traces.glob("*.jsonl")) for rec in read_jsonl(path)]
    assert passes and all(set(p) == set(FIELDS) for p in passes)
    assert sum(p["draft_rows"] for p in passes) == sum(len(r.proposed) for r in records) > 0
    assert sum(p["accepted"] for p in passes) == sum(r.accepted for r in records)
    assert sum(p["decoding"] for p in passes) == len(records)  # one record per request per pass that emitted
    assert all(p["rows"] >= p["draft_rows"] + p["decoding"] and p["verify_ms"] > 0 and p["priced_ms"] > 0
               for p in passes)
    assert any(p["prompt_rows"] for p in passes) and not any(p["tree"] for p in passes)  # (ngram: chains)


def test_the_summary_prices_drafts_on_the_curve():
    """Two passes on a linear curve T(r) = 10 + r: a chain pass (4 decoding, 2 draft rows, both accepted) saves two
    tokens at T(4)/4 = 3.5 ms each, less its 2 rows (2 ms) and its drafting beyond the baseline (1 ms); the plain
    pass saves nothing."""
    plain = dict(rows=4, prompt_rows=0, decoding=4, draft_rows=0, accepted=0, tree=False, verify_ms=14.0,
                 priced_ms=14.0, before_ms=0.5, after_ms=0.5, t=1.0)
    chain = dict(plain, rows=6, draft_rows=2, accepted=2, verify_ms=16.8, priced_ms=16.0, before_ms=1.5, t=2.0)
    got = summary([plain, chain], lambda r: 10.0 + r, baseline_ms=1.0)
    assert got["none"] == {"passes": 1, "draft_rows": 0, "accepted": 0, "verify_over_priced": 1.0, "outside_ms": 1.0,
                           "saved_ms": 0}
    assert got["chain ≤4"]["saved_ms"] == 7 - 2 - 1 and got["chain ≤4"]["verify_over_priced"] == 1.05


def test_by_load_counts_tokens_per_second_of_server_time_and_each_loads_share():
    """A draft that delivers more a second at every load than target-only can deliver less in all: it spends more of
    its time at one request (the tail); by_load shows both."""
    def p(decoding, accepted, ms):
        return dict(rows=decoding + accepted, prompt_rows=0, decoding=decoding, draft_rows=accepted,
                    accepted=accepted, tree=False, verify_ms=ms, priced_ms=ms, before_ms=0.0, after_ms=0.0, t=0.0)
    base = [p(8, 0, 80.0)] * 9 + [p(1, 0, 40.0)] * 8  # 80 tokens in 1.04 s
    draft = [p(8, 1, 80.0)] * 8 + [p(1, 1, 40.0)] * 8  # 88 tokens in 0.96 s: 8 passes at full width fewer
    b, d = by_load(base), by_load(draft)
    assert b["8+"] == {"passes": 9, "tokens": 72, "s": 0.72, "tokens_per_s": 100.0, "share": 0.9}
    assert d["8+"]["tokens_per_s"] == 112.5 > b["8+"]["tokens_per_s"] and d["1"]["tokens_per_s"] == 50.0 > 25.0
    assert d["1"]["share"] == round(16 / 88, 3) and d["1"]["share"] > b["1"]["share"]
    assert set(by_load([p(0, 0, 5.0)] + base)) == {"1", "8+"}  # a pass that decoded nothing: no load


def test_a_pass_log_that_cannot_be_written_is_refused_or_stops_quietly(rt_sd, tmp_path, capsys):
    with pytest.raises(InvalidRequest, match="--pass-log"):
        create_app(rt_sd, pass_log=str(tmp_path / "no" / "such" / "dir" / "passes.jsonl"))
    with pytest.raises(InvalidRequest, match="--no-batch"):
        create_app(rt_sd, pass_log=str(tmp_path / "p.jsonl"), batch=False)
    log = PassLog(str(tmp_path / "full.jsonl"))
    log._file.write = lambda line: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    log({"rows": 1})  # a full disk: said once, and the log ends; the pass goes on
    log({"rows": 2})
    assert capsys.readouterr().err.count("the pass log") == 1


def test_serve_refuses_an_unwritable_pass_log_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--target", "default", "--port", "8",
                          "--pass-log", str(tmp_path / "missing" / "p.jsonl")], capture_output=True, text=True,
                         timeout=120, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1 and "--pass-log" in out.stderr, out.stderr


def test_the_benchmark_reads_a_log(tmp_path, capsys):
    """`python benchmarks/serve.py pass-log FILE` prints a row per group, the baseline from its `none` passes."""
    sys.path.insert(0, "benchmarks/suite")
    import pass_log as bench
    path = tmp_path / "p.jsonl"
    plain = dict(rows=4, prompt_rows=0, decoding=4, draft_rows=0, accepted=0, tree=False, verify_ms=14.0,
                 priced_ms=14.0, before_ms=0.5, after_ms=0.5, t=1.0)
    tree = dict(plain, rows=7, decoding=2, draft_rows=5, accepted=2, tree=True, priced_ms=17.0)
    path.write_text("\n".join(json.dumps(r) for r in [plain, tree]) + "\n")
    assert bench.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| none | 1 | 0 | 0 |" in out and "| tree ≤4 | 1 | 5 | 2 |" in out


def test_the_benchmark_refuses_a_missing_or_foreign_file_in_one_line(tmp_path, capsys):
    sys.path.insert(0, "benchmarks/suite")
    import pass_log as bench
    assert bench.main([str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "x.jsonl").write_text("not json\n")
    assert bench.main([str(tmp_path / "x.jsonl")]) == 2
    (tmp_path / "y.jsonl").write_text('{"rows": 3}\n')
    assert bench.main([str(tmp_path / "y.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("pass-log: ") for line in err)
