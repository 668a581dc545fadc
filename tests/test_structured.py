"""Structured outputs on the real default model (its tokenizer is what llguidance reads): every output follows
the schema, speculation (forced tokens drafted free, drafts cut by the grammar, every verify row masked) gives
exactly constrained target-only's tokens, greedy and seeded; the batch engine and the HTTP server serve it; bad
schemas are clear 400s."""
import json

import httpx
import pytest
import torch

from specdec import SpecDecoder
from specdec.errors import InvalidRequest
from specdec.sampling import SamplingParams
from specdec.verification import verify_constrained

pytestmark = pytest.mark.real

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPTS = ["Describe a person as JSON.", "Invent a customer record as JSON.", "Who lives in Paris? Answer in JSON."]


@pytest.fixture(scope="module")
def decoders():
    base = SpecDecoder(draft="none")
    return base, {d: SpecDecoder.from_models(base.model, base.tokenizer, d, tau=3)
                  for d in ("ngram", "datastore+ngram", "datastore+ngram+recycle:/nonexistent/never-saved")}


def valid(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "city", "tags"} and isinstance(obj["age"], int)
    assert obj["city"] in ("Paris", "London", "Berlin") and len(obj["tags"]) <= 3
    return obj


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}])
def test_constrained_speculation_equals_constrained_target_only(decoders, sampling):
    base, spec = decoders
    forced = 0
    for p in PROMPTS:
        ref = base.generate(p, max_new_tokens=96, response_format=SCHEMA, **sampling)
        assert ref.finish_reason == "stop" and all(r.forced == 0 for r in ref.records)  # none: target-only
        valid(ref.text)
        for name, sd in spec.items():
            out = sd.generate(p, max_new_tokens=96, response_format=SCHEMA, **sampling)
            assert out.token_ids == ref.token_ids, (name, p)
            forced += sum(r.forced for r in out.records)
    assert forced > 0  # keys and punctuation were drafted for free


def test_json_object_and_bad_schemas(decoders):
    base, _ = decoders
    out = base.generate("Give me some JSON about cats.", max_new_tokens=64, response_format={"type": "json_object"})
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": "not an object"}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 5}}}):
        with pytest.raises(InvalidRequest):
            base.generate("x", max_new_tokens=4, response_format=bad)


def test_the_batch_engine_serves_grammars_beside_free_requests(decoders):
    from specdec.batch import BatchEngine, Sequence
    base, spec = decoders
    sd = spec["datastore+ngram"]
    engine = BatchEngine(sd.model, sd.engine.drafter, sd.model.config.vocab_size, sd.engine.eos_ids,
                         sd.context_window, max_batch_rows=8)
    seqs = []
    for i, p in enumerate(PROMPTS):
        req = sd.prepare(p, max_new_tokens=96, response_format=SCHEMA if i != 1 else None)
        seqs.append(engine.add(Sequence(req.prompt_ids, 96, req.params, constraint=req.constraint)))
    while engine.running:
        engine.step()
    for i, (p, s) in enumerate(zip(PROMPTS, seqs)):
        alone = base.generate(p, max_new_tokens=96, response_format=SCHEMA if i != 1 else None)
        assert s.generated == alone.token_ids
    engine.close()


def test_response_format_and_tools_over_http(decoders):
    from specdec.server import create_app
    from test_server import LiveServer
    base, spec = decoders
    srv = LiveServer(create_app(spec["datastore+ngram"], model_name="tiny"))
    try:
        body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 96,
                "response_format": SCHEMA}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == base.generate(PROMPTS[0], max_new_tokens=96, response_format=SCHEMA).text
        valid(text)
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "response_format": {"type": "yaml"}})
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
        weather = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}},
                   {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        ask = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "temperature": 0,
               "max_tokens": 40, "tools": weather}
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = httpx.post(srv.url + "/v1/chat/completions", json={**ask, "tool_choice": choice}, timeout=120)
            c = r.json()["choices"][0]
            assert r.status_code == 200 and c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            call = c["message"]["tool_calls"][0]
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert call["function"]["name"] in ("get_weather", "get_time")
            args = json.loads(call["function"]["arguments"])  # a JSON string, as OpenAI sends it
            if call["function"]["name"] == "get_weather":
                assert set(args) == {"city"}  # closed to the declared parameters
        calls, finish = [], None  # streamed: the call arrives whole, as a tool_calls delta
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          json={**ask, "tool_choice": "required", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    calls += c["delta"].get("tool_calls") or []
                    finish = c["finish_reason"] or finish
        assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) is not None
        assert finish == "tool_calls"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**ask, "tool_choice": "auto"}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        no_tools = {k: v for k, v in ask.items() if k != "tools"}
        for bad in ({**ask, "tools": [{"type": "function", "function": {}}]}, {**no_tools, "tool_choice": "required"},
                    {**ask, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                    {**ask, "response_format": {"type": "json_object"}}):
            r = httpx.post(srv.url + "/v1/chat/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad
    finally:
        srv.stop()


class Allowed:
    """A toy grammar: the tokens allowed at each step, by the number consumed."""

    def __init__(self, steps):
        self.steps, self.pos = steps, 0

    def masked(self, logits):
        row = torch.full_like(logits, float("-inf"))
        ok = list(self.steps[min(self.pos, len(self.steps) - 1)])
        row[ok] = logits[ok]
        return row

    def accept(self, token):
        assert token in self.steps[min(self.pos, len(self.steps) - 1)]
        self.pos += 1
        return True


def test_verify_constrained_masks_each_row_with_the_state_after_the_drafts_before_it():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 4)  # unconstrained: always token 1
    g = Allowed([{2, 3}, {0, 2}, {1}, {3}])  # masked argmax per row: 3, 2, 1, 3
    assert verify_constrained([3, 2, 0], logits, SamplingParams(), None, 10, g) == (2, 1)
    assert g.pos == 3  # the two accepted drafts and the target's token
