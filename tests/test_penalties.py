"""Presence and frequency penalties, logit_bias and the repetition penalty (penalties.py), and min_p over HTTP: the
rule on a row, on a verified chain (each row adjusted with the draft tokens before it), and on the real default
model: speculation gives exactly the adjusted target-only output (greedy token for token against an independent
step-by-step loop, seeded text for text), with a grammar too, in the batch engine and over HTTP; bad values are
clear errors."""
import json

import httpx
import pytest
import torch

from specdec.errors import InvalidRequest
from specdec.penalties import MAX_BIASES, Penalties, penalties
from specdec.sampling import PositionNoise, SamplingParams, warp
from specdec.verification import verify_constrained


def test_the_rule_on_one_row():
    p = Penalties(presence=0.5, frequency=0.25, bias={0: 10.0, 3: -100.0})
    for t in (2, 2, 1):
        p.accept(t)
    row = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p.masked(row).tolist() == [11.0, 1.25, 2.0, -96.0, 5.0]
    assert row.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # a copy: the verify block is not changed
    third = torch.tensor([0.1], dtype=torch.float64) - 0.1 - 0.3  # rounded once, in float64, then to float32
    q = Penalties(presence=0.3, frequency=0.1)
    q.accept(0)
    assert q.masked(torch.tensor([0.1]))[0].item() == float(third.float()[0])


def test_the_repetition_penalty_divides_what_is_positive_and_multiplies_the_rest():
    p = Penalties(frequency=0.5, bias={3: 1.0}, repetition=2.0, prompt=[0, 0, 2])
    p.accept(1)
    row = torch.tensor([3.0, -1.0, -4.0, 6.0, 5.0])
    # 0 and 2 from the prompt, 1 from the output (then its frequency penalty); 3 only biased, 4 untouched
    assert p.masked(row).tolist() == [1.5, -2.5, -8.0, 7.0, 5.0]
    assert Penalties(bias={3: 1.0}, prompt=[0]).masked(row).tolist() == [3.0, -1.0, -4.0, 7.0, 5.0]  # r = 1: no prompt


def test_a_drafts_view_counts_its_own_context_past_the_prompt():
    p = Penalties(frequency=1.0, repetition=2.0, prompt=[5, 6])
    p.accept(7)
    view = p.after([5, 6, 7, 8, 8])  # the prompt, the committed 7, then two drafted 8s
    assert view.counts == {7: 1, 8: 2} and p.counts == {7: 1}  # the request's own state untouched
    assert view.masked(torch.tensor([0.0] * 5 + [4.0, -4.0, 2.0, 6.0]))[5:].tolist() == [2.0, -8.0, 0.0, 1.0]


def test_a_window_penalises_only_its_last_tokens_of_prompt_and_output():
    """llama.cpp's repeat_last_n: the repetition penalty lowers what the last `window` tokens of prompt and output
    hold, the window sliding as tokens are accepted and over a draft's view; the frequency penalty still counts the
    whole output."""
    p = Penalties(frequency=0.5, repetition=2.0, prompt=[0, 1, 2], window=3)
    row = torch.tensor([4.0, 4.0, 4.0, 4.0, 4.0])
    assert p.masked(row).tolist() == [2.0, 2.0, 2.0, 4.0, 4.0]  # the whole prompt is the window
    p.accept(3)
    assert p.masked(row).tolist() == [4.0, 2.0, 2.0, 1.5, 4.0]  # 0 left the window; 3 counted once (-0.5)
    view = p.after([0, 1, 2, 3, 4, 4])
    assert view.masked(row).tolist() == [4.0, 4.0, 4.0, 1.5, 1.0] and p.recent == [1, 2, 3]
    assert penalties(100, repetition=2.0, prompt=[0], repetition_window=2).window == 2
    assert penalties(100, frequency=0.1, prompt=[0], repetition_window=2).window is None  # r = 1: no window
    with pytest.raises(InvalidRequest, match="window"):
        penalties(100, repetition=2.0, repetition_window=0)


def test_each_verify_row_sees_the_draft_tokens_before_it():
    """Row 1 is adjusted for draft token 1 at row 0: its argmax moves to token 2 and the second draft is rejected;
    without the count both would be accepted."""
    logits = torch.tensor([[0.0, 1.0, 0.9]] * 3)
    p = Penalties(frequency=0.5)
    assert verify_constrained([1, 1], logits, SamplingParams(), None, 0, p) == (1, 2)
    assert p.counts == {1: 1, 2: 1}  # the accepted draft and the target's token: the state of the next cycle
    assert verify_constrained([1, 1], logits, SamplingParams(), None, 0, Penalties()) == (2, 1)


def test_sampled_rows_race_on_the_adjusted_distribution():
    """Seeded sampling: each row's token is the race winner of warp(adjusted row), the draw target-only makes."""
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, seed=11)
    noise = params.generator()
    assert isinstance(noise, PositionNoise)
    p, ref, seq = Penalties(presence=1.5, bias={4: 2.0}), Penalties(presence=1.5, bias={4: 2.0}), []
    n, token = verify_constrained([5, 5, 5], logits, params, noise, 10, p)
    for i in range(n + 1):
        seq.append(noise.pick(warp(ref.masked(logits[i])[None], params), [10 + i])[0])
        ref.accept(seq[-1])
    assert [5] * n + [token] == seq


@pytest.mark.parametrize("bad", [
    dict(presence=2.5), dict(frequency=-3), dict(frequency=float("nan")), dict(presence=True),
    dict(logit_bias=[1]), dict(logit_bias={"x": 1}), dict(logit_bias={"-1": 1}), dict(logit_bias={"100": 1}),
    dict(logit_bias={"1": 101}), dict(logit_bias={"1": float("inf")}), dict(logit_bias={"1": "5"}),
    dict(logit_bias={str(i): 1 for i in range(MAX_BIASES + 1)}), dict(repetition=0.0), dict(repetition=2.5),
    dict(repetition=float("nan")), dict(repetition=-1)])
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidRequest):
        penalties(100, **bad)


def test_nothing_to_adjust_is_no_processor():
    assert penalties(100) is None and penalties(100, 0.0, 0.0, {"5": 0}) is None
    assert penalties(100, logit_bias={"5": -100}).bias == {5: -100.0}


# ---- the real default model --------------------------------------------------------------------------------------
PROMPTS = ["Write the word hello five times, one per line.", "List the numbers from 1 to 12.",
           "Write a Python function that returns the first n square numbers."]
ADJUST = dict(presence_penalty=0.4, frequency_penalty=0.6)


@pytest.fixture(scope="module")
def decoders():
    from specdec import SpecDecoder
    base = SpecDecoder(draft="none")
    return base, {d: SpecDecoder.from_models(base.model, base.tokenizer, d, tau=3)
                  for d in ("ngram", "datastore+ngram", "target")}


def step_by_step(sd, prompt: str, n: int, presence: float, frequency: float, bias: dict[int, float],
                 repetition: float = 1.0, window: int | None = None) -> list[int]:
    """Target-only greedy decoding written out: one step of the target a token, the rule applied in float64."""
    from specdec.kv import cached_model
    lm = cached_model(sd.model, sd.model.config.vocab_size)
    seq = sd.encode(prompt)
    counts: dict[int, int] = {}
    for _ in range(n):
        row = lm.forward(seq)[-1].double()
        seen = seq[-window:] if window else seq
        for v in set(counts) | set(bias) | (set(seen) if repetition != 1 else set()):
            if v in seen and repetition != 1:  # the prompt and the output so far (their last `window` tokens)
                row[v] = row[v] / repetition if row[v] > 0 else row[v] * repetition
            row[v] = row[v] + (bias.get(v, 0.0) - counts.get(v, 0) * frequency - (presence if v in counts else 0.0))
        token = int(row.float().argmax())
        seq.append(token)
        if token in sd.engine.eos_ids:
            break
        counts[token] = counts.get(token, 0) + 1
    lm.reset()
    return seq[len(sd.encode(prompt)):]


@pytest.mark.real
@pytest.mark.parametrize("presence,frequency,repetition", [(0.4, 0.6, 1.0), (1.5, 0.0, 1.0), (0.0, -0.3, 1.0),
                                                            (0.0, 0.0, 1.3), (0.2, 0.0, 0.8)])
def test_greedy_speculation_equals_the_adjusted_target_alone(decoders, presence, frequency, repetition):
    base, spec = decoders
    adjust = dict(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    changed = 0
    for p in PROMPTS:
        ref = base.generate(p, max_new_tokens=40, **adjust)
        assert ref.token_ids == step_by_step(base, p, 40, presence, frequency, {}, repetition)
        changed += ref.token_ids != base.generate(p, max_new_tokens=40).token_ids
        for name, sd in spec.items():
            assert sd.generate(p, max_new_tokens=40, **adjust).token_ids == ref.token_ids, (name, p)
    assert changed  # the penalties moved the output


@pytest.mark.real
def test_a_windowed_repetition_penalty_equals_the_target_alone(decoders):
    """llama.cpp's repeat_last_n (8 here): the output of every draft is the windowed target-only output, which
    differs from the whole-context penalty's."""
    base, spec = decoders
    for p in PROMPTS[:2]:
        ref = base.generate(p, max_new_tokens=40, repetition_penalty=1.3, repetition_window=8)
        assert ref.token_ids == step_by_step(base, p, 40, 0.0, 0.0, {}, 1.3, window=8)
        assert ref.token_ids != base.generate(p, max_new_tokens=40, repetition_penalty=1.3).token_ids
        for name, sd in spec.items():
            out = sd.generate(p, max_new_tokens=40, repetition_penalty=1.3, repetition_window=8)
            assert out.token_ids == ref.token_ids, (name, p)


@pytest.mark.real
@pytest.mark.parametrize("batched", [False, True])
def test_a_model_draft_adjusts_its_own_rows(decoders, batched):
    """The target as its own draft, under penalties: the draft's rows adjusted alike (SamplingParams.penalties,
    counted over its own context) propose exactly the adjusted target's tokens, so every draft is accepted."""
    from specdec.batch import BatchEngine, Sequence
    base, spec = decoders
    sd = spec["target"]
    for kw in (dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5, logit_bias={"28": -3})):
        for p in PROMPTS[:2]:
            if not batched:
                out = sd.generate(p, max_new_tokens=40, **kw)
                tokens, accepted, proposed = out.token_ids, out.stats["accepted"], out.stats["proposed"]
            else:
                engine = BatchEngine(sd.model, sd.engine.drafter, sd.model.config.vocab_size, sd.engine.eos_ids,
                                     sd.context_window, max_batch_rows=8)
                req = sd.prepare(p, max_new_tokens=40, **kw)
                seq = engine.add(Sequence(req.prompt_ids, 40, req.params, constraint=req.constraint))
                accepted = proposed = 0
                while engine.running:
                    for _, rec in engine.step():
                        if rec is not None:
                            accepted, proposed = accepted + rec.accepted, proposed + len(rec.proposed)
                engine.close()
                tokens = seq.generated
            assert tokens == base.generate(p, max_new_tokens=40, **kw).token_ids
            assert 0 < accepted == proposed, (kw, p, accepted, proposed)


@pytest.mark.real
def test_logit_bias_bans_and_forces_tokens(decoders):
    base, spec = decoders
    plain = base.generate(PROMPTS[1], max_new_tokens=12).token_ids
    banned = base.generate(PROMPTS[1], max_new_tokens=12, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned.token_ids
    forced = spec["ngram"].generate(PROMPTS[1], max_new_tokens=6, logit_bias={"42": 100})
    assert forced.token_ids[0] == 42
    bias = {plain[0]: -3.5, plain[1]: 2.0}
    assert spec["target"].generate(PROMPTS[1], max_new_tokens=20, logit_bias={str(k): v for k, v in bias.items()}
                                   ).token_ids == step_by_step(base, PROMPTS[1], 20, 0.0, 0.0, bias)
    with pytest.raises(InvalidRequest, match="not a token id of this model"):
        base.generate("x", max_new_tokens=2, logit_bias={str(base.model.config.vocab_size): 1})


@pytest.mark.real
def test_seeded_sampling_gives_the_same_text_whatever_the_draft(decoders):
    base, spec = decoders
    for p in PROMPTS:
        ref = base.generate(p, max_new_tokens=32, temperature=0.8, seed=7, **ADJUST).token_ids
        for name, sd in spec.items():
            assert sd.generate(p, max_new_tokens=32, temperature=0.8, seed=7, **ADJUST).token_ids == ref, name


@pytest.mark.real
def test_with_a_grammar_and_in_the_batch_engine(decoders):
    from specdec.batch import BatchEngine, Sequence
    base, spec = decoders
    schema = {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["words"], "additionalProperties": False}}}
    ask = "Give four words as JSON."
    ref = base.generate(ask, max_new_tokens=48, response_format=schema, **ADJUST)
    assert set(json.loads(ref.text)) == {"words"}
    assert spec["ngram"].generate(ask, max_new_tokens=48, response_format=schema, **ADJUST).token_ids == ref.token_ids
    sd = spec["datastore+ngram"]
    engine = BatchEngine(sd.model, sd.engine.drafter, sd.model.config.vocab_size, sd.engine.eos_ids,
                         sd.context_window, max_batch_rows=8)
    cases = [(p, ADJUST) for p in PROMPTS] + [(PROMPTS[0], {}), (PROMPTS[2], dict(frequency_penalty=-0.5))]
    seqs = []
    for p, kw in cases:
        req = sd.prepare(p, max_new_tokens=40, **kw)
        seqs.append(engine.add(Sequence(req.prompt_ids, 40, req.params, constraint=req.constraint)))
    while engine.running:
        engine.step()
    engine.close()
    for (p, kw), s in zip(cases, seqs):
        assert s.generated == base.generate(p, max_new_tokens=40, **kw).token_ids, (p, kw)


@pytest.mark.real
def test_a_model_draft_drafts_for_penalized_requests_in_the_batch_engine(decoders):
    """A model draft (the target as its own draft) proposes after the row split for requests under penalties or a
    grammar that forces nothing at the moment, and continues a grammar's forced tokens in a small batch; every output
    stays the request's own, target-only one."""
    from specdec.batch import BatchEngine, Sequence
    base, spec = decoders
    sd = spec["target"]
    engine = BatchEngine(sd.model, sd.engine.drafter, sd.model.config.vocab_size, sd.engine.eos_ids,
                         sd.context_window, max_batch_rows=12)
    schema = {"type": "json_object"}
    cases = [(PROMPTS[0], ADJUST), (PROMPTS[1], dict(repetition_penalty=1.2)), (PROMPTS[2], {}),
             ("Describe a cat as JSON.", dict(response_format=schema, frequency_penalty=0.3)),
             ("Describe a dog as JSON.", dict(response_format=schema)),
             (PROMPTS[2], dict(temperature=0.8, seed=4, **ADJUST))]
    seqs, accepted = [], {}
    for p, kw in cases:
        req = sd.prepare(p, max_new_tokens=32, **kw)
        seqs.append(engine.add(Sequence(req.prompt_ids, 32, req.params, constraint=req.constraint)))
    while engine.running:
        for seq, rec in engine.step():
            if rec is not None:
                accepted[seq.id] = accepted.get(seq.id, 0) + rec.accepted
    engine.close()
    for (p, kw), s in zip(cases, seqs):
        assert s.generated == base.generate(p, max_new_tokens=32, **kw).token_ids, (p, kw)
    assert all(accepted.get(s.id, 0) > 0 for s in seqs[:2] + seqs[3:])  # drafts were verified under penalties


@pytest.mark.real
def test_over_http(decoders):
    from specdec.server import create_app
    from test_server import LiveServer
    base, spec = decoders
    srv = LiveServer(create_app(spec["datastore+ngram"], model_name="tiny"))
    try:
        body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 30,
                **ADJUST, "logit_bias": {"28": -2.5}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want = base.generate(PROMPTS[0], max_new_tokens=30, logit_bias={"28": -2.5}, **ADJUST).text
        assert r.json()["choices"][0]["message"]["content"] == want
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0,
                                                          "frequency_penalty": 1.0, "presence_penalty": None})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == base.generate(
            "1, 2, 3,", max_new_tokens=8, chat=False, frequency_penalty=1.0).text
        sampled = {**body, "temperature": 1.0, "seed": 3, "min_p": 0.2}  # vLLM's min_p, beside the penalties
        r = httpx.post(srv.url + "/v1/chat/completions", json=sampled, timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == base.generate(
            PROMPTS[0], max_new_tokens=30, logit_bias={"28": -2.5}, temperature=1.0, seed=3, min_p=0.2, **ADJUST).text
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "repetition_penalty": 1.25}, timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == base.generate(
            PROMPTS[0], max_new_tokens=30, logit_bias={"28": -2.5}, repetition_penalty=1.25, **ADJUST).text
        for bad, field in (({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                           ({"repetition_penalty": True}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                           ({"logit_bias": {"5": 500}}, "logit_bias"), ({"logit_bias": ["5"]}, "logit_bias"),
                           ({"logit_bias": {"5": True}}, "logit_bias"), ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
                           ({"frequency_penalty": True}, "frequency_penalty")):
            for stream in (False, True):  # refused before a stream starts
                r = httpx.post(srv.url + "/v1/chat/completions", json={**body, **bad, "stream": stream}, timeout=60)
                assert r.status_code == 400 and field in r.json()["error"]["message"], (bad, r.text)
    finally:
        srv.stop()
