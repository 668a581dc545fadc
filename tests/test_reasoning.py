"""A thinking model's reasoning apart from its answer (server/reasoning.py): the split of whole answers, the same
split however the answer streams in, and over real HTTP on the default model with a thinking template (its answers
forced by a grammar, the only way a 135M model writes the tags)."""
import json
import re

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
            "{% if add_generation_prompt %}<|assistant|>{% if opened %}<think>\n{% endif %}{% endif %}"
            "{# answers may carry <think>...</think> #}")
GRAMMAR = 'root ::= "<think>\\nfirst the plan\\n</think>\\n\\n" [a-z]+ "."'
OPENED = 'root ::= "first the plan\\n</think>\\n\\n" [a-z]+ "."'


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(create_app(SpecDecoder(draft="ngram", chat_template=THINKING), model_name="smol"))
    yield srv
    srv.stop()


def ask(live, grammar, stream=False, **kw):
    body = {"messages": [{"role": "user", "content": "Plan, then answer in one word."}], "max_tokens": 40,
            "temperature": 0, "grammar": grammar, "stream": stream, **kw}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c[0]["delta"] for c in deltas if c]
    return {"reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas) or None,
            "content": "".join(d.get("content") or "" for d in deltas)}


@pytest.mark.parametrize("stream", [False, True])
def test_over_http_the_reasoning_goes_to_reasoning_content(live, stream):
    raw = ask(live, GRAMMAR, reasoning_format="none")["content"]
    assert raw.startswith("<think>\nfirst the plan\n</think>\n\n")
    message = ask(live, GRAMMAR, stream)
    assert message["reasoning_content"] == "first the plan"
    assert message["content"] == raw.removeprefix("<think>\nfirst the plan\n</think>\n\n")
    opened = ask(live, OPENED, stream, chat_template_kwargs={"opened": True})  # R1: the prompt opens the tag
    assert opened["reasoning_content"] == "first the plan" and re.fullmatch("[a-z]+[.]", opened["content"])
    raw = ask(live, OPENED, chat_template_kwargs={"opened": True}, reasoning_format="none")["content"]
    assert opened["content"] == raw.removeprefix("first the plan\n</think>\n\n")
    assert ask(live, 'root ::= [a-z]+ "."', stream).get("reasoning_content") is None  # no tags: none
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "reasoning_format": "verbose"})
    assert r.status_code == 400 and "reasoning_format" in r.text
