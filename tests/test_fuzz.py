"""No request body gets a 5xx: property-based bodies (hypothesis) for every endpoint (OpenAI's and
llama-server's), built from the fields the API knows with values of any JSON type (lone surrogates, NUL, huge and
negative numbers, deep nesting, wrong types), posted over real HTTP. Every answer is a 200 or a JSON 4xx with an
error message."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "tau", "policy", "stop", "seed", "n", "stream", "stream_options", "user", "presence_penalty",
          "frequency_penalty", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "echo",
          "store", "metadata", "logit_bias", "role", "content", "type", "text", "json_schema", "schema",
          # llama-server's (llama_compat.py)
          "n_predict", "n_probs", "repeat_penalty", "repeat_last_n", "grammar", "ignore_eos", "return_tokens",
          "tokens", "add_special", "with_pieces", "input_prefix", "input_suffix", "mirostat", "cache_prompt",
          "n_indent", "t_max_predict_ms",
          # OpenAI's Responses API (responses_api.py)
          "input", "instructions", "max_output_tokens", "include", "call_id", "name", "arguments", "output",
          "format", "previous_response_id", "truncation", "conversation", "items", "background",
          # Anthropic's Messages API (anthropic_api.py)
          "system", "stop_sequences", "tool_use_id", "input_schema", "output_config", "thinking", "source",
          # chat templates and thinking models (server/reasoning.py)
          "chat_template_kwargs", "reasoning_format", "reasoning_effort", "reasoning", "enable_thinking"]
ODD = st.sampled_from(["\ud800", "\x00", "a\udfffb", "", " ", "x" * 3000, "<|im_end|>", "{", "\u202e"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20), ODD)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=4)),
    max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"])
                                 | values, "content": st.one_of(st.text(max_size=30), ODD, values)})
item = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                       "reasoning", "input_text"]) | values},
                             optional={f: values for f in ("role", "content", "call_id", "name", "arguments",
                                                           "output")})
block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])
                              | values}, optional={f: values for f in ("text", "id", "name", "input", "tool_use_id",
                                                                       "content", "is_error")})
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(1, 16) | values, "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | values,
                               "content": st.one_of(st.text(max_size=30), ODD, st.lists(block, max_size=3))}),
        max_size=3)}, optional={f: values for f in ("system", "tools", "tool_choice", "stop_sequences", "stream",
                                                    "temperature", "output_config")}),
    st.fixed_dictionaries({"input": st.one_of(st.text(max_size=30), ODD, st.lists(item | message, max_size=3))},
                          optional={f: values for f in ("tools", "tool_choice", "text", "instructions",
                                                        "max_output_tokens", "stream", "include", "top_logprobs",
                                                        "background", "store")}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                          optional={f: values for f in FIELDS[3:20]}),
    st.fixed_dictionaries({"items": st.lists(item | message, max_size=3)}, optional={"metadata": values}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), ODD, values)},
                          optional={f: values for f in FIELDS[3:20]}),
)


@pytest.fixture(scope="module")
def srv(tok, target, draft_close):
    from specdec import SpecDecoder
    from specdec.server import create_app
    from test_server import LiveServer
    server = LiveServer(create_app(SpecDecoder.from_models(target, tok, draft=draft_close, tau=3), model_name="tiny",
                                   max_tokens_default=8))
    yield server
    server.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/input_tokens",
                             "/v1/messages", "/v1/messages/count_tokens", "/v1/conversations",
                             "/v1/conversations/{conv}/items", "/v1/conversations/{conv}"]), body=bodies | values)
def test_no_body_gets_a_5xx(srv, path, body):
    if "{conv}" in path:  # a conversation of the server's (a random body adds to it, or updates its metadata)
        conv = httpx.post(srv.url + "/v1/conversations", json={}, timeout=30).json()["id"]
        path = path.format(conv=conv)
    check(srv, path, body)


@pytest.fixture(scope="module")
def thinking_srv(tok, target, draft_close):
    """The same model behind a thinking template that opens <think> at the end of every prompt (as R1's do): every
    answer goes through the reasoning split."""
    import copy

    from specdec import SpecDecoder
    from specdec.server import create_app
    from test_server import LiveServer
    thinker = copy.deepcopy(tok)
    thinker.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<assistant><think>\n{% endif %}{# </think> #}")
    server = LiveServer(create_app(SpecDecoder.from_models(target, thinker, draft=draft_close, tau=3),
                                   model_name="tiny", max_tokens_default=8))
    yield server
    server.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages"]), body=bodies)
def test_no_body_to_a_thinking_model_gets_a_5xx(thinking_srv, path, body):
    check(thinking_srv, path, body)


def test_the_thinking_server_splits_its_answers(thinking_srv):
    r = httpx.post(thinking_srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0})
    assert "reasoning_content" in r.json()["choices"][0]["message"], r.text  # (what the fuzzing above goes through)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(stream=st.sampled_from(["true", "false", "1", "x", ""]) | st.none(),
       after=st.integers(-2**70, 2**70).map(str) | st.text(max_size=6) | st.none(),
       streamed=st.booleans())
def test_no_query_to_a_stored_response_gets_a_5xx(srv, stream, after, streamed):
    """GET /v1/responses/{id} with any stream / starting_after, on a background stream's response or a plain one:
    the response, its events, or a JSON 4xx."""
    body = {"input": "hi", "max_output_tokens": 4, **({"background": True, "stream": True} if streamed else {})}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: ") or line.startswith("{"))
    rid = json.loads(first.removeprefix("data: "))["response" if streamed else "id"]
    rid = rid["id"] if streamed else rid
    params = {k: v for k, v in (("stream", stream), ("starting_after", after)) if v is not None}
    got = httpx.get(f"{srv.url}/v1/responses/{rid}", params=params, timeout=60)
    assert got.status_code == 200 or 400 <= got.status_code < 500, (got.status_code, got.text, params)
    if got.status_code != 200:
        assert got.json()["error"]["message"]


LLAMA = ["n_predict", "n_probs", "repeat_penalty", "repeat_last_n", "grammar", "ignore_eos", "return_tokens", "stop",
         "logit_bias", "json_schema", "seed", "temperature", "top_k", "min_p", "stream", "mirostat", "samplers"]
llama_bodies = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), ODD, values)},
                                     optional={f: values for f in LLAMA})


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/completion", "/infill", "/tokenize", "/detokenize", "/apply-template"]),
       body=bodies | llama_bodies | values)
def test_no_body_to_llama_servers_endpoints_gets_a_5xx(srv, path, body):
    check(srv, path, body)


def check(srv, path, body):
    if not isinstance(body, dict):
        body = {"_": body} if body is None else body  # (a bare null would be an empty body)
    for limit in ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"):  # long is only slow
        if isinstance(body, dict) and isinstance(body.get(limit), int) and body[limit] > 16:
            body[limit] = 16
    content = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \\ud800 escapes
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    elif isinstance(body, dict) and body.get("stream") is True and path in ("/v1/chat/completions", "/v1/completions"):
        assert "data: [DONE]" in r.text
