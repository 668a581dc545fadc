"""OpenAI's Responses API through the official client over real HTTP: a response is the chat completion of the
same conversation (greedy token for token, seeded text for text), streamed as typed events the client's own
stream helper accepts; instructions, message items and text parts, earlier function calls and their outputs,
logprobs, the length limit, function tools and JSON schemas; what needs stored state, and what the server lacks,
are 400s that say so."""
import json

import httpx
import openai
import pytest
from test_server import chat_completion

QUESTION = "Name a colour."


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_response_is_the_chat_completion_of_its_conversation(rt_live, rt_sd):
    c = client(rt_live)
    r = c.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                           temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    want = chat_completion(rt_live, messages, max_tokens=12, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"] == rt_sd.generate(messages, max_new_tokens=12).text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"] and r.usage.output_tokens == 12
    assert r.id.startswith("resp_") and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.model_extra["specdec"]["target_passes"] > 0
    counted = c.responses.input_tokens.count(model="tiny", input=QUESTION, instructions="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    assert c.responses.create(input=items, max_output_tokens=12, temperature=0).output_text == r.output_text


def test_seeded_sampling_gives_the_chat_completions_text(rt_live):
    r = client(rt_live).responses.create(input=QUESTION, max_output_tokens=16, temperature=0.9,
                                      extra_body={"seed": 7})
    want = chat_completion(rt_live, [{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0.9, seed=7)
    assert r.output_text == want["choices"][0]["message"]["content"]
    unseeded = client(rt_live).responses.create(input=QUESTION, max_output_tokens=16, temperature=0.9)
    again = client(rt_live).responses.create(input=QUESTION, max_output_tokens=16, temperature=0.9,
                                          extra_body={"seed": unseeded.model_extra["specdec"]["seed"]})
    assert again.output_text == unseeded.output_text  # the reported seed reproduces it


def test_streamed_events_are_what_the_clients_stream_helper_accepts(rt_live):
    c = client(rt_live)
    whole = c.responses.create(input=QUESTION, max_output_tokens=20, temperature=0).output_text
    with c.responses.stream(model="tiny", input=QUESTION, max_output_tokens=20, temperature=0) as s:
        seen = list(s)  # the helper checks each event against what it has accumulated
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    final = seen[-1].response  # cut at the limit: response.incomplete, as OpenAI ends such a stream
    assert seen[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert "".join(deltas) == whole == final.output[0].content[0].text and final.usage.output_tokens == 20
    events = list(c.responses.create(input=QUESTION, max_output_tokens=20, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]


def test_earlier_calls_and_their_outputs_are_the_chat_history(rt_live):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    r = client(rt_live).responses.create(input=items, max_output_tokens=10, temperature=0)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    want = chat_completion(rt_live, history, max_tokens=10, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"]


def test_logprobs_are_the_chat_completions(rt_live):
    r = client(rt_live).responses.create(input=QUESTION, max_output_tokens=5, temperature=0, top_logprobs=2,
                                      include=["message.output_text.logprobs"])
    want = chat_completion(rt_live, [{"role": "user", "content": QUESTION}], max_tokens=5, temperature=0, logprobs=True,
                     top_logprobs=2)["choices"][0]["logprobs"]["content"]
    got = r.output[0].content[0].logprobs
    assert [(p.token, p.logprob) for p in got] == [(w["token"], w["logprob"]) for w in want]
    assert all(len(p.top_logprobs) == 2 for p in got)


@pytest.mark.parametrize("body,says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "response_format"),
    ({"input": []}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"modalities": ["audio"]}, "modalities"),
])
def test_bad_requests_are_400s_that_say_why(rt_live, body, says):
    r = httpx.post(rt_live.url + "/v1/responses", json={"input": QUESTION, **body}, timeout=60)
    assert r.status_code == 400 and says in r.text, r.text
    with pytest.raises(openai.BadRequestError):
        client(rt_live).responses.create(**{"input": QUESTION, **{k: v for k, v in body.items()
                                                               if k in ("previous_response_id", "background")}},
                                      **({} if set(body) & {"previous_response_id", "background"} else
                                         {"extra_body": body}))


# ---- the real default model: function tools and schemas need a byte-level vocabulary --------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.real
def test_function_tools_are_called_and_schemas_followed(smol_live):
    c = client(smol_live)
    ask = dict(model="smol", input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=40,
               temperature=0)
    r = c.responses.create(**ask, tool_choice="required")
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    named = c.responses.create(**ask, tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[0].arguments == call.arguments
    with c.responses.stream(**ask, tool_choice="required") as s:
        done = [e for e in s if e.type == "response.function_call_arguments.done"]
        final = s.get_final_response()
    assert [e.arguments for e in done] == [call.arguments] and final.output[0].type == "function_call"
    with c.responses.stream(model="smol", input="Say hello.", max_output_tokens=64, temperature=0) as s:
        hello = s.get_final_response()  # a whole answer: response.completed
    assert hello.status == "completed" and hello.output_text == c.responses.create(
        model="smol", input="Say hello.", max_output_tokens=64, temperature=0).output_text
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    out = c.responses.create(input="Pick a colour as JSON.", max_output_tokens=30, temperature=0,
                             text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert json.loads(out.output_text)["colour"] in ("red", "blue")
