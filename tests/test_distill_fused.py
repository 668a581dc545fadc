"""`specdec distill --features fused` (EAGLE-3-style) on a tiny target run by specdec's runtime: the target's low,
middle and high layers fused into the draft's feature, trained on the target's distributions, saved, loaded and
lossless (greedy, seeded, batched); its budget stops and resumes a run; the fused feature is row-invariant."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_distill import PROMPTS, prompt_file  # noqa: F401 (a fixture)
from test_eagle3 import batched_http_is_target_only

from specdec import SpecDecoder, models
from specdec.cli import main
from specdec.distill import distill, fused_taps
from specdec.distill.progress import BudgetSpent
from specdec.drafters.feature import FeatureDrafter, target_identity
from specdec.errors import IncompatibleDraft, InvalidRequest

RECIPE = dict(max_new_tokens=20, gen_batch=4, reduced=40, epochs=2, batch=4, lr=3e-3, seed=0, eval_limit=2,
              self_chat=4, val_every=4, features="fused", noise=0.1)


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


@pytest.fixture(autouse=True)
def untapped(rt):
    """A test leaves the shared target as it found it: untapped."""
    yield
    rt[0].feature_layers = None


@pytest.fixture(scope="module")
def fused(tmp_path_factory, prompt_file, rt):
    out = tmp_path_factory.mktemp("fused")
    rep = distill("tiny", str(out), [prompt_file], [], loaded=rt, **RECIPE)
    return out, rep


def test_fused_draft_is_trained_saved_and_reads_the_taps(fused, rt):
    out, rep = fused
    meta = json.loads((out / "specdec_draft.json").read_text())
    L = rt[0].config.num_hidden_layers
    assert meta["net"]["taps"] == list(fused_taps(L)) == rep["taps"] and rep["features"] == "fused"
    assert rep["held_out"]["identical_to_target"] and len(rep["train_history"]) == 2
    assert 0 < rep["answer_tokens"] < rep["tokens"]
    assert (out / "training.png").stat().st_size > 1000


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}])
def test_fused_draft_is_lossless(fused, rt, sampling):
    out, _ = fused
    model, tok = rt
    model.feature_layers = None
    plain = SpecDecoder.from_models(model, tok, draft="none")
    prompts = ["Hello", "The cat sat", "x = 1"]
    want = [plain.generate(p, max_new_tokens=24, chat=False, **sampling).token_ids for p in prompts]
    sd = SpecDecoder.from_models(model, tok, draft=str(out), tau=3)
    got = [sd.generate(p, max_new_tokens=24, chat=False, **sampling) for p in prompts]
    assert [g.token_ids for g in got] == want
    assert sum(len(r.proposed) for g in got for r in g.records) > 0  # it drafted


def test_batched_requests_with_a_fused_draft_get_what_target_only_gives(fused, rt):
    rt[0].feature_layers = None
    batched_http_is_target_only(*rt, str(fused[0]))


def test_the_fused_feature_is_row_invariant(fused, rt):
    """The fuse runs per committed row in q8: a many-row call's rows equal one-row calls', bitwise."""
    out, _ = fused
    model, tok = rt
    drafter = FeatureDrafter.load(out, model, models.tokenizer_fingerprint(tok))
    taps = torch.randn(7, 3 * model.config.hidden_size) * 5
    many = drafter._fuse(taps)
    assert torch.equal(many, torch.cat([drafter._fuse(taps[i:i + 1]) for i in range(7)]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=12))
def test_tapped_states_fused_late_are_the_features_of_each_cycles_call(fused, rt, cycles):
    """The drafter fuses the tapped states it was handed when it reads them (or FUSE_AFTER wait), in one call: its
    features after any run of cycles (each a rollback of up to 3 positions, then new rows) are bitwise those of a
    fuse per cycle, and a rolled-back row is never among them."""
    out, _ = fused
    model, tok = rt
    lazy = FeatureDrafter.load(out, model, models.tokenizer_fingerprint(tok))
    eager = lazy.fork()
    eager.observe_target = lambda start, hidden: eager._write(start, eager._fuse(hidden))
    gen, end = torch.Generator().manual_seed(len(cycles)), 0
    for back, n in cycles:
        start = max(0, end - back)
        taps = torch.randn(n, 3 * model.config.hidden_size, generator=gen) * 5
        lazy.observe_target(start, taps)
        eager.observe_target(start, taps)
        end = start + n
    assert len(lazy.feats) == end and torch.equal(lazy.feats, eager.feats)


def test_a_budget_stops_a_run_and_the_same_call_goes_on(tmp_path, prompt_file, rt, monkeypatch):
    import specdec.distill.progress as progress
    clock = iter(range(0, 10 ** 6, 7))  # every check is 7 s later: a 1-minute budget ends after 8 checks
    monkeypatch.setattr(progress, "monotonic", lambda: next(clock), raising=False)
    with pytest.raises(BudgetSpent):
        distill("tiny", str(tmp_path), [prompt_file], [], loaded=rt, budget_minutes=1, **RECIPE)
    assert not (tmp_path / "specdec_draft.json").exists() and (tmp_path / "work" / "sequences.jsonl").exists()
    first = json.loads((tmp_path / "work" / "seconds.json").read_text())["data"]  # the chunk's time, kept
    monkeypatch.undo()
    rep = distill("tiny", str(tmp_path), [prompt_file], [], loaded=rt, **RECIPE)
    assert rep["held_out"]["identical_to_target"] and rep["sequences"] == len(PROMPTS) + 4
    # the wall time of both runs: the first one's data phase, then this one's
    spent = rep["seconds_all_runs"]
    assert 0 < first < spent["data"] and {"labels", "train"} <= set(spent)


def test_bad_input_is_one_line(tmp_path, prompt_file, rt, target, tok, tiny_dirs, capsys):
    with pytest.raises(InvalidRequest, match="features"):
        distill("tiny", str(tmp_path), [prompt_file], [], loaded=rt, **{**RECIPE, "features": "middle"})
    with pytest.raises(InvalidRequest, match="budget"):
        distill("tiny", str(tmp_path), [prompt_file], [], loaded=rt, budget_minutes=0, **RECIPE)
    with pytest.raises(InvalidRequest, match="runtime"):
        distill("tiny", str(tmp_path), [prompt_file], [], loaded=(target, tok), **RECIPE)
    with pytest.raises(SystemExit):
        main(["distill", "--target", tiny_dirs["target"], "--features", "middle"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_fused_draft_needs_the_runtime_target(fused, target, tok):
    out, _ = fused
    with pytest.raises(IncompatibleDraft, match="runtime"):
        FeatureDrafter.load(out, target, models.tokenizer_fingerprint(tok))


def test_the_drafts_safetensors_file_alone_is_the_draft(fused, rt, tmp_path):
    """The file a user copies and publishes: model.safetensors carries the metadata in its header."""
    import shutil
    out, _ = fused
    model, tok = rt
    alone = tmp_path / "coder-draft.safetensors"
    shutil.copy(out / "model.safetensors", alone)
    plain = SpecDecoder.from_models(model, tok, draft="none")
    want = plain.generate("The cat sat", max_new_tokens=24, chat=False).token_ids
    sd = SpecDecoder.from_models(model, tok, draft=str(alone), tau=3)
    got = sd.generate("The cat sat", max_new_tokens=24, chat=False)
    assert got.token_ids == want and any(r.proposed for r in got.records)


def test_a_fused_draft_refuses_another_target_file(fused, rt, tmp_path):
    """It reads the target's inner layers: a target file of another content (same tokenizer) is refused."""
    import shutil
    out, _ = fused
    model, tok = rt
    other = tmp_path / "d"
    shutil.copytree(out, other)
    meta = json.loads((other / "specdec_draft.json").read_text())
    assert meta["target_sha256"] == target_identity(model)
    (other / "specdec_draft.json").write_text(json.dumps({**meta, "target_sha256": "0" * 64}))
    with pytest.raises(IncompatibleDraft, match="another target file"):
        FeatureDrafter.load(other, model, models.tokenizer_fingerprint(tok))


def test_the_cli_stops_at_its_budget_with_status_75_and_says_how_to_go_on(tmp_path, prompt_file, tiny_dirs,
                                                                          monkeypatch, capsys):
    import specdec.distill.progress as progress
    clock = iter(range(0, 10 ** 6, 30))  # set at 0, checked at 30 s (one batch made), then at 60 s: spent
    monkeypatch.setattr(progress, "monotonic", lambda: next(clock))
    args = ["distill", "--target", tiny_dirs["target"], "--out", str(tmp_path), "--prompts", prompt_file,
            "--features", "fused", "--max-new-tokens", "8", "--gen-batch", "2", "--self-chat", "0",
            "--reduced-vocab", "40", "--epochs", "1", "--budget-minutes", "1"]
    assert main(args) == 75
    err = capsys.readouterr().err
    assert "budget ran out during target responses" in err and "run the same command again" in err
    assert len((tmp_path / "work" / "sequences.jsonl").read_text().splitlines()) == 2  # one batch


def test_plain_texts_labels_are_the_tokens_the_target_itself_would_pick(rt, tmp_path, monkeypatch):
    """A teacher-forced text's label at each position is the runtime target's own greedy token after that prefix: its
    pass's own logits (the q8 head as it serves), not a second, exact product of the head over the stored fp16
    states (on the 1.5B those agreed on 98% of 256 positions: the other 2% trained the draft toward tokens the
    served target does not pick)."""
    import specdec.distill.data as data
    from specdec.distill.data import teacher_labels

    def no_second_head(*a, **k):
        raise AssertionError("the head multiplied again over the labelled states")
    monkeypatch.setattr(data, "qlinear", no_second_head)
    model = rt[0]
    model.feature_layers = (*fused_taps(model.config.num_hidden_layers), model.config.num_hidden_layers)
    ids = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 11, 2]
    [labelled] = teacher_labels(model, [{"ids": ids, "h": None}], tmp_path / "labels.pt", "cpu")
    model.feature_layers = None
    cache = model.new_cache()
    try:
        want = [int(cache.forward(ids[:j + 1]).argmax()) for j in range(len(ids))]
    finally:
        cache.close()
    assert labelled["argmax"].tolist() == want
    assert labelled["h"].shape == (len(ids), 4 * model.config.hidden_size)


def test_forks_fused_together_get_the_features_of_their_own_calls(fused, rt):
    """The engine fuses every fork's waiting taps in one call (FeatureDrafter.fuse_together): each fork's features
    are bitwise those of fusing its own, and the forks' features stay apart."""
    out, _ = fused
    model, tok = rt
    base = FeatureDrafter.load(out, model, models.tokenizer_fingerprint(tok))
    forks, alone = [base.fork() for _ in range(3)], [base.fork() for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    for step, n in enumerate([5, 1, 3]):
        for a, b in zip(forks, alone):
            taps = torch.randn(n + step, 3 * model.config.hidden_size, generator=gen) * 5
            start = max(0, len(a._fbuf[: a._flen]) + sum(len(r) for _, r in a._taps) - 1)  # each a 1-row rollback
            a.observe_target(start, taps)
            b.observe_target(start, taps)
        FeatureDrafter.fuse_together(forks)
        assert all(not f._taps for f in forks)
    for a, b in zip(forks, alone):
        assert torch.equal(a.feats, b.feats)
    assert not torch.equal(forks[0].feats[:5], forks[1].feats[:5])


def test_a_draft_goes_on_from_another_instead_of_starting_again(fused, prompt_file, rt, tmp_path):
    """--init-from: the trained draft's weights are where training starts (its fc brought back to the scaled
    embeddings, its fused norm kept), on more data; the result is lossless and records where it came from."""
    from safetensors.torch import load_file
    out, rep = fused
    assert abs(rep["recipe"]["embedding_gain"] - 1) > 0.5  # an fc left scaled would show
    still = distill("tiny", str(tmp_path / "still"), [prompt_file], [], loaded=rt,
                    **{**RECIPE, "epochs": 1, "lr": 1e-30}, init_from=str(out))
    before, after = load_file(out / "model.safetensors"), load_file(tmp_path / "still" / "model.safetensors")
    for name, w in before.items():  # a step of 1e-30 moves nothing: the draft is the one it started from, bit for bit
        assert torch.equal(after[name], w), name
    assert still["recipe"]["init_from"]["path"] == str(out)
    assert still["recipe"]["init_from"]["recipe"]["epochs"] == RECIPE["epochs"]
    more = {**RECIPE, "epochs": 1, "self_chat": 8}  # more data, one epoch: on from the draft, or from the start
    warm = distill("tiny", str(tmp_path / "warm"), [prompt_file], [], loaded=rt, **more, init_from=str(out))
    cold = distill("tiny", str(tmp_path / "cold"), [prompt_file], [], loaded=rt, **more)
    assert warm["held_out"]["identical_to_target"]
    assert warm["train_history"][0]["val"]["acc"] > cold["train_history"][0]["val"]["acc"]


def test_a_draft_to_go_on_from_is_checked_before_any_data(fused, prompt_file, rt, tmp_path, tiny_dirs, capsys):
    out, _ = fused
    for bad, match in ((tmp_path / "none", "not a draft"), (out, "draft-ffn")):
        with pytest.raises(InvalidRequest, match=match):
            distill("tiny", str(tmp_path / "o"), [prompt_file], [], loaded=rt,
                    **{**RECIPE, "ffn": 32 if bad == out else None}, init_from=str(bad))
        assert not (tmp_path / "o" / "work" / "sequences.jsonl").exists()
    other = tmp_path / "other"
    other.mkdir()
    meta = json.loads((out / "specdec_draft.json").read_text())
    (other / "specdec_draft.json").write_text(json.dumps({**meta, "target_fingerprint": "0" * 16}))
    (other / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    with pytest.raises(IncompatibleDraft, match="another target"):
        distill("tiny", str(tmp_path / "o"), [prompt_file], [], loaded=rt, **RECIPE, init_from=str(other))
    assert main(["distill", "--target", tiny_dirs["target"], "--out", str(tmp_path / "o"), "--features", "fused",
                 "--reduced-vocab", "40", "--init-from", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--init-from" in err and "not a draft" in err and len(err.splitlines()) == 1
