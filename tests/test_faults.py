"""Serving state under faults (server/worker.py, batch/admission.py, runtime/owner.py): an exception raised at each
phase of a request's life beside 8 live streams fails that request alone (or, in its cleanup, nobody), every other
stream equals the target alone, and the server goes on serving; repeated failures restart the worker, with /health
saying so; and nothing but the worker thread touches the engine or its prefix cache."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from specdec import SpecDecoder, models
from specdec.batch import BatchEngine, Sequence
from specdec.batch.requests import Sequence as BatchSequence
from specdec.drafters import NgramDrafter
from specdec.runtime import owner
from specdec.sampling import SamplingParams
from specdec.server import create_app
from test_hardening import GOOD, post
from test_server import LiveServer, queue_depth, wait_for
from test_serving import stream

MARK = "~~"  # the injected request's prompt holds it; no good one does


class Marked(NgramDrafter):
    """n-gram drafts, forked per request, raising where a test says (`phase`) for the marked request's context."""
    name = "ngram"
    phase: list = [None]
    mark: list[int] = []

    def fork(self):
        return Marked()

    def _marked(self, context) -> bool:
        n = len(self.mark)
        return any(context[i:i + n] == self.mark for i in range(len(context) - n + 1))

    def propose(self, context, k, params, generator):
        self._context = list(context)
        if self.phase[0] == "draft" and self._marked(context):
            raise RuntimeError("injected: draft")
        return super().propose(context, k, params, generator)

    def close(self):
        if self.phase[0] == "remove" and self._marked(getattr(self, "_context", [])):
            raise RuntimeError("injected: remove")


@pytest.fixture(scope="module")
def faulty(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    Marked.mark = tok(MARK, add_special_tokens=False).input_ids
    sd = SpecDecoder.from_models(model, tok, draft=Marked(), tau=3)
    srv = LiveServer(create_app(sd, model_name="tiny", max_queue=64, max_batch_rows=24, prefill_chunk=8))
    alone = SpecDecoder.from_models(model, tok, draft="none")
    want = [alone.generate(b["prompt"], max_new_tokens=b["max_tokens"], chat=False).text for b in GOOD]
    yield srv, model, tok, want
    srv.stop()


def _inject(monkeypatch, srv, model, tok, phase: str) -> None:
    """Make `phase` raise for the marked request only."""
    worker = srv.app.state.worker
    engine, mark = worker.engine, Marked.mark
    Marked.phase[0] = phase

    def marked(tokens) -> bool:
        n = len(mark)
        return any(list(tokens[i:i + n]) == mark for i in range(len(tokens) - n + 1))

    def wrap(obj, name, test):
        original = getattr(obj, name)

        def fails(*a, **kw):
            if test(*a, **kw):
                raise RuntimeError(f"injected: {phase}")
            return original(*a, **kw)
        monkeypatch.setattr(obj, name, fails)
    if phase == "admission":
        wrap(engine, "add", lambda seq: marked(seq.prompt))
    elif phase == "prefill":
        wrap(model, "forward", lambda tokens, *a, **kw: marked(tokens))
    elif phase == "verify":
        wrap(engine, "_finish_cycle", lambda s, *a, **kw: marked(s.prompt))
    elif phase == "finish":
        original = BatchSequence.finish

        def finish(self, reason):
            if marked(self.prompt):
                raise RuntimeError("injected: finish")
            return original(self, reason)
        monkeypatch.setattr(BatchSequence, "finish", finish)
    elif phase == "store":
        wrap(engine.prefixes, "store", lambda tokens, *a, **kw: marked(tokens))
    elif phase == "emit":
        decoder, prepare = srv.app.state.decoder, srv.app.state.decoder.prepare

        def prepared(**kw):
            req = prepare(**kw)
            if marked(req.prompt_ids):
                def chunk(rec):
                    raise RuntimeError("injected: emit")
                req.chunk = chunk
            return req
        monkeypatch.setattr(decoder, "prepare", prepared)


# phase -> the injected request's status: its own work fails it (500); its cleanup fails nobody
PHASES = {"admission": 500, "prefill": 500, "draft": 500, "verify": 500, "emit": 500, "finish": 500, "remove": 200,
          "store": 200}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_fault_at_each_phase_fails_only_its_request(faulty, monkeypatch, phase):
    srv, model, tok, want = faulty
    worker = srv.app.state.worker
    restarts = worker.restarts
    _inject(monkeypatch, srv, model, tok, phase)
    # the mark first: in the first prompt chunk whatever rows the batch leaves it (in the middle, a chunk cut short
    # by the good requests' rows could split it, and no pass would carry it whole)
    bad = {"prompt": f"{MARK} say please, a long prompt of several chunks", "max_tokens": 10, "temperature": 0}

    async def scenario():
        goods = [asyncio.create_task(stream(srv.url, body)) for body in GOOD]
        await asyncio.sleep(0.05)
        r = await post(srv.url, "/v1/completions", bad)
        return [await t for t in goods], r
    try:
        texts, r = asyncio.run(scenario())
    finally:
        Marked.phase[0] = None
        monkeypatch.undo()
    assert texts == want
    assert r.status_code == PHASES[phase], r.text[:300]
    if r.status_code != 200:
        assert "injected" in r.json()["error"]["message"] or "in this request" in r.json()["error"]["message"]
    wait_for(lambda: queue_depth(srv) == 0, "every request ended")
    assert worker.restarts == restarts and httpx.get(srv.url + "/health").status_code == 200
    after = httpx.post(srv.url + "/v1/completions", json={**GOOD[0], "stream": False}, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == want[0]
    wait_for(lambda: not worker.active, "the batch is empty")
    assert not worker.engine.running and not worker.engine._state  # nobody left behind with or without state


def test_cleanups_that_keep_failing_restart_the_worker_and_health_tells(faulty, monkeypatch):
    """Every removal fails: after CLEANUP_FAILURES of them in a minute the worker is restarted (its engine reset, its KV pool made
    anew), /health is 503 meanwhile, and the server serves again after."""
    from specdec.server import worker as worker_mod
    srv, model, tok, want = faulty
    worker = srv.app.state.worker
    restarts = worker.restarts
    health = []
    original = model.release_slot

    def broken(slot):
        original(slot)
        raise RuntimeError("injected: every release")
    monkeypatch.setattr(model, "release_slot", broken)

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as hc:
            tasks = [asyncio.create_task(hc.post(srv.url + "/v1/completions", json=b)) for b in GOOD]
            while not all(t.done() for t in tasks):
                health.append((await hc.get(srv.url + "/health")).status_code)
                await asyncio.sleep(0.002)
            return [t.result() for t in tasks]
    asyncio.run(scenario())
    monkeypatch.undo()
    wait_for(lambda: worker.restarts > restarts, "the supervisor restarts the worker")
    assert 2 <= worker_mod.CLEANUP_FAILURES <= len(GOOD)
    wait_for(lambda: worker.alive, "the worker serves again")
    r = httpx.post(srv.url + "/v1/completions", json=GOOD[1], timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[1]


def test_the_engine_and_its_prefix_cache_are_the_worker_threads_alone(faulty):
    """Predictions run on HTTP threads from the published snapshot; a touch of the engine or its prefix cache from
    any thread but the worker's raises (the tests run with SPECDEC_CHECK_OWNER=1)."""
    srv, model, tok, _ = faulty
    worker = srv.app.state.worker
    assert owner.CHECK
    with pytest.raises(owner.NotOwner):
        worker.engine.prefixes.lookup(tok("hello there").input_ids)
    with pytest.raises(owner.NotOwner):
        worker.engine.step()
    errors = []

    def predict():  # three threads predicting while 8 streams run: no error, every prediction a number
        try:
            for _ in range(200):
                got = worker.predict({"prompt_ids": tok(GOOD[0]["prompt"] * 5).input_ids, "max_new_tokens": 8})
                assert got is not None and got[0] > 0
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    async def streams():
        return await asyncio.gather(*(stream(srv.url, b) for b in GOOD))
    threads = [threading.Thread(target=predict) for _ in range(3)]
    for t in threads:
        t.start()
    asyncio.run(streams())
    for t in threads:
        t.join()
    assert errors == []


def test_a_removal_that_raises_leaves_the_batch_consistent(tiny_dirs, monkeypatch):
    """Finding 1 in the engine alone: the drafter's close raises as a finished request leaves; it has left the batch
    all the same, and every later step serves the others (before: every step raised KeyError for good)."""
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    Marked.mark, Marked.phase[0] = tok(MARK, add_special_tokens=False).input_ids, "remove"
    try:
        engine = BatchEngine(model, Marked(), model.config.vocab_size, set(), 256, max_batch_rows=16,
                             prefill_chunk=8)
        bad = engine.add(Sequence(tok(f"a {MARK} b").input_ids, 3, SamplingParams()))
        good = [engine.add(Sequence(tok(p).input_ids, 12, SamplingParams())) for p in ("Hello", "The cat sat")]
        while engine.running:
            engine.step()
            assert not engine.failed
    finally:
        Marked.phase[0] = None
    assert bad.finish_reason == "length" and engine.cleanup_failures == 1
    alone = SpecDecoder.from_models(model, tok, draft="none")
    for s, p in zip(good, ("Hello", "The cat sat")):
        assert s.generated == alone.generate(p, max_new_tokens=12, chat=False).token_ids
    engine.reset()
    assert model.pool.available == model.pool.blocks
