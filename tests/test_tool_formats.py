"""Function calling in the chat template's own tool format: a template that lists tools in <tools></tools> and
writes calls in <tool_call></tool_call> (Qwen2.5's, stored beside this file from Qwen2.5-Coder's GGUF) gets the
tools itself; forced calls come out in its tags and parse; free answers holding tagged calls become the calls;
history renders as the template writes it. Other templates keep the system-message description."""
import copy
import json
from pathlib import Path

import httpx
import pytest
from test_server import LiveServer

from specdec.server import create_app, tools

QWEN = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}]
TWO = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_the_tool_format_is_the_templates():
    assert tools.native(type("T", (), {"chat_template": QWEN})()) == tools.HERMES
    assert tools.native(type("T", (), {"chat_template": "{{ messages }}"})()) is None
    assert tools.native(object()) is None


@pytest.mark.parametrize("text,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [("get_weather", {"city": "Oslo"}),
                                                                       ("get_time", {})]),
    ('{"name": "get_time", "arguments": {}}', [("get_time", {})]),  # the system-message format
    ('```json\n{\n  "name": "get_time",\n  "arguments": {}\n}\n```', [("get_time", {})]),  # a small model's
    ('```\n{"name": "get_time", "arguments": {}}\n```\n', [("get_time", {})]),
    ('Here:\n```json\n{"name": "get_time", "arguments": {}}\n```', None),  # a block inside an answer: no call
    ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "nope"}</tool_call>', None),
    ('<tool_call>{"name": "get_weather", "arguments": </tool_call>', None),
    ("It is sunny.", None),
])
def test_calls_parse_from_their_tags(text, calls):
    got = tools.parse_call(text, TWO)
    assert (None if got is None else [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                      for c in got]) == calls


@pytest.fixture(scope="module")
def qwen_styled():
    """The default model with Qwen2.5's chat template: a byte-level vocabulary (what grammars need) and a template
    with its own tool format."""
    from specdec import SpecDecoder
    base = SpecDecoder(draft="none")
    tok = copy.deepcopy(base.tokenizer)
    tok.chat_template = QWEN
    sd = SpecDecoder.from_models(base.model, tok, "ngram", tau=3)
    srv = LiveServer(create_app(sd, model_name="smol"))
    yield sd, srv
    srv.stop()


@pytest.mark.real
def test_the_template_describes_the_tools_and_forced_calls_come_in_its_tags(qwen_styled):
    sd, srv = qwen_styled
    ask = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": WEATHER,
           "max_tokens": 48, "temperature": 0}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = httpx.post(srv.url + "/v1/chat/completions", json={**ask, "tool_choice": choice}, timeout=120).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert set(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])) == {"city"}
        # the prompt is the template's own rendering, with the tools in <tools></tools>, the call in its tags
        ids = sd.encode(ask["messages"], True, WEATHER)
        out = sd.generate("", prompt_ids=ids, max_new_tokens=48, response_format=tools.call_format(
            WEATHER, choice, tools.HERMES))
        assert out.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {') and out.text.endswith(
            "}\n</tool_call>")
        cached = r["usage"].pop("prompt_tokens_details")["cached_tokens"]  # a repeat finds the prompt cached
        assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                              "total_tokens": len(ids) + len(out.token_ids)} and 0 <= cached < len(ids)
        assert c["message"]["tool_calls"][0]["function"]["arguments"] == json.dumps(
            json.loads(out.text.split("\n")[1])["arguments"])
    fn = WEATHER[0]["function"]  # the other APIs' counts render the tools as the chat path does
    as_anthropic = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    anthropic_count = httpx.post(srv.url + "/v1/messages/count_tokens",
                                 json={"model": "smol", "messages": ask["messages"], "tools": [as_anthropic]})
    responses_count = httpx.post(srv.url + "/v1/responses/input_tokens", json={"input": ask["messages"][0]["content"],
                                                                               "tools": [{"type": "function", **fn}]})
    assert anthropic_count.json()["input_tokens"] == responses_count.json()["input_tokens"] == len(ids)
    rendered = sd.tokenizer.apply_chat_template(ask["messages"], tokenize=False, add_generation_prompt=True,
                                                tools=WEATHER)
    assert "<tools>" in rendered and '"get_weather"' in rendered
    free = httpx.post(srv.url + "/v1/chat/completions", json={**ask, "tool_choice": "auto"}, timeout=120)
    assert free.status_code == 200 and free.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    streamed = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**ask, "tool_choice": "required",
                                                                       "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                streamed += (delta[0]["delta"].get("tool_calls") or []) if delta else []
    assert [t["function"]["name"] for t in streamed] == ["get_weather"]


@pytest.mark.real
def test_history_renders_as_the_template_writes_it(qwen_styled):
    sd, srv = qwen_styled
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": history, "tools": WEATHER, "max_tokens": 8,
                                                           "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    from specdec.server.schemas import Message
    prompt = sd.tokenizer.apply_chat_template([Message(**m).for_template() for m in history], tokenize=False,
                                              add_generation_prompt=True, tools=WEATHER)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt
    assert r.json()["usage"]["prompt_tokens"] == len(sd.encode([Message(**m).for_template() for m in history],
                                                                True, WEATHER))
