"""A draft model's own prefix cache (drafters/model.py): a request's first proposal starts from the cached blocks of
its context, within its tenant, and proposes exactly what a draft without the cache proposes; at rest the cache keeps
at most its bound; through the batch engine every output stays the request's alone."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder, models
from specdec.api import build_drafter
from specdec.batch import BatchEngine, Sequence
from specdec.drafters import model as model_draft
from specdec.drafters.model import ModelDrafter
from specdec.runtime.blocks import BLOCK
from specdec.sampling import SamplingParams

GREEDY, SAMPLED = SamplingParams(), SamplingParams(0.8, 1.0, 0, 5)


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


@pytest.fixture(scope="module")
def draft_model(tiny_dirs):
    return models.load(tiny_dirs["draft"], backend="runtime")[0]


def plain(draft_model) -> ModelDrafter:
    d = ModelDrafter(draft_model, draft_model.config.vocab_size)
    d.prefixes = None  # the same draft without its cache: what every proposal must equal
    return d


def propose(drafter, context, params):
    gen = torch.Generator().manual_seed(3)
    return drafter.propose(context, 4, params, gen)


def same(a, b) -> bool:
    return a.tokens == b.tokens and (a.q is None) == (b.q is None) and (a.q is None or torch.equal(a.q, b.q))


def context(seed: int, n: int) -> list[int]:
    return torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_cached_prefix_proposes_what_the_draft_computes_and_only_for_its_tenant(draft_model):
    draft_model.pool.clear_hashes()
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    shared = context(0, 3 * BLOCK + 5)
    first = template.fork()
    first.cache_salt = b"tenant a"
    for params in (GREEDY, SAMPLED):
        first.reset()
        assert same(propose(first, shared + [7, 8], params), propose(plain(draft_model), shared + [7, 8], params))
    first.close()  # its blocks stay named for the next request
    hits, reused = template.prefixes.hits, template.prefixes.reused
    for params in (GREEDY, SAMPLED):
        again = template.fork()
        again.cache_salt = b"tenant a"
        ctx = shared + [9, 10, 11]
        got = propose(again, ctx, params)
        assert again.lm.last_start == 0 or again.lm.tokens[:3 * BLOCK] == shared[:3 * BLOCK]
        assert same(got, propose(plain(draft_model), ctx, params))  # bitwise the draft run over the whole context
        again.close()
    assert template.prefixes.hits == hits + 2 and template.prefixes.reused >= reused + 2 * 3 * BLOCK
    stranger = template.fork()
    stranger.cache_salt = b"tenant b"  # another tenant's cached prompts are never found, shared or timed
    got = propose(stranger, shared + [9, 10, 11], GREEDY)
    assert template.prefixes.hits == hits + 2
    assert same(got, propose(plain(draft_model), shared + [9, 10, 11], GREEDY))
    stranger.close()


def test_the_cache_keeps_its_bound_and_the_answer_for_the_next_turn(draft_model, monkeypatch):
    draft_model.pool.clear_hashes()
    per_block = draft_model.kv_bytes_per_position * BLOCK
    monkeypatch.setattr(model_draft, "CACHE_BYTES", 5 * per_block)
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    assert template.prefixes.max_blocks == 5
    turn = context(1, 3 * BLOCK - 2)
    d = template.fork()
    proposed = propose(d, turn, GREEDY).tokens
    d.close()  # the whole slot is named when it leaves, its proposals too: 3 full blocks
    assert len(draft_model.pool.evictable) <= 5
    d = template.fork()  # the next turn: the conversation so far, the answer, a new message
    longer = turn + proposed[:3] + context(2, BLOCK)
    reused = template.prefixes.reused
    assert same(propose(d, longer, GREEDY), propose(plain(draft_model), longer, GREEDY))
    assert template.prefixes.reused - reused == 3 * BLOCK  # the answer's block too, not only the prompt's two
    d.close()
    for seed in range(3, 9):  # many prompts: the cache stays within its bound at rest
        d = template.fork()
        propose(d, context(seed, 3 * BLOCK), GREEDY)
        d.close()
        assert len(draft_model.pool.evictable) <= 5


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 40), st.booleans()), min_size=1,
                max_size=6))
def test_random_requests_propose_what_the_uncached_draft_proposes(draft_model, requests):
    """Requests drawn from three shared prefixes and two tenants, with tails of random length, greedy or sampled,
    some left open while the next ones run: each proposal equals the draft's without the cache."""
    draft_model.pool.clear_hashes()
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    prefixes = [context(10 + i, 2 * BLOCK + 7 * i) for i in range(3)]
    held = draft_model.held_slots
    open_ = []
    for prefix, tenant, tail, sampled in requests:
        d = template.fork()
        d.cache_salt = bytes([tenant])
        ctx = prefixes[prefix] + context(100 + tail, tail + 1)
        params = SAMPLED if sampled else GREEDY
        assert same(propose(d, ctx, params), propose(plain(draft_model), ctx, params))
        (open_.append(d) if tail % 2 else d.close())
    for d in open_:
        d.close()
    assert draft_model.held_slots == held


def test_batched_requests_share_the_drafts_blocks_within_a_tenant(rt, tiny_dirs):
    """Through the batch engine: a second request of the same tenant finds the draft's blocks of the first one's
    prompt, one of another tenant does not; every output equals the request alone."""
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    drafter.lm.model.pool.clear_hashes()
    engine = BatchEngine(model, drafter, model.config.vocab_size, models.eos_ids(model, tok), 256)
    prompt = "The cat sat on the mat. The dog sat on the log. " * 2
    alone = SpecDecoder.from_models(model, tok, draft="none")
    for salt, ending, found in [(b"a", "Then", False), (b"a", "And so", True), (b"b", "And so", False)]:
        hits = drafter.prefixes.hits
        seq = engine.add(Sequence(tok(prompt + ending).input_ids, 12, SamplingParams(), cache_salt=salt))
        while engine.running:
            engine.step()
            assert not engine.failed
        assert (drafter.prefixes.hits > hits) == found, (salt, ending)
        assert seq.generated == alone.generate(prompt + ending, max_new_tokens=12, chat=False).token_ids
    engine.close()
