"""OpenAI's Responses API through the official client over real HTTP: a response is the chat completion of the
same conversation (greedy token for token, seeded text for text), streamed as typed events the client's own
stream helper accepts; instructions, message items and text parts, earlier function calls and their outputs,
logprobs, the length limit, function tools and JSON schemas; what needs stored state, and what the server lacks,
are 400s that say so."""
import json

import httpx
import openai
import pytest
from test_server import chat_completion, slow_server  # noqa: F401 - a fixture

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
    ({"background": True, "store": False}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"tools": ["web_search"]}, "tools"),
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
                                                               if k in ("previous_response_id", "background",
                                                                        "store")}},
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


# ---- stored responses: previous_response_id, retrieve, input_items, delete (response_store.py) -------------------
def test_a_follow_up_is_the_chat_completion_of_the_stored_conversation(rt_live):
    """A response continued by id gets what the whole conversation sent as chat messages gets, greedy token for
    token; instructions are not carried on (OpenAI's rule), new ones lead; a streamed response is stored too."""
    c = client(rt_live)
    first = c.responses.create(input=QUESTION, instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert first.store is True and first.previous_response_id is None
    second = c.responses.create(input="And another?", previous_response_id=first.id, max_output_tokens=8,
                                temperature=0)
    talk = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}]
    assert second.output_text == chat_completion(rt_live, talk, max_tokens=8, temperature=0)[
        "choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    with c.responses.stream(model="tiny", input="A third?", previous_response_id=second.id, instructions="Be kind.",
                            max_output_tokens=8, temperature=0) as s:
        third = list(s)[-1].response  # response.incomplete: cut at the limit
    talk += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "A third?"}]
    assert third.output_text == chat_completion(rt_live, [{"role": "system", "content": "Be kind."}] + talk,
                                                max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    fourth = c.responses.create(input="More?", previous_response_id=third.id, max_output_tokens=8, temperature=0)
    talk += [{"role": "assistant", "content": third.output_text}, {"role": "user", "content": "More?"}]
    assert fourth.output_text == chat_completion(rt_live, talk, max_tokens=8, temperature=0)[
        "choices"][0]["message"]["content"]
    counted = c.responses.input_tokens.count(input="More?", previous_response_id=third.id)
    assert counted.input_tokens == fourth.usage.input_tokens


def test_stored_responses_are_retrieved_listed_and_deleted(rt_live):
    c = client(rt_live)
    items = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Three?"}]}]
    r = c.responses.create(input=items, max_output_tokens=6, temperature=0)
    got = c.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.usage.output_tokens == r.usage.output_tokens
    listed = c.responses.input_items.list(r.id)
    assert [i.content[0].text for i in listed.data] == ["Three?", "Two.", "One."]  # newest first, as OpenAI's
    assert [i.role for i in listed.data] == ["user", "assistant", "user"] and all(i.id for i in listed.data)
    page = httpx.get(f"{rt_live.url}/v1/responses/{r.id}/input_items", params={"order": "asc", "limit": 1},
                     timeout=30).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["One."] and page["has_more"]
    rest = httpx.get(f"{rt_live.url}/v1/responses/{r.id}/input_items",
                     params={"order": "asc", "after": page["last_id"]}, timeout=30).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Two.", "Three?"] and not rest["has_more"]
    follow = c.responses.create(input="Four?", previous_response_id=r.id, max_output_tokens=6, temperature=0)
    assert c.responses.delete(r.id) is None  # the client's own check of {"deleted": true}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError, match=r.id):  # its follow-up's chain is broken at r: named
        c.responses.create(input="Five?", previous_response_id=follow.id, max_output_tokens=6, temperature=0)
    unkept = c.responses.create(input=QUESTION, store=False, max_output_tokens=4, temperature=0)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)
    for params in ({"limit": 0}, {"order": "up"}, {"after": "msg_nope"}):
        bad = httpx.get(f"{rt_live.url}/v1/responses/{follow.id}/input_items", params=params, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json(), bad.text


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(rt_live, rt_sd):
    """A stored chain that outgrows the context window (the tiny model's 256 positions): without truncation a 400,
    with truncation "auto" the oldest turns are dropped, the fewest that make room (OpenAI's rule), and the answer is
    the chat completion of what was kept; the system message stays."""
    c = client(rt_live)
    long = "Tell me more about colours and their names, please, and then a bit more about their uses!!"
    assert len(long) == 90  # 90 tokens here: two turns of it fit, three do not
    first = c.responses.create(input=long, max_output_tokens=6, temperature=0)
    second = c.responses.create(input=long, previous_response_id=first.id, max_output_tokens=6, temperature=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.responses.create(input="Short?", instructions="Be brief.", previous_response_id=second.id,
                           max_output_tokens=6, temperature=0)
    cut = c.responses.create(input="Short?", instructions="Be brief.", previous_response_id=second.id,
                             max_output_tokens=6, temperature=0, truncation="auto")
    assert cut.truncation == "auto"
    kept = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long},
            {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Short?"}]
    assert cut.output_text == chat_completion(rt_live, kept, max_tokens=6, temperature=0)[
        "choices"][0]["message"]["content"]
    assert cut.usage.input_tokens + 6 <= rt_sd.context_window
    # an agent sends no max_output_tokens: the turns dropped leave room for the server's default answer (256 here,
    # at most half the window), not for one token (before: `incomplete` after a handful of tokens)
    agent = c.responses.create(input="Short?", instructions="Be brief.", previous_response_id=second.id,
                               temperature=0, truncation="auto")
    assert agent.usage.input_tokens + rt_sd.context_window // 2 <= rt_sd.context_window
    assert agent.usage.output_tokens > 6 or agent.status == "completed"
    counted = c.responses.input_tokens.count(input="Short?", instructions="Be brief.",
                                             previous_response_id=second.id, truncation="auto")
    assert counted.input_tokens == agent.usage.input_tokens
    fits = c.responses.create(input="Short?", previous_response_id=first.id, max_output_tokens=6, temperature=0,
                              truncation="auto")  # fits whole: nothing dropped
    assert fits.usage.input_tokens == c.responses.input_tokens.count(input="Short?", previous_response_id=first.id
                                                                     ).input_tokens
    r = httpx.post(rt_live.url + "/v1/responses", json={"input": "x", "truncation": "middle"}, timeout=30)
    assert r.status_code == 400 and "truncation" in r.text


def test_a_keys_responses_are_its_own(tiny_dirs):
    """Each API key finds only the responses and conversations it stored: another key's id is a 404 (retrieve,
    delete, input_items, items, a response in it) and a 400 as previous_response_id, the same as an id never made."""
    from test_server import LiveServer

    from specdec import SpecDecoder, models
    from specdec.server import create_app
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    srv = LiveServer(create_app(SpecDecoder.from_models(model, tok, draft="ngram"), model_name="tiny",
                                api_key=["ka", "kb"]))
    try:
        a, b = (openai.OpenAI(base_url=srv.url + "/v1", api_key=k, max_retries=0, timeout=60) for k in ("ka", "kb"))
        r = a.responses.create(input=QUESTION, max_output_tokens=4, temperature=0)
        assert a.responses.retrieve(r.id).id == r.id
        for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                     lambda: b.responses.input_items.list(r.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError, match="not found"):
            b.responses.create(input="x", previous_response_id=r.id, max_output_tokens=4)
        assert a.responses.create(input="x", previous_response_id=r.id, max_output_tokens=4).previous_response_id == r.id
        conv = a.conversations.create(items=[{"role": "user", "content": "mine"}])
        for call in (lambda: b.conversations.retrieve(conv.id), lambda: b.conversations.items.list(conv.id),
                     lambda: b.responses.create(input="x", conversation=conv.id, max_output_tokens=4),
                     lambda: b.conversations.delete(conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert a.responses.create(input="x", conversation=conv.id, max_output_tokens=4).conversation.id == conv.id
    finally:
        srv.stop()


def test_a_server_that_stores_nothing_says_so(rt_sd):
    from test_server import LiveServer

    from specdec.server import create_app
    srv = LiveServer(create_app(rt_sd, model_name="tiny", response_store_mb=0, batch=False))
    try:
        c = client(srv)
        r = c.responses.create(input=QUESTION, max_output_tokens=4, temperature=0)
        assert r.store is False
        with pytest.raises(openai.BadRequestError, match="stores no responses"):
            c.responses.create(input="x", previous_response_id=r.id, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError, match="keeps no conversations"):
            c.conversations.create()
    finally:
        srv.stop()


@pytest.mark.real
def test_an_agent_loop_continues_a_stored_call_with_its_output(smol_live):
    """The loop agents run: a forced call, then only its output sent with previous_response_id; the answer is the
    chat completion of the whole exchange (the call as the assistant's tool_calls), its first turn's prompt blocks
    found in the prefix cache."""
    c = client(smol_live)
    ask = dict(model="smol", tools=[WEATHER], max_output_tokens=24, temperature=0)
    first = c.responses.create(input="What is the weather in Paris?", tool_choice="required", **ask)
    call = first.output[0]
    assert call.type == "function_call"
    answer = c.responses.create(input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "rain, 12 C"}], previous_response_id=first.id, **ask)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "rain, 12 C"}]
    want = c.chat.completions.create(model="smol", messages=history, tools=[{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}], max_tokens=24, temperature=0)
    assert answer.output_text == want.choices[0].message.content and answer.output_text
    cached = answer.usage.input_tokens_details.cached_tokens  # the first turn's blocks, from the prefix cache
    assert first.usage.input_tokens - 16 <= cached < answer.usage.input_tokens


# ---- conversations (conversations.py) -----------------------------------------------------------------------
def test_a_response_in_a_conversation_reads_its_items_and_joins_them(rt_live):
    c = client(rt_live)
    conv = c.conversations.create(items=[{"role": "user", "content": "One."},
                                         {"type": "message", "role": "assistant", "content": "Two."}],
                                  metadata={"topic": "counting"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "counting"}
    r = c.responses.create(input=QUESTION, conversation=conv.id, max_output_tokens=8, temperature=0)
    talk = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
            {"role": "user", "content": QUESTION}]
    assert r.output_text == chat_completion(rt_live, talk, max_tokens=8, temperature=0)[
        "choices"][0]["message"]["content"]
    assert r.conversation.id == conv.id
    items = c.conversations.items.list(conv.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "One."), ("assistant", "Two."),
                                                            ("user", QUESTION), ("assistant", r.output_text)]
    with c.responses.stream(model="tiny", input="More?", conversation={"id": conv.id}, max_output_tokens=8,
                            temperature=0) as s:
        second = list(s)[-1].response
    talk += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": "More?"}]
    assert second.output_text == chat_completion(rt_live, talk, max_tokens=8, temperature=0)[
        "choices"][0]["message"]["content"]
    added = c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Aside."}])
    aside = added.data[0]
    assert c.conversations.items.retrieve(aside.id, conversation_id=conv.id).content[0].text == "Aside."
    assert len(c.conversations.items.list(conv.id).data) == 7
    assert c.conversations.items.delete(aside.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve(aside.id, conversation_id=conv.id)
    stored = rt_live.metrics()  # the stores' bytes at each scrape
    assert stored[("specdec_stored_bytes", (("kind", "conversations"),))] > 0
    assert stored[("specdec_stored_bytes", (("kind", "responses"),))] > 0
    assert c.conversations.update(conv.id, metadata={"topic": "colours"}).metadata == {"topic": "colours"}
    assert c.conversations.retrieve(conv.id).metadata == {"topic": "colours"}
    with pytest.raises(openai.BadRequestError, match="not both"):
        c.responses.create(input="x", conversation=conv.id, previous_response_id=r.id, max_output_tokens=2)
    assert c.conversations.delete(conv.id).deleted
    for call in (lambda: c.conversations.retrieve(conv.id), lambda: c.conversations.items.list(conv.id),
                 lambda: c.responses.create(input="x", conversation=conv.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.parametrize("path,body,says", [
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
    ("/v1/conversations", {"metadata": {str(k): "v" for k in range(17)}}, "metadata"),
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "at most 20"),
    ("/v1/conversations", {"items": [{"type": "web_search_call"}]}, "web_search_call"),
    ("/v1/conversations", {"bogus": 1}, "bogus"),
    ("/v1/responses", {"input": "x", "conversation": {"id": 1}}, "conversation"),
])
def test_bad_conversation_requests_are_400s(rt_live, path, body, says):
    r = httpx.post(rt_live.url + path, json=body, timeout=30)
    assert r.status_code == 400 and says in r.text, r.text
    assert len(httpx.post(rt_live.url + "/v1/conversations", json={}, timeout=30).json()["id"]) > 40


def test_conversations_keep_each_keys_share():
    from specdec.server.conversations import Conversations
    store = Conversations(6000, tenants=2)  # 3,000 bytes a key
    a = store.create(b"a", None, [{"role": "user", "content": "x" * 400}])
    b = store.create(b"b", None, [{"role": "user", "content": "y" * 400}])
    later = store.create(b"a", None, [{"role": "user", "content": "z" * 400}])
    store.get(b"a", a.id)  # used: `later` is now the least recently used of key a
    store.add(b"a", a.id, [{"role": "assistant", "content": "w" * 1400}])
    assert [c for c in store._by_tenant[b"a"]] == [a.id] and store.get(b"b", b.id)  # a's own share, b untouched
    store.add(b"a", a.id, [{"role": "user", "content": "v" * 3000}])  # alone over the share: it leaves too
    assert not store._by_tenant[b"a"] and store.get(b"b", b.id) and later.id not in store._by_tenant[b"a"]
    for _ in range(100):  # empty conversations count too: a flood of them stays within the share
        store.create(b"a", {"k": "v"}, [])
    assert 0 < len(store._by_tenant[b"a"]) < 10 and sum(c.size for c in store._by_tenant[b"a"].values()) <= 3000
    assert store.get(b"b", b.id)


def test_text_that_is_not_unicode_is_echoed_escaped_never_a_500(rt_live):
    """A lone surrogate (valid JSON, invalid UTF-8) kept in a conversation or in a response's metadata comes back as
    its escape (app.SafeJSON); before, encoding the answer failed: a 500."""
    body = json.dumps({"items": [{"role": "user", "content": "a\ud800b"}]}).encode()
    r = httpx.post(rt_live.url + "/v1/conversations", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    items = httpx.get(f"{rt_live.url}/v1/conversations/{r.json()['id']}/items", timeout=30)
    assert items.status_code == 200 and '"a\\ud800b"' in items.text
    body = json.dumps({"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "\udfff"}}).encode()
    r = httpx.post(rt_live.url + "/v1/responses", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "\udfff"}


# ---- background responses ---------------------------------------------------------------------------------------
def poll(c, response_id, until=("completed", "incomplete", "failed", "cancelled")):
    from test_server import wait_for
    wait_for(lambda: c.responses.retrieve(response_id).status in until, f"response {response_id} in {until}")
    return c.responses.retrieve(response_id)


def test_a_finished_background_response_cannot_be_cancelled(rt_live):
    """Its status lives in one place (the stored response): once it has ended, a cancel returns it as it is."""
    from test_server import wait_for
    c = client(rt_live)
    made = c.responses.create(input=QUESTION, background=True, max_output_tokens=4, temperature=0)
    wait_for(lambda: c.responses.retrieve(made.id).status not in ("queued", "in_progress"), "it ends")
    ended = c.responses.retrieve(made.id).status
    assert c.responses.cancel(made.id).status == ended == c.responses.retrieve(made.id).status != "cancelled"


def test_a_background_response_is_polled_to_the_same_answer(rt_live):
    c = client(rt_live)
    queued = c.responses.create(input=QUESTION, background=True, max_output_tokens=8, temperature=0)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = poll(c, queued.id)
    assert done.status == "incomplete" and done.output_text == c.responses.create(
        input=QUESTION, max_output_tokens=8, temperature=0).output_text
    follow = c.responses.create(input="More?", previous_response_id=queued.id, max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == queued.id
    with pytest.raises(openai.BadRequestError, match="Only background"):
        c.responses.cancel(follow.id)
    assert c.responses.cancel(queued.id).status == "incomplete"  # ended: returned as it is
    r = httpx.post(rt_live.url + "/v1/responses", json={"input": "x", "background": True, "store": False}, timeout=30)
    assert r.status_code == 400 and "background" in r.text
    with pytest.raises(openai.BadRequestError, match="only a response created with background and stream"):
        list(c.responses.retrieve(queued.id, stream=True))  # polled, not streamed: no events were kept


def test_a_background_stream_is_followed_from_any_event_and_replayed(rt_live):
    """background + stream (OpenAI's resumable stream): the client that made it hangs up after a few events, the
    answer goes on without it, and GET ?stream=true&starting_after=N gives the rest, then the whole stream again
    once it has ended; the text is the foreground answer's."""
    c = client(rt_live)
    want = c.responses.create(input=QUESTION, max_output_tokens=12, temperature=0)
    first = []
    with c.responses.create(input=QUESTION, background=True, stream=True, max_output_tokens=12,
                            temperature=0) as s:
        for e in s:
            first.append(e)
            if e.type == "response.output_text.delta":
                break  # hang up mid-answer
    rid = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.status == "queued"
    assert first[0].response.background
    last = first[-1].sequence_number
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=last))
    seen = first + rest
    assert [e.sequence_number for e in seen] == list(range(len(seen)))  # nothing lost, nothing twice
    assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == want.output_text
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == want.output_text
    done = poll(c, rid)
    assert done.status == "incomplete" and done.output_text == want.output_text and done.background
    again = list(c.responses.retrieve(rid, stream=True))  # ended: the whole stream, replayed
    assert [e.model_dump() for e in again] == [e.model_dump() for e in seen]
    assert list(c.responses.retrieve(rid, stream=True, starting_after=len(seen) - 1)) == []
    follow = c.responses.create(input="More?", previous_response_id=rid, max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == rid
    bad = httpx.get(f"{rt_live.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -1}, timeout=30)
    assert bad.status_code == 400 and "starting_after" in bad.text


def test_a_background_response_is_cancelled_where_it_is(slow_server):  # noqa: F811 - the fixture
    """The drafter's gate holds the job: cancelled, it says so, stops, leaves the queue, and cannot be continued;
    one deleted while it runs stops too."""
    from test_server import queue_depth, wait_for
    slow = slow_server(max_queue=4)
    gate = slow.app.state.decoder.engine.drafter.gate
    c = client(slow)
    gate.clear()
    queued = c.responses.create(input="Hello", background=True, max_output_tokens=60, temperature=0)
    wait_for(lambda: queue_depth(slow) == 1, "the job is queued")
    assert c.responses.cancel(queued.id).status == "cancelled"
    dropped = c.responses.create(input="Hi", background=True, max_output_tokens=60, temperature=0)
    c.responses.delete(dropped.id)
    gate.set()
    wait_for(lambda: queue_depth(slow) == 0, "both jobs leave")
    assert c.responses.retrieve(queued.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        c.responses.create(input="x", previous_response_id=queued.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(dropped.id)
    gate.clear()  # a background stream cancelled while it is followed: the follower's stream ends there
    streamed = c.responses.create(input="Hello", background=True, stream=True, max_output_tokens=60, temperature=0)
    created = next(iter(streamed))
    wait_for(lambda: queue_depth(slow) == 1, "the streamed job is queued")
    assert c.responses.cancel(created.response.id).status == "cancelled"
    seen = list(streamed)  # what came before the cancel, then its end: an error event saying so (it had none)
    assert [e.type for e in seen] == ["response.in_progress", "error"] and seen[-1].code == "cancelled"
    gate.set()
    wait_for(lambda: queue_depth(slow) == 0, "it leaves")
    assert c.responses.retrieve(created.response.id).status == "cancelled"


def test_an_empty_tools_list_is_no_tools(rt_live):
    """The Agents SDK sends `tools: []` for an agent without tools (OpenAI accepts it): the answer is the plain
    one; a tool_choice that needs a tool is then a 400."""
    c = client(rt_live)
    plain = c.responses.create(input=QUESTION, max_output_tokens=6, temperature=0).output_text
    assert c.responses.create(input=QUESTION, tools=[], max_output_tokens=6, temperature=0).output_text == plain
    with pytest.raises(openai.BadRequestError, match="no function tools"):
        c.responses.create(input=QUESTION, tools=[], tool_choice="required", max_output_tokens=6)


@pytest.mark.real
def test_hosted_tools_are_left_out_and_named(smol_live):
    """Codex sends web_search and namespace tools beside its functions, and client_metadata: the hosted tools are
    left out of the prompt (as llama-server leaves them) and named in `specdec.tools_left_out`."""
    c = client(smol_live)
    fn = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    alone = c.responses.create(input=QUESTION, tools=[fn], max_output_tokens=6, temperature=0)
    mixed = c.responses.create(input=QUESTION, tools=[fn, {"type": "web_search"}, {"type": "namespace", "name": "n"}],
                               max_output_tokens=6, temperature=0, extra_body={"client_metadata": {"a": "b"}})
    assert mixed.output_text == alone.output_text and mixed.usage.input_tokens == alone.usage.input_tokens
    assert mixed.model_extra["specdec"]["tools_left_out"] == ["web_search", "namespace"]
    assert "tools_left_out" not in alone.model_extra["specdec"]
    only_hosted = c.responses.create(input=QUESTION, tools=[{"type": "web_search"}], max_output_tokens=6,
                                     temperature=0)
    assert only_hosted.output_text == c.responses.create(input=QUESTION, max_output_tokens=6,
                                                         temperature=0).output_text


def test_an_answers_own_failure_ends_its_stream_or_fails_its_background_response(rt_live, monkeypatch):
    """A bug while an answer is put together (here: its output items raise) is that response's own failure: a
    stream ends with an `error` event, a background response (streamed or not) ends `failed` with the error; the
    server answers the next request."""
    from specdec.server import responses_api
    c = client(rt_live)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(responses_api.Answer, "items", broken)
    last = list(c.responses.create(input=QUESTION, max_output_tokens=4, temperature=0, stream=True))[-1]
    assert last.type == "error" and last.code == "internal_error" and "RuntimeError" in last.message
    polled = c.responses.create(input=QUESTION, background=True, max_output_tokens=4, temperature=0)
    streamed = list(c.responses.create(input=QUESTION, background=True, stream=True, max_output_tokens=4,
                                       temperature=0))
    assert streamed[-1].type == "error" and streamed[-1].code == "internal_error"
    for rid in (polled.id, streamed[0].response.id):
        failed = poll(c, rid)
        assert failed.status == "failed" and failed.error.code == "internal_error"
    monkeypatch.undo()
    assert c.responses.create(input=QUESTION, max_output_tokens=4, temperature=0).status == "incomplete"
