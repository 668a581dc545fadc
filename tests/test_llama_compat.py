"""llama-server's own endpoints over real HTTP: /completion answers what the engine answers for the same prompt
(text, token ids or both mixed; streamed or not), reports how it stopped, its tokens and their probabilities;
llama-server's logit_bias pairs, ignore_eos, repeat_penalty over repeat_last_n, GBNF grammars and JSON schemas;
/tokenize, /detokenize, /apply-template and /props; every bad field a 400 that names it."""
import json

import httpx
import pytest


PROMPT = "The cat sat on"


def post(rt_live, path, body, **kw):
    return httpx.post(rt_live.url + path, json=body, timeout=60, **kw)


def stream(rt_live, path, body) -> list[dict]:
    with httpx.stream("POST", rt_live.url + path, json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def test_completion_answers_what_the_engine_answers(rt_live, rt_sd):
    want = rt_sd.generate(PROMPT, max_new_tokens=24, chat=False)
    body = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "return_tokens": True,
                                      "cache_prompt": True, "samplers": ["top_k"]}).json()
    assert body["content"] == want.text and body["tokens"] == want.token_ids
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 24
    timings = body["timings"]
    assert body["tokens_evaluated"] == len(rt_sd.encode(PROMPT, chat=False)) == timings["prompt_n"] + timings["cache_n"]
    assert timings["draft_n"] == body["specdec"]["proposed"] and timings["draft_n_accepted"] == body["specdec"][
        "accepted"]
    assert body["generation_settings"]["n_predict"] == 24 and 0 < body["specdec"]["target_passes"] <= 24
    events = stream(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0})
    assert "".join(e["content"] for e in events) == want.text
    assert sum((e["tokens"] for e in events), []) == want.token_ids
    assert [e["stop"] for e in events].count(True) == 1 and events[-1]["stop_type"] == "limit"
    assert events[-1]["tokens_predicted"] == 24
    assert post(rt_live, "/completions", {"prompt": PROMPT, "n_predict": 24, "temperature": 0}).json()["content"] \
        == want.text


@pytest.mark.parametrize("kind", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_curl_d_sends_it_is_read_as_json(rt_live, kind):
    """`curl -d '{...}'` says the body is a form; llama-server reads it as JSON, and so does every route here."""
    for path, body in (("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0}),
                       ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})):
        r = httpx.post(rt_live.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": kind} if kind else {}, timeout=60)
        assert r.status_code == 200, (path, r.text)
    bad = httpx.post(rt_live.url + "/completion", content=b"prompt=x", headers={"content-type": kind or ""})
    assert bad.status_code == 400 and "error" in bad.json()


def test_n_predict_0_caches_the_prompt_and_answers_nothing(rt_live):
    """As llama.vscode sends a file's context ahead of need: the prompt is prefilled into the prefix cache, nothing
    comes back, and the next request that starts with it finds it there."""
    def hits():
        m = rt_live.metrics()
        return m.get(("vllm:prefix_cache_hits_total", ()), 0)
    context = "import os\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(5))
    warm = post(rt_live, "/completion", {"prompt": context, "n_predict": 0, "return_tokens": True}).json()
    assert (warm["content"], warm["tokens"], warm["tokens_predicted"], warm["stop_type"]) == ("", [], 0, "limit")
    streamed = stream(rt_live, "/completion", {"prompt": context, "n_predict": 0})
    assert [e["content"] for e in streamed] == [""] and streamed[-1]["tokens_predicted"] == 0
    before = hits()
    post(rt_live, "/completion", {"prompt": context + "def g(", "n_predict": 4, "temperature": 0})
    assert hits() - before >= 64  # the context's blocks were found


def test_token_and_mixed_prompts(rt_live, rt_sd):
    ids = rt_sd.encode(PROMPT, chat=False)
    text = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0}).json()["content"]
    assert post(rt_live, "/completion", {"prompt": ids, "n_predict": 12, "temperature": 0}).json()["content"] == text
    head, tail = "The cat", " sat on"
    mixed = rt_sd.encode(head, chat=False) + rt_sd.tokenizer(tail, add_special_tokens=False).input_ids
    want = rt_sd.generate("", prompt_ids=mixed, max_new_tokens=12, chat=False).text
    body = post(rt_live, "/completion", {"prompt": [*rt_sd.encode(head, chat=False), tail], "n_predict": 12,
                                      "temperature": 0}).json()
    assert body["content"] == want and body["tokens_evaluated"] == len(mixed)


def test_how_it_stopped_a_stop_string_and_the_end_of_text(rt_live, rt_sd):
    full = rt_sd.generate(PROMPT, max_new_tokens=24, chat=False).text
    word = full[5:7]
    body = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "stop": [word]}).json()
    assert body["content"] == full[:full.index(word)] and body["stop_type"] == "word"
    assert body["stopping_word"] == word
    eos = [[rt_sd.engine.eos_ids[0] if isinstance(rt_sd.engine.eos_ids, list) else min(rt_sd.engine.eos_ids), 100]]
    ended = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "logit_bias": eos}).json()
    assert ended["content"] == "" and ended["stop_type"] == "eos" and ended["tokens_predicted"] == 1
    ignored = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "logit_bias": eos,
                                         "ignore_eos": True}).json()
    assert ignored["stop_type"] == "limit" and ignored["tokens_predicted"] == 8


def test_an_unseeded_sampled_answer_reports_the_seed_that_reproduces_it(rt_live):
    first = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 1.0}).json()
    seed = first["generation_settings"]["seed"]
    assert isinstance(seed, int)
    again = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 1.0, "seed": seed}).json()
    assert again["content"] == first["content"] and again["generation_settings"]["seed"] == seed


def test_probabilities_are_the_openai_logprobs(rt_live, rt_sd):
    body = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3,
                                      "return_tokens": True}).json()
    probs = body["completion_probabilities"]
    oai = post(rt_live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}).json()
    lp = oai["choices"][0]["logprobs"]
    assert [p["id"] for p in probs] == body["tokens"] and [p["token"] for p in probs] == lp["tokens"]
    assert [p["logprob"] for p in probs] == lp["token_logprobs"]
    for p, top in zip(probs, lp["top_logprobs"]):
        assert len(p["top_logprobs"]) == 3 and {a["token"]: a["logprob"] for a in p["top_logprobs"]} == top
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest
    events = stream(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3})
    assert sum((e.get("completion_probabilities", []) for e in events), []) == probs


def test_logit_bias_pairs_ban_tokens_and_text(rt_live, rt_sd):
    first = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                                       "return_tokens": True}).json()["tokens"][0]
    for bias in ([[first, False]], [[first, -100]], {str(first): -100},
                 [[rt_sd.tokenizer.decode([first]), False]]):
        body = post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "logit_bias": bias,
                                          "return_tokens": True}).json()
        assert first not in body["tokens"], bias


def test_repeat_penalty_counts_the_last_repeat_last_n_tokens(rt_live, rt_sd):
    def run(**kw):
        return post(rt_live, "/completion", {"prompt": PROMPT, "n_predict": 30, "temperature": 0, **kw}).json()
    for n in (4, -1):
        want = rt_sd.generate(PROMPT, max_new_tokens=30, chat=False, repetition_penalty=1.5,
                           repetition_window=None if n == -1 else n)
        assert run(repeat_penalty=1.5, repeat_last_n=n)["content"] == want.text
    assert run(repeat_penalty=1.5, repeat_last_n=0)["content"] == run()["content"]  # 0: no penalty
    assert run(repeat_penalty=1.5, repeat_last_n=4)["content"] != run(repeat_penalty=1.5, repeat_last_n=-1)["content"]


def test_infill_takes_the_shared_options(rt_live):
    r = post(rt_live, "/infill", {"input_prefix": "x", "repeat_penalty": 1.2, "n_probs": 2})
    assert r.status_code == 400 and "fill-in-the-middle" in r.text  # the tiny model has no FIM tokens


def test_tokenize_detokenize_apply_template_props(rt_live, rt_sd):
    ids = post(rt_live, "/tokenize", {"content": "Hi there"}).json()["tokens"]
    assert ids == rt_sd.tokenizer("Hi there", add_special_tokens=False).input_ids
    with_bos = post(rt_live, "/tokenize", {"content": "Hi", "add_special": True}).json()["tokens"]
    assert with_bos == rt_sd.tokenizer("Hi", add_special_tokens=True).input_ids
    pieces = post(rt_live, "/tokenize", {"content": "Hi", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": t, "piece": rt_sd.tokenizer.decode([t])} for t in ids[:2]]
    assert post(rt_live, "/detokenize", {"tokens": ids}).json() == {"content": "Hi there"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = post(rt_live, "/apply-template", {"messages": messages, "model": "tiny"}).json()["prompt"]
    assert prompt == rt_sd.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    props = httpx.get(rt_live.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == rt_sd.context_window and props["model_alias"] == "tiny"


@pytest.mark.parametrize("path,body,says", [
    ("/completion", {"prompt": PROMPT, "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": PROMPT, "typical_p": 0.5, "dry_multiplier": 0.8}, "typical_p, dry_multiplier"),
    ("/completion", {"prompt": ["one", "two"]}, "one prompt"),
    ("/completion", {"prompt": [1, 99999]}, "token ids"),
    ("/completion", {"prompt": PROMPT, "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": PROMPT, "repeat_penalty": 3}, "repeat_penalty"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[1]]}, "logit_bias"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[99999, 1]]}, "logit_bias"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[1, True]]}, "logit_bias"),
    ("/completion", {"prompt": PROMPT, "grammar": "root ::= x", "json_schema": {}}, "not both"),
    ("/completion", {"prompt": PROMPT, "bogus": 1}, "bogus"),
    ("/completion", {"prompt": ""}, "prompt"),
    ("/completion", {"prompt": PROMPT, "stop": [""]}, "stop"),
    ("/completion", {"prompt": PROMPT, "stop": ["a"] * 9}, "stop"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [-1]}, "token ids"),
    ("/apply-template", {"messages": []}, "messages"),
])
def test_bad_fields_are_400s_that_name_them(rt_live, path, body, says):
    r = post(rt_live, path, body)
    assert r.status_code == 400 and says in r.text, r.text
    assert "error" in r.json()


# ---- the real default model: a byte-level vocabulary, which grammars and pieces need ---------------------------
@pytest.mark.real
def test_gbnf_grammars_and_json_schemas_constrain_the_output(smol_live):
    for temperature in (0, 0.8):
        body = post(smol_live, "/completion", {"prompt": "Is the sky blue? Answer:", "n_predict": 8, "seed": 3,
                                          "temperature": temperature, "grammar": 'root ::= " yes" | " no"'}).json()
        assert body["content"] in (" yes", " no") and body["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = post(smol_live, "/completion", {"prompt": "A number as JSON:", "n_predict": 32, "temperature": 0,
                                     "json_schema": schema}).json()
    assert set(json.loads(out["content"])) == {"n"}
    bad = post(smol_live, "/completion", {"prompt": "x", "grammar": "root ::= missing"})
    assert bad.status_code == 400 and "grammar" in bad.text
    chat = post(smol_live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                                               "max_tokens": 8, "grammar": 'root ::= "Yes" | "No"'})  # as llama-server
    assert chat.json()["choices"][0]["message"]["content"] in ("Yes", "No")
    both = post(smol_live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "grammar": "x",
                                                    "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "grammar" in both.text


@pytest.mark.real
def test_pieces_of_partial_characters_are_bytes(smol_live):
    tokens = post(smol_live, "/tokenize", {"content": "héllo ☃", "with_pieces": True}).json()["tokens"]
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in tokens)
    assert joined == "héllo ☃".encode()
    assert post(smol_live, "/detokenize", {"tokens": [t["id"] for t in tokens]}).json()["content"] == "héllo ☃"


@pytest.mark.real
def test_editor_stops_end_the_answer_early_as_a_prefix_of_the_whole(smol_live):
    """llama.vscode's n_indent (a later line indented less ends the answer, before that line) and t_max_predict_ms
    (past it, the answer ends at a line's end): each answer is a prefix of the one without them, reported as the
    limit, as llama-server does; streamed the same."""
    from test_text import short_line_cut
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    ask = {"prompt": prompt, "n_predict": 80, "temperature": 0}
    full = post(smol_live, "/completion", ask).json()["content"]
    for least in (4, 8):
        body = post(smol_live, "/completion", {**ask, "n_indent": least}).json()
        assert body["content"] == short_line_cut(full, least) != full and body["stop_type"] == "limit"
        assert "".join(e["content"] for e in stream(smol_live, "/completion", {**ask, "n_indent": least})) == \
            body["content"]
    timed = post(smol_live, "/completion", {**ask, "t_max_predict_ms": 1}).json()
    assert full.startswith(timed["content"]) and timed["content"].endswith("\n") and len(timed["content"]) < len(full)
    assert timed["stop_type"] == "limit"
    assert post(smol_live, "/completion", {**ask, "n_indent": -1}).status_code == 400
