"""End-to-end losslessness on tiny random models: speculative output == the target alone."""
import pytest
import torch
from tiny import VOCAB, char_tokenizer, reference_greedy, tiny_llama

from specdec import InvalidRequest, SpecDecoder
from specdec.drafters import ChainDrafter, ModelDrafter, NgramDrafter, NoDrafter
from specdec.engine import Engine
from specdec.sampling import SamplingParams

PROMPTS = ["Hello world", "def f(x):\n    return x", "abcabcabc", "The quick brown fox", "q", "1 2 3 4 5 6",
           "~!@#$%^&*()"]
GREEDY = SamplingParams()


def engine_for(target, drafter, eos=(), window=256):
    return Engine(target, drafter, VOCAB, set(eos), window)


def run_ids(engine, prompt_ids, n, tau, params=GREEDY, stop=None):
    recs = list(engine.run(prompt_ids, n, params, tau, stop))
    return [t for r in recs for t in r.emitted], recs


def make_drafter(kind, target, draft_random, draft_close):
    return {"none": NoDrafter(), "ngram": NgramDrafter(), "self": ModelDrafter(target, VOCAB),
            "random": ModelDrafter(draft_random, VOCAB), "close": ModelDrafter(draft_close, VOCAB)}[kind]


@pytest.mark.parametrize("kind", ["none", "ngram", "self", "random", "close"])
@pytest.mark.parametrize("tau", [1, 2, 3, 5, 8])
def test_greedy_token_identical_to_target_alone(kind, tau, tok, target, draft_random, draft_close):
    engine = engine_for(target, make_drafter(kind, target, draft_random, draft_close))
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        got, recs = run_ids(engine, ids, 40, tau)
        assert got == reference_greedy(target, ids, 40), (kind, tau, prompt)
        assert len(got) == 40 and recs[-1].finish_reason == "length"
        for r in recs:  # the trace is consistent with what happened
            assert len(r.proposed) <= tau and 0 <= r.accepted <= len(r.proposed)
            assert r.emitted[: r.accepted] == r.proposed[: r.accepted]


def test_drafters_exercise_partial_acceptance(tok, target, draft_close):
    """The losslessness test above is meaningful: the close draft is accepted sometimes, rejected sometimes."""
    engine = engine_for(target, ModelDrafter(draft_close, VOCAB))
    recs = [r for p in PROMPTS for r in run_ids(engine, tok(p).input_ids, 40, 4)[1]]
    accepted = [r.accepted for r in recs]
    assert 0 < sum(accepted) < sum(len(r.proposed) for r in recs)
    assert any(a == 4 for a in accepted) and any(0 < a < 4 for a in accepted) and 0 in accepted
    self_recs = run_ids(engine_for(target, ModelDrafter(target, VOCAB)), tok("Hello").input_ids, 30, 4)[1]
    assert all(r.accepted == len(r.proposed) for r in self_recs)  # the target as its own draft: all accepted


def test_each_cycle_names_the_member_of_a_chain_that_drafted_it(tok, target, draft_close):
    """`by`: a chain's cycle is booked to its member that proposed (the copy where the text repeats, the model
    elsewhere), a lone drafter's to itself, and a cycle that proposed nothing to nobody."""
    chain = ChainDrafter([NgramDrafter(), ModelDrafter(draft_close, VOCAB, name="close")])
    recs = run_ids(engine_for(target, chain), tok("the cat sat on the mat. the cat sat on the").input_ids, 40, 3)[1]
    assert recs[0].by == "ngram" and {r.by for r in recs if r.proposed} == {"ngram", "close"}
    assert all(r.by is None for r in recs if not r.proposed)
    alone = run_ids(engine_for(target, ModelDrafter(draft_close, VOCAB, name="close")), tok("Hello").input_ids, 20, 3)[1]
    assert {r.by for r in alone if r.proposed} == {"close"}


@pytest.mark.parametrize("kind", ["none", "ngram", "close"])
@pytest.mark.parametrize("tau", [1, 3, 8])
def test_eos_stops_and_nothing_after_it(kind, tau, tok, target, draft_random, draft_close):
    ids = tok("Once upon a time").input_ids
    ref = reference_greedy(target, ids, 40)
    eos = ref[7]  # a token the target really produces, first at index ref.index(eos)
    got, recs = run_ids(engine_for(target, make_drafter(kind, target, draft_random, draft_close), eos=[eos]), ids,
                        40, tau)
    assert got == ref[: ref.index(eos) + 1]
    assert recs[-1].finish_reason == "stop"


def test_kv_rollback_continuation_equals_fresh_run(tok, target, draft_close):
    """After rejections, the caches hold exactly the committed text: continuing equals a fresh run."""
    drafter = ModelDrafter(draft_close, VOCAB)
    engine = engine_for(target, drafter)
    ids = tok("Hello world").input_ids
    first, recs = run_ids(engine, ids, 17, 5)
    assert any(r.accepted < len(r.proposed) for r in recs)
    lm = engine.target
    assert lm.tokens == (ids + first)[:-1] and lm.cache.get_seq_length() == len(lm.tokens)
    assert drafter.lm.tokens == (ids + first)[: len(drafter.lm.tokens)]
    # continue from the committed text with the live caches (not reset): feed it through CachedModel directly
    nxt = lm.forward(ids + first)[-1]
    fresh = target(torch.tensor([ids + first])).logits[0, -1]
    assert torch.allclose(nxt, fresh, atol=1e-9)
    more, _ = run_ids(engine, ids + first, 20, 5)
    assert first + more == reference_greedy(target, ids, 37)


@pytest.mark.parametrize("draft", ["ngram", "none", "close"])
def test_stop_strings_cut_text_and_tokens(draft, tok, target, draft_close):
    drafter = ModelDrafter(draft_close, VOCAB, "close") if draft == "close" else draft
    sd = SpecDecoder.from_models(target, tok, draft=drafter, tau=4)
    full = sd.generate("abc", max_new_tokens=40, chat=False)
    text = full.text
    stop = text[10:13]
    cut = text.find(stop)
    out = sd.generate("abc", max_new_tokens=40, chat=False, stop=[stop, "NEVER"])
    assert out.text == text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    streamed = "".join(sd.stream("abc", max_new_tokens=40, chat=False, stop=stop))
    assert streamed == out.text


def test_stream_concatenates_to_generate(tok, target, draft_close):
    sd = SpecDecoder.from_models(target, tok, draft=draft_close, tau=3)
    out = sd.generate("Hello", max_new_tokens=30)
    assert "".join(sd.stream("Hello", max_new_tokens=30)) == out.text
    s = out.stats
    assert s["new_tokens"] == 30 == len(out.token_ids)
    assert s["target_passes"] == s["cycles"] == len(out.records)
    assert s["accepted"] == sum(r.accepted for r in out.records)
    assert s["acceptance_rate"] == round(s["accepted"] / s["proposed"], 4)


def test_chat_template_and_no_chat(tok, target):
    sd = SpecDecoder.from_models(target, tok, draft="none")
    assert sd.encode("hi") == tok("<user>hi\n<assistant>", add_special_tokens=False).input_ids
    assert sd.encode("hi", chat=False) == tok("hi").input_ids


def test_context_window_limits_generation(tok):
    small = tiny_llama(seed=0, max_pos=32)
    sd = SpecDecoder.from_models(small, tok, draft="ngram", tau=8)
    out = sd.generate("x" * 20, max_new_tokens=100, chat=False)
    assert out.prompt_tokens + len(out.token_ids) == 32 and out.finish_reason == "length"


def sample_counts(sd, prompt, n, params, tokens=2, seeded=True):
    """Seeded: seed i per sample (PositionNoise races). Unseeded: the rejection sampler, its private generator
    seeded from torch's global RNG, which is seeded per sample for a reproducible test."""
    counts = {}
    for seed in range(n):
        if not seeded:
            torch.manual_seed(seed)
        ids = sd.generate(prompt, max_new_tokens=tokens, chat=False, seed=seed if seeded else None,
                          **params).token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=3), dict(temperature=0.8, top_p=0.7),
                                    dict(temperature=1.3, min_p=0.12)])
def test_sampling_first_tokens_match_exact_target_distribution(params, seeded, tok, target, draft_close):
    """Speculative sampling on a real (tiny) model, by either rule: the first two tokens ~ the target's exact
    joint."""
    from specdec.sampling import warp
    from test_verification import chi2_pvalue

    sp = SamplingParams(**params)
    ids = tok("ab").input_ids
    with torch.inference_mode():
        p1 = warp(target(torch.tensor([ids])).logits[0, -1], sp)
        support = p1.nonzero().flatten().tolist()
        joint = {}
        for a in support:
            p2 = warp(target(torch.tensor([ids + [a]])).logits[0, -1], sp)
            for b in p2.nonzero().flatten().tolist():
                joint[(a, b)] = float(p1[a] * p2[b])
    sd = SpecDecoder.from_models(target, tok, draft=draft_close, tau=3)
    counts = sample_counts(sd, "ab", 1500, params, seeded=seeded)
    keys = sorted(set(joint) | set(counts))
    pv = chi2_pvalue(torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64),
                     torch.tensor([joint.get(k, 0.0) for k in keys], dtype=torch.float64))
    assert pv > 1e-3, (pv, counts)


def test_seeded_sampling_is_reproducible(tok, target, draft_close):
    sd = SpecDecoder.from_models(target, tok, draft=draft_close, tau=3)
    a = sd.generate("Hello", max_new_tokens=20, temperature=1.0, seed=42)
    b = sd.generate("Hello", max_new_tokens=20, temperature=1.0, seed=42)
    c = sd.generate("Hello", max_new_tokens=20, temperature=1.0, seed=43)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_seeded_text_is_the_same_whatever_the_drafter_tau_and_policy(tok, target, draft_close):
    """A seed fixes the text (sampling.PositionNoise): a sampling draft model, an n-gram drafter, no drafter and
    every τ and policy give the tokens target-only sampling gives with that seed, while drafts are accepted."""
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, chat=False)
    alone = SpecDecoder.from_models(target, tok, draft="none")
    for seed in (1, 2, 3):
        ref = alone.generate("Hello", seed=seed, **kw).token_ids
        accepted = 0
        for draft in (draft_close, "ngram"):
            for tau in (1, 2, 4, 7):
                for policy in ("fixed", "adaptive"):
                    sd = SpecDecoder.from_models(target, tok, draft=draft, tau=tau, policy=policy)
                    out = sd.generate("Hello", seed=seed, **kw)
                    assert out.token_ids == ref, (seed, draft, tau, policy)
                    accepted += out.stats["accepted"]
        assert accepted > 0  # drafts were really verified


def test_incompatible_draft_model_refused(tok, target, draft_close):
    from specdec import IncompatibleDraft
    with pytest.raises(IncompatibleDraft, match="different tokenizer"):
        SpecDecoder.from_models(target, tok, draft=draft_close, draft_tokenizer=char_tokenizer(shift=7))


def test_few_row_linears_same_math_on_this_model_only():
    """The decode/verify linear layouts (MKL GEMM for 1-2 rows, oneDNN for more) give the stock result for every
    row count and shape, follow weight updates, keep autograd working, and are installed on the given model only."""
    from torch import nn
    from torch.nn import functional as F
    from specdec.kv import few_row_linears, stock_linears
    torch.manual_seed(0)
    mine, other = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False)), nn.Linear(16, 32)
    few_row_linears(mine)
    for rows in (1, 2, 3, 5, 8, 9, 64):
        for shape in ((rows, 16), (1, rows, 16), (2, rows, 16)):
            x = torch.randn(*shape)
            ref = F.linear(F.linear(x, mine[0].weight, mine[0].bias), mine[1].weight)
            with torch.inference_mode():  # as in decoding: 3+ rows take oneDNN
                out = mine(x)
            assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
    assert all(m._few_rows for m in mine) and not hasattr(other, "_few_rows")
    from specdec.kv import _ONEDNN
    assert hasattr(mine[0], "_packed") == _ONEDNN
    x = torch.randn(5, 16)
    with torch.no_grad():
        mine[0].weight.mul_(2)  # the oneDNN copy of the weight is redone when the weight changes
        assert torch.allclose(mine[0](x), F.linear(x, mine[0].weight, mine[0].bias), atol=1e-5)
    y = mine(x.requires_grad_())  # training: the autograd path, gradients flow
    y.sum().backward()
    assert x.grad is not None and mine[0].weight.grad is not None
    assert other.forward.__func__ is nn.Linear.forward
    with stock_linears(mine):  # the bench's transformers rows run the stock layers
        assert all(m.forward.__func__ is nn.Linear.forward for m in mine)
    assert all(m._few_rows and "forward" in vars(m) for m in mine)


def test_stop_strings_are_bounded(tok, target):
    sd = SpecDecoder.from_models(target, tok, "ngram")
    for stop in (["a"] * 5, ["y" * 257]):
        with pytest.raises(InvalidRequest, match="up to 4 non-empty strings of at most 256"):
            sd.generate("abc", max_new_tokens=4, chat=False, stop=stop)


def test_a_stop_string_before_eos_in_the_same_cycle_cuts_the_tokens_there():
    """token_ids (and usage) end where the text ends: the stop string, not the EOS drafted after it."""
    from specdec.engine import cut
    stop = lambda ids: 1 if ids[:1] == [5] else None  # noqa: E731  the first generated token completes a stop
    assert cut([5, 6, 2], [1], 1, stop, 10, {2}, 256) == ([5], "stop")
    assert cut([7, 6, 2], [1], 1, stop, 10, {2}, 256) == ([7, 6, 2], "stop")  # no stop: the EOS ends it
    assert cut([7, 6], [1], 1, stop, 2, {2}, 256) == ([7, 6], "length")


def test_encoding_and_decoding_use_separate_tokenizers_each_under_its_lock(tok, target, monkeypatch):
    """The server encodes prompts on request threads while the worker decodes: each side has its own copy of the
    tokenizer (fast tokenizers are not safe to share across threads) and its own lock, so a long prompt being
    encoded never holds up the worker's streams."""
    sd = SpecDecoder.from_models(target, tok, "ngram")
    assert sd._encoder is not sd.tokenizer
    seen = []
    for name in ("decode", "apply_chat_template", "__call__"):
        original = getattr(type(tok), name)
        monkeypatch.setattr(type(tok), name, lambda self, *a, _o=original, **kw: seen.append(
            (self is sd._encoder, (sd._encoder_lock if self is sd._encoder else sd.tokenizer_lock).locked()))
            or _o(self, *a, **kw))
    sd.generate("Hello", max_new_tokens=6, stop=["zz"])
    assert {side for side, _ in seen} == {True, False} and all(held for _, held in seen)


@pytest.mark.parametrize("tau", [5, 6, 7, 8])
def test_greedy_identity_in_fp32_on_the_transformers_backend(tok, tau):
    """fp32 (the production dtype) where verify passes of 6-9 rows cross the transformers backend's linear-layer
    paths: still token-identical to the target alone through the same engine."""
    target32 = tiny_llama(seed=0, dtype=torch.float32)
    base = SpecDecoder.from_models(target32, tok, "none")
    for draft in ("target", NgramDrafter()):
        spec = SpecDecoder.from_models(target32, tok, draft, tau=tau)
        for prompt in ("Hello there", "abcabcabc"):
            want = base.generate(prompt, max_new_tokens=30, chat=False).token_ids
            got = spec.generate(prompt, max_new_tokens=30, chat=False)
            assert got.token_ids == want, (tau, draft, prompt)
    assert got.stats["proposed"] > 0


def test_stop_checks_are_outside_the_timed_verify_section(tok, target, monkeypatch):
    """verify_ms is the target's cost (the adaptive policy reads it); stop checks and detokenizing are not."""
    import specdec.engine
    clock = {"now": 0.0}
    monkeypatch.setattr(specdec.engine, "perf_counter", lambda: clock["now"])

    def slow_stop(ids):
        clock["now"] += 1.0  # a stop check that costs a whole second on the engine's clock
        return None
    engine = Engine(target, NgramDrafter(), VOCAB, set(), 256)
    recs = list(engine.run(tok("abcabc").input_ids, 5, GREEDY, 2, slow_stop))
    assert all(r.verify_ms < 1000 <= r.cycle_ms for r in recs)
