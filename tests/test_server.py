"""Real HTTP on 127.0.0.1 against the tiny model: the official openai client, bad input, auth, queueing,
disconnects, timeouts and /metrics."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec import SpecDecoder
from specdec.drafters import NgramDrafter
from specdec.server import create_app
from specdec.trace import read_jsonl


class SlowDrafter(NgramDrafter):
    """Makes each cycle take >= 40 ms so queueing, disconnects and timeouts can be observed; and a gate the test
    holds: while `gate` is clear, no proposal returns, so no request can finish (assertions that hold at any speed)."""
    name = "slow"

    def __init__(self, delay_s: float = 0.04):
        super().__init__()
        self.delay_s, self.gate = delay_s, threading.Event()
        self.gate.set()

    def propose(self, context, k, params, generator):
        assert self.gate.wait(60), "the test never opened the gate"
        time.sleep(self.delay_s)
        return super().propose(context, k, params, generator)


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Poll until `condition()` holds; the timeout only turns a hang into a failure, no assertion depends on it."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def queue_depth(srv) -> int:
    return httpx.get(srv.url + "/health").json()["queue_depth"]


def all_held_cancelled(srv) -> bool:
    held = list(srv.app.state.worker._held)
    return bool(held) and all(j.cancelled.is_set() for j in held)


def two_completions(url: str) -> None:
    """Two small completions over real HTTP (what a shutdown then saves: tables, refined curves)."""
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 24},
                       timeout=60)
        assert r.status_code == 200, r.text


class LiveServer:
    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app

    def price_rows_cheap(self) -> None:
        """Rows priced cheap, whatever the tiny model's sub-millisecond passes measure beside other tests (a timed
        split on CI drafted nothing): a row then pays at any acceptance a random draft has, and the server drafts."""
        worker = self.app.state.worker
        worker.wait_ready()  # (the engine is built on the worker's thread)
        assert worker.engine is not None, "only a model on specdec's runtime is batched and has rows to price"
        worker.engine.pass_ms = lambda rows: 10.0 + 0.1 * rows

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", headers=getattr(self, "auth", {})).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def chat_completion(srv, messages, **kw) -> dict:
    """A chat completion over real HTTP (what the other APIs' answers are compared with)."""
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def decoder(tok, target, draft_close):
    return SpecDecoder.from_models(target, tok, draft=draft_close, tau=3)


@pytest.fixture(scope="module")
def live(decoder, tmp_path_factory):
    srv = LiveServer(create_app(decoder, model_name="tiny", trace_dir=str(tmp_path_factory.mktemp("traces"))))
    yield srv
    srv.stop()


@pytest.fixture
def slow_server(tok, target):
    servers = []

    def make(**kwargs):
        sd = SpecDecoder.from_models(target, tok, draft=SlowDrafter(), tau=2)
        servers.append(LiveServer(create_app(sd, model_name="tiny", **kwargs)))
        return servers[-1]
    yield make
    for srv in servers:
        srv.stop()


def client(srv, key="none"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_client_chat_and_completions_equal_generate(live, decoder):
    c = client(live)
    want = decoder.generate([{"role": "user", "content": "Hello"}], max_new_tokens=20)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
                                  temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == want.prompt_tokens
    assert r.model_extra["specdec"]["target_passes"] == want.stats["target_passes"]
    assert r.model_extra["specdec"]["verify_ms"] > 0 <= r.model_extra["specdec"]["draft_ms"]  # (benchmarks/pair.py)
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    want = decoder.generate("def f(x):", max_new_tokens=15, chat=False)
    r = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=15, temperature=0)
    assert r.choices[0].text == want.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=15, temperature=0, stream=True))
    assert streamed == want.text


def test_a_server_without_batching_answers_as_generate(rt_sd):
    """`serve --no-batch` (one request at a time, worker.Worker) on the runtime: the same answers, streamed or not.
    (Its admission once took a tenant argument only the batching worker accepted: every request a 500.)"""
    srv = LiveServer(create_app(rt_sd, model_name="tiny", batch=False))
    try:
        c = client(srv)
        want = rt_sd.generate([{"role": "user", "content": "Hello"}], max_new_tokens=12)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
                                      temperature=0, extra_body={"cache_salt": "t1"})
        assert r.choices[0].message.content == want.text
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt="def f(x):", max_tokens=10, temperature=0, stream=True))
        assert streamed == rt_sd.generate("def f(x):", max_new_tokens=10, chat=False).text
    finally:
        srv.stop()


def test_http_greedy_equals_cli_generate(live, tiny_dirs, capsys):
    from specdec.cli import main
    assert main(["generate", "abc", "--target", tiny_dirs["target"], "--draft", "ngram", "--no-chat",
                 "--max-new-tokens", "12", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    r = client(live).completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0)
    assert r.choices[0].text == cli["text"]


def test_sampling_stop_and_seed(live):
    c = client(live)
    kw = dict(model="tiny", prompt="Hello", max_tokens=20, temperature=1.0, seed=5)
    a, b = c.completions.create(**kw).choices[0].text, c.completions.create(**kw).choices[0].text
    assert a == b
    stop = a[3:5]
    r = c.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == a[: a.find(stop)] and r.choices[0].finish_reason == "stop"


def test_models_and_health(live):
    assert client(live).models.list().data[0].id == "tiny"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "  "}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"parameters": {}}}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                              "max_completion_tokens": 6}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "x" * 400}, 400),
    ("/v1/completions", {"prompt": ["a"] * 17}, 400),
    ("/v1/completions", {"prompt": ["a", ""]}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),  # OpenAI allows 4
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 100_000]}, 400),  # held the worker for the whole timeout
    ("/v1/completions", b"x" * (2 << 20), 413),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_gets_4xx_error_object(live, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(live.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_api_key(decoder):
    srv = LiveServer(create_app(decoder, model_name="tiny", api_key="sekret"))
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        for path in ["/v1/models", "/metrics"]:
            assert httpx.get(srv.url + path).status_code == 401
            assert httpx.get(srv.url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(srv, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert client(srv, "sekret").completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    finally:
        srv.stop()


def test_full_queue_disconnect_and_recovery(slow_server):
    """max_queue=1: while one stream runs, another request is refused at once with 429; dropping the stream
    cancels its generation and frees the worker for the next request. The drafter's gate holds the stream, so
    "at once" and "early" hold at any machine speed."""
    slow = slow_server(max_queue=1)
    gate = slow.app.state.decoder.engine.drafter.gate
    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "stream": True}
    gate.clear()
    with httpx.Client(timeout=10) as hc:
        with hc.stream("POST", slow.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            wait_for(lambda: queue_depth(slow) == 1, "the stream holds the queue")
            busy = httpx.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"  # it cannot have ended
    wait_for(lambda: all_held_cancelled(slow), "the hang-up cancels the job")
    gate.set()
    wait_for(lambda: queue_depth(slow) == 0, "the cancelled job leaves")
    ok = httpx.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # the dropped stream made at most the cycle it was in (tau=2: 3 tokens) past the gate, the new request 3 tokens
    assert slow.metrics()[("specdec_generated_tokens_total", ())] <= 3 + 3


def test_a_key_that_fills_the_queue_leaves_a_place_for_each_other_key(slow_server):
    """Two API keys, max_queue=3: key a's streams take two places, its third request is refused (the last place
    is kept for key b's first), and key b's first request is served; b's second finds the queue full. The gate holds
    every stream, so nothing ends meanwhile."""
    slow = slow_server(max_queue=3, api_key=["ka", "kb"])
    gate = slow.app.state.decoder.engine.drafter.gate
    body = {"prompt": "Hello", "max_tokens": 50, "temperature": 0, "stream": True}
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("ka", "kb"))
    gate.clear()
    with httpx.Client(timeout=30) as hc, hc.stream("POST", slow.url + "/v1/completions", json=body, headers=a) as s1, \
            hc.stream("POST", slow.url + "/v1/completions", json=body, headers=a) as s2:
        assert s1.status_code == s2.status_code == 200
        wait_for(lambda: httpx.get(slow.url + "/health").json()["queue_depth"] == 2, "a's streams hold two places")
        third = hc.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=a)
        assert third.status_code == 429 and "other API keys" in third.json()["error"]["message"]
        with hc.stream("POST", slow.url + "/v1/completions", json=body, headers=b) as first_of_b:
            assert first_of_b.status_code == 200
            full = hc.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=b)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            gate.set()
            assert "[DONE]" in "".join(first_of_b.iter_text())
        assert "[DONE]" in "".join(s1.iter_text()) + "".join(s2.iter_text())
    again = httpx.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=a, timeout=30)
    assert again.status_code == 200  # every place is free again


def test_long_non_streaming_request_completes(slow_server):
    slow = slow_server()
    r = httpx.post(slow.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_client_disconnect_non_streaming_frees_worker(slow_server):
    slow = slow_server(max_queue=1)
    gate = slow.app.state.decoder.engine.drafter.gate
    gate.clear()  # the request cannot finish before the client gives up, at any speed
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "temperature": 0},
                   timeout=0.5)
    wait_for(lambda: all_held_cancelled(slow), "the hang-up cancels the job")
    gate.set()
    wait_for(lambda: queue_depth(slow) == 0, "the cancelled job leaves")
    assert slow.metrics()[("specdec_generated_tokens_total", ())] <= 3  # the one cycle it was in


def test_timeout_stops_cleanly(slow_server):
    slow = slow_server(timeout_s=0.5)
    r = httpx.post(slow.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "temperature": 0},
                   timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    ok = httpx.post(slow.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_metrics_consistent_with_responses(decoder):
    srv = LiveServer(create_app(decoder, model_name="tiny"))
    try:
        c = client(srv)
        served = [c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0) for p in ["a", "bb"]]
        served.append(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=9, temperature=0))
        httpx.post(srv.url + "/v1/completions", json={"prompt": ""})
        m = srv.metrics()
        assert m[("specdec_generated_tokens_total", ())] == sum(r.usage.completion_tokens for r in served)
        assert m[("specdec_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens for r in served)
        assert m[("specdec_cycles_total", ())] == sum(r.model_extra["specdec"]["target_passes"] for r in served)
        assert m[("specdec_draft_tokens_total", ())] == sum(r.model_extra["specdec"]["proposed"] for r in served)
        accepted = sum(r.model_extra["specdec"]["accepted"] for r in served)
        assert m[("specdec_accepted_tokens_total", ())] == accepted
        by_pos = sum(v for (name, _), v in m.items() if name == "specdec_accepted_tokens_by_position_total")
        assert by_pos == accepted
        assert m[("specdec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
        assert m[("specdec_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
        assert m[("specdec_verify_seconds_count", ())] == m[("specdec_cycles_total", ())]
        assert m[("specdec_queue_depth", ())] == 0
    finally:
        srv.stop()


def test_trace_dir_per_request(live):
    trace_dir = live.app.state.worker.trace_dir
    before = set(trace_dir.glob("*.jsonl")) if trace_dir.exists() else set()
    r = client(live).completions.create(model="tiny", prompt="trace me", max_tokens=10, temperature=0)
    new = set(trace_dir.glob("*.jsonl")) - before
    assert len(new) == 1
    records = read_jsonl(new.pop())
    assert sum(len(x.emitted) for x in records) == r.usage.completion_tokens


def test_oversized_chunked_body_gets_413(live):
    """No Content-Length (chunked transfer): the size is still checked before the body is parsed."""
    def chunks():
        for _ in range(40):
            yield b"x" * 65536
    r = httpx.post(live.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()


def test_worker_exception_is_a_clean_500_and_a_logged_traceback(decoder, capfd, monkeypatch):
    srv = LiveServer(create_app(decoder, model_name="tiny"))
    try:
        def broken(**kw):
            raise RuntimeError("kernel exploded")
            yield
        monkeypatch.setattr(decoder, "stream_chunks", broken)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "kernel exploded" not in r.text  # internals stay in the log
        err = capfd.readouterr().err
        assert "Traceback" in err and "RuntimeError: kernel exploded" in err
    finally:
        srv.stop()


def test_what_openai_clients_send_is_served_as_its_plain_equivalent(live):
    """max_completion_tokens, text content parts, the developer role, tool-call history and the fields SDK helpers
    add (store, metadata, ...) are accepted; each request answers exactly what its plain form answers (greedy);
    a refused field is named in the error."""
    def chat(**body):
        r = httpx.post(live.url + "/v1/chat/completions", json={"temperature": 0, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    plain = chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi\nthere"}],
                 max_tokens=12)
    assert chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text",
                                                                                       "text": "there"}]}],
                max_completion_tokens=12, store=False, metadata={"k": "v"}, service_tier="auto", user="u1",
                parallel_tool_calls=True, reasoning_effort="low") == plain
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    assert isinstance(chat(messages=history, max_tokens=8), str)
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "functions": [{"name": "f"}]})
    assert r.status_code == 400 and "functions is not supported" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/completions", json={"prompt": ["hi"], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == httpx.post(
        live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0}).json()["choices"][0]["text"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 4}])
def test_logprobs_are_the_targets_own(live, decoder, tok, target, sampling):
    """Chat logprobs/top_logprobs and completion logprobs over HTTP equal what target-only decoding reports
    (speculation changes none of them: each row of a verify pass is a one-token step), warped as the request
    samples; a greedy request reports the unwarped distribution."""
    from specdec import SpecDecoder
    plain = SpecDecoder.from_models(target, tok, draft="none")
    ref = plain.generate("hi", max_new_tokens=10, logprobs=3, **sampling)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "logprobs": True, "top_logprobs": 3,
            **sampling}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    kept = [lp for t, lp in zip(ref.token_ids, ref.logprobs) if t != 2]
    # this target is a float64 transformers model: a verify pass's rows equal one-token steps to ~1e-16, not bitwise
    # on every CPU (the runtime's are bitwise: tests/test_runtime.py); the tokens are the same
    assert [c["logprob"] for c in content] == pytest.approx([lp for lp, _ in kept], rel=1e-12, abs=1e-12)
    assert [[a["logprob"] for a in c["top_logprobs"]] for c in content] == \
        [pytest.approx([v for _, v in alts], rel=1e-12, abs=1e-12) for _, alts in kept]
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == \
        [[tok.decode([t]) for t, _ in alts] for _, alts in kept]
    assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)
    if not sampling.get("temperature"):
        assert all(c["token"] == c["top_logprobs"][0]["token"] for c in content)  # greedy picks the top one
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 6, "logprobs": 2, **sampling})
    lp = r.json()["choices"][0]["logprobs"]
    assert r.status_code == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert all(len(alts) <= 2 for alts in lp["top_logprobs"])


def test_n_choices_and_prompt_lists_are_separate_sequences(live, tok, target):
    """n choices of a seeded request are the texts seeds seed, seed+1, ... give alone; a list of prompts answers
    each prompt as its own request would, in order, usage summed."""
    from specdec import SpecDecoder
    plain = SpecDecoder.from_models(target, tok, draft="none")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert texts == [plain.generate("hi", max_new_tokens=8, temperature=1.0, seed=11 + i).text for i in range(3)]
    r = httpx.post(live.url + "/v1/completions", json={"prompt": ["ab", "Hello"], "max_tokens": 5, "temperature": 0},
                   timeout=60)
    got = r.json()
    assert [c["text"] for c in got["choices"]] == [plain.generate(p, max_new_tokens=5, chat=False).text
                                                    for p in ("ab", "Hello")]
    assert got["usage"]["prompt_tokens"] == len(tok("ab").input_ids) + len(tok("Hello").input_ids)


def test_echo_scores_the_prompt_as_lm_eval_asks(live, tok, target):
    """Completions echo + logprobs + max_tokens 0 (lm-evaluation-harness's loglikelihood): the prompt's tokens with
    their logprobs under the target, the first one None; with max_tokens > 0 the completion follows."""
    from specdec import SpecDecoder
    plain = SpecDecoder.from_models(target, tok, draft="none")
    ref = plain.generate("Hello there", max_new_tokens=0, chat=False, prompt_logprobs=1)
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 0, "echo": True,
                                                       "logprobs": 1, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == "Hello there" and "".join(lp["tokens"]) == "Hello there"
    assert lp["token_logprobs"] == [None] + [v for v, _ in ref.prompt_logprobs] and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # one character per token here
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "echo": True,
                                                       "logprobs": 0, "temperature": 0}, timeout=60)
    c = r.json()["choices"][0]
    assert c["text"] == "Hello there" + plain.generate("Hello there", max_new_tokens=4, chat=False).text
    assert len(c["logprobs"]["tokens"]) == 11 + 4


def test_token_id_prompts(live, tok, target):
    """Completions take token ids (lm-evaluation-harness's tokenized requests): the same answer as the text."""
    ids = tok("Hello there").input_ids
    for prompt in (ids, [ids, ids]):
        r = httpx.post(live.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                           "echo": True}, timeout=60)
        text = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 4,
                                                              "temperature": 0, "echo": True}).json()
        assert r.status_code == 200 and all(c["text"] == text["choices"][0]["text"] for c in r.json()["choices"])
    for bad in ([10**6], [-1], [[1, 2], []]):
        r = httpx.post(live.url + "/v1/completions", json={"prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_streamed_logprobs_equal_the_collected_ones(live):
    """stream with logprobs: each chunk carries its cycle's tokens; together they are the non-streamed logprobs."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    streamed = []
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs")
                streamed += lp["content"] if lp else []
    assert streamed == whole["content"] and len(streamed) > 0


def test_streamed_choices_carry_their_index(live):
    """n = 3 streamed: each choice's chunks carry its index and concatenate to the non-streamed choice; a list of
    prompts streams the same way; usage covers every choice."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0, "seed": 2, "n": 3}
    full = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    whole = [c["message"]["content"] for c in full["choices"]]
    texts, usage = ["", "", ""], None
    with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                usage = chunk.get("usage") or usage
    assert texts == whole and usage == full["usage"]
    got = {}
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"prompt": ["ab", "Hello"], "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    got[c["index"]] = got.get(c["index"], "") + c["text"]
    plain = httpx.post(live.url + "/v1/completions", json={"prompt": ["ab", "Hello"], "max_tokens": 5,
                                                           "temperature": 0}).json()["choices"]
    assert [got[0], got[1]] == [c["text"] for c in plain]
    echoed = ""
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"prompt": "ab", "max_tokens": 5, "temperature": 0, "stream": True, "echo": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                echoed += json.loads(line[6:])["choices"][0]["text"]
    assert echoed == "ab" + plain[0]["text"]


def test_unseeded_answers_differ_across_restarts_and_their_reported_seed_reproduces_them(tok, target, draft_close):
    """Two servers started alike: the same unseeded sampled request gets different text from each (a seed from the
    OS, not torch's fixed start), each response reports its seed in `specdec.seed`, and sending that seed back
    gives the same text again, streamed or not. Greedy answers report no seed. (The end of text is banned: two seeds
    may both draw it first, p = 0.0015 each on this model, and two empty answers are equal.)"""
    answers = []
    no_eos = {"logit_bias": {"2": -100}}
    for _ in range(2):
        srv = LiveServer(create_app(SpecDecoder.from_models(target, tok, draft=draft_close, tau=3), model_name="tiny"))
        try:
            c = client(srv)
            r = c.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=1.0, **no_eos)
            seed = r.model_extra["specdec"]["seed"]
            assert isinstance(seed, int) and 0 <= seed < 2 ** 63 and r.usage.completion_tokens == 24
            again = c.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=1.0, seed=seed,
                                         **no_eos)
            assert again.choices[0].text == r.choices[0].text and again.model_extra["specdec"]["seed"] == seed
            chunks = list(c.completions.create(model="tiny", prompt="Once upon", max_tokens=24, temperature=1.0,
                                               seed=seed, stream=True, **no_eos))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
            assert all(ch.model_extra["specdec"]["seed"] == seed for ch in chunks)
            greedy = c.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
            assert greedy.model_extra["specdec"]["seed"] is None
            answers.append((seed, r.choices[0].text))
        finally:
            srv.stop()
    assert answers[0][0] != answers[1][0] and answers[0][1] != answers[1][1]


def test_max_tokens_0_answers_until_the_context_window(rt_sd):
    """serve --max-tokens 0: a request that sets no limit (as Codex sends none) runs until the context window."""
    eos = rt_sd.engine.eos_ids
    ban = {str(t): -100 for t in (eos if isinstance(eos, (list, set, tuple)) else [eos])}
    srv = LiveServer(create_app(rt_sd, model_name="tiny", max_tokens_default=0, batch=False))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "temperature": 0, "logit_bias": ban},
                       timeout=120).json()
        assert r["usage"]["completion_tokens"] + r["usage"]["prompt_tokens"] == rt_sd.context_window
        assert r["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()


def test_a_streams_own_failure_ends_it_with_an_error_event_on_every_api(rt_live, monkeypatch):
    """A bug while a stream is put together (here: the last piece each API builds raises) is that request's own
    failure: chat completions, Anthropic's messages and llama-server's /completion each end the stream with their
    API's error event, not a broken connection; the next request is served."""
    from specdec.server import anthropic_api, llama_compat, streaming

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(streaming, "usage", broken)
    monkeypatch.setattr(anthropic_api.Reply, "message", broken)
    monkeypatch.setattr(llama_compat, "_final", broken)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    claude = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True}
    llama = {"prompt": "Hello", "n_predict": 4, "stream": True}
    for path, body, says in (("/v1/chat/completions", chat, '"code": "internal_error"'),
                             ("/v1/messages", claude, "event: error"), ("/completion", llama, "internal_error")):
        with httpx.stream("POST", rt_live.url + path, json=body, timeout=60) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and says in text and "RuntimeError" in text, (path, text[-300:])
    monkeypatch.undo()
    assert chat_completion(rt_live, [{"role": "user", "content": "Hello"}], max_tokens=2)["choices"]


def test_a_key_given_twice_is_one_tenant(decoder):
    """`--api-key A --api-key A --api-key B`: two tenants, each with half the stores and a queue place, not three."""
    app = create_app(decoder, model_name="tiny", api_key=["a", "a", "b"])
    try:
        assert app.state.worker.keys == 2
        assert app.state.responses.share == app.state.conversations.share == app.state.conversations.max_bytes // 2
    finally:
        app.state.worker.stop()
