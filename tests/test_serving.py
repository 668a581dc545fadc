"""Continuous batching over real HTTP (the runtime backend, as `specdec serve` runs the default model): concurrent
streams get what they get alone, a client that hangs up frees its place, a full queue answers 429 at once, and the
load gauges routers read are exported."""
import asyncio
import json

import httpx
import pytest

from specdec import SpecDecoder, models
from specdec.server import create_app
from test_server import LiveServer, SlowDrafter, all_held_cancelled, queue_depth, wait_for

REQUESTS = [dict(prompt="Hello there", max_tokens=30, temperature=0),
            dict(prompt="abcabcabc", max_tokens=25, temperature=0.9, seed=4),
            dict(prompt="The cat sat on the mat, and the dog sat on the log.", max_tokens=35, temperature=0,
                 stop=["zz"]),
            dict(prompt="xyz", max_tokens=20, temperature=1.0, top_k=5, seed=9),
            dict(prompt="Once upon", max_tokens=28, temperature=0, tau=2, policy="fixed"),
            dict(prompt="qqq", max_tokens=22, temperature=0.7, seed=1)]


@pytest.fixture(scope="module")
def rt_decoder(tiny_dirs):  # a model of its own (not conftest's rt_sd): its KV pool's usage is checked
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    return SpecDecoder.from_models(model, tok, draft="ngram", tau=3)


@pytest.fixture(scope="module")
def batched(rt_decoder):
    """The n-gram drafter behind a gate the test holds (no delay)."""
    gated = SpecDecoder.from_models(rt_decoder.model, rt_decoder.tokenizer, draft=SlowDrafter(delay_s=0), tau=3)
    srv = LiveServer(create_app(gated, model_name="tiny", max_queue=32, max_batch_rows=12, prefill_chunk=4))
    yield srv
    srv.stop()


async def stream(url, body):
    text = ""
    async with httpx.AsyncClient(timeout=30) as hc:
        async with hc.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_concurrent_streams_equal_each_request_served_alone(batched, rt_decoder):
    gate = batched.app.state.decoder.engine.drafter.gate

    async def all_at_once():  # all six queued while the gate holds the worker: they must share passes
        gate.clear()
        tasks = [asyncio.create_task(stream(batched.url, r)) for r in REQUESTS]
        await asyncio.to_thread(wait_for, lambda: queue_depth(batched) == len(REQUESTS), "all six are queued")
        gate.set()
        return await asyncio.gather(*tasks)
    together = asyncio.run(all_at_once())
    for body, text in zip(REQUESTS, together):
        alone = asyncio.run(stream(batched.url, body))
        assert text == alone, body
        if body["temperature"] == 0 and "tau" not in body:  # and greedy equals the target alone
            ref = SpecDecoder.from_models(rt_decoder.model, rt_decoder.tokenizer, draft="none").generate(
                body["prompt"], max_new_tokens=body["max_tokens"], chat=False, stop=body.get("stop"))
            assert text == ref.text
    m = batched.metrics()
    passes, rows = m[("specdec_batch_rows_count", ())], m[("specdec_batch_rows_sum", ())]
    assert rows / passes > 1.5  # requests shared passes
    assert m[("vllm:num_requests_running", ())] == m[("specdec_requests_running", ())] == 0
    assert ("vllm:num_requests_waiting", ()) in m
    assert m[("specdec_kv_cache_bytes", ())] > 0  # the prefix cache's blocks (nothing is running)
    assert m[("vllm:kv_cache_usage_perc", ())] == 0  # cached blocks nobody holds count as free, as in vLLM
    assert m[("vllm:prefix_cache_queries_total", ())] >= m[("vllm:prefix_cache_hits_total", ())] > 0  # repeats


def test_disconnect_mid_batch_frees_its_slot_and_others_finish(rt_decoder):
    """A stream hangs up while held in the batch (the drafter's gate keeps it from finishing at any speed); it
    leaves at the next cycle boundary with its slot, and the requests running beside it finish as they do alone."""
    model, tok = rt_decoder.model, rt_decoder.tokenizer
    slow = SpecDecoder.from_models(model, tok, draft=SlowDrafter(), tau=2)
    srv = LiveServer(create_app(slow, model_name="tiny", max_queue=4, max_batch_rows=8))
    gate = slow.engine.drafter.gate
    try:
        held = model.held_slots
        gate.clear()

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as hc:
                async with hc.stream("POST", srv.url + "/v1/completions",
                                     json={"prompt": "Hello", "max_tokens": 200, "temperature": 0,
                                           "stream": True, "tau": 2, "policy": "fixed"}) as r:
                    assert r.status_code == 200
                    await asyncio.to_thread(wait_for, lambda: queue_depth(srv) == 1, "the stream is admitted")
            await asyncio.to_thread(wait_for, lambda: all_held_cancelled(srv), "the hang-up cancels the job")
            others = [asyncio.create_task(stream(srv.url, r)) for r in REQUESTS[:2]]
            await asyncio.to_thread(wait_for, lambda: queue_depth(srv) == 3, "the others are queued beside it")
            gate.set()
            return await asyncio.gather(*others)
        texts = asyncio.run(scenario())
        wait_for(lambda: queue_depth(srv) == 0, "every job leaves")
        assert model.held_slots == held  # the dropped request's slot is free again (cached prompts hold no slot)
        others = sum(len(tok(t, add_special_tokens=False).input_ids) for t in texts)
        # the dropped request made its first token and at most the one cycle (tau=2: 3 tokens) it was held in
        assert srv.metrics()[("specdec_generated_tokens_total", ())] - others <= 1 + 3
        for body, text in zip(REQUESTS[:2], texts):
            assert text == asyncio.run(stream(srv.url, body))
    finally:
        gate.set()
        srv.stop()


def test_full_queue_answers_429_at_once(rt_decoder):
    """Two streams fill a queue of 2, held by the drafter's gate (neither can finish, at any speed): a third
    request gets 429 without waiting for either."""
    slow = SpecDecoder.from_models(rt_decoder.model, rt_decoder.tokenizer, draft=SlowDrafter(), tau=2)
    srv = LiveServer(create_app(slow, model_name="tiny", max_queue=2, max_batch_rows=8))
    gate = slow.engine.drafter.gate
    try:
        body = {"prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True, "tau": 2,
                "policy": "fixed"}
        gate.clear()
        with httpx.Client(timeout=10) as hc:
            with hc.stream("POST", srv.url + "/v1/completions", json=body), \
                    hc.stream("POST", srv.url + "/v1/completions", json=body):
                wait_for(lambda: queue_depth(srv) == 2, "both streams hold the queue")
                busy = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full" and busy.headers["retry-after"]
                assert srv.metrics()[("specdec_generated_tokens_total", ())] <= 2  # nobody got past the gate
            gate.set()
    finally:
        gate.set()
        srv.stop()


@pytest.mark.parametrize("args", [["--max-batch-rows", "0"], ["--prefill-chunk", "0"], ["--max-tau", "-1"],
                                  ["--ray", "--ray-autoscaling", "{not json"], ["--ray", "--replicas", "0"]])
def test_serve_refuses_bad_batching_and_ray_options(tiny_dirs, capsys, args):
    """One readable line and exit status 2, before any model or Ray process starts (without Ray installed, the
    --ray options say how to install it)."""
    from specdec.cli import main
    assert main(["serve", "--target", tiny_dirs["target"], "--port", "1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("must" in err or "Ray Serve is not installed" in err), err


def test_each_api_key_is_a_tenant_of_its_own(rt_decoder):
    """A server with two API keys: the same long system prompt sent with the second key gets no cache hit after the
    first key's request (nor with a cache_salt the first used), the first key's repeat does; a wrong key is a 401."""
    srv = LiveServer(create_app(rt_decoder, model_name="tiny", max_queue=8, max_batch_rows=8,
                                api_key=["key-alice", "key-bob"]))
    try:
        rt_decoder.model.pool.clear_hashes()
        system = "You are a careful assistant for ACME's internal billing team. " * 3
        srv.auth = {"Authorization": "Bearer key-alice"}

        def ask(key, **extra):
            before = srv.metrics().get(("vllm:prefix_cache_hits_total", ()), 0)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": system + "Hi", "max_tokens": 6,
                                                              "temperature": 0, **extra},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], srv.metrics()[("vllm:prefix_cache_hits_total", ())] - before
        first, hits = ask("key-alice")
        assert hits == 0
        assert ask("key-bob") == (first, 0)  # bob learns nothing from alice's cached prompt
        again, hits = ask("key-alice")
        assert again == first and hits > 0  # each key's repeat is served from its own cache
        assert ask("key-bob")[1] > 0 and ask("key-alice", cache_salt="other") == (first, 0)
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"},
                          headers={"Authorization": "Bearer key-carol"}).status_code == 401
    finally:
        srv.stop()


def test_tenants_do_not_share_cached_prompts_over_http(rt_decoder):
    """Two tenants (cache_salt, or OpenAI's prompt_cache_key) with the same long system prompt: the second tenant's
    first request gets no cache hit, the first tenant's repeat does; answers are the same for both."""
    srv = LiveServer(create_app(rt_decoder, model_name="tiny", max_queue=8, max_batch_rows=8))
    try:
        rt_decoder.model.pool.clear_hashes()
        system = "You are a careful assistant for ACME's internal billing team. " * 3

        def ask(**tenant):
            before = srv.metrics().get(("vllm:prefix_cache_hits_total", ()), 0)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": system + "Hi", "max_tokens": 6,
                                                              "temperature": 0, **tenant}, timeout=60)
            assert r.status_code == 200, r.text
            hits = srv.metrics()[("vllm:prefix_cache_hits_total", ())] - before
            usage = r.json()["usage"]  # OpenAI's count of the prompt tokens served from the cache
            assert (usage["prompt_tokens_details"]["cached_tokens"] > 0) == (hits > 0)
            assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
            return r.json()["choices"][0]["text"], hits
        first, hits = ask(cache_salt="alice")
        assert hits == 0
        assert ask(cache_salt="bob") == (first, 0)  # another tenant learns nothing from alice's cached prompt
        assert ask(prompt_cache_key="carol") == (first, 0)
        again, hits = ask(cache_salt="alice")
        assert again == first and hits > 0  # the owner's repeat is served from its cache
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "cache_salt": "s" * 300})
        assert r.status_code == 400 and "cache_salt" in r.text
    finally:
        srv.stop()


def test_every_api_reports_the_prompt_tokens_served_from_the_cache(rt_decoder):
    """The same conversation twice through each API: the repeat reports its cached prompt tokens in that API's own
    field (OpenAI's prompt_tokens_details, streamed too; the Responses API's input_tokens_details; Anthropic's
    cache_read_input_tokens beside the input_tokens it did not read; llama-server's cache_n), the first none."""
    srv = LiveServer(create_app(rt_decoder, model_name="tiny", max_queue=8, max_batch_rows=8))
    system = "You are a careful assistant for ACME's internal billing team. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    apis = {
        "/v1/chat/completions": ({"messages": messages, "max_tokens": 4, "temperature": 0},
                                 lambda u: (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])),
        "stream": ({"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}},
                   lambda u: (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])),
        "/v1/responses": ({"input": messages, "max_output_tokens": 4, "temperature": 0},
                          lambda u: (u["input_tokens"], u["input_tokens_details"]["cached_tokens"])),
        "/v1/messages": ({"model": "tiny", "system": system, "messages": messages[1:], "max_tokens": 4,
                          "temperature": 0},
                         lambda u: (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"])),
        "/completion": ({"prompt": system + "Hi", "n_predict": 4, "temperature": 0},
                        lambda t: (t["prompt_n"] + t["cache_n"], t["cache_n"])),
    }
    try:
        for api, (body, read) in apis.items():
            rt_decoder.model.pool.clear_hashes()
            counts = []
            for _ in range(2):
                r = httpx.post(srv.url + ("/v1/chat/completions" if api == "stream" else api), json=body, timeout=60)
                assert r.status_code == 200, r.text
                if api == "stream":
                    got = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                    counts.append(read(got[-1]["usage"]))
                else:
                    counts.append(read(r.json()["timings" if api == "/completion" else "usage"]))
            (prompt, first), (again, cached) = counts
            assert prompt == again and first == 0 and 0 < cached < prompt, (api, counts)
    finally:
        srv.stop()
