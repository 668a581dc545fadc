"""A thinking model's reasoning apart from its answer (server/reasoning.py): the split of whole answers, the same
split however the answer streams in, and over real HTTP on the default model with a thinking template (its answers
forced by a grammar, the only way a 135M model writes the tags)."""
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import LiveServer

from specdec import SpecDecoder
from specdec.server import create_app
from specdec.server.reasoning import ReasoningSplit, split


@pytest.mark.parametrize("text, inside, want", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, ("plan it", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("<think></think>\n\nb", False, ("", "b")),  # Qwen3 with enable_thinking false writes an empty one
    ("plan it\n</think>\n\nThe answer.", True, ("plan it", "The answer.")),  # R1: the prompt opened the tag
    ("still thinking", True, ("still thinking", "")),  # cut off before the tag closed
    ("<think>still thinking <", False, ("still thinking <", "")),
    ("The answer, no tags.", False, (None, "The answer, no tags.")),
    ("  An answer that mentions <think> later", False, (None, "  An answer that mentions <think> later")),
    ("<thin", False, (None, "<thin")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
])
def test_whole_answers_split(text, inside, want):
    assert split(text, inside) == want


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "</th", "<thi", "think>", " ", "\n", "a", "bc", "> "])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.booleans(), st.lists(st.integers(0, 60), max_size=6))
def test_a_streamed_answer_splits_as_the_whole_answer_does(pieces, inside, cuts):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    s, reasoning, content = ReasoningSplit(inside), [], []
    for i, chunk in enumerate(chunks):
        r, c = s.feed(chunk, final=i == len(chunks) - 1)
        reasoning.append(r)
        content.append(c)
    want_reasoning, want_content = split(text, inside)
    assert "".join(content) == want_content
    assert "".join(reasoning) == (want_reasoning or "")
    assert s.reasoned == (want_reasoning is not None)


THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if opened %}<think>\n{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
            "{# answers may carry <think>...</think> #}")
GRAMMAR = 'root ::= "<think>\\nfirst the plan\\n</think>\\n\\n" [a-z]+ "."'


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(create_app(SpecDecoder(draft="ngram", chat_template=THINKING), model_name="smol"))
    yield srv
    srv.stop()


def ask(live, grammar, stream=False, **kw):
    body = {"messages": [{"role": "user", "content": "Plan, then answer in one word."}], "max_tokens": 40,
            "temperature": 0, "stream": stream, **({"grammar": grammar} if grammar else {}), **kw}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c[0]["delta"] for c in deltas if c]
    return {"reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas) or None,
            "content": "".join(d.get("content") or "" for d in deltas)}


def ask_usage(live, grammar, stream=False, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": "Plan, then answer in one word."}], "max_tokens": 40,
            "temperature": 0, "grammar": grammar, "stream": stream, **kw}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    if not stream:
        return r.json()["usage"]
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]["usage"]


def test_reasoning_tokens_are_those_up_to_the_closing_tag(thinking_decoder):
    from specdec.server.reasoning import reasoning_tokens
    tok = thinking_decoder.tokenizer
    ids = tok(ANSWER, add_special_tokens=False).input_ids
    n = reasoning_tokens(tok, ids, ANSWER, False)
    end = ANSWER.index("</think>") + len("</think>")
    assert len(tok.decode(ids[:n])) >= end > len(tok.decode(ids[:n - 1]))
    assert reasoning_tokens(tok, ids[:n - 1], ANSWER[:end - 1], False) == n - 1  # not closed: all of them
    assert reasoning_tokens(tok, ids, "The answer.", False) == 0
    opened = ANSWER.removeprefix("<think>")
    ids = tok(opened, add_special_tokens=False).input_ids
    assert 0 < reasoning_tokens(tok, ids, opened, True) < len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_over_http_the_reasoning_goes_to_reasoning_content(live, stream):
    raw = ask(live, GRAMMAR, reasoning_format="none")["content"]
    assert raw.startswith("<think>\nfirst the plan\n</think>\n\n")
    message = ask(live, GRAMMAR, stream)
    assert message["reasoning_content"] == "first the plan"
    assert message["content"] == raw.removeprefix("<think>\nfirst the plan\n</think>\n\n")
    assert ask(live, 'root ::= [a-z]+ "."', stream).get("reasoning_content") is None  # no tags: none
    usage = ask_usage(live, GRAMMAR)  # the tokens up to the closing tag, as OpenAI counts reasoning_tokens
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    assert ask_usage(live, GRAMMAR, stream=True) == usage
    assert "completion_tokens_details" not in ask_usage(live, GRAMMAR, reasoning_format="none")
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "reasoning_format": "verbose"})
    assert r.status_code == 400 and "reasoning_format" in r.text


# ---- the other APIs: Anthropic's thinking blocks, the Responses API's reasoning items -------------------------------
class ScriptedJob:
    """A job whose answer comes in the given chunks (what the worker streams), the last with its result."""

    def __init__(self, chunks, result):
        from specdec.api import Chunk
        from specdec.trace import CycleRecord
        record = CycleRecord(0, 0, [], 0, [], 0.0, 0.0, 0.0)
        self.items = [("chunk", Chunk(c, record, result if k == len(chunks) - 1 else None))
                      for k, c in enumerate(chunks)] + [("end", None)]
        self.id, self.kwargs = "scripted", {"seed": None}

    async def next(self, timeout=None):
        return self.items.pop(0)

    def cancel(self):
        pass


ANSWER = "<think>\nfirst the plan\n</think>\n\nThe answer."


def scripted_streams(decoder):
    """The answer cut into chunks every way at the tags' edges, each with its final result."""
    from types import SimpleNamespace
    ids = decoder.tokenizer(ANSWER, add_special_tokens=False).input_ids
    stats = {k: 0 for k in ("acceptance_rate", "mean_accepted_len", "target_passes", "proposed", "accepted",
                            "acceptance_by_position", "tokens_per_s", "draft_ms", "verify_ms", "cached_tokens")}
    result = SimpleNamespace(token_ids=ids + list(decoder.engine.eos_ids)[:1], finish_reason="stop", stats=stats,
                             logprobs=None, text=ANSWER)
    for cuts in ([], [3], [7, 9], [12, 21, 30], list(range(1, len(ANSWER), 4))):
        bounds = [0] + cuts + [len(ANSWER)]
        yield [ANSWER[a:b] for a, b in zip(bounds, bounds[1:])], result


def events_of(stream) -> list[dict]:
    import asyncio

    async def drain():
        return [e async for e in stream]
    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(drain())]


@pytest.fixture(scope="module")
def thinking_decoder(live):
    return live.app.state.decoder


def test_anthropic_streams_the_thinking_block_first_as_its_client_accumulates_it(thinking_decoder):
    import inspect

    from anthropic.lib.streaming._messages import accumulate_event
    bufs = {"json_bufs": {}} if "json_bufs" in inspect.signature(accumulate_event).parameters else {}  # (2.x)

    from specdec.server import anthropic_api
    req = anthropic_api.MessagesRequest(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=40)
    chat = anthropic_api.as_chat(req)
    prompt = thinking_decoder.encode([{"role": "user", "content": "x"}])
    for chunks, result in scripted_streams(thinking_decoder):
        reply = anthropic_api.Reply(ScriptedJob(chunks, result), req, chat, thinking_decoder, "smol", prompt)
        snapshot = None
        for e in events_of(anthropic_api._events(ScriptedJob(chunks, result), reply, lambda job: None)):
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, **bufs)
        blocks = [{k: v for k, v in b.to_dict().items() if v is not None} for b in snapshot.content]  # (0.x: None fields)
        assert blocks == [{"type": "thinking", "thinking": "first the plan", "signature": ""},
                          {"type": "text", "text": "The answer."}], chunks
        assert blocks == reply.content(ANSWER) and snapshot.stop_reason == "end_turn"


def test_the_responses_stream_has_the_reasoning_item_first_as_its_client_accumulates_it(thinking_decoder):
    from openai._models import construct_type
    from openai.lib.streaming.responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from specdec.server import responses_api, responses_events
    req = responses_api.ResponsesRequest(input="x", max_output_tokens=40)
    chat = responses_api.as_chat(req)
    prompt = thinking_decoder.encode([{"role": "user", "content": "x"}])
    for chunks, result in scripted_streams(thinking_decoder):
        answer = responses_api.Answer(ScriptedJob(chunks, result), req, chat, "smol", thinking_decoder, prompt)
        state, done = ResponseStreamState(input_tools=[], text_format=openai_omit()), None
        for e in events_of(responses_events.events(thinking_decoder, ScriptedJob(chunks, result), answer,
                                                 lambda job: None)):
            state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
            done = e.get("response") if e["type"] == "response.completed" else done
        output = done["output"]
        assert [o["type"] for o in output] == ["reasoning", "message"], chunks
        assert output[0]["content"] == [{"type": "reasoning_text", "text": "first the plan"}]
        assert output[1]["content"][0]["text"] == "The answer."
        assert output == answer.items(thinking_decoder, ANSWER, result)


def openai_omit():
    from openai import omit
    return omit


@pytest.fixture(scope="module")
def opened_live():
    """A server whose template opens <think> at the end of every prompt (as R1's do): every answer is reasoning
    until the model closes the tag."""
    sd = SpecDecoder(draft="ngram", chat_template=THINKING, chat_template_kwargs={"opened": True})
    srv = LiveServer(create_app(sd, model_name="smol"))
    yield srv
    srv.stop()


def test_the_official_clients_get_the_reasoning_as_thinking_blocks_and_reasoning_items(opened_live):
    import anthropic
    import openai
    reasoning = ask(opened_live, None)["reasoning_content"]  # chat completions: 40 tokens of reasoning, no answer
    assert reasoning and "</think>" not in reasoning
    a = anthropic.Anthropic(base_url=opened_live.url, api_key="none", max_retries=0, timeout=120)
    body = dict(model="smol", max_tokens=40, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Plan, then answer in one word."}])
    message = a.messages.create(**body)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == reasoning and message.content[1].text == ""
    with a.messages.stream(**body) as stream:
        assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
                for b in stream.get_final_message().content] == [("thinking", reasoning, None), ("text", None, "")]
    quiet = a.messages.create(**body, thinking={"type": "disabled"})  # the template closes the tag itself
    effortless = httpx.post(opened_live.url + "/v1/chat/completions", timeout=120, json={
        "messages": body["messages"], "max_tokens": 8, "temperature": 0, "reasoning_effort": "none"}).json()
    assert "reasoning_content" not in effortless["choices"][0]["message"], effortless
    assert [b.type for b in quiet.content] == ["text"]
    o = openai.OpenAI(base_url=opened_live.url + "/v1", api_key="none", max_retries=0, timeout=120)
    response = o.responses.create(model="smol", input=body["messages"], max_output_tokens=40, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens  # never closed
    assert response.output[0].content[0].text == reasoning and response.output_text == ""
    with o.responses.stream(model="smol", input=body["messages"], max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response().output
    assert [(o.type, o.content[0].text) for o in streamed] == [("reasoning", reasoning), ("message", "")]
    quiet = o.responses.create(model="smol", input=body["messages"], max_output_tokens=40, temperature=0,
                               reasoning={"effort": "none"})
    assert [item.type for item in quiet.output] == ["message"]


def test_a_grammar_waits_for_the_reasoning_on_every_api(opened_live):
    """Structured outputs and forced calls shape the answer, not the reasoning: where the prompt opened <think>, the
    reasoning runs as it does without them (40 tokens: the 135M never closes the tag), and nothing of it is taken
    for the content (JSON, a call). Before, the grammar wrote from the first token and the model never thought."""
    import anthropic
    messages = [{"role": "user", "content": "Give a JSON object with a name."}]
    free = ask(opened_live, None, messages=messages)["reasoning_content"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    for stream in (False, True):
        got = ask(opened_live, None, stream, messages=messages,
                  response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        assert got["reasoning_content"] == free and got["content"] == "", got
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}
    called, unforced = (httpx.post(opened_live.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 40, "temperature": 0, "tools": [tool], "tool_choice": choice}).json()[
        "choices"][0]["message"] for choice in ("required", "auto"))
    assert called["reasoning_content"] == unforced["reasoning_content"] and not called.get("tool_calls"), called
    a = anthropic.Anthropic(base_url=opened_live.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model="smol", max_tokens=40, messages=messages, tool_choice={"type": "any"},
                          tools=[{"name": "lookup", "input_schema": tool["function"]["parameters"]}],
                          extra_body={"temperature": 0})
    assert m.content[0].type == "thinking" and "tool_use" not in [b.type for b in m.content]


SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}


def test_after_the_reasoning_the_grammar_holds(thinking_decoder):
    """The wrapped grammar (constraints.after_thinking) on the default model's tokens: any text up to the first
    </think> (where the plain grammar allows no such token), whitespace, then only what the grammar allows; an
    answer may open its own <think> block or skip it; a GBNF that writes the tags itself is not wrapped."""
    from specdec.constraints import writes_tags
    tok, grammars = thinking_decoder.tokenizer, thinking_decoder.grammars

    def ids(text):
        return tok(text, add_special_tokens=False).input_ids

    def run(fmt, text):  # how many of the text's tokens the grammar takes, and whether it then stops
        c = grammars.constraint(fmt)
        taken = c.valid_prefix(ids(text))
        return taken == len(ids(text)), c
    for inside, lead in ((True, ""), (False, "<think>")):
        fmt = {"type": "after_thinking", "inside": inside, "format": SCHEMA}
        whole, _ = run(fmt, lead + 'So 2+2 is 4, </thi not yet.</think>\n\n{"a":4}')
        assert whole
        assert not run(fmt, lead + "plan</think>\n\nhello")[0]  # after the reasoning: the schema only
        assert not run(fmt, lead + 'plan</think>{"a":4}</think>')[0]
        c = grammars.constraint(fmt)
        for t in ids(lead + 'plan</think> {"a":4}'):
            assert c.accept(t)
        assert c.done
    hello = ids("hello")[:1]
    assert grammars.constraint({"type": "after_thinking", "inside": True, "format": SCHEMA}).valid_prefix(hello) == 1
    assert grammars.constraint(SCHEMA).valid_prefix(hello) == 0
    outside = {"type": "after_thinking", "inside": False, "format": SCHEMA}
    assert run(outside, '{"a":4}')[0] and not run(outside, "plan</think>")[0]  # no reasoning: the schema at once
    gbnf = {"type": "after_thinking", "inside": True, "format": {"type": "gbnf", "grammar": 'root ::= [a-z]+ "."'}}
    assert run(gbnf, "hmm</think>\nyes.")[0] and not run(gbnf, "hmm</think>\nYes!")[0]
    assert writes_tags({"type": "gbnf", "grammar": GRAMMAR}) and not writes_tags(SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_after_the_reasoning_keeps_speculation_lossless(opened_live, temperature):
    """The wrapped grammar's rows are masked as any grammar's: with drafts the tokens equal target-only's, greedy
    and seeded."""
    sd = opened_live.app.state.decoder
    fmt = {"type": "after_thinking", "inside": True, "format": SCHEMA}
    messages = [{"role": "user", "content": "Think, then give a JSON object."}]
    kw = dict(max_new_tokens=24, response_format=fmt, temperature=temperature, seed=5)
    with_drafts = sd.generate(messages, **kw)
    alone = SpecDecoder(draft="none", chat_template=THINKING, chat_template_kwargs={"opened": True}).generate(
        messages, **kw)
    assert with_drafts.token_ids == alone.token_ids and with_drafts.stats["target_passes"] < 24
    # the API (and the CLI's --schema) wraps a plain format itself on a thinking template: the same tokens
    assert sd.generate(messages, **{**kw, "response_format": SCHEMA}).token_ids == with_drafts.token_ids
