"""The KV cache as one pool of blocks (runtime/blocks.py): rows stay row-invariant wherever their positions' blocks
lie; rollback, sharing, eviction and preemption return exactly what they should; a preempted request gets what it
gets alone; budgets are checked at start; the server refuses what it cannot start in time with 429 Retry-After."""
import asyncio
import time

import httpx
import pytest
import torch

from specdec import SpecDecoder, models
from specdec.api import build_drafter
from specdec.batch import BatchEngine, Sequence
from specdec.errors import InvalidRequest
from specdec.runtime.blocks import BLOCK, BlockPool, OutOfBlocks, prefix_hashes
from specdec.runtime.load import load_gguf
from specdec.sampling import SamplingParams
from specdec.server import create_app
from test_runtime import gguf_pair  # noqa: F401
from test_server import LiveServer


def fresh(tiny_dirs, contexts: float | None = None):
    """The tiny target on the runtime, its KV pool sized to `contexts` whole contexts."""
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    if contexts is not None:
        model.set_kv_memory(int(contexts * model.max_len * model.kv_bytes_per_position))
    return model, tok


def alone(model, tok, prompt, params, n):
    sd = SpecDecoder.from_models(model, tok, draft="none")
    return sd.generate(prompt, max_new_tokens=n, chat=False, temperature=params.temperature, top_p=params.top_p,
                       top_k=params.top_k, seed=params.seed).token_ids


def test_block_pool_counts_shares_and_evicts_least_recently_used_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2) and pool.available == 1 and pool.used == 3
    pool.register(a, b"A"), pool.register(b, b"B")
    pool.hold(a)  # a second reader
    assert pool.shared(a) and pool.shared(b) and not pool.shared(c)  # hashed or held twice: copy before writing
    for block in (a, a, b, c):
        pool.release(block)
    assert pool.available == 4 and pool.used == 2  # the hashed two stay cached, evictable
    pool.hold(b), pool.release(b)  # b used again: a is now the least recently used
    assert [pool.allocate() for _ in range(2)] == [c, 3]  # unhashed free blocks go first
    assert pool.allocate() == a and b"A" not in pool.by_hash and pool.evictions == 1
    assert pool.allocate() == b and pool.evictions == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    h = prefix_hashes(list(range(40)), 2)
    assert len(h) == 2 and h == prefix_hashes(list(range(32)) + [9] * 8, 2) != prefix_hashes([1] + list(range(39)), 2)


def scatter(model, slots, n):
    """Fill `slots` one position at a time, round robin, after the pool's free list was shuffled: every slot's
    blocks end up apart and out of order."""
    pool = model.pool
    order = torch.randperm(len(pool.free), generator=torch.Generator().manual_seed(0)).tolist()
    pool.free[:] = [pool.free[i] for i in order]
    for pos in range(n):
        for s in slots:
            model.forward([3 + (pos * 7 + s) % 50], [s], [pos])


@pytest.mark.parametrize("numerics", ["exact", "q8"])
def test_rows_over_scattered_blocks_equal_one_token_steps_and_contiguous_blocks(gguf_pair, numerics):  # noqa: F811
    model = load_gguf(gguf_pair[0])
    model.set_numerics(numerics)
    filler = [model.acquire_slot() for _ in range(3)]
    scatter(model, filler, 37)
    a, b = model.acquire_slot(), model.acquire_slot()
    ids = [(5 * i + 1) % 60 + 3 for i in range(70)]
    whole = model.forward(ids, [a] * len(ids), list(range(len(ids))))  # one pass over 70 rows
    blocks = model.blocks_of(a)
    assert len(blocks) == 5 and sorted(blocks) != blocks or max(blocks) - min(blocks) > 4  # not one run
    steps = torch.cat([model.forward([t], [b], [i]) for i, t in enumerate(ids)])
    assert torch.equal(whole, steps)
    clean = load_gguf(gguf_pair[0])  # a fresh pool: blocks 0..4 in order
    clean.set_numerics(numerics)
    s = clean.acquire_slot()
    assert clean.blocks_of(s) == [] and torch.equal(clean.forward(ids, [s] * len(ids), list(range(len(ids)))), whole)
    assert clean.blocks_of(s) == [0, 1, 2, 3, 4]


def test_rollback_and_release_return_blocks(tiny_dirs):
    model, _ = fresh(tiny_dirs, contexts=2)
    per_block = model.kv_bytes_per_position * BLOCK
    c = model.new_cache()
    c.forward(list(range(3, 43)))  # 40 positions: 3 blocks
    assert model.kv_bytes() == 3 * per_block
    c.forward(list(range(3, 13)) + [90, 91])  # a divergence at 10: rolled back to 10, then 2 more positions
    assert model.kv_bytes() == 1 * per_block and len(c.tokens) == 12
    c.close()
    assert model.kv_bytes() == 0 and model.pool.available == model.pool.blocks


def test_shared_prompt_blocks_are_copied_before_a_write(tiny_dirs):
    """A prompt of exactly 2 blocks, twice: the second request shares both blocks, and its last prompt row (whose
    logits it needs) writes into the second, which it copies first; both get what they get alone."""
    model, tok = fresh(tiny_dirs, contexts=4)
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, {2}, 128,
                         max_batch_rows=16, prefill_chunk=8)
    prompt = tok("abcdefghij klmnopqrstu vwxyz01234").input_ids[: 2 * BLOCK]
    assert len(prompt) == 2 * BLOCK
    first = engine.add(Sequence(prompt, 10, SamplingParams()))
    while engine.running:
        engine.step()
    cached = [model.pool.by_hash[h] for h in prefix_hashes(prompt, 2)]
    second = engine.add(Sequence(prompt, 10, SamplingParams()))
    slot = engine._state[second.id][0]
    assert second.fed == 2 * BLOCK - 1 and model.blocks_of(slot)[0] == cached[0] != cached[1]
    assert model.blocks_of(slot)[1] != cached[1]  # its own copy of the block it writes into
    while engine.running:
        engine.step()
    ref = alone(model, tok, tok.decode(prompt), SamplingParams(), 10)
    assert first.generated == second.generated == ref[: len(first.generated)]
    assert [model.pool.by_hash[h] for h in prefix_hashes(prompt, 2)] == cached  # the cached blocks unchanged
    engine.close()


def test_cached_prompts_live_within_the_budget_least_recently_used_evicted_first(tiny_dirs):
    model, tok = fresh(tiny_dirs, contexts=1)  # 16 blocks
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, {2}, 256,
                         max_batch_rows=16, prefill_chunk=64)
    texts = [f"{c * 60}" for c in "abcdefgh"]  # 60-token prompts: 3 full blocks cached each
    for t in texts:
        engine.add(Sequence(tok(t).input_ids, 4, SamplingParams()))
        while engine.running:
            engine.step()
        assert model.pool.used <= model.pool.blocks
    cached = lambda t: prefix_hashes(tok(t).input_ids, 3)[0] in model.pool.by_hash  # noqa: E731
    assert model.pool.evictions > 0 and not cached(texts[0]) and cached(texts[-1])
    hits = engine.prefixes.hits
    seq = engine.add(Sequence(tok(texts[-1]).input_ids, 4, SamplingParams()))
    assert engine.prefixes.hits == hits + 1 and seq.fed == 3 * BLOCK
    engine.close()


@pytest.mark.parametrize("seeded", [False, True])
def test_preempted_requests_get_what_they_get_alone(tiny_dirs, seeded):
    """Four requests whose contexts together outgrow a pool of 1.25 contexts: the newest are preempted, recomputed
    later from their tokens, and every output is token-identical to the request alone (greedy, or seeded)."""
    model, tok = fresh(tiny_dirs, contexts=1.25)  # 20 blocks; the four need 4 x 6
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, set(), 256,
                         max_batch_rows=16, prefill_chunk=16)
    prompts = ["Hello there, general", "abcabcabcabc", "The cat sat on the mat", "Once upon a time"]
    params = [SamplingParams(0.9, 1.0, 0, 5 + i) if seeded else SamplingParams() for i in range(4)]
    seqs = [engine.add(Sequence(tok(p).input_ids, 90 - len(tok(p).input_ids), q)) for p, q in zip(prompts, params)]
    peak = 0
    while engine.running:
        engine.step()
        peak = max(peak, model.pool.used - len(model.pool.evictable))
    assert engine.preemptions > 0 and peak <= model.pool.blocks
    for s, p, q in zip(seqs, prompts, params):
        assert s.generated == alone(model, tok, p, q, s.max_new_tokens), p
    engine.close()


def test_bad_budgets_are_refused_in_one_line(tiny_dirs):
    model, tok = fresh(tiny_dirs)
    with pytest.raises(ValueError, match="context of 256 needs"):
        model.set_kv_memory(model.kv_bytes_per_position * BLOCK)  # one block
    from specdec.api import set_kv_memory
    for bad in (0, -1, True, "2"):
        with pytest.raises(InvalidRequest, match="kv_memory"):
            set_kv_memory(model, bad)
    with pytest.raises(InvalidRequest, match=r"^a KV memory budget of .* GiB holds \d+ positions; this model"):
        set_kv_memory(model, 1e-6)
    from specdec.cli import main
    assert main(["serve", "--target", tiny_dirs["target"], "--kv-memory", "0"]) != 0
    from specdec.server import describe_kv
    set_kv_memory(model, 2 * model.max_len * model.kv_bytes_per_position / 2**30)
    assert describe_kv(model).endswith("512 positions at 256 bytes (float16), 2.0 whole contexts of 256")  # q8: fp16


def test_requests_arriving_together_are_predicted_to_share_passes(tiny_dirs, monkeypatch):
    """Eight requests sent at once, each about 2 s of 0.1 s passes alone, against a 6 s timeout: they share the batch's
    passes, so none is refused. Their decode summed as if each ran after the others predicted the last ones past
    16 s, and they got 429 (the pair's 8 streams, a fresh server: 2 of 16 refused)."""
    model, tok = fresh(tiny_dirs)
    slow = model.forward

    def slowed(*a, **kw):
        time.sleep(0.1)
        return slow(*a, **kw)
    monkeypatch.setattr(model, "forward", slowed)  # (before the server: its pass curve is timed slowed too)
    sd = SpecDecoder.from_models(model, tok, draft="none")
    srv = LiveServer(create_app(sd, model_name="tiny", timeout_s=6.0, max_batch_rows=64, prefill_chunk=64))
    try:
        async def requests():
            async with httpx.AsyncClient(timeout=30) as client:
                body = lambda i: {"model": "tiny", "prompt": f"item {i}:", "max_tokens": 20}  # noqa: E731
                assert (await client.post(srv.url + "/v1/completions", json=body(-1))).status_code == 200
                return await asyncio.gather(*(client.post(srv.url + "/v1/completions", json=body(i))
                                              for i in range(8)))
        got = asyncio.run(requests())
        assert [r.status_code for r in got] == [200] * 8, [r.text for r in got if r.status_code != 200]
    finally:
        srv.stop()


def test_the_requests_ahead_delay_a_decode_only_where_they_fill_the_batch():
    from specdec.batch.load import finish_ms
    ahead = [(10.0, 1000.0)] * 7
    assert finish_ms(ahead, (10.0, 1000.0), 5.0, 0, 64) == 5.0 + 80.0 + 1000.0  # all prompts, one decode
    assert finish_ms(ahead, (10.0, 1000.0), 5.0, 0, 4) == 5.0 + 80.0 + 1000.0 + 7000.0 / 4  # the batch is full
    assert finish_ms([], (10.0, 1000.0), 0.0, 3, 4) == 1010.0  # the last free slot


def test_a_request_that_cannot_finish_in_time_gets_429_with_retry_after(tiny_dirs, monkeypatch, caplog):
    """A pool of one context, held by a long request on a slowed model: a request waiting for blocks gets 429 with
    Retry-After once its predicted finish passes its deadline (not a 504 after the timeout); one whose own work alone
    would outlast the timeout gets 429 at once; the gauges show the pool in use."""
    model, tok = fresh(tiny_dirs, contexts=1)
    sd = SpecDecoder.from_models(model, tok, draft="none")
    srv = LiveServer(create_app(sd, model_name="tiny", timeout_s=8.0, max_batch_rows=64, prefill_chunk=64))
    slow = model.forward

    def slowed(*a, **kw):
        time.sleep(0.7)
        return slow(*a, **kw)
    monkeypatch.setattr(model, "forward", slowed)  # the big request: 4 prompt passes and 5 steps, ~6.3 s
    try:
        async def requests():
            async with httpx.AsyncClient(timeout=30) as one, httpx.AsyncClient(timeout=30) as two, \
                    httpx.AsyncClient(timeout=30) as three:
                big = asyncio.create_task(one.post(srv.url + "/v1/completions", json={  # 250 + 5: all 16 blocks
                    "model": "tiny", "prompt": "x" * 250, "max_tokens": 5, "temperature": 0}))
                await asyncio.sleep(1.5)  # (passes measured: the work model knows a pass takes ~0.7 s)
                t = time.monotonic()
                small = asyncio.create_task(two.post(srv.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "hi", "max_tokens": 6}))
                await asyncio.sleep(0.1)
                t2 = time.monotonic()
                long = await three.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "yo",
                                                                            "max_tokens": 40})  # 40 passes: ~28 s
                long_s = time.monotonic() - t2
                small = await small
                waited = time.monotonic() - t
                return await big, small, waited, long, long_s
        big, small, waited, long, long_s = asyncio.run(requests())
        assert big.status_code == 200
        # waiting for blocks the big request holds, the small one is refused once it could no longer finish in time
        assert small.status_code == 429 and int(small.headers["retry-after"]) >= 1, small.text
        assert small.json()["error"]["code"] == "server_busy" and waited < 6.5  # its start_by: 4 s
        assert any(r.getMessage().startswith("a request ended with 429: server busy") for r in caplog.records)
        # the long one's own steps outlast its timeout: refused at once
        assert long.status_code == 429 and long_s < 1.0 and "would finish" in long.json()["error"]["message"]
        assert int(long.headers["retry-after"]) >= 10
        m = srv.metrics()
        assert m[("specdec_requests_refused_total", ())] == 2 and ("vllm:kv_cache_usage_perc", ()) in m
        assert ("vllm:num_preemptions_total", ()) in m
        assert m[("specdec_kv_cache_budget_bytes", ())] == model.kv_pool_bytes()
        assert m[("vllm:request_queue_time_seconds_count", ())] >= 1
    finally:
        srv.stop()


def test_work_model_predicts_prefill_from_two_depths(tiny_dirs):
    """measure_row_cost: a row deeper in the sequence costs at least as much (it reads more keys); the engine's
    prediction grows with the prompt and shrinks by what the prefix cache holds."""
    from specdec.batch import measure_row_cost
    model, tok = fresh(tiny_dirs, contexts=2)
    row_ms, key_ms = measure_row_cost(model, rows=16, reps=1)
    assert row_ms > 0 and key_ms >= 0
    engine = BatchEngine(model, build_drafter("ngram", model, tok), model.config.vocab_size, {2}, 256)
    engine.calibrate(1.0, 0.01)
    assert engine.rows_ms(0, 100) == pytest.approx(100 + 0.01 * 99 * 100 / 2)
    prompt = tok("y" * 100).input_ids
    before = engine.request_ms(prompt, 0)
    engine.add(Sequence(prompt, 2, SamplingParams()))
    assert engine.backlog_ms() == pytest.approx(before)  # all of it still to prefill
    while engine.running:
        engine.step()
    assert engine.backlog_ms() == 0 and engine.request_ms(prompt, 0) < before / 4  # 6 of 7 blocks are cached now
    engine.close()


def test_the_kv_budget_gauge_is_the_pools_size_read_once(tiny_dirs, monkeypatch):
    """specdec_kv_cache_budget_bytes reports the pool the server made, not what free memory would allow now, and
    a step's metrics never read /proc/meminfo (issue "serve strangers safely", item 7)."""
    from specdec.batch import BatchEngine
    from specdec.drafters import NgramDrafter
    from specdec.runtime import model as model_module
    from specdec.server.metrics import Metrics
    model, tok = fresh(tiny_dirs)  # the default budget: a share of available memory
    engine = BatchEngine(model, NgramDrafter(), model.config.vocab_size, {2}, 128)
    size = model.pool.blocks * model.kv_bytes_per_position * BLOCK

    def meminfo(*a):
        raise AssertionError("a step's metrics read /proc/meminfo")
    monkeypatch.setattr(model_module, "default_kv_memory", meminfo)
    metrics = Metrics()
    for _ in range(3):
        metrics.observe_engine(engine)
    assert metrics.kv_budget._value.get() == size == model.kv_pool_bytes()
    engine.close()
