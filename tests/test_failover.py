"""Failover's pieces without Ray (server/failover.py): a sampled request is seeded before any replica sees it, a
replica's app streams through asgi_stream as it generates, and a stream cut mid-way and sent again to another
replica resumes where the client is: one stream, no token repeated or missing, equal to the request served alone.
The same across real Ray replicas, one killed mid-stream: test_ray.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from specdec import SpecDecoder
from specdec.server import create_app
from specdec.server.failover import Resumer, asgi_stream, resumed_events, split_event, with_seed


def test_sampled_requests_get_a_seed_before_any_replica_and_nothing_else_changes():
    seeded = json.loads(with_seed("/v1/completions", json.dumps({"prompt": "x", "temperature": 0.7}).encode()))
    assert isinstance(seeded["seed"], int) and 0 <= seeded["seed"] < 2 ** 63
    defaulted = json.loads(with_seed("/v1/chat/completions", b'{"messages": []}'))  # OpenAI's default: 1.0
    assert "seed" in defaulted
    for path, body in [("/v1/completions", b'{"prompt": "x", "temperature": 0}'),  # greedy
                       ("/v1/completions", b'{"prompt": "x", "seed": 5}'),  # its own seed
                       ("/v1/completions", b"not json"), ("/health", b""), ("/v1/models", b"")]:
        assert with_seed(path, body) == body
    assert json.loads(with_seed("/infill", b'{"input_prefix": "a", "seed": -1}'))["seed"] >= 0  # llama's "random"
    assert json.loads(with_seed("/completion", b'{"prompt": "a"}'))["seed"] >= 0  # llama-server's default: 0.8


def sse(events: list[dict | str]) -> list[str]:
    return [e if isinstance(e, str) else json.dumps(e) for e in events]


def test_a_resumed_stream_sends_only_what_the_client_lacks():
    r = Resumer()
    first = sse([{"id": "a", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                 {"id": "a", "created": 1, "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
                 {"id": "a", "created": 1, "choices": [{"index": 0, "delta": {"content": "lo, w"}}]}])
    got = [r.event(e) for e in first]
    r.restart()  # the replica died; the same request elsewhere, chunked differently
    second = sse([{"id": "b", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  {"id": "b", "created": 2, "choices": [{"index": 0, "delta": {"content": "Hello"}}]},
                  {"id": "b", "created": 2, "choices": [{"index": 0, "delta": {"content": ", wor"}}]},
                  {"id": "b", "created": 2, "choices": [{"index": 0, "delta": {"content": "ld"}}]},
                  {"id": "b", "created": 2, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"id": "b", "created": 2, "choices": [], "usage": {"completion_tokens": 4}}, "[DONE]"])
    got += [r.event(e) for e in second]
    sent = [json.loads(g) for g in got if g is not None and g != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in sent if c["choices"])
    assert text == "Hello, world"
    assert sum(1 for c in sent if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    assert sum(1 for c in sent if c["choices"] and c["choices"][0].get("finish_reason")) == 1
    assert all(c["id"] == "a" and c["created"] == 1 for c in sent)  # one stream to the client
    assert got[-1] == "[DONE]" and r.event("[DONE]") is None


def test_a_resumed_stream_counts_reasoning_apart_from_content():
    """A thinking model's stream (reasoning.py): reasoning_content deltas, then content; resumed after a cut inside
    the reasoning, each field gets exactly the text the client lacks."""
    r = Resumer()
    chunk = lambda field, text: {"id": "a", "choices": [{"index": 0, "delta": {field: text}}]}  # noqa: E731
    got = [r.event(e) for e in sse([chunk("reasoning_content", "I will"), chunk("reasoning_content", " say")])]
    r.restart()
    got += [r.event(e) for e in sse([chunk("reasoning_content", "I"), chunk("reasoning_content", " will say hi"),
                                     chunk("content", "Hi"), chunk("content", " there")])]
    sent = [json.loads(g)["choices"][0]["delta"] for g in got if g is not None]
    assert "".join(d.get("reasoning_content", "") for d in sent) == "I will say hi"
    assert "".join(d.get("content", "") for d in sent) == "Hi there"


def run_stream(app, body: dict, cut_after: int | None = None) -> list[str]:
    """The `data:` payloads of one streamed request through asgi_stream; cut_after: stop after that many (a replica
    killed mid-stream)."""
    async def go():
        out, buffer, status = [], "", None
        async for item in asgi_stream(app, "POST", "/v1/completions", b"",
                                      [(b"content-type", b"application/json")], json.dumps(body).encode()):
            if isinstance(item, tuple):
                status = item[1]
                continue
            buffer += item.decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                out.append(event[6:])
                if cut_after is not None and len(out) >= cut_after:
                    return status, out
        return status, out
    status, out = asyncio.run(go())
    assert status == 200
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_a_stream_cut_mid_way_resumes_on_another_replica_equal_to_the_request_alone(tok, target, draft_close, sampled,
                                                                                     monkeypatch):
    """Two replicas (two apps on one model), a stream cut after a few events on the first: the same seeded request
    on the second, through the Resumer, completes it. The client's text is the request's text alone, every token
    once. (with_seed's seed is fixed here: a random one now and then drew an end of text within 5 characters, before
    the cut.)"""
    monkeypatch.setattr("specdec.server.failover.secrets.randbits", lambda bits: 20261202)
    replicas = [create_app(SpecDecoder.from_models(target, tok, draft=draft_close, tau=3), model_name="tiny")
                for _ in range(2)]
    body = json.loads(with_seed("/v1/completions", json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 40, "stream": True, "temperature": 0.9 if sampled else 0}
    ).encode()))
    alone = run_stream(replicas[1], body)
    want = "".join(json.loads(e)["choices"][0]["text"] for e in alone if e != "[DONE]" and json.loads(e)["choices"])
    r = Resumer()
    client = [r.event(e) for e in run_stream(replicas[0], body, cut_after=4)]
    r.restart()
    client += [r.event(e) for e in run_stream(replicas[1], body)]
    events = [json.loads(e) for e in client if e is not None and e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want and len(want) > 20
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["finish_reason"]) == 1
    assert client.count("[DONE]") == 1


def test_an_infill_stream_resumes_too():
    """llama-server's /infill events ({content, stop}) resume like OpenAI chunks: text once, the stop once."""
    r = Resumer()
    got = [r.event(json.dumps({"content": c, "stop": False})) for c in ("def ", "f(x")]
    r.restart()
    got += [r.event(json.dumps(e)) for e in ({"content": "def f", "stop": False}, {"content": "(x):", "stop": False},
                                             {"content": "", "stop": True, "tokens_predicted": 5})]
    got.append(r.event(json.dumps({"content": "", "stop": True})))  # a stop again: not sent twice
    sent = [json.loads(g) for g in got if g is not None]
    assert "".join(e["content"] for e in sent) == "def f(x):" and sum(e["stop"] for e in sent) == 1


def test_a_cut_completion_event_drops_its_tokens():
    """A /completion event that straddles what the client has keeps its new text only, and its token ids (which
    no longer match that text) are left out; whole events keep theirs."""
    r = Resumer()
    r.event(json.dumps({"content": "ab", "tokens": [1, 2], "stop": False}))
    r.restart()
    cut = json.loads(r.event(json.dumps({"content": "abc", "tokens": [1, 2, 3], "stop": False})))
    whole = json.loads(r.event(json.dumps({"content": "d", "tokens": [4], "stop": False})))
    assert cut == {"content": "c", "stop": False} and whole["tokens"] == [4]


def test_a_responses_stream_resumes_under_its_first_ids():
    """OpenAI Responses events: the retried attempt's text deltas from where the client is, its other events sent
    once, numbered on, under the first attempt's response and message ids."""
    def attempt(job, deltas, end=True):
        rid, mid = f"resp_{job}", f"msg_{job}"
        out = [{"type": "response.created", "response": {"id": rid}}, {"type": "response.in_progress",
                                                                      "response": {"id": rid}},
               {"type": "response.output_item.added", "output_index": 0, "item": {"id": mid}},
               {"type": "response.content_part.added", "item_id": mid, "output_index": 0, "content_index": 0}]
        out += [{"type": "response.output_text.delta", "item_id": mid, "output_index": 0, "content_index": 0,
                 "delta": d} for d in deltas]
        if end:
            out += [{"type": "response.output_text.done", "item_id": mid, "output_index": 0, "content_index": 0,
                     "text": "".join(deltas)}, {"type": "response.completed", "response": {"id": rid}}]
        return [f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': k})}" for k, e in enumerate(out)]
    r = Resumer()
    got = [r.event(split_event(e)[1]) for e in attempt("aaa", ["Hel"], end=False)]
    r.restart()
    got += [r.event(split_event(e)[1]) for e in attempt("bbb", ["He", "llo"])]
    sent = [json.loads(g) for g in got if g is not None]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert [e["type"] for e in sent].count("response.created") == 1 and "bbb" not in json.dumps(sent)
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == "Hello"
    assert sent[-1]["response"]["id"] == "resp_aaa"
    assert split_event('event: x\ndata: {"a": "data: b"}') == ("event: x\n", '{"a": "data: b"}')
    assert split_event(": ping") == (": ping", None) and split_event("data: [DONE]") == ("", "[DONE]")


def test_an_anthropic_stream_resumes_under_its_first_message_id():
    def attempt(job, deltas, end=True):
        out = [{"type": "message_start", "message": {"id": f"msg_{job}", "content": []}},
               {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]
        out += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}}
                for d in deltas]
        if end:
            out += [{"type": "content_block_stop", "index": 0},
                    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
                    {"type": "message_stop"}]
        return [f"event: {e['type']}\ndata: {json.dumps(e)}" for e in out]
    r = Resumer()
    got = [r.event(split_event(e)[1]) for e in attempt("aaa", ["Hel"], end=False)]
    r.restart()
    got += [r.event(split_event(e)[1]) for e in attempt("bbb", ["He", "llo"])]
    sent = [json.loads(g) for g in got if g is not None]
    assert [e["type"] for e in sent] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in sent if e["type"] == "content_block_delta") == "Hello"
    assert sent[0]["message"]["id"] == "msg_aaa" and "bbb" not in json.dumps(sent)



# ---- the router's stream loop (failover.resumed_events), its replicas faked ---------------------------------------
def chunk_event(text: str | None = None, **extra) -> str:
    delta = {"content": text} if text is not None else {}
    return "data: " + json.dumps({"id": "c", "created": 1, "choices": [{"index": 0, "delta": {**delta, **extra}}]})


def replica(events: list[str], status: int = 200, die_after: int | None = None, body: bytes = b""):
    """An attempt: its response start, then its events (or, refused, its JSON body); dying after `die_after`."""
    async def gen():
        yield ("start", status, [])
        if status != 200:
            yield body
            return
        for k, e in enumerate(events):
            if die_after is not None and k == die_after:
                raise ConnectionError("the replica died")
            yield (e + "\n\n").encode()
    return gen()


def follow(first, retries: list, tries: int = 4) -> list[str]:
    async def run():
        start = first
        await start.__anext__()  # the router reads the first attempt's start before it streams
        out = []
        async for event in resumed_events(start, lambda: retries.pop(0), tries, 0.0):
            out.append(event)
        return out
    return asyncio.run(run())


FULL = [chunk_event("Hel"), chunk_event("lo"), "data: " + json.dumps({"id": "c", "created": 1, "choices": [
    {"index": 0, "delta": {}, "finish_reason": "stop"}]}), "data: [DONE]"]


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events
                   if e.startswith("data: {") and "choices" in e)


def test_a_retry_refused_busy_is_tried_on_another_replica():
    busy = json.dumps({"error": {"message": "server busy", "type": "rate_limit_error", "code": "queue_full"}})
    out = follow(replica(FULL, die_after=1), [replica([], 503, body=busy.encode()), replica(FULL)])
    assert text_of(out) == "Hello" and out[-1] == "data: [DONE]\n\n"


def test_a_stream_no_replica_will_finish_ends_with_the_refusals_error():
    """Before: the 429's JSON body was dropped and the stream just stopped, with no error and no [DONE]."""
    busy = json.dumps({"error": {"message": "server busy: queue full", "type": "rate_limit_error", "code": "queue_full"}})
    out = follow(replica(FULL, die_after=1), [replica([], 429, body=busy.encode()) for _ in range(3)])
    assert text_of(out) == "Hel"
    assert json.loads(out[-1][6:])["error"]["message"] == "server busy: queue full"
    bad = follow(replica(FULL, die_after=1), [replica([], 400, body=b'{"error": {"message": "no", "type": "x"}}')])
    assert json.loads(bad[-1][6:])["error"]["message"] == "no"  # not retried: a refusal that would repeat


def test_a_stream_that_stops_without_its_end_gets_an_error_event():
    out = follow(replica(FULL[:2]), [])
    assert text_of(out) == "Hello" and json.loads(out[-1][6:])["error"]["code"] == "worker_down"


def test_chunks_with_logprobs_and_no_text_are_kept_and_tool_calls_sent_once():
    """A token whose text is not out yet (a partial UTF-8 character) still carries its logprobs: before, such a chunk
    was dropped even with no failover. A tool call's chunk is sent once when its stream is resumed."""
    lp = chunk_event("", logprobs={"content": [{"token": "\\xe2", "logprob": -0.1}]})
    r = Resumer()
    assert r.event(lp[6:]) is not None
    call = "data: " + json.dumps({"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]})
    events = [chunk_event("x"), call, FULL[2], "data: [DONE]"]
    out = follow(replica(events, die_after=2), [replica(events)])
    assert sum("tool_calls" in e for e in out) == 1 and out[-1] == "data: [DONE]\n\n"
