"""`specdec check` catches broken acceptance rules; `specdec tune`'s cost model predicts measured speedups."""
import json

import pytest
import torch

import specdec.verification
from specdec.cli import main
from specdec.tune import plot, tune
from specdec.verification import sample_verify

PROMPTS = ['{"prompt": "Hello world", "mode": "completion"}', '{"prompt": "abc", "mode": "chat"}',
           '{"prompt": "The cat", "mode": "completion"}']


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


def run_check(capsys, tiny_dirs, prompts_file, *extra, draft="draft"):
    code = main(["check", "--target", tiny_dirs["target"], "--draft", tiny_dirs[draft], "--prompts", prompts_file,
                 "--tau", "4", "--max-new-tokens", "30", "--samples", "1500", "--top-k", "4", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("draft", ["draft", "random"])
def test_check_passes_on_correct_engine(capsys, tiny_dirs, prompts_file, draft):
    code, rep = run_check(capsys, tiny_dirs, prompts_file, "--limit", "1", "--policy", "heuristic", draft=draft)
    assert code == 0 and rep["passed"] and all(r["ok"] for r in rep["greedy"])
    assert rep["policy"] == "heuristic" and rep["tau"] == 4  # check runs the policy it is given
    assert rep["sampling"][0]["p_value"] >= 1e-3


def test_check_catches_top2_greedy_acceptance(capsys, tiny_dirs, prompts_file, monkeypatch, tmp_path):
    def top2_verify(draft, logits, argmax=None):  # BUG: accept whenever the draft token is in the target's top 2
        top2 = logits.topk(2, -1).indices
        n = 0
        while n < len(draft) and int(draft[n]) in top2[n].tolist():
            n += 1
        return n, int(logits[n].argmax())
    monkeypatch.setattr(specdec.verification, "greedy_verify", top2_verify)
    page = tmp_path / "check.html"
    code, rep = run_check(capsys, tiny_dirs, prompts_file, "--sampling-prompts", "0", "--html", str(page))
    assert code == 1 and not rep["passed"]
    bad = [r for r in rep["greedy"] if not r["ok"]]
    assert bad and all(r["speculative"] != r["target"] and r["first_divergence"] >= 0 for r in bad)
    assert main(["check", "--target", tiny_dirs["target"], "--prompts", prompts_file, "--limit", "1",
                 "--sampling-prompts", "0", "--html", str(tmp_path / "no" / "c.html")]) == 2  # unwritable: one line
    assert capsys.readouterr().err.startswith("specdec: error: cannot write")
    text = page.read_text()  # the page: each divergence token by token, its first differing column marked
    assert "FAILED" in text and text.count("class='first'") == 2 * len(bad)
    for r in bad:
        assert f"differs at token {r['first_divergence']}" in text
        assert r["tokens"]["speculative"][0] != r["tokens"]["target"][0] or not r["tokens"]["target"]


def test_check_catches_resampling_from_p_after_a_rejection(capsys, tiny_dirs, prompts_file, monkeypatch):
    """BUG: after a rejection, resample from p instead of norm(max(0, p - q)): caught at a drafted position, with
    enough drafted-and-rejected events behind the verdict."""
    monkeypatch.setattr(specdec.verification, "residual", lambda p, q: p)
    code, rep = run_check(capsys, tiny_dirs, prompts_file, "--limit", "1", "--samples", "800", draft="random")
    r = rep["sampling"][0]
    assert code == 1 and r["verdict"] == "differs" and r["p_value"] < 1e-3 and r["events"] >= 20


def test_check_catches_a_draft_reporting_another_q(capsys, tiny_dirs, prompts_file, monkeypatch):
    """BUG: the draft reports a q other than the one it sampled from (here: uniform)."""
    from specdec.drafters.model import ModelDrafter
    honest = ModelDrafter.propose

    def wrong_q(self, *a, **kw):
        d = honest(self, *a, **kw)
        if d.q is not None:
            d.q = torch.full_like(d.q, 1.0 / d.q.shape[-1])
        return d
    monkeypatch.setattr(ModelDrafter, "propose", wrong_q)
    code, rep = run_check(capsys, tiny_dirs, prompts_file, "--limit", "1", "--samples", "800")
    assert code == 1 and rep["sampling"][0]["verdict"] == "differs"


def test_check_sampling_is_inconclusive_without_drafts_and_tests_each_chain_member(capsys, tiny_dirs,
                                                                                    prompts_file):
    """A drafter that never drafts (none) proves nothing: inconclusive, a failure. A chain is tested member by
    member; the sample size follows from the stated power."""
    code = main(["check", "--target", tiny_dirs["target"], "--draft", "none", "--prompts", prompts_file, "--limit",
                 "1", "--max-new-tokens", "8", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and rep["sampling"][0]["verdict"] == "inconclusive"
    code = main(["check", "--target", tiny_dirs["target"], "--draft", f"ngram+{tiny_dirs['random']}", "--prompts",
                 prompts_file, "--limit", "1", "--max-new-tokens", "8", "--top-k", "4", "--detect", "0.15",
                 "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert [r["draft"] for r in rep["sampling"]] == [f"ngram+{tiny_dirs['random']}", "ngram", tiny_dirs["random"]]
    tested = [r for r in rep["sampling"] if "samples" in r]
    assert tested and all(r["detectable_tv"] <= 0.15 for r in tested)


def test_detectable_error_shrinks_with_samples():
    from specdec.check import detectable_tv
    probs = [0.4, 0.3, 0.2, 0.1]
    small, large = detectable_tv(probs, 200, 1e-3), detectable_tv(probs, 3200, 1e-3)
    assert 0 < large < small < 0.5


def test_check_catches_q_from_wrong_position(capsys, tiny_dirs, prompts_file, monkeypatch):
    def shifted_q(draft, q, p, gen):  # BUG: q of the next position is used for the acceptance test
        if q is not None and len(q) > 1:
            q = torch.roll(q, -1, 0)
        return sample_verify(draft, q, p, gen)
    monkeypatch.setattr(specdec.verification, "sample_verify", shifted_q)
    code, rep = run_check(capsys, tiny_dirs, prompts_file, "--limit", "1", draft="random")
    assert code == 1 and rep["sampling"][0]["p_value"] < 1e-3 and rep["sampling"][0]["verdict"] == "differs"


def test_check_bad_input(capsys, tiny_dirs, prompts_file, tmp_path):
    assert main(["check", "--target", tiny_dirs["target"], "--samples", "3"]) == 2
    assert main(["check", "--target", tiny_dirs["target"], "--temperature", "0"]) == 2
    for bad in (["--detect", "0"], ["--detect", "1.5"], ["--min-events", "-1"]):
        assert main(["check", "--target", tiny_dirs["target"], *bad]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["check", "--target", tiny_dirs["target"], "--prompts", str(empty)]) == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    assert main(["check", "--target", tiny_dirs["target"], "--prompts", str(tmp_path / "bad.jsonl")]) == 2
    assert "prompt" in capsys.readouterr().err


class FakeClock:
    """The time every duration in tune/bench/engine is measured with (injected for perf_counter): it moves only when
    a model pass is charged, so the cost model's inputs and the measured speedups are exact whatever the machine's
    load (wall-clock bands failed on shared CI machines)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Sleepy(torch.nn.Module):
    """A model whose every forward pass costs a fixed time on the clock, as on memory-bound hardware."""

    def __init__(self, inner, ms, clock):
        super().__init__()
        self.inner, self.ms, self.clock = inner, ms, clock
        self.config, self.generation_config = inner.config, inner.generation_config

    def forward(self, **kw):
        self.clock.now += self.ms / 1e3
        return self.inner(**kw)


def fake_clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    for module in ("specdec.engine", "specdec.api", "specdec.costs"):
        monkeypatch.setattr(f"{module}.perf_counter", clock)
    return clock


def test_tune_predictions_match_measured_runs(tok, target, draft_close, tmp_path, monkeypatch):
    clock = fake_clock(monkeypatch)
    prompts = [{"prompt": p, "chat": False} for p in ["Hello world", "The cat", "abc"]]
    loaded = (Sleepy(target, 15, clock), tok, {"close": Sleepy(draft_close, 2, clock)})
    rep = tune("unused", ["close", "ngram"], 4, prompts, 30, confirm=3, loaded=loaded)
    assert set(rep["drafts"]) == {"close", "ngram"} and len(rep["predictions"]) == 8
    assert rep["target_step_ms"] == pytest.approx(15)
    assert rep["drafts"]["close"]["draft_ms_per_token"] == pytest.approx(2)
    assert rep["drafts"]["close"]["alphas"][0] > 0.3 and rep["drafts"]["ngram"]["acceptance_rate"] < 0.1
    for p in rep["confirmed"]:
        assert p["identical_to_baseline"]
        assert abs(p["predicted_speedup"] - p["measured_speedup"]) / p["measured_speedup"] < 0.25, p
    rec = rep["recommendation"]
    assert rec["draft"] == "close" and f"tau={rec['tau']}" in rec["reason"]
    assert max(p["measured_speedup"] for p in rep["confirmed"] if p["draft"] == "close") > 1.2
    plot(rep, tmp_path / "tune.png")
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"


def test_tune_recommends_not_speculating_when_nothing_wins(tok, target, draft_random, monkeypatch):
    clock = fake_clock(monkeypatch)
    prompts = [{"prompt": "Hello world", "chat": False}]
    loaded = (Sleepy(target, 10, clock), tok, {"slow": Sleepy(draft_random, 25, clock)})
    rep = tune("unused", ["slow"], 3, prompts, 20, confirm=2, loaded=loaded)
    assert rep["recommendation"]["draft"] == "none" and "do not speculate" in rep["recommendation"]["reason"]


def test_bench_json_schema(tiny_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--draft", "ngram", "--draft",
                 tiny_dirs["draft"], "--tau", "2", "--tau", "3", "--policy", "fixed", "--policy", "adaptive",
                 "--max-new-tokens", "12", "--compare-hf", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    # baseline + 2 drafts x 2 taus x 2 policies + hf baseline + hf 2 drafts x 2 taus
    assert len(rows) == 1 + 8 + 1 + 4 and data["prompts"] == 2
    for r in rows:
        assert {"draft", "tau", "policy", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_len",
                "target_passes_per_token", "identical_to_baseline"} <= set(r)
        assert r["identical_to_baseline"] is True and r["tokens_per_s"] > 0
    assert rows[0]["draft"] == "none" and rows[0]["speedup"] == 1.0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart beside the JSON
    assert {r["policy"] for r in rows if r["engine"] == "specdec" and r["draft"] != "none"} == {"fixed", "adaptive"}
    # what a draft costs: ms per drafted token and its share of a target-only step (a draft model is not free)
    model_rows = [r for r in rows if r["engine"] == "specdec" and r["draft"] == tiny_dirs["draft"]]
    assert all(r["draft_ms_per_token"] > 0 and r["draft_share_of_pass"] > 0 for r in model_rows)
    ngram = [r for r in rows if r["engine"] == "specdec" and r["draft"] == "ngram" and r["acceptance_rate"]]
    assert all(r["draft_share_of_pass"] < min(m["draft_share_of_pass"] for m in model_rows) for r in ngram)
    assert rows[0]["draft_ms_per_token"] is None and rows[0]["acceptance_by_position"] is None
    # alpha_k per position: the first is the share of drafting cycles that kept their first draft
    for r in [r for r in rows if r["engine"] == "specdec" and r["acceptance_rate"]]:
        alphas = r["acceptance_by_position"]
        assert len(alphas) == r["tau"] and all(a is None or 0 <= a <= 1 for a in alphas)
    assert "specdec bench" in capsys.readouterr().out
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--policy", "magic"]) == 2
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(tmp_path / "nope.jsonl")]) == 2


@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "0"], "--port must be"),
    (["serve", "--max-queue", "0"], "--max-queue"),
    (["serve", "--timeout", "-1"], "--timeout"),
    (["serve", "--response-store-mb", "-1"], "--response-store-mb"),
    (["serve", "--max-tokens", "-1"], "--max-tokens"),
    (["tune", "--max-tau", "0"], "--max-tau"),
    (["tune", "--confirm", "0"], "--confirm"),
])
def test_serve_and_tune_bad_input(argv, message, tiny_dirs, capsys):
    assert main([*argv, "--target", tiny_dirs["target"]]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bench_acceptance_by_position_of_the_target_drafting_for_itself_is_all_ones(tiny_dirs, tmp_path, capsys):
    """The target as its own greedy draft is right at every position (a verify row equals a one-token step), and
    a random draft model is not: bench's alpha_k tells them apart, position by position."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--draft", "target", "--draft",
                 tiny_dirs["draft"], "--tau", "3", "--max-new-tokens", "16", "--json", str(out)]) == 0
    rows = {r["draft"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["target"]["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert rows[tiny_dirs["draft"]]["acceptance_by_position"][0] < 1.0


def test_bench_sampled(tiny_dirs, tmp_path, capsys):
    """--temperature/--top-p/--seed: every row samples; outputs are not compared token by token (same
    distribution, other draws), so `identical` is null; bad sampling options are one line, exit 2."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--draft", "ngram", "--tau", "2",
                 "--max-new-tokens", "10", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--compare-hf",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["temperature"] == 0.7 and rep["seed"] == 3
    assert {r["engine"] for r in rep["results"]} == {"specdec", "transformers"}
    assert all(r["identical_to_baseline"] is None and r["tokens"] > 0 for r in rep["results"])
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--temperature", "-1"]) == 2
    assert "temperature must be in [0, 2]" in capsys.readouterr().err


def test_bench_builds_each_draft_once(tiny_dirs, monkeypatch):
    import specdec.bench as bench_module
    calls = []
    real = bench_module.build_drafter
    monkeypatch.setattr(bench_module, "build_drafter", lambda d, *a, **kw: calls.append(d) or real(d, *a, **kw))
    bench_module.Bench(tiny_dirs["target"], ["ngram", tiny_dirs["draft"]], [2, 3], 4, False,
                       policies=["fixed", "adaptive"])
    assert sorted(calls) == sorted(["none", "ngram", tiny_dirs["draft"]])  # 9 configurations, 3 drafters
