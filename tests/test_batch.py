"""Continuous batching on the runtime: whatever a request is batched with, and whenever it joins or others leave,
it gets the tokens it gets alone (greedy: bitwise logits; seeded sampling: per-position noise)."""
import pytest
import torch

from specdec import SpecDecoder, models
from specdec.api import build_drafter
from specdec.batch import (
    EARLY_MODEL_BATCH,
    BatchEngine,
    Sequence,
    default_budget,
    lower_envelope,
    measure_pass_curve,
)
from specdec.drafters.model import ModelDrafter
from specdec.runtime.blocks import BLOCK
from specdec.sampling import SamplingParams

PROMPTS = ["Hello there, general", "abcabcabcabc", "The cat sat on the mat. The cat", "xyz", "Once upon a time"]
PARAMS = [SamplingParams(), SamplingParams(0.9, 0.95, 0, 7), SamplingParams(), SamplingParams(1.0, 1.0, 5, 3),
          SamplingParams(0.7, 1.0, 0, 11)]


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


def alone(rt, prompt, params, n):
    """The request on its own, through the one-request engine, without speculation."""
    model, tok = rt
    sd = SpecDecoder.from_models(model, tok, draft="none")
    return sd.generate(prompt, max_new_tokens=n, chat=False, temperature=params.temperature, top_p=params.top_p,
                       top_k=params.top_k, seed=params.seed).token_ids


def feature_drafter(model):
    """A feature draft (random weights, full blocks) on the runtime model's embedding and head."""
    from specdec.drafters.feature import FeatureDrafter
    from specdec.drafters.feature_net import FeatureDraftNet
    torch.manual_seed(0)
    c = model.config
    net = FeatureDraftNet(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, 32, 10000.0, 1e-5)
    return FeatureDrafter(net, model.embed, model.head, torch.arange(c.vocab_size), c.vocab_size, name="feature",
                          min_confidence=0.0, max_len=128)


@pytest.mark.parametrize("draft", ["ngram", "target", "draft", "feature", "ngram+feature", "recycle"])
def test_requests_joining_and_leaving_get_what_they_get_alone(rt, tiny_dirs, draft, tmp_path):
    model, tok = rt
    if draft == "recycle":  # token trees, their table warmed on the same prompts run alone
        drafter = build_drafter(f"recycle:{tmp_path / 'table.safetensors'}", model, tok)
        warm = SpecDecoder.from_models(model, tok, draft=drafter)
        for p in PROMPTS:
            warm.generate(p, max_new_tokens=40, chat=False)
    elif "feature" in draft:
        from specdec.drafters import ChainDrafter, NgramDrafter
        drafter = feature_drafter(model) if draft == "feature" else ChainDrafter([NgramDrafter(),
                                                                                   feature_drafter(model)])
    else:
        drafter = build_drafter(tiny_dirs["draft"] if draft == "draft" else draft, model, tok, backend="runtime")
    engine = BatchEngine(model, drafter, model.config.vocab_size, models.eos_ids(model, tok), 128,
                         max_batch_rows=9, prefill_chunk=4)  # prompts take several chunks; rows are scarce
    engine.pass_ms = lambda rows: 10.0 + 0.1 * rows  # rows pay at any acceptance, however busy the machine
    held = model.held_slots  # by the template drafter ("target" drafts in a slot of its own)
    seqs = [Sequence(tok(p).input_ids, 24 + 3 * i, params, max_tau=4 + i % 3)
            for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
    joins = {0: [0, 1], 2: [2], 5: [3, 4]}  # step -> requests joining then
    cancelled, done, accepted, proposed, rows, trees, sampled_trees = seqs[4], [], 0, 0, [], 0, 0
    for step in range(400):
        for i in joins.get(step, []):
            engine.add(seqs[i])
        if step == 9:
            engine.remove(cancelled)  # a client that went away: the others carry on
        for s, rec in engine.step():
            accepted += rec.accepted
            proposed += len(rec.proposed)
            trees += bool(rec.parents)
            sampled_trees += bool(rec.parents) and not s.params.greedy
            if rec.finish_reason:
                done.append(s)
        rows.append(engine.last.get("rows", 0))
        if not engine.running and step > 5:
            break
    assert len(done) == 4 and cancelled not in done and not engine.running
    assert max(rows) <= 9 and max(rows) > 4  # several requests shared passes, within the budget
    for s in done:
        i = seqs.index(s)
        assert s.generated == alone(rt, PROMPTS[i], PARAMS[i], s.max_new_tokens), (draft, i)
    if draft in ("target", "draft", "recycle"):  # (a random model rarely repeats itself; a random feature draft errs)
        assert accepted > 0
    if draft == "recycle":
        assert trees > 0
    if "feature" in draft:
        assert proposed > 0  # the batched feature drafting ran
    if draft == "feature" and drafter._rt is not None:
        assert trees > 0 and sampled_trees > 0  # greedy and seeded sampled requests drafted batched trees
    # the prompts' blocks stay named for later requests; for a drafter reading target features, with theirs
    assert len(model.pool.by_hash) > 0 and (set(model.pool.kept) == set(model.pool.by_hash)) == ("feature" in draft)
    assert model.held_slots == held
    engine.close()
    assert model.held_slots == held


def test_a_chains_model_free_member_proposes_before_the_split_in_a_big_batch(rt, monkeypatch):
    """`ngram+feature` with more requests decoding than EARLY_MODEL_BATCH: every n-gram copy is proposed before the
    verification budget splits the rows (so the split sizes it on what it holds, with the copies' own acceptance
    estimates); after the split the chain finds no copy it had not offered; every output still equals the request
    alone."""
    import specdec.batch.engine as be
    from specdec.drafters import ChainDrafter, NgramDrafter
    model, tok = rt
    events, real_plan, real_propose = [], be.plan, NgramDrafter.propose

    def ngram(self, context, *a):
        draft = real_propose(self, context, *a)
        events.append(("ngram", tuple(context), bool(draft.tokens), draft.match))
        return draft
    monkeypatch.setattr(NgramDrafter, "propose", ngram)
    monkeypatch.setattr(be, "plan", lambda *a, **k: events.append(("plan", len(a[0]))) or real_plan(*a, **k))
    engine = BatchEngine(model, ChainDrafter([NgramDrafter(), feature_drafter(model)]), model.config.vocab_size,
                         models.eos_ids(model, tok), 128, max_batch_rows=32, prefill_chunk=8)

    class Kept(dict):  # the copies' estimates, kept after their requests leave
        def pop(self, key, default=None):
            return self.get(key, default)
    engine._copy_est = Kept()
    observed, real_observe = [], be.AdaptivePolicy.observe
    monkeypatch.setattr(be.AdaptivePolicy, "observe", lambda self, rec: observed.append(self) or real_observe(self, rec))
    prompts = [p + " one two three one two three one two" for p in PROMPTS] * 2  # copies for the n-gram
    seqs = [engine.add(Sequence(tok(p).input_ids, 20, SamplingParams())) for p in prompts[:7]]
    copies, after_split, copy_updates, buckets = 0, 0, 0, set()
    while engine.running:
        events.clear(), observed.clear()
        engine.step()
        split = next((i for i, e in enumerate(events) if e[0] == "plan"), len(events))
        copied = sum(e[0] == "ngram" and e[2] for e in events[:split])
        buckets |= {sum(e[3] >= b for b in be.COPY_BUCKETS[1:]) for e in events[:split] if e[0] == "ngram" and e[2]}
        big = split < len(events) and events[split][1] > be.EARLY_MODEL_BATCH
        copies += big and copied
        after_split += big and sum(e[0] == "ngram" and e[2] for e in events[split:])
        # each copy updates its request's copy estimates, and nothing else does (the model draft's stay its own)
        mine = sum(any(o is c for b in engine._copy_est.values() for c in b.values()) for o in observed)
        assert mine == copied
        copy_updates += mine
    assert copies > 0 and after_split == 0 and copy_updates >= copies
    # a copy's estimates are those of its match length's bucket: short and long matches learn apart
    assert len(buckets) > 1 and {b for kept in engine._copy_est.values() for b in kept} == buckets
    # a sampled request's copies share one set, whatever their match (its token follows the match less)
    sampled = [engine.add(Sequence(tok(p).input_ids, 20, SamplingParams(temperature=0.8, seed=i)))
               for i, p in enumerate(prompts[:6])]
    while engine.running:
        engine.step()
    assert {b for s in sampled for b in engine._copy_est.get(s.id, {})} == {0}
    for s, p in zip(seqs, prompts):
        assert s.generated == alone(rt, p, SamplingParams(), 20)


def test_one_request_alone_in_the_batch_engine_equals_the_engine(rt):
    model, tok = rt
    sd = SpecDecoder.from_models(model, tok, draft="ngram", tau=3)
    engine = BatchEngine(model, sd.engine.drafter, model.config.vocab_size, sd.engine.eos_ids, 128)
    for p in PROMPTS[:3]:
        seq = engine.add(Sequence(tok(p).input_ids, 30, SamplingParams()))
        while engine.running:
            engine.step()
        assert seq.generated == sd.generate(p, max_new_tokens=30, chat=False).token_ids


def test_pass_curve_and_default_budget(rt):
    curve = measure_pass_curve(rt[0], sizes=(1, 2, 4, 8), context=8, reps=1)
    assert sorted(curve) == [1, 2, 4, 8] and all(v > 0 for v in curve.values())
    assert all(curve[a] <= curve[b] for a, b in [(1, 2), (2, 4), (4, 8)])
    # a disturbed size (2 rows slower than 4: noise only adds time) takes the larger size's time
    assert lower_envelope({1: 16.2, 2: 31.2, 4: 26.2, 8: 35.0}) == {1: 16.2, 2: 26.2, 4: 26.2, 8: 35.0}
    assert default_budget({1: 10, 2: 10.5, 4: 12, 8: 16, 16: 60}) == 8  # rows 9-16 cost 5.5 ms each: > half of 10
    assert default_budget({1: 10, 2: 30, 4: 90, 8: 200, 16: 400}) == 8  # never under 8 rows where measured (MIN_BUDGET)


def test_full_batch_refuses_a_request(rt):
    model, tok = rt
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, {2}, 128,
                         max_batch_rows=2)
    engine.add(Sequence([5, 6], 4, SamplingParams()))
    engine.add(Sequence([5, 6], 4, SamplingParams()))
    with pytest.raises(RuntimeError, match="full"):
        engine.add(Sequence([5, 6], 4, SamplingParams()))
    torch.manual_seed(0)
    while engine.running:
        engine.step()


def test_prefix_cache_copies_a_shared_prompt_prefix_and_changes_nothing(rt):
    """A second request sharing a long prompt prefix starts from the cached K/V (fewer prefill rows) and gets
    bitwise what it gets alone; a drafter reading target hidden states turns the cache off."""
    model, tok = rt
    system = "You are a careful assistant. Answer briefly. "
    prompts = [system + "Hello there", system + "abcabc", system + "The cat"]
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, {2}, 128,
                         max_batch_rows=16, prefill_chunk=8)
    rows = []
    for p in prompts:
        seq = engine.add(Sequence(tok(p).input_ids, 12, SamplingParams()))
        rows.append(len(seq.prompt) - seq.fed)
        while engine.running:
            engine.step()
        assert seq.generated == alone(rt, p, SamplingParams(), 12)
    shared = len(tok(system).input_ids) // BLOCK * BLOCK  # whole blocks of the common prefix
    assert shared >= 2 * BLOCK and rows[0] == len(tok(prompts[0]).input_ids)
    assert all(r == len(tok(p).input_ids) - shared for r, p in zip(rows[1:], prompts[1:]))
    assert engine.prefixes.hits == 2 and engine.prefixes.reused == 2 * shared
    assert engine.prefixes.queried == sum(len(tok(p).input_ids) - 1 for p in prompts)
    engine.close()


def test_a_feature_drafter_shares_cached_prefixes_with_their_hidden_states(rt):
    """With a drafter that reads the target's hidden states, a prompt sharing cached blocks gets their hidden states
    too: fewer prefill rows, and every cycle's draft (hence the output) bitwise what it is without the cache."""
    from specdec.drafters import ChainDrafter, NgramDrafter
    model, tok = rt
    system = "You are a careful assistant. Answer briefly and clearly. "
    prompts = [system + "Hello there", system + "abcabc", "Unrelated " + system, system + "Hello there"]

    def run(cache: bool):
        drafter = ChainDrafter([NgramDrafter(), feature_drafter(model)])
        engine = BatchEngine(model, drafter, model.config.vocab_size, {2}, 128, max_batch_rows=16, prefill_chunk=8,
                             prefix_cache=cache)
        engine.early_model = False  # fixed τ chains: trees sized on measured pass times would differ run to run
        drafts, rows = [], []
        for p in prompts:
            seq = engine.add(Sequence(tok(p).input_ids, 16, SamplingParams(), max_tau=4, fixed_tau=True))
            rows.append(len(seq.prompt) - seq.fed)
            while engine.running:
                drafts += [rec.proposed for _, rec in engine.step()]
            assert seq.generated == alone(rt, p, SamplingParams(), 16)
        kept = dict(model.pool.kept)
        engine.close()
        return drafts, rows, kept

    drafts, rows, kept = run(cache=True)
    plain, full, _ = run(cache=False)
    assert drafts == plain and sum(map(len, drafts)) > 0  # the restored hidden states are the computed ones
    shared = len(tok(system).input_ids) // BLOCK * BLOCK
    whole = min(full[3] // BLOCK * BLOCK, full[3] - 1)  # a prompt seen before: all its full blocks
    assert rows[1] == full[1] - shared and rows[2] == full[2] and rows[3] == full[3] - whole < BLOCK
    assert kept and all(f.shape == (BLOCK, model.config.hidden_size) for f in kept.values())
    assert not model.pool.kept  # forgotten with the blocks' names


def test_feature_drafts_batched_across_requests_equal_each_alone(rt, monkeypatch):
    """propose_many over several forks (one layer pass per step for all) = each fork's draft alone, bitwise: a tree
    for greedy and seeded sampled requests (on the kernels), a chain for unseeded sampled ones (no race noise to
    rank children by); the forks keep their own state."""
    from specdec.drafters.base import fork, propose_many
    model, tok = rt
    template = feature_drafter(model)
    contexts = [tok(p).input_ids for p in PROMPTS[:5]]
    params = [SamplingParams(), SamplingParams(0.9, 1.0, 0, 5), SamplingParams(), SamplingParams(1.0, 1.0, 0, 2),
              SamplingParams(0.8, 1.0, 0, None)]

    def primed():  # forks that have seen the target's features of their contexts
        forks = [fork(template) for _ in contexts]
        for d, ctx in zip(forks, contexts):
            s = model.acquire_slot()
            _, h = model.forward(ctx, [s] * len(ctx), list(range(len(ctx))), [], hidden=True)
            model.release_slot(s)
            d.observe_target(0, h)
        return forks
    ks = [4, 3, 1, 5, 3]
    seeded = lambda p: p.generator() if p.seed is not None else torch.Generator().manual_seed(9)  # noqa: E731
    from specdec.drafters import feature
    positions, real = [], feature.race_children
    monkeypatch.setattr(feature, "race_children", lambda *a: positions.append(a[-1]) or real(*a))
    together = propose_many(primed(), contexts, ks, params, [seeded(p) for p in params])
    if template._rt is not None:  # a sampled child of depth d sits at len(context) - 1 + d: the noise it races on
        firsts = {len(c) for c, p in zip(contexts, params) if p.seed is not None}
        assert firsts <= set(positions) <= {len(c) + d for c, p, k in zip(contexts, params, ks) if p.seed is not None
                                            for d in range(k)}
    alone = [d.propose_many([d], [c], [k], [p], [seeded(p)])[0] for d, c, k, p in zip(primed(), contexts, ks,
                                                                                         params)]
    assert [(d.tokens, d.parents, d.values) for d in together] == [(d.tokens, d.parents, d.values) for d in alone]
    trees = template._rt is not None
    for a, b, k, p in zip(together, alone, ks, params):
        assert (a.q is None and b.q is None) or torch.equal(a.q, b.q)
        assert a.is_tree == (trees and p.seed is not None or trees and p.greedy) and (a.is_tree or len(a.tokens) == k)


def test_a_sampled_trees_first_child_is_the_drafts_own_race_winner_at_that_position(monkeypatch):
    """race_children ranks a seeded request's children by the draft's race on the request's noise at the child's
    position, over full-vocabulary ids: with the target's own logits as the draft (and no sharpening) its first
    child is the token target-only sampling draws there, at every position, with top-k and top-p too."""
    from specdec.drafters import feature
    from specdec.sampling import PositionNoise, warp
    monkeypatch.setattr(feature, "SHARPEN", 1.0)
    torch.manual_seed(0)
    vocab_map = torch.randperm(300)[:64].sort().values  # a reduced vocabulary inside a 300-token one
    noise = PositionNoise(5)
    for params in (SamplingParams(0.7, 1.0, 0, 5), SamplingParams(1.0, 0.9, 20, 5)):
        for position in range(40):
            logits = torch.randn(64) * 2
            full = torch.full((300,), float("-inf"))
            full[vocab_map] = logits
            values, ids = feature.race_children(logits, vocab_map, params, noise, position)
            assert int(vocab_map[ids[0]]) == noise.pick(warp(full, params)[None], [position])[0]
            assert values == sorted(values, reverse=True) and 0 < sum(values) <= 1 + 1e-9


def test_feature_draft_runs_as_q4_0_blocks_and_keeps_every_feature(rt):
    """On the kernels the draft's matrices and its reduced head are Q4_0 blocks run in the q8 mode (where a matrix's
    rows are whole blocks); the target features it keeps grow and roll back as one tensor of the committed ones."""
    from specdec import kernels
    model, _ = rt
    d = feature_drafter(model)
    if not kernels.available():
        pytest.skip("no kernels: the draft runs in torch")
    layer = d._rt.layers[0]
    assert d._rt.q8 and d._fc.fmt == kernels.Q4_0 and layer.gate.fmt == kernels.Q4_0 and layer.down.fmt in (
        kernels.Q4_0, kernels.F32, kernels.BF16)  # down's 32 input columns: one block
    feats = torch.randn(150, model.config.hidden_size)
    d.observe_target(0, feats[:10])
    d.observe_target(10, feats[10:100])  # past the first buffer
    d.observe_target(60, feats[60:150])  # a rollback to 60, then on
    assert torch.equal(d.feats, feats)
    d.observe_target(20, feats[:3])
    assert torch.equal(d.feats, torch.cat([feats[:20], feats[:3]]))
    d.reset()
    assert len(d.feats) == 0


def test_logprobs_in_the_batch_equal_the_request_alone(rt):
    """Greedy and seeded requests batched together report, token by token, the logprobs target-only reports."""
    model, tok = rt
    sd = SpecDecoder.from_models(model, tok, draft="ngram", tau=3)
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, sd.engine.drafter, model.config.vocab_size, sd.engine.eos_ids, 128, max_batch_rows=8)
    seqs = [engine.add(Sequence(tok(p).input_ids, 16, params, logprobs=2)) for p, params in zip(PROMPTS, PARAMS)]
    got = {s.id: [] for s in seqs}
    while engine.running:
        for s, rec in engine.step():
            got[s.id] += rec.logprobs
    for s, p, params in zip(seqs, PROMPTS, PARAMS):
        ref = plain.generate(p, max_new_tokens=16, chat=False, temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k, seed=params.seed, logprobs=2)
        assert s.generated == ref.token_ids and got[s.id] == [[lp, list(a)] for lp, a in ref.logprobs]
    engine.close()


def test_prompt_logprobs_through_chunked_prefill_equal_one_pass(rt):
    """A scored prompt (echo) prefilled in chunks beside other requests: its logprobs equal one pass over it; with
    max_new_tokens 0 it ends after the prompt."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    ref = plain.generate(PROMPTS[2], max_new_tokens=0, chat=False, prompt_logprobs=2).prompt_logprobs
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 128,
                         max_batch_rows=8, prefill_chunk=4)
    ids = tok(PROMPTS[2]).input_ids
    engine.add(Sequence(tok(PROMPTS[0]).input_ids, 12, SamplingParams()))
    scored = [engine.add(Sequence(ids, n, SamplingParams(), prompt_logprobs=2)) for n in (0, 6)]
    got = {}
    while engine.running:
        for s, rec in engine.step():
            if rec.prompt_logprobs is not None:
                got[s.id] = rec.prompt_logprobs
    assert len(ref) == len(ids) - 1 and all(got[s.id] == ref for s in scored)
    assert scored[0].generated == [] and len(scored[1].generated) == 6


def test_a_scored_prompt_preempted_mid_prefill_scores_each_token_once(rt):
    """A request scoring its prompt (echo with logprobs) that is preempted mid-prefill starts it again from the
    first token: its logprobs come back once per token, aligned, equal to one pass (they were duplicated)."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    ref = plain.generate(PROMPTS[2], max_new_tokens=0, chat=False, prompt_logprobs=2).prompt_logprobs
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 128,
                         max_batch_rows=8, prefill_chunk=4)
    seq = engine.add(Sequence(tok(PROMPTS[2]).input_ids, 0, SamplingParams(), prompt_logprobs=2))
    engine.step()
    engine.step()
    assert seq.prefilling and seq.scored  # part of the prompt scored
    engine._preempt(seq)  # what the pool running short does to the newest request
    got = None
    while engine.running:
        for s, rec in engine.step():
            got = rec.prompt_logprobs if rec.prompt_logprobs is not None else got
    assert got == ref and engine.preemptions == 1


def test_a_prompt_prefilled_once_for_its_twins(rt):
    """n choices of one prompt join together: one prefills, the others wait for it and copy its K/V (bitwise the
    same), so the prompt's rows are computed once; each choice gets what it gets alone."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 128,
                         max_batch_rows=16, prefill_chunk=8)
    ids = tok(PROMPTS[2]).input_ids
    model.pool.clear_hashes()  # nothing cached from earlier tests
    params = [SamplingParams(1.0, 1.0, 0, 40 + i) for i in range(3)]
    seqs = [engine.add(Sequence(ids, 8, p)) for p in params]
    rows, first = 0, {}
    while engine.running:
        for s, rec in engine.step():
            first.setdefault(s.id, rec)
        rows += engine.last.get("rows", 0)
    for s, p in zip(seqs, params):
        assert s.generated == alone(rt, PROMPTS[2], p, 8)
    # usage's cached_tokens: the twins found all but the last prompt position computed, the first nothing
    assert [first[s.id].cached_tokens for s in seqs] == [0, len(ids) - 1, len(ids) - 1]
    assert rows < len(ids) + 3 * 8 + 4  # the prompt once, then about one row per token per choice
    assert engine.prefixes.hits == 2
    engine.close()


def test_a_twin_gets_every_block_the_cache_lost_from_its_twin(rt):
    """The reproduced case (issue "serve strangers safely"): S waits for its twin T's prefill, and when it is
    released the cache gives back only part of the prompt (evicted, or registered by another request's copies). It
    copies every missing block from T, not one, so it never decodes from K/V no pass wrote; it gets what it gets
    alone (it generated zeros before), and a later request restoring the same prompt from the cache does too."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 256,
                         max_batch_rows=16, prefill_chunk=8)
    prompt = "The cat sat on the mat. " * 4 + "Then the dog came in and sat down by the door."
    ids = tok(prompt).input_ids
    assert len(ids) > 6 * BLOCK
    model.pool.clear_hashes()
    restore = engine.prefixes.restore
    engine.prefixes.restore = lambda tokens, slot, salt: restore(tokens[:BLOCK + 1], slot, salt)  # one block cached
    params = [SamplingParams(), SamplingParams(0.9, 1.0, 0, 5)]
    t, s = (engine.add(Sequence(ids, 8, p)) for p in params)
    assert s.after == t.id  # S waits for T's prefill
    while engine.running:
        engine.step()
    for seq, p in ((t, params[0]), (s, params[1])):
        assert seq.generated == alone(rt, prompt, p, 8)
    engine.prefixes.restore = restore
    later = engine.add(Sequence(ids, 8, params[1]))
    while engine.running:
        engine.step()
    assert later.generated == alone(rt, prompt, params[1], 8) and engine.prefixes.hits >= 2
    engine.close()


class OracleTreeDraft:
    """A drafter that reads the target's features and proposes trees holding the true continuation (from a reference
    run) beside decoys, at depths that vary by cycle: how a feature draft's tree passes must hand on features."""
    name, wants_target_hidden, makes_trees, free = "oracle", True, True, False

    def __init__(self, reference: list[int], vocab: int):
        self.reference, self.vocab = reference, vocab
        self.reset()

    def reset(self) -> None:
        self.feats, self.calls = None, 0

    def fork(self):
        return OracleTreeDraft(self.reference, self.vocab)

    def observe_target(self, start: int, hidden) -> None:
        self.feats = hidden.clone() if self.feats is None else torch.cat([self.feats[:start], hidden])

    def propose(self, context, k, params, generator):
        from specdec.drafters.base import Draft
        L = len(context)
        if context != self.reference[:L] or L + 2 > len(self.reference):
            return Draft()
        good = self.reference[L: L + 2]
        bad = [(t + 1) % self.vocab for t in good]
        self.calls += 1
        depth = self.calls % 3  # 0: decoys only, 1: the first token right, 2: two right
        tokens = [bad[0], good[0] if depth else bad[1], good[1] if depth == 2 else bad[1], bad[1]]
        return Draft(tokens, parents=[-1, -1, 1, 1], values=[0.99, 0.98, 0.97, 0.96])  # worth their rows


@pytest.mark.parametrize("batched", [False, True])
def test_tree_passes_hand_a_feature_draft_the_features_of_the_committed_path(rt, batched):
    """After tree passes whose accepted depth varies (0, 1, 2), the features a drafter was handed equal the target's
    own hidden states of the committed sequence, bitwise (row-invariance), in the engine and the batch engine; the
    output equals target-only."""
    from specdec.engine import Engine
    model, tok = rt
    prompt = tok(PROMPTS[2]).input_ids
    ref = alone(rt, PROMPTS[2], SamplingParams(), 24)
    draft = OracleTreeDraft(prompt + ref, model.config.vocab_size)
    if batched:
        engine = BatchEngine(model, draft, model.config.vocab_size, set(), 128, max_batch_rows=16)
        seq = engine.add(Sequence(prompt, 24, SamplingParams()))
        records, drafter = [], engine._state[seq.id][1]  # the request's fork
        while engine.running:
            records += [rec for _, rec in engine.step() if rec is not None]
        out = seq.generated
        engine.close()
    else:
        engine = Engine(model, draft, model.config.vocab_size, set(), 128)
        records = list(engine.run(prompt, 24, SamplingParams(), 3))
        out, drafter = [t for r in records for t in r.emitted], draft
    assert out == ref
    assert {r.accepted for r in records if r.parents} == {0, 1, 2}
    s = model.acquire_slot()
    seq = prompt + ref
    _, h = model.forward(seq, [s] * len(seq), list(range(len(seq))), [], hidden=True)
    model.release_slot(s)
    assert torch.equal(drafter.feats, h[: len(seq) - 1])


def test_feature_draft_grows_a_best_first_tree_whose_paths_are_its_chain_steps(rt, monkeypatch):
    """The EAGLE-2 tree: best-first (parents first, values non-increasing), each value the product of the draft's
    probabilities along the path; with every node expanded, the draft's greedy chain is one of its paths (a tree row
    of the draft pass is bitwise its chain step). Greedy speculation with it equals target-only."""
    from specdec.drafters import feature
    from specdec.drafters.tree import depths, path
    from specdec.engine import Engine
    model, tok = rt
    d = feature_drafter(model)
    if d._rt is None:
        pytest.skip("no kernels: the draft proposes chains")
    ctx = tok(PROMPTS[0]).input_ids
    s = model.acquire_slot()
    _, h = model.forward(ctx, [s] * len(ctx), list(range(len(ctx))), [], hidden=True)
    model.release_slot(s)
    d.observe_target(0, h[:-1])
    chain = d.chains([d], [ctx], [4], [SamplingParams()], [None])[0].tokens
    monkeypatch.setattr(feature, "TREE_WIDTH", 64)
    monkeypatch.setattr(feature, "TREE_EXPAND", 0.0)
    monkeypatch.setattr(feature, "TREE_NODES", 10 ** 4)
    tree = d.propose(ctx, 4, SamplingParams(), None)
    assert tree.is_tree and all(p < i for i, p in enumerate(tree.parents))
    assert all(a >= b for a, b in zip(tree.values, tree.values[1:])) and max(depths(tree.parents)) == 4
    paths = {tuple(tree.tokens[j] for j in path(tree.parents, i)) for i in range(len(tree.tokens))}
    assert tuple(chain) in paths
    monkeypatch.undo()

    class FreeRows:  # every node pays its row: whole trees get verified
        def observe(self, rows, ms):
            pass

        def __call__(self, rows):
            return 1.0
    engine = Engine(model, d, model.config.vocab_size, set(), 128)
    engine.costs = FreeRows()
    for p in PROMPTS[:3]:
        ids = tok(p).input_ids
        records = list(engine.run(ids, 20, SamplingParams(), 3))
        assert [t for r in records for t in r.emitted] == alone(rt, p, SamplingParams(), 20)
        assert sum(len(r.proposed) > 1 and r.parents is not None for r in records) >= 3


def test_the_prefix_cache_is_salted_per_tenant(rt):
    """A tenant's cached prompt is found only by the same tenant: another one with the same prompt computes it (no
    hit, no shared blocks, no twin), the owner's repeat hits; every output equals the request alone."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 256,
                         max_batch_rows=16, prefill_chunk=8)
    model.pool.clear_hashes()
    prompt = "A system prompt that one tenant would rather keep to itself. " * 2
    ids = tok(prompt).input_ids
    alice, bob = b"a" * 16, b"b" * 16

    def run(salt):
        hits = engine.prefixes.hits
        seq = engine.add(Sequence(ids, 6, SamplingParams(), cache_salt=salt))
        cached = []
        while engine.running:
            cached += [rec.cached_tokens for s, rec in engine.step() if s is seq]
        assert seq.generated == alone(rt, prompt, SamplingParams(), 6)
        assert (cached[0] > 0) == (engine.prefixes.hits > hits) and not any(cached[1:])  # usage's cached_tokens
        return engine.prefixes.hits - hits
    assert run(alice) == 0
    assert engine.uncached(ids, bob) == 0 and engine.uncached(ids, alice) > 0
    assert run(bob) == 0  # same prompt, another tenant: computed, nothing learned from alice's
    assert run(alice) == 1 and run(b"") == 0  # the owner's repeat hits; the shared tenant is one more tenant
    twins = [engine.add(Sequence(ids + [5], 4, SamplingParams(), cache_salt=s)) for s in (alice, bob)]
    assert twins[1].after is None  # a twin only within a tenant
    while engine.running:
        engine.step()
    engine.close()


def test_can_start_counts_an_unheld_cached_block_once(rt):
    """Cached blocks nobody holds are in `available` already and leave it when shared: a prompt whose blocks are all
    cached but unheld, with nothing else free, cannot start (it used to be admitted, then fail to reserve)."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 256,
                         max_batch_rows=16, prefill_chunk=8)
    model.pool.clear_hashes()
    ids = tok("Cached but unheld: every block of this prompt. " * 2).input_ids
    seq = engine.add(Sequence(ids, 2, SamplingParams()))
    while engine.running:
        engine.step()
    pool = model.pool
    cached = len(engine.prefixes.lookup(ids))
    assert cached >= 2 and len(pool.evictable) >= cached
    taken = []
    while pool.free:  # everything else held
        taken.append(pool.allocate())
    assert pool.available == len(pool.evictable)
    need = -(-(len(ids) + 1) // BLOCK)
    assert need - cached <= pool.available < need  # the old count said yes
    assert not engine.can_start(ids)
    for block in taken:
        pool.release(block)
    engine.close()
    del seq


def test_a_preempted_request_is_owed_its_blocks_before_a_newcomer_starts(rt):
    """Blocks a preempted request needs to resume are not free for a new arrival (it waited behind newcomers that
    kept taking what finishing requests freed, and could time out after streaming tokens)."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 256,
                         max_batch_rows=16, prefill_chunk=8)
    model.pool.clear_hashes()
    first = engine.add(Sequence(tok("A request that will be preempted, " * 3).input_ids, 4, SamplingParams()))
    engine.step()
    engine._preempt(first)
    owed = -(-(len(first.tokens) + 1) // BLOCK)
    pool = model.pool
    taken = [pool.allocate() for _ in range(pool.available - owed)]  # what is left is what `first` needs
    newcomer = tok("x").input_ids
    assert not engine.can_start(newcomer)  # it would take what the preempted request needs to resume
    for block in taken:
        pool.release(block)
    assert engine.can_start(newcomer)
    while engine.running:
        engine.step()
    assert first.generated == alone(rt, "A request that will be preempted, " * 3, SamplingParams(), 4)
    engine.close()


def test_the_life_cycle_refuses_what_is_not_a_transition():
    """requests.py: each transition method moves a request along the life cycle, and anything else is a bug."""
    from specdec.batch.requests import BadTransition, State
    s = Sequence([5, 6, 7, 8], 4, SamplingParams())
    assert s.state == State.WAITING and not s.prefilling
    with pytest.raises(BadTransition, match="emit in state waiting"):
        s.emit([9])  # not in the batch yet
    s.join(0)
    assert s.state == State.PREFILLING
    s.advance(3)
    assert s.state == State.DECODING
    with pytest.raises(BadTransition, match="resume in state decoding"):
        s.resume(0)  # only a preempted request resumes
    s.emit([9, 10])
    assert s.fed == 5 and s.generated == [9, 10]
    s.preempt()
    assert s.state == State.PREEMPTED and s.fed == 0 and s.generated == [9, 10]  # what was sent stays
    s.resume(0)
    assert s.state == State.PREFILLING
    s.finish("length")
    assert s.state == State.FINISHED
    with pytest.raises(BadTransition):
        s.advance(1)
    assert s.fed == 0 and s.generated == [9, 10]  # a refused transition changes nothing
    twin = Sequence([5, 6, 7, 8], 4, SamplingParams())
    twin.join(2, twin=s.id)
    assert twin.state == State.WAITING_FOR_TWIN and twin.fed == 0 and twin.prefilling


def test_n_choices_of_a_long_prompt_are_admitted_together_not_n_times_its_memory(rt):
    """Waiting twins hold no blocks (issue "serve strangers safely", item 6): with KV memory for about two copies
    of a long prompt, 12 choices of it join at once; the first prefills, the others copy its K/V, and each gets
    what it gets alone."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    prompt = "The cat sat on the mat. " * 5 + "Then the dog came in."
    ids = tok(prompt).input_ids
    model.set_kv_memory(model.kv_bytes_per_position * max(model.max_len, 2 * len(ids) + 12 * 3 * BLOCK))
    try:
        engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 256,
                             max_batch_rows=16, prefill_chunk=8)
        model.pool.clear_hashes()
        params = [SamplingParams(0.9, 1.0, 0, 100 + i) for i in range(12)]
        seqs = []
        for p in params:
            assert engine.can_start(ids), f"choice {len(seqs)} refused"
            seqs.append(engine.add(Sequence(ids, 6, p)))
        assert all(s.after == seqs[0].id for s in seqs[1:])
        assert all(not model.blocks_of(engine._state[s.id][0]) for s in seqs[1:])  # waiting twins hold nothing
        assert 12 * -(-len(ids) // BLOCK) > model.pool.blocks  # n copies would not fit
        while engine.running:
            engine.step()
            assert not engine.failed
        for s, p in zip(seqs, params):
            assert s.generated == alone(rt, prompt, p, 6)
        engine.close()
    finally:
        model.set_kv_memory(None)


def test_a_finished_requests_answer_is_cached_for_the_next_turn(rt):
    """A conversation's next turn sends the prompt and the answer back: the answer's blocks are named when the request
    leaves, so the next turn's prefill starts after them, within its tenant only; its output is still its own alone."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, set(), 256)
    model.pool.clear_hashes()
    first = tok("The cat sat on the mat. " * 2).input_ids
    seq = engine.add(Sequence(first, 40, SamplingParams(), cache_salt=b"a"))
    while engine.running:
        engine.step()
    turn = first + seq.generated + tok(" And then?").input_ids
    covered = (len(first) + len(seq.generated) - 1) // BLOCK * BLOCK  # all but the answer's last (newest) token
    assert covered > len(first) // BLOCK * BLOCK  # (the answer fills blocks of its own)
    assert engine.uncached(turn, b"a") == covered and engine.uncached(turn, b"b") < covered
    nxt = engine.add(Sequence(turn, 6, SamplingParams(), cache_salt=b"a"))
    assert nxt.fed == covered
    while engine.running:
        engine.step()
    fresh = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, set(), 256, prefix_cache=False)
    ref = fresh.add(Sequence(turn, 6, SamplingParams()))
    while fresh.running:
        fresh.step()
    assert nxt.generated == ref.generated  # as computed from nothing cached
    engine.close()


def test_a_prompts_block_hashes_are_computed_once(rt, monkeypatch):
    """Admission, the 429 prediction, restore and store all walk one lookup, and the prompt's hashes are made once
    (issue "serve strangers safely", item 2)."""
    from specdec.runtime import prefix_cache
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    engine = BatchEngine(model, plain.engine.drafter, model.config.vocab_size, plain.engine.eos_ids, 128)
    model.pool.clear_hashes()
    calls = []
    real = prefix_cache.prefix_hashes
    monkeypatch.setattr(prefix_cache, "prefix_hashes", lambda *a: calls.append(a) or real(*a))
    ids = tok("The cat sat on the mat. " * 3 + "Then it slept.").input_ids
    assert engine.can_start(ids) and engine.uncached(ids) == 0
    seq = engine.add(Sequence(ids, 4, SamplingParams()))
    while engine.running:
        engine.step()
    assert engine.uncached(ids) > 0 and len(calls) == 1  # stored, then found, from one hashing
    assert seq.generated == alone(rt, "The cat sat on the mat. " * 3 + "Then it slept.", SamplingParams(), 4)
    engine.close()


def test_a_request_preempted_while_decoding_never_resends_text_or_logprobs(rt):
    """A decoding request with logprobs, preempted after it streamed some tokens, recomputes its K/V and goes on:
    what its records emit, joined, is its output once (no token or logprob sent twice), equal to target-only's."""
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    want = plain.generate(PROMPTS[1], max_new_tokens=12, chat=False, logprobs=2)
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, plain.engine.eos_ids,
                         128, max_batch_rows=8, prefill_chunk=8)
    model.pool.clear_hashes()
    seq = engine.add(Sequence(tok(PROMPTS[1]).input_ids, 12, SamplingParams(), logprobs=2))
    emitted, logprobs, preempted = [], [], False
    while engine.running:
        for _, rec in engine.step():
            emitted += rec.emitted
            logprobs += rec.logprobs
        if not preempted and len(emitted) >= 3:
            engine._preempt(seq)
            preempted = True
    assert preempted and engine.preemptions == 1
    assert emitted == seq.generated == want.token_ids and len(logprobs) == len(emitted)
    assert [lp for lp, _ in logprobs] == [lp for lp, _ in want.logprobs]
    engine.close()


def run_denied(rt, pass_ms, n=6):
    """`n` requests with the target as their draft (always right) but running acceptance estimates forced to 0 after
    every cycle, so the split denies them rows: the draft rows per pass, the requests that drafted, the outputs
    checked against each alone."""
    model, tok = rt
    engine = BatchEngine(model, build_drafter("target", model, tok, backend="runtime"), model.config.vocab_size, {2},
                         128, max_batch_rows=16)
    engine.pass_ms = pass_ms  # (not refined by the tiny model's passes)
    prompts = ["abcabcabcabc " * (i + 1) for i in range(n)]
    seqs = [engine.add(Sequence(tok(p).input_ids, 40, SamplingParams())) for p in prompts]
    probed, per_pass = set(), []
    while engine.running:
        drafted = [s.id for s, rec in engine.step() if rec.proposed]
        per_pass.append(len(drafted))
        probed.update(drafted)
        for s in engine.running:
            for a in engine._state[s.id][2].alpha:
                a.value, a.n = 0.0, 10
    for p, s in zip(prompts, seqs):
        assert s.generated == alone(rt, p, SamplingParams(), 40)
    return per_pass, probed, {s.id for s in seqs}


def test_a_pass_probes_at_most_one_request_denied_draft_rows(rt):
    """Where a good draft's rows pay (a row costs 1% of a pass) but every request's acceptance reads 0, requests
    get no rows but probes, one a pass, the longest denied first: each is re-measured now and then, and the probes
    stay a row a pass whatever the load."""
    per_pass, probed, ids = run_denied(rt, lambda rows: 10.0 + 0.1 * rows)
    assert max(per_pass) == 1 and probed == ids


def test_no_request_is_probed_where_no_acceptance_could_buy_a_row(rt):
    """Where each row costs as much as a pass, no acceptance up to PROBE_ALPHA pays for one: a probe would only make
    the pass dearer, and none runs (Qwen2.5-1.5B at 8 streams: a 9th row costs 20% of the pass)."""
    per_pass, probed, _ = run_denied(rt, lambda rows: 10.0 * rows)
    assert sum(per_pass) == 0 and not probed


@pytest.mark.parametrize("catch_up_ms_per_token", [0.01, 1e4])
def test_a_model_draft_fallen_behind_is_probed_where_its_catch_up_would_pay(rt, tiny_dirs, catch_up_ms_per_token):
    """One stream, a model draft whose running acceptance reads 0 after every cycle: it stops drafting and falls
    behind the request. Where catching up on the tokens it missed is cheap, it is still probed now and then to the
    end of the request (before, a draft behind was never probed: at one stream a completion whose first drafts
    missed never drafted again); where catching up costs more than a right draft could save, never."""
    model, tok = rt
    draft = models.load(tiny_dirs["draft"], backend="runtime")[0]
    drafter = ModelDrafter(draft, draft.config.vocab_size)
    drafter.draft_cache.ms_per_token = catch_up_ms_per_token  # (as if measured)
    engine = BatchEngine(model, drafter, model.config.vocab_size, {2}, 128, max_batch_rows=16)
    engine.pass_ms = lambda rows: 10.0 + 0.1 * rows  # (not refined by the tiny model's passes)
    prompt = "abcabcabcabc " * 3
    seq = engine.add(Sequence(tok(prompt).input_ids, 60, SamplingParams()))
    probed_at = []
    while engine.running:
        probed_at += [len(s.generated) for s, rec in engine.step() if rec.proposed]
        for s in engine.running:
            for a in engine._state[s.id][2].alpha:
                a.value, a.n = 0.0, 10
    assert seq.generated == alone(rt, prompt, SamplingParams(), 60)
    if catch_up_ms_per_token < 1:
        assert len(probed_at) >= 4 and max(probed_at) > 40  # (every PROBE_EVERY cycles, the last late on)
    else:
        assert probed_at == []
    engine.close()


def test_the_online_pass_curve_stays_on_its_grid_and_never_dips():
    """Passes between two measured sizes scale the nearer one; noise at one row count makes no dip for the
    scheduler to buy, and a lasting slowdown moves the curve."""
    from specdec.batch.calibration import OnlineCurve
    curve = OnlineCurve({1: 20.0, 8: 30.0, 16: 60.0, 32: 120.0})
    curve.observe(21, 40.0)  # one fast pass: 40 ms where 78.75 was predicted
    assert sorted(curve.grid) == [1, 8, 16, 32]  # no point of its own
    values = [curve(r) for r in range(1, 40)]
    assert all(a <= b for a, b in zip(values, values[1:]))  # nondecreasing
    assert curve(16) < 60.0 and curve(32) == 120.0  # the nearer size moved
    for _ in range(60):
        curve.observe(28, 2 * 112.5)  # the machine got twice as slow around 28 rows
    assert 200 < curve(28) < 240 and curve(32) > 200
    curve.observe(64, 300.0)  # beyond the grid: a new size
    assert curve(64) == 300.0


@pytest.mark.parametrize("batch", [1, EARLY_MODEL_BATCH + 1])
def test_a_small_batch_sizes_a_model_drafts_tree_on_its_node_values(rt, batch):
    """In a small batch a tree-growing model draft proposes before the split, and the scheduler reads its node
    values: a request whose running acceptance says 0 still verifies a tree its draft values at 0.99. In a larger
    batch the draft runs after the split, on the running acceptance: no rows."""
    model, tok = rt
    prompt = tok(PROMPTS[2]).input_ids
    ref = alone(rt, PROMPTS[2], SamplingParams(), 12)
    engine = BatchEngine(model, OracleTreeDraft(prompt + ref, model.config.vocab_size), model.config.vocab_size,
                         set(), 128, max_batch_rows=32)
    seqs = [engine.add(Sequence(prompt, 12, SamplingParams())) for _ in range(batch)]
    for s in seqs:
        for a in engine._state[s.id][2].alpha:
            a.value, a.n = 0.0, 10
    first = {}
    while engine.running and len(first) < batch:
        for s, rec in engine.step():
            if s.cycle > 1:  # (cycle 0 emits the prompt's first token)
                first.setdefault(s.id, rec)
    assert all(bool(rec.proposed) == (batch <= EARLY_MODEL_BATCH) for rec in first.values())
    while engine.running:
        engine.step()
    assert all(s.generated == ref for s in seqs)


@pytest.mark.parametrize("step_ms", [1e6, 1e-3])
def test_a_model_draft_whose_batched_steps_cost_more_than_they_save_drafts_nothing(rt, step_ms):
    """The verification budget charges a batched model draft by its steps (costs.DraftSteps): priced at a million
    ms a step, a draft that is always right (the target itself) drafts nothing, not even a probe; priced at nothing,
    it drafts. Either way each request gets what it gets alone."""
    model, tok = rt
    engine = BatchEngine(model, build_drafter("target", model, tok, backend="runtime"), model.config.vocab_size, {2},
                         128, max_batch_rows=32)
    engine.pass_ms = lambda rows: 10.0 + 0.1 * rows  # (not refined by the tiny model's passes)
    engine.draft_steps.DECAY = 1.0  # the price stays what it is told, whatever the tiny draft's steps take
    for _ in range(engine.draft_steps.MIN_SEEN):
        engine.draft_steps.observe([1], step_ms)
    engine.draft_steps.observe = lambda taus, ms: None
    prompts = ["abcabcabcabc " * (i + 1) for i in range(4)]
    seqs = [engine.add(Sequence(tok(p).input_ids, 24, SamplingParams())) for p in prompts]
    proposed = []
    while engine.running:
        proposed.append([len(rec.proposed) for _, rec in engine.step()])
    if step_ms > 1:
        assert all(sum(p) == 0 for p in proposed)  # not even a probe: no acceptance pays for such a step
    else:
        assert max(max(p, default=0) for p in proposed) > 1
    for p, s in zip(prompts, seqs):
        assert s.generated == alone(rt, p, SamplingParams(), 24)


def test_a_draft_priced_out_by_a_stall_drafts_again_once_the_price_is_stale(rt):
    """A draft step priced at a million ms (a stall's reading) drafts nothing; no proposal then updates that price,
    and after DraftSteps.STALE_S it is forgotten: the requests draft again, each still what it gets alone."""
    model, tok = rt
    engine = BatchEngine(model, build_drafter("target", model, tok, backend="runtime"), model.config.vocab_size, {2},
                         128, max_batch_rows=32)
    engine.pass_ms = lambda rows: 10.0 + 0.1 * rows
    now = [0.0]
    engine.draft_steps._clock = lambda: now[0]
    for _ in range(engine.draft_steps.MIN_SEEN):
        engine.draft_steps.observe([1], 1e6)
    prompts = ["abcabcabcabc " * (i + 1) for i in range(4)]
    seqs = [engine.add(Sequence(tok(p).input_ids, 24, SamplingParams())) for p in prompts]
    before = [len(rec.proposed) for _ in range(4) for _, rec in engine.step()]
    now[0] += engine.draft_steps.STALE_S + 1
    after = []
    while engine.running:
        after += [len(rec.proposed) for _, rec in engine.step()]
    assert sum(before) == 0 and max(after) > 1
    for p, s in zip(prompts, seqs):
        assert s.generated == alone(rt, p, SamplingParams(), 24)


def test_a_new_requests_copy_estimates_start_from_earlier_requests(rt):
    """A chain's greedy n-gram copies are sized on estimates by match length; a new request's start from the
    running average of earlier requests' (per tenant), not from the fixed COPY_PRIORS: copies the model never
    follows stop being drafted at the prior's depth by every newcomer."""
    from specdec.batch.engine import COPY_PRIORS
    model, tok = rt
    engine = BatchEngine(model, build_drafter("ngram+target", model, tok, backend="runtime"), model.config.vocab_size, {2},
                         128, max_batch_rows=32)
    prompts = ["abcabcabcabc " * 3, "the cat the cat the cat ", "xyzxyzxyz xyzxyz"]
    for p in prompts:
        seq = engine.add(Sequence(tok(p).input_ids, 24, SamplingParams()))
        while engine.running:
            engine.step()
        assert seq.generated == alone(rt, p, SamplingParams(), 24)
    learned = engine.copy_priors(b"")
    seen = [b for b, est in enumerate(learned) if est.alpha[0].n]
    assert seen, "no copy was verified"
    b = seen[0]
    assert learned[b].alpha[0].value != COPY_PRIORS[b]
    assert engine.copy_priors(b"other")[b].alpha[0].value == COPY_PRIORS[b]  # another tenant's start as before
    s = engine.add(Sequence(tok("abc").input_ids, 4, SamplingParams()))
    engine._copied[s.id] = b
    assert engine._estimates(s).alpha[0].value == learned[b].alpha[0].value
