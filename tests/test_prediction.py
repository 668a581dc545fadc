"""Predicted outputs: the prediction drafter rejoins after an insertion, a deletion and a replacement; the output is
the same with or without a prediction (greedy token for token, seeded sampling too) in the engine, the batch engine
and over HTTP, where usage reports the accepted and rejected prediction tokens; bad input is a clear error."""
import json

import httpx
import openai
import pytest
from test_server import LiveServer

from specdec import SpecDecoder, models
from specdec.batch import BatchEngine, Sequence
from specdec.cli import main
from specdec.drafters import NgramDrafter
from specdec.drafters.prediction import PredictionDrafter
from specdec.sampling import SamplingParams
from specdec.server import create_app

PROMPT = "hello there"


def walk(prediction: list[int], output: list[int], k: int = 8) -> tuple[int, list]:
    """Verify `output` against the drafter as an engine would: each cycle the longest agreeing prefix of its
    proposal is accepted and the output's next token follows -> (cycles, the proposals)."""
    d = PredictionDrafter(prediction)
    context, proposals, cycles = [1, 2, 3], [], 0  # a prompt, then the output
    i = 0
    while i < len(output):
        draft = d.propose(context + output[:i], k, None, None)
        proposals.append((i, draft.tokens))
        n = 0
        while n < len(draft.tokens) and i + n < len(output) and draft.tokens[n] == output[i + n]:
            n += 1
        d.observe_verify(None, draft, None, list(range(n)))
        i += n + 1
        cycles += 1
    return cycles, proposals


PRED = list(range(100, 160))


@pytest.mark.parametrize("edit", ["insertion", "deletion", "replacement"])
def test_the_drafter_rejoins_the_prediction_after_an_edit(edit):
    out = {"insertion": PRED[:20] + [7, 8, 9] + PRED[20:],
           "deletion": PRED[:20] + PRED[25:],
           "replacement": PRED[:20] + [7, 8, 9, 6, 5] + PRED[25:]}[edit]
    cycles, proposals = walk(PRED, out)
    resumed = 23 if edit == "insertion" else 20 if edit == "deletion" else 25  # output index where it rejoins
    # one cycle after the edit's last token it proposes the prediction's continuation again
    after = [tokens for i, tokens in proposals if i > resumed]
    assert after and after[0][:3] == out[next(i for i, _ in proposals if i > resumed):][:3]
    assert cycles <= len(out) // 4  # long proposals while in step: a few cycles, not one a token
    assert walk(PRED, PRED)[0] == -(-len(PRED) // 9)  # the prediction itself: 8 drafts + 1 a cycle


@pytest.mark.parametrize("new", [[8], [8, 9], [8, 9, 10]])
def test_a_rename_learned_at_its_first_occurrence_is_drafted_at_the_later_ones(new, monkeypatch):
    """The output writes `new` wherever the prediction has token 7 (five times): after the first, the drafter
    proposes `new` in its place, so the later occurrences cost no cycles; a rename the output does not keep
    everywhere is learned back."""
    pred = [7 if i % 10 == 0 and i else 100 + i for i in range(60)]
    out = [t for p in pred for t in (new if p == 7 else [p])]
    cycles, proposals = walk(pred, out)
    third = new + [100 + 31]  # the third occurrence and the prediction's token after it, drafted
    assert any(tokens[j: j + len(third)] == third for _, tokens in proposals for j in range(len(tokens)))
    monkeypatch.setattr("specdec.drafters.prediction.MAX_REPLACED", 0)  # no renames: each occurrence costs cycles
    assert cycles + 6 <= walk(pred, out)[0]
    monkeypatch.undo()
    kept = [t for j, p in enumerate(pred) for t in (new if p == 7 and j != 30 else [p])]  # 7 kept once
    monkeypatch.setattr("specdec.drafters.prediction.MAX_REPLACED", 0)
    unlearned = walk(pred, kept)[0]
    monkeypatch.undo()
    assert walk(pred, kept)[0] < unlearned


def test_nothing_is_proposed_off_the_prediction():
    d = PredictionDrafter(PRED)
    assert d.propose([1, 2], 4, None, None).tokens == PRED[:4]  # the output starts with the prediction
    assert d.propose([1, 2, 7, 8, 9], 4, None, None).tokens == []  # three tokens it has never seen


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    sd = SpecDecoder.from_models(model, tok, draft="ngram", tau=3)
    sd.engine.eos_ids = set()  # the tiny model stops early otherwise: long outputs to predict
    return sd


def variants(text: str) -> dict[str, str]:
    return {"exact": text, "insertion": text[:20] + "XYZ" + text[20:], "deletion": text[:20] + text[26:],
            "replacement": text[:20] + "QQQQQQ" + text[26:], "unrelated": "nothing like the output at all"}


def test_greedy_output_is_the_same_with_any_prediction(rt):
    base = rt.generate(PROMPT, max_new_tokens=80, chat=False)
    for name, pred in variants(base.text).items():
        out = rt.generate(PROMPT, max_new_tokens=80, chat=False, prediction=pred)
        assert out.token_ids == base.token_ids, name
        s = out.stats
        by = [r for r in out.records if r.by == "prediction"]
        assert s["accepted_prediction_tokens"] == sum(r.accepted for r in by)
        assert s["rejected_prediction_tokens"] == sum(len(r.proposed) - r.accepted for r in by)
        if name == "exact":
            assert s["target_passes"] <= len(base.token_ids) // 4 and s["rejected_prediction_tokens"] <= 2
            assert max(len(r.proposed) for r in by) > 3  # deeper than τ while in step
        if name == "unrelated":
            assert s["accepted_prediction_tokens"] <= 2
    assert "accepted_prediction_tokens" not in base.stats


def test_seeded_sampling_gives_the_same_text_with_a_prediction(rt):
    kw = dict(max_new_tokens=60, chat=False, temperature=0.8, seed=3)
    base = rt.generate(PROMPT, **kw)
    for pred in variants(base.text).values():
        assert rt.generate(PROMPT, prediction=pred, **kw).token_ids == base.token_ids


def test_batched_requests_with_predictions_equal_the_engine_alone(rt):
    base = rt.generate(PROMPT, max_new_tokens=50, chat=False)
    engine = BatchEngine(rt.model, NgramDrafter(), rt.model.config.vocab_size, set(), 128)
    ids = rt.tokenizer(PROMPT, add_special_tokens=False).input_ids
    seqs = {name: engine.add(Sequence(ids, 50, SamplingParams(), prediction=rt.tokenizer(
        pred, add_special_tokens=False).input_ids)) for name, pred in variants(base.text).items()}
    records = {name: [] for name in seqs}
    while engine.running:
        for s, rec in engine.step():
            records[next(n for n, q in seqs.items() if q is s)].append(rec)
    for name, s in seqs.items():
        assert s.generated == base.token_ids, name
    # (how deep the scheduler verifies follows measured pass times: only what holds at any speed is asserted)
    assert sum(len(r.emitted) for r in records["exact"]) / len(records["exact"]) > 2  # tokens a pass
    assert sum(r.accepted for r in records["exact"] if r.by == "prediction") > 20


def test_the_batch_engine_drafts_the_prediction_from_where_the_output_stands(rt):
    """The prediction is drafted from the prompt's last chunk on, and always from where the output stands."""
    base = rt.generate(PROMPT, max_new_tokens=40, chat=False).token_ids
    engine = BatchEngine(rt.model, NgramDrafter(), rt.model.config.vocab_size, set(), 128)
    s = engine.add(Sequence(rt.tokenizer(PROMPT, add_special_tokens=False).input_ids, 40, SamplingParams(),
                            prediction=list(base)))
    proposals = []
    while engine.running:
        for _, rec in engine.step():
            if rec.by == "prediction":
                proposals.append((len(s.generated) - len(rec.emitted), list(rec.proposed)))
    assert s.generated == base and proposals
    assert proposals[0][0] == 0  # the first proposal rides on the prompt's last chunk, before the first token
    for at, proposed in proposals:  # every proposal is the output's own continuation, all of it accepted
        assert proposed == base[at: at + len(proposed)], at


def test_the_batch_engine_learns_a_rename_from_the_output(rt, monkeypatch):
    """A prediction that has token Y wherever the output has X (a recurring token): the output is the same, and
    once the first X is verified the drafter drafts X, so more of the prediction is accepted than with renames
    off."""
    from collections import Counter
    base = rt.generate(PROMPT, max_new_tokens=80, chat=False).token_ids
    x = next(t for t, n in Counter(base[4:]).most_common() if n >= 3)  # recurs after the output's opening
    y = next(t for t in range(rt.model.config.vocab_size) if t not in base)
    pred = [y if t == x else t for t in base]
    accepted = {}
    for renames in (6, 0):
        monkeypatch.setattr("specdec.drafters.prediction.MAX_REPLACED", renames)
        engine = BatchEngine(rt.model, NgramDrafter(), rt.model.config.vocab_size, set(), 128)
        s = engine.add(Sequence(rt.tokenizer(PROMPT, add_special_tokens=False).input_ids, 80, SamplingParams(),
                                prediction=pred))
        while engine.running:
            engine.step()
        assert s.generated == base
        accepted[renames] = s.predicted.accepted
    assert accepted[6] > accepted[0]


@pytest.fixture(scope="module")
def live(rt):
    srv = LiveServer(create_app(rt, model_name="tiny", max_batch_rows=16))
    yield srv
    srv.stop()


def test_http_prediction_changes_nothing_and_usage_counts_it(live, rt):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=30)
    plain = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert plain.usage.completion_tokens_details is None
    pred = {"type": "content", "content": plain.choices[0].text}
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                               extra_body={"prediction": pred})
    assert got.choices[0].text == plain.choices[0].text
    details = got.usage.completion_tokens_details
    # (the tiny model's text drops the end-of-text tokens it emits: there the prediction and the output part)
    assert details.accepted_prediction_tokens >= 20 and details.rejected_prediction_tokens >= 0
    parts = {"type": "content", "content": [{"type": "text", "text": plain.choices[0].text[:10]},
                                            {"type": "text", "text": "ZZZ" + plain.choices[0].text[10:]}]}
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "prediction": parts, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                text += "".join(ch["text"] for ch in data["choices"])
                usage = data.get("usage") or usage
    assert text == plain.choices[0].text
    assert usage["completion_tokens_details"]["rejected_prediction_tokens"] >= 1  # "ZZZ" was proposed and refused
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                     temperature=0, extra_body={"prediction": {"type": "content", "content": "x"}})
    assert chat.usage.completion_tokens_details.accepted_prediction_tokens is not None


@pytest.mark.parametrize("prediction", [{"type": "file", "content": "x"}, {"type": "content", "content": 3},
                                        {"type": "content"}, "text", {"type": "content", "content": [{"text": "x"}]}])
def test_a_malformed_prediction_is_a_400(live, prediction):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "prediction": prediction})
    assert r.status_code == 400 and "prediction" in r.text


def test_generate_prediction_file_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "hi", "--prediction", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert "cannot read the prediction file" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    assert main(["generate", "hi", "--prediction", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


QUOTED_CODE = "```python\ndef add(a, b):\n    return a + b  # the sum of a and b, as the caller expects\n```"
QUOTED = f"Rewrite this function with type hints:\n{QUOTED_CODE}\nKeep the comment."


def test_the_quoted_block_is_the_longest_fenced_block_of_the_last_message():
    from specdec.drafters.prediction import quoted_block
    assert quoted_block(QUOTED) == QUOTED_CODE
    assert quoted_block([{"role": "system", "content": "be brief"}, {"role": "user", "content": QUOTED}]) == QUOTED_CODE
    assert quoted_block([{"role": "user", "content": QUOTED}, {"role": "assistant", "content": "ok"}]) is None
    longer = "```\n" + "z = 1\n" * 20 + "```"
    assert quoted_block(QUOTED + "\nand\n" + longer) == longer
    assert quoted_block("a short one: ```x\ny```") is None and quoted_block("no code at all") is None
    assert quoted_block("an open fence ```python\n" + "x" * 100) is None and quoted_block([]) is None
    for odd in (None, 3, ["not a message"], [{"role": "user", "content": [{"type": "text"}]}], {"content": QUOTED}):
        assert quoted_block(odd) is None


@pytest.mark.real
def test_quoted_code_leaves_the_default_models_q8_output_as_target_only_greedy_and_seeded():
    """The production path: the default GGUF in q8 on the kernels, its draft (datastore+ngram) with the quoted
    block first; greedy token for token and seeded sampling text for text equal `none`'s."""
    sd, none = SpecDecoder(), SpecDecoder(draft="none")
    assert sd.numerics == "q8" and sd.prepare(QUOTED).quoted
    greedy = sd.generate(QUOTED, max_new_tokens=48)
    assert greedy.token_ids == none.generate(QUOTED, max_new_tokens=48).token_ids
    assert any(r.by == "prediction" for r in greedy.records)
    for seed in (1, 2):
        kw = dict(max_new_tokens=40, temperature=0.8, seed=seed)
        assert sd.generate(QUOTED, **kw).text == none.generate(QUOTED, **kw).text


def test_a_quoted_block_drafts_like_a_prediction_yet_changes_nothing_and_is_not_reported(rt, live, monkeypatch):
    """A chat request that quotes code and sends no prediction drafts from the quoted block (its first cycle
    proposes the block's start); the output is target-only's token for token, in the engine and over HTTP, and no
    prediction usage is reported. Target-only (`none`), an explicit prediction and a raw prompt do not quote."""
    from specdec import api
    from specdec.drafters.prediction import QUOTED_PRIOR
    none = SpecDecoder.from_models(rt.model, rt.tokenizer, draft="none")
    none.engine.eos_ids = set()
    base = none.generate(QUOTED, max_new_tokens=60)
    assert not any(r.by == "prediction" for r in base.records)
    out = rt.generate(QUOTED, max_new_tokens=60)
    assert out.token_ids == base.token_ids
    assert any(r.by == "prediction" for r in out.records)
    assert not any(k.endswith("_prediction_tokens") for k in out.stats)
    req = rt.prepare(QUOTED)
    assert req.quoted and req.prediction_prior == QUOTED_PRIOR and len(req.prediction) == len(QUOTED_CODE)
    assert none.prepare(QUOTED).prediction is None and rt.prepare(QUOTED, chat=False).prediction is None
    explicit = rt.prepare(QUOTED, prediction="abc")
    assert not explicit.quoted and explicit.prediction == rt.tokenizer("abc", add_special_tokens=False).input_ids
    monkeypatch.setattr(api, "QUOTED_DRAFTS", False)
    assert rt.prepare(QUOTED).prediction is None
    monkeypatch.undo()

    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=30)
    got = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUOTED}], max_tokens=40,
                                    temperature=0)
    assert got.choices[0].message.content == none.generate(QUOTED, max_new_tokens=40).text
    assert got.usage.completion_tokens_details is None
    assert got.model_extra["specdec"]["proposed"] > 0


def test_renames_do_not_compound():
    """A rename whose replacement holds what it replaces (x -> x x) learned again and again grew an 8,000-token
    prediction to 78,000: such a rename is not taken, and no rename takes the prediction past MAX_GROWTH x its
    length."""
    from specdec.drafters.prediction import MAX_GROWTH, PredictionDrafter
    d = PredictionDrafter([5, 7, 6] * 200, start=0)
    for _ in range(10):  # the output wrote [7, 7] where the prediction has [7], at its start, ten times over
        d.left, d.at = (1, 1), 2
        d._learn_rename([5, 7, 7, 6], 1)
    assert len(d.pred) == 600
    d = PredictionDrafter([5, 7, 6] * 200, start=0)
    for k in range(10):  # [7] -> [8, 8], then [8] -> [9, 9], ...: each a true rename, together a blow-up
        d.left, d.at = (1, 1), 2
        d.pred[1] = 7 + k
        d._learn_rename([5, 8 + k, 8 + k, 6], 1)
    assert len(d.pred) <= MAX_GROWTH * 600
