"""Anthropic's Messages API through the official `anthropic` client over real HTTP: a message is the chat completion
of the same conversation (greedy token for token, seeded text for text), streamed as events the client's own stream
helper accumulates; system blocks, stop sequences, tool_use and tool_result history, token counting, the x-api-key
header; errors in Anthropic's shape; on the default model, tools and JSON schemas."""
import json

import anthropic
import httpx
import openai
import pytest
from test_server import LiveServer, chat_completion

from specdec import SpecDecoder
from specdec.server import create_app

QUESTION = "Name a colour."
GREEDY = {"temperature": 0}  # the current API has no sampling fields (it samples at 1); earlier ones had them


def client(srv, key="none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=60)


def test_a_message_is_the_chat_completion_of_its_conversation(rt_live, rt_sd):
    c = client(rt_live)
    m = c.messages.create(model="tiny", max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                          messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                          extra_body=GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    want = chat_completion(rt_live, messages, max_tokens=12, temperature=0)
    assert m.content[0].text == want["choices"][0]["message"]["content"]
    assert m.content[0].text == rt_sd.generate(messages, max_new_tokens=12).text
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.id.startswith("msg_")
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens  # (another test may have cached its blocks)
    assert prompt == want["usage"]["prompt_tokens"] and m.usage.output_tokens == 12
    counted = c.messages.count_tokens(model="tiny", system="Be brief.",
                                      messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == prompt
    seeded = c.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                               extra_body={"seed": 5, "temperature": 0.9})
    want = chat_completion(rt_live, [{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0.9, seed=5)
    assert seeded.content[0].text == want["choices"][0]["message"]["content"]


def test_stop_sequences_end_the_message_and_say_which(rt_live):
    c = client(rt_live)
    full = c.messages.create(model="tiny", max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
                             extra_body=GREEDY).content[0].text
    word = full[4:6]
    m = c.messages.create(model="tiny", max_tokens=24, stop_sequences=["\x01", word], extra_body=GREEDY,
                          messages=[{"role": "user", "content": QUESTION}])
    assert m.content[0].text == full[:full.index(word)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word


def test_streams_are_what_the_clients_stream_helper_accumulates(rt_live):
    c = client(rt_live)
    ask = dict(model="tiny", max_tokens=20, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    whole = c.messages.create(**ask).content[0].text
    with c.messages.stream(**ask) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    kinds = [e.type for e in c.messages.create(**ask, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]


def test_tool_use_and_results_are_the_chat_history(rt_live):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                 {"type": "tool_use", "id": "t1", "name": "weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]}]
    m = client(rt_live).messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, messages=history)
    as_chat = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "t1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "t1", "content": "rain"}]
    assert m.content[0].text == chat_completion(rt_live, as_chat, max_tokens=10, temperature=0)["choices"][0]["message"]["content"]


def test_both_clients_list_and_retrieve_the_model(rt_live):
    assert [m.id for m in client(rt_live).models.list()] == ["tiny"]
    past = httpx.get(rt_live.url + "/v1/models", params={"after_id": "tiny"}).json()  # clients before anthropic 2.x
    assert past["data"] == [] and past["last_id"] is None  # page until last_id is null (they looped for good)
    assert client(rt_live).models.retrieve("tiny").display_name == "tiny"
    oai = openai.OpenAI(base_url=rt_live.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in oai.models.list()] == ["tiny"] and oai.models.retrieve("tiny").owned_by == "specdec"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    with pytest.raises(anthropic.NotFoundError):
        client(rt_live).models.retrieve("claude")


def test_the_x_api_key_header_is_the_key(tok, target):
    srv = LiveServer(create_app(SpecDecoder.from_models(target, tok, draft="ngram"), model_name="tiny", api_key="k1"))
    try:
        ask = dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": QUESTION}])
        assert client(srv, "k1").messages.create(**ask).content
        with pytest.raises(anthropic.AuthenticationError):
            client(srv, "wrong").messages.create(**ask)
    finally:
        srv.stop()


@pytest.mark.parametrize("body,says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": None}, "max_tokens"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": []}, "mcp_servers"),
])
def test_bad_requests_are_400s_in_anthropics_shape(rt_live, body, says):
    base = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
    r = httpx.post(rt_live.url + "/v1/messages", json={k: v for k, v in {**base, **body}.items() if v is not None},
                   timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=says):
        client(rt_live).messages.create(**base, extra_body=body)


# ---- the real default model: tools and schemas need a byte-level vocabulary --------------------------------------
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.real
def test_tools_are_used_and_schemas_followed(smol_live):
    c = client(smol_live)
    ask = dict(model="smol", max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    m = c.messages.create(**ask, tool_choice={"type": "any"})
    use = m.content[0]
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city"}
    named = c.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert named.content[0].input == use.input
    with c.messages.stream(**ask, tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == use.input
    with c.messages.stream(model="smol", max_tokens=64, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Say hello."}]) as s:
        hello = s.get_final_message()
    assert hello.stop_reason == "end_turn" and hello.content[0].text
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    out = c.messages.create(model="smol", max_tokens=30, extra_body=GREEDY,
                            output_config={"format": {"type": "json_schema", "schema": schema}},
                            messages=[{"role": "user", "content": "Pick a colour as JSON."}])
    assert json.loads(out.content[0].text)["colour"] in ("red", "blue")
