"""A model draft's chain stops once its own estimate that the whole chain is accepted (the product of its tokens'
probabilities: greedy, the argmax's softmax probability; sampled, q of the token drawn) falls below the drafter's
min_confidence (drafters/model.py). The policy's k is then a cap; what the chain holds is unchanged."""
import pytest
import torch
from test_engine import PROMPTS, engine_for, run_ids, sample_counts
from test_verification import chi2_pvalue
from tiny import VOCAB, reference_greedy

from specdec import SpecDecoder, models
from specdec.drafters.base import propose_many
from specdec.drafters.model import MIN_CONFIDENCE, ModelDrafter
from specdec.sampling import SamplingParams, warp

K = 6
GREEDY, SAMPLED = SamplingParams(), SamplingParams(0.8, 1.0, 0, 5)


@pytest.fixture(autouse=True)
def production_threshold(monkeypatch):
    monkeypatch.setattr("specdec.drafters.model.MIN_CONFIDENCE", MIN_CONFIDENCE)  # conftest turns it off


@pytest.fixture(scope="module")
def draft_model(tiny_dirs):
    return models.load(tiny_dirs["draft"], backend="runtime")[0]


def drafter(model, min_confidence: float) -> ModelDrafter:
    d = ModelDrafter(model, model.config.vocab_size)
    d.draft_cache, d.min_confidence = None, min_confidence
    return d


def context(seed: int) -> list[int]:
    return torch.randint(3, 60, (11 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_chain(model, ctx, params, seed):
    """The chain of K tokens, and after each token the draft's estimate that the chain so far is accepted, computed
    here from the draft's logits over the chain itself (greedy) or from the q it returned (sampled)."""
    d = drafter(model, 0.0)
    got = d.propose(ctx, K, params, torch.Generator().manual_seed(seed))
    d.close()
    if params.greedy:
        ref = drafter(model, 0.0)
        logits = ref.lm.forward(ctx + got.tokens[:-1], n_logits=K).float()
        ref.close()
        probs = [float(torch.softmax(logits[j], 0)[t]) for j, t in enumerate(got.tokens)]
        assert all(int(logits[j].argmax()) == t for j, t in enumerate(got.tokens))
    else:
        probs = [float(got.q[j][t]) for j, t in enumerate(got.tokens)]
    reach = torch.tensor(probs, dtype=torch.float64).cumprod(0).tolist()
    return got.tokens, reach


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_chain_stops_where_its_confidence_falls_below_the_threshold(draft_model, params):
    """For each cut j, a threshold between the estimate after token j and after j + 1 keeps exactly j + 1 tokens,
    the full chain's first j + 1, in a batched call where every request stops at its own step."""
    draft_model.pool.clear_hashes()
    cases = []
    for seed in range(4):
        ctx = context(seed)
        tokens, reach = full_chain(draft_model, ctx, params, seed)
        assert len(tokens) == K
        for j in range(K - 1):
            if reach[j] > reach[j + 1] * 1.01:  # a gap the threshold can sit in
                cases.append((ctx, seed, tokens[: j + 2], (reach[j] + reach[j + 1]) / 2))
    assert len({len(want) for *_, want, _ in cases}) >= 3, "the cuts should span several lengths"
    forks = [drafter(draft_model, threshold) for *_, threshold in cases]
    got = propose_many(forks, [c[0] for c in cases], [K] * len(cases), [params] * len(cases),
                       [torch.Generator().manual_seed(c[1]) for c in cases])
    for (ctx, seed, want, threshold), draft in zip(cases, got):
        assert draft.tokens == want, (seed, threshold)
        full = full_chain(draft_model, ctx, params, seed)[1]
        assert draft.values == pytest.approx(full[: len(want)], rel=1e-5)  # what the scheduler sizes it by
        assert params.greedy or len(draft.q) == len(want)
    for f in forks:
        f.close()


def test_an_unsure_draft_proposes_one_token_and_a_sure_one_its_full_k(draft_model, monkeypatch):
    """The default threshold: the random draft's first token is already below it, so each chain is one token (one
    pass); a threshold of 0 runs every chain to k."""
    for seed in range(3):
        ctx = context(seed)
        _, reach = full_chain(draft_model, ctx, GREEDY, seed)
        assert reach[0] < MIN_CONFIDENCE  # the premise: a random draft is unsure
        passes, real = [], draft_model.forward
        monkeypatch.setattr(draft_model, "forward", lambda *a, **k: passes.append(1) or real(*a, **k))
        d = drafter(draft_model, MIN_CONFIDENCE)
        assert len(d.propose(ctx, K, GREEDY, None).tokens) == 1 and len(passes) == 1
        d.close()
        monkeypatch.setattr(draft_model, "forward", real)
        assert len(drafter(draft_model, 0.0).propose(ctx, K, GREEDY, None).tokens) == K


def test_a_fork_keeps_its_templates_threshold(draft_model):
    d = drafter(draft_model, 0.25)
    assert d.fork().min_confidence == 0.25
    assert ModelDrafter(draft_model, draft_model.config.vocab_size).min_confidence == MIN_CONFIDENCE


def stopping(draft, threshold) -> ModelDrafter:
    d = ModelDrafter(draft, VOCAB)
    d.min_confidence = threshold
    return d


def test_stopped_chains_keep_greedy_output_token_identical(tok, target, draft_close):
    """Through the engine, at the default threshold: the target's own greedy tokens, with chains of every length up
    to τ (and some not drafted past their first token)."""
    engine = engine_for(target, stopping(draft_close, MIN_CONFIDENCE))
    lengths = set()
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        got, recs = run_ids(engine, ids, 40, 6)
        assert got == reference_greedy(target, ids, 40), prompt
        lengths |= {len(r.proposed) for r in recs}
    assert {1, 2} <= lengths and max(lengths) < 6


def test_stopped_chains_keep_seeded_text_and_the_targets_distribution(tok, target, draft_close):
    """Sampled chains stop on q of the tokens drawn (a decision on what was drafted before each position): seeded,
    the text target-only sampling gives; unseeded, the first two tokens ~ the target's exact joint."""
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, chat=False)
    alone = SpecDecoder.from_models(target, tok, draft="none")
    sd = SpecDecoder.from_models(target, tok, draft=stopping(draft_close, 0.3), tau=4)
    for seed in (1, 2, 3):
        out = sd.generate("Hello", seed=seed, **kw)
        assert out.token_ids == alone.generate("Hello", seed=seed, **kw).token_ids
    lengths = {len(r.proposed) for r in out.records}
    assert len(lengths - {0}) >= 2  # chains stopped at different steps
    params = dict(temperature=1.0, top_k=3)
    sp, ids = SamplingParams(**params), tok("ab").input_ids
    with torch.inference_mode():
        p1 = warp(target(torch.tensor([ids])).logits[0, -1], sp)
        joint = {(a, b): float(p1[a] * pb[b]) for a in p1.nonzero().flatten().tolist()
                 for pb in [warp(target(torch.tensor([ids + [a]])).logits[0, -1], sp)]
                 for b in pb.nonzero().flatten().tolist()}
    counts = sample_counts(sd, "ab", 1500, params, seeded=False)
    keys = sorted(set(joint) | set(counts))
    pv = chi2_pvalue(torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64),
                     torch.tensor([joint.get(k, 0.0) for k in keys], dtype=torch.float64))
    assert pv > 1e-3, (pv, counts)
