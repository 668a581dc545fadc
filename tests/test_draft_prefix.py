"""A draft model's own prefix cache (drafters/model.py): a request's first proposal starts from the cached blocks of
its context, within its tenant, and proposes exactly what a draft without the cache proposes; at rest the cache keeps
at most its bound; through the batch engine every output stays the request's alone."""
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder, models
from specdec.api import build_drafter
from specdec.batch import BatchEngine, Sequence
from specdec.drafters import draft_cache
from specdec.drafters.model import ModelDrafter
from specdec.runtime.blocks import BLOCK, prefix_hashes
from specdec.sampling import SamplingParams
from specdec.server import create_app
from test_server import LiveServer, wait_for

GREEDY, SAMPLED = SamplingParams(), SamplingParams(0.8, 1.0, 0, 5)


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


@pytest.fixture(scope="module")
def draft_model(tiny_dirs):
    return models.load(tiny_dirs["draft"], backend="runtime")[0]


def plain(draft_model) -> ModelDrafter:
    d = ModelDrafter(draft_model, draft_model.config.vocab_size)
    d.draft_cache = None  # the same draft without its cache: what every proposal must equal
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
    cache = template.draft_cache.prefixes
    hits, reused = cache.hits, cache.reused
    for params in (GREEDY, SAMPLED):
        again = template.fork()
        again.cache_salt = b"tenant a"
        ctx = shared + [9, 10, 11]
        got = propose(again, ctx, params)
        assert again.lm.last_start == 0 or again.lm.tokens[:3 * BLOCK] == shared[:3 * BLOCK]
        assert same(got, propose(plain(draft_model), ctx, params))  # bitwise the draft run over the whole context
        again.close()
    assert cache.hits == hits + 2 and cache.reused >= reused + 2 * 3 * BLOCK
    stranger = template.fork()
    stranger.cache_salt = b"tenant b"  # another tenant's cached prompts are never found, shared or timed
    got = propose(stranger, shared + [9, 10, 11], GREEDY)
    assert cache.hits == hits + 2
    assert same(got, propose(plain(draft_model), shared + [9, 10, 11], GREEDY))
    stranger.close()


def test_the_cache_keeps_its_bound_and_the_answer_for_the_next_turn(draft_model, monkeypatch):
    draft_model.pool.clear_hashes()
    per_block = draft_model.kv_bytes_per_position * BLOCK
    monkeypatch.setattr(draft_cache, "CACHE_BYTES", 5 * per_block)
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    cache = template.draft_cache.prefixes
    assert cache.max_blocks == 5
    turn = context(1, 3 * BLOCK - 2)
    d = template.fork()
    proposed = propose(d, turn, GREEDY).tokens
    d.close()  # the whole slot is named when it leaves, its proposals too: 3 full blocks
    assert len(draft_model.pool.evictable) <= 5
    d = template.fork()  # the next turn: the conversation so far, the answer, a new message
    longer = turn + proposed[:3] + context(2, BLOCK)
    reused = cache.reused
    assert same(propose(d, longer, GREEDY), propose(plain(draft_model), longer, GREEDY))
    assert cache.reused - reused == 3 * BLOCK  # the answer's block too, not only the prompt's two
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
        hits = drafter.draft_cache.prefixes.hits
        seq = engine.add(Sequence(tok(prompt + ending).input_ids, 12, SamplingParams(), cache_salt=salt, max_tau=3,
                                  fixed_tau=True))  # it drafts whatever this machine's timings price
        while engine.running:
            engine.step()
            assert not engine.failed
        assert (drafter.draft_cache.prefixes.hits > hits) == found, (salt, ending)
        assert seq.generated == alone.generate(prompt + ending, max_new_tokens=12, chat=False).token_ids
    engine.close()


def test_a_catch_up_that_cannot_pay_waits_for_idle_time(draft_model):
    """A request whose first proposal would run the draft over more context than its tokens left repay drafts nothing
    with the model; its context is caught up on in idle time, a chunk a step, and the next turn finds the blocks."""
    draft_model.pool.clear_hashes()
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    cache, held = template.draft_cache, draft_model.held_slots
    cache.ms_per_token = 10.0  # as if measured
    long = context(20, 6 * BLOCK + 5)
    d = template.fork()
    d.budget = (8, lambda: 0.25)  # 8 tokens left saving 0.25 ms each repay 2 ms, not 101 tokens at 10 ms
    assert propose(d, long, GREEDY).tokens == [] and d.put_off and cache.put_off == 1
    assert propose(d, long + [5], GREEDY).tokens == []  # for the rest of the request
    d.close()
    assert cache.idle_work() == 1 and not cache.prefixes.lookup(long)
    steps = 1
    while cache.idle_step():
        steps += 1
    assert steps == -(-len(long) // draft_cache.IDLE_CHUNK) and cache.idle_work() == 0
    assert draft_model.held_slots == held and len(cache.prefixes.lookup(long)) == len(long) // BLOCK
    nxt = template.fork()  # the next turn: a few tokens to catch up on, which pay
    nxt.budget = (8, lambda: 0.25)
    ctx = long + [5, 6, 7]
    got = propose(nxt, ctx, GREEDY)
    assert not nxt.put_off and got.tokens and same(got, propose(plain(draft_model), ctx, GREEDY))
    nxt.close()
    rich = template.fork()
    rich.budget = (10**6, lambda: 25.0)  # a budget that repays the catch-up: no putting off
    assert propose(rich, context(22, 6 * BLOCK), GREEDY).tokens and not rich.put_off
    rich.close()


def test_a_draft_behind_its_request_prices_its_catch_up(draft_model):
    """ModelDrafter.catch_up_ms: before its first proposal, a prompt shorter than MEASURED past the cached blocks at
    the measured rate less what the request's drafting is expected to repay (DraftCache.unrepaid_ms), a longer one
    nothing (it is weighed over the request's life: DraftCache.pays, which lets short ones through: put off, a
    request would never draft); after it, nothing for a step's usual 1-2 tokens, tokens it did not draft (a copy's)
    at the measured rate; a put-off draft none."""
    draft_model.pool.clear_hashes()
    d = ModelDrafter(draft_model, draft_model.config.vocab_size)
    d.draft_cache.ms_per_token = 2.0
    ctx = context(30, 3 * BLOCK)
    assert len(ctx) < draft_cache.MEASURED and d.catch_up_ms(ctx) == len(ctx) * 2.0  # (no budget: all of it)
    saves = [0.0]
    d.budget = (8, lambda: saves[0])
    assert d.catch_up_ms(ctx) == len(ctx) * 2.0  # nothing saved: nothing repaid
    saves[0] = 5.0
    assert d.catch_up_ms(ctx) == len(ctx) * 2.0 - 8 * 5.0
    saves[0] = 12.0  # 8 tokens x 12 ms repay 96 ms
    assert d.catch_up_ms(ctx) == 0.0
    assert d.draft_cache.pays(len(ctx), (1, lambda: 0.0))  # (short: the split prices it, never put off for good)
    long = ModelDrafter(draft_model, draft_model.config.vocab_size, cache=d.draft_cache)
    assert long.catch_up_ms(context(31, 5 * BLOCK)) == 0.0
    got = propose(d, ctx, GREEDY)
    assert got.tokens and not d.put_off and same(got, propose(plain(draft_model), ctx, GREEDY))
    got = got.tokens
    other = [t for t in range(1, 50) if t != got[0]][:20]
    assert d.catch_up_ms(ctx + other[:2]) == 0.0
    assert d.catch_up_ms(ctx + other) == 20 * 2.0
    d.put_off = True
    assert d.catch_up_ms(ctx + other) == 0.0
    d.close()


def test_a_request_drafts_from_its_first_decode_though_its_prompt_catch_up_costs_passes(rt, tiny_dirs):
    """At one stream, a prompt's catch-up of several passes' time is repaid over the request, not by one cycle: the
    model drafts from the request's first decoding pass (charged to that cycle alone, as it once was, it paid in no
    cycle, and the pair's 0.5B sat out the first 9-36 passes of each completion). The answer is target-only's."""
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    cache.model.pool.clear_hashes()
    engine = BatchEngine(model, drafter, model.config.vocab_size, set(), 256, max_batch_rows=16, prefill_chunk=64)
    engine.pass_ms = lambda rows: 10.0 + 0.5 * (rows - 1)
    cache.ms_per_token, cache.observe = 2.0, lambda tokens, ms: None  # the prompt's catch-up: ~10 passes
    engine.draft_steps.DECAY = 1.0
    for _ in range(engine.draft_steps.MIN_SEEN):  # a draft step priced at 0.5 ms, whatever the tiny draft's take
        engine.draft_steps.observe([1], 0.5)
    engine.draft_steps.observe = lambda taus, ms: None
    prompt = tok("The cat sat on the mat. The dog sat on the log. The cat").input_ids
    assert draft_cache.MEASURED > len(prompt) and len(prompt) * cache.ms_per_token > 4 * engine.pass_ms(8)
    seq = engine.add(Sequence(prompt, 48, SamplingParams()))  # 48 tokens, each saving ~4 ms, repay ~110 ms
    records = []
    while engine.running:
        records += [rec for _, rec in engine.step()]
    assert records[0].proposed or records[1].proposed, [len(r.proposed) for r in records]
    assert cache.put_off == 0 and sum(len(r.proposed) for r in records) >= 12
    ref = BatchEngine(model, build_drafter("none", model, tok), model.config.vocab_size, set(), 256,
                      prefix_cache=False)
    plain_seq = ref.add(Sequence(prompt, 48, SamplingParams()))
    while ref.running:
        ref.step()
    assert seq.generated == plain_seq.generated
    engine.close()


def test_the_batch_engine_puts_off_a_catch_up_and_does_it_when_idle(rt, tiny_dirs):
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    cache.model.pool.clear_hashes()
    engine = BatchEngine(model, drafter, model.config.vocab_size, set(), 256)
    prompt = tok("The cat sat on the mat. The dog sat on the log. " * 2).input_ids
    cache.ms_per_token = 1e3  # a draft that takes a second a token: a 6-token request cannot repay its catch-up
    first = engine.add(Sequence(prompt, 6, SamplingParams()))
    proposed = 0
    while engine.running:
        proposed += sum(len(rec.proposed) for _, rec in engine.step())
    assert proposed == 0 and cache.put_off == 1 and engine.idle_work() == 1
    while engine.idle():
        pass
    turn = prompt + first.generated + tok(" And").input_ids
    hits = cache.prefixes.hits
    cache.ms_per_token = 1e-3  # now it pays
    nxt = engine.add(Sequence(turn, 8, SamplingParams()))
    while engine.running:
        proposed += sum(len(rec.proposed) for _, rec in engine.step())
    assert cache.prefixes.hits == hits + 1 and proposed > 0  # the blocks caught up on in idle time were found
    fresh = BatchEngine(model, build_drafter("none", model, tok), model.config.vocab_size, set(), 256,
                        prefix_cache=False)
    refs = [fresh.add(Sequence(p, n, SamplingParams())) for p, n in ((prompt, 6), (turn, 8))]
    while fresh.running:
        fresh.step()
    assert [first.generated, nxt.generated] == [r.generated for r in refs]
    engine.close()


def test_a_catch_up_is_weighed_against_what_drafting_saves_at_the_batchs_load(rt, tiny_dirs):
    """Alone, a request's catch-up on its prompt pays. Beside 7 others on a machine whose 8 rows already cost what
    more rows do, no draft row pays, not even a probe (engine.PROBE_ALPHA): the model is never asked to catch up
    while 5 or more decode (each catch-up would stall all of them); once 4 or fewer are left, rows are free again
    and it drafts. Every answer is target-only's."""
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    cache.model.pool.clear_hashes()
    engine = BatchEngine(model, drafter, model.config.vocab_size, set(), 256, max_batch_rows=128, prefill_chunk=64)
    engine.pass_ms = lambda rows: 10.0 if rows <= 4 else 2.5 * rows  # (a pass of 5+ rows: its rows one by one)
    cache.ms_per_token, cache.observe = 0.01, lambda tokens, ms: None  # (not timed: priced)
    engine.draft_steps.DECAY = 1.0  # a draft step priced at 0.1 ms, whatever the tiny draft's steps take on a busy
    for _ in range(engine.draft_steps.MIN_SEEN):  # machine (timed, they once put the catch-ups off: a timed test)
        engine.draft_steps.observe([1], 0.1)
    engine.draft_steps.observe = lambda taus, ms: None
    prompts = [tok(f"Note {i}: the cat sat on the mat, the dog sat on the log. " * 3).input_ids for i in range(9)]
    assert min(map(len, prompts)) >= draft_cache.MEASURED
    alone = engine.add(Sequence(prompts[0], 8, SamplingParams()))
    proposed = 0
    while engine.running:
        proposed += sum(len(rec.proposed) for _, rec in engine.step())
    assert cache.put_off == 0 and proposed > 0
    batch = [engine.add(Sequence(p, 24, SamplingParams())) for p in prompts[1:]]
    wide = narrow = 0  # draft tokens proposed while 5+ requests decode, and after
    while engine.running:
        many = len(engine.running) >= 5
        made = sum(len(rec.proposed) for _, rec in engine.step())
        wide, narrow = (wide + made, narrow) if many else (wide, narrow + made)
    assert wide == 0 and cache.put_off == 0 and narrow > 0, (wide, cache.put_off, narrow)
    ref = BatchEngine(model, build_drafter("none", model, tok), model.config.vocab_size, set(), 256,
                      prefix_cache=False)
    refs = [ref.add(Sequence(p, 24 if i else 8, SamplingParams())) for i, p in enumerate(prompts)]
    while ref.running:
        ref.step()
    assert [s.generated for s in [alone, *batch]] == [r.generated for r in refs]
    engine.close()


def test_a_put_off_catch_up_is_weighed_again_once_the_load_falls(rt, tiny_dirs):
    """9 requests at once, draft rows cheap: a drafted token saves little of a pass 9 requests share, and most
    requests' catch-ups on their prompts (0.5 ms a token) are put off. The longest request then runs alone, where a
    drafted token saves most: its catch-up is weighed again, pays, and it drafts (put off for good, it drafted
    nothing for its life: the pair's 0.5B at 8 streams ran each window's last requests alone and undrafted). Every
    answer is target-only's."""
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    cache.model.pool.clear_hashes()
    engine = BatchEngine(model, drafter, model.config.vocab_size, set(), 256, max_batch_rows=128, prefill_chunk=64)
    engine.pass_ms = lambda rows: 10.0 + 0.1 * rows  # noqa: E731
    cache.ms_per_token, cache.observe = 0.5, lambda tokens, ms: None  # (not timed: priced)
    engine.draft_steps.DECAY = 1.0  # a draft step priced at 0.1 ms (not timed: a timed test)
    for _ in range(engine.draft_steps.MIN_SEEN):
        engine.draft_steps.observe([1], 0.1)
    engine.draft_steps.observe = lambda taus, ms: None
    prompts = [tok(f"Note {i}: the cat sat on the mat, the dog sat on the log. " * 3).input_ids for i in range(9)]
    assert min(map(len, prompts)) >= draft_cache.MEASURED
    lengths = [40] + [6] * 8
    seqs = [engine.add(Sequence(p, n, SamplingParams())) for p, n in zip(prompts, lengths)]
    alone = 0  # draft tokens the long request proposed once it ran alone
    while engine.running:
        by_itself = len(engine.running) == 1
        for s, rec in engine.step():
            if s is seqs[0] and by_itself:
                alone += len(rec.proposed)
    assert cache.put_off >= 5 and alone > 0, (cache.put_off, alone)
    ref = BatchEngine(model, build_drafter("none", model, tok), model.config.vocab_size, set(), 256,
                      prefix_cache=False)
    refs = [ref.add(Sequence(p, n, SamplingParams())) for p, n in zip(prompts, lengths)]
    while ref.running:
        ref.step()
    assert [s.generated for s in seqs] == [r.generated for r in refs]
    engine.close()


def test_the_server_catches_up_when_idle(rt, tiny_dirs):
    """Over HTTP: the worker does a put-off catch-up by itself once nothing runs, and /metrics shows it pending until
    then; the answer is target-only's."""
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    cache.model.pool.clear_hashes()
    cache.ms_per_token = 1e3
    decoder = SpecDecoder.from_models(model, tok, draft=drafter)
    srv = LiveServer(create_app(decoder, model_name="tiny", max_queue=8, max_batch_rows=8))
    try:
        srv.price_rows_cheap()  # (the split then asks the draft, which weighs its catch-up and puts it off)
        prompt = "Once upon a time there was a cat who sat on a mat all day long. " * 2
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        want = SpecDecoder.from_models(model, tok, draft="none").generate(prompt, max_new_tokens=5, chat=False).text
        assert r.json()["choices"][0]["text"] == want
        assert cache.put_off == 1
        first = prefix_hashes(tok(prompt).input_ids, 1)[0]  # (read, not looked up: the cache is the worker's)
        wait_for(lambda: first in cache.prefixes.model.pool.by_hash, "the idle catch-up naming the prompt's blocks")
        wait_for(lambda: srv.metrics().get(("specdec_draft_catchups_pending", ())) == 0, "the gauge back at 0")
    finally:
        srv.stop()


def test_a_server_measures_what_a_catch_up_costs(rt, tiny_dirs):
    model, tok = rt
    drafter = build_drafter(tiny_dirs["draft"], model, tok, backend="runtime")
    cache = drafter.draft_cache
    held = cache.model.held_slots
    assert cache.ms_per_token is None
    srv = LiveServer(create_app(SpecDecoder.from_models(model, tok, draft=drafter), model_name="tiny", max_queue=8,
                                max_batch_rows=8))
    try:
        wait_for(lambda: cache.ms_per_token is not None, "the measured catch-up")
        assert 0 < cache.ms_per_token < 1e3 and cache.model.held_slots == held  # its scratch slot given back
    finally:
        srv.stop()
