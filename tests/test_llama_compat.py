"""llama-server's own endpoints over real HTTP: /completion answers what the engine answers for the same prompt
(text, token ids or both mixed; streamed or not), reports how it stopped, its tokens and their probabilities;
llama-server's logit_bias pairs, ignore_eos, repeat_penalty over repeat_last_n, GBNF grammars and JSON schemas;
/tokenize, /detokenize, /apply-template and /props; every bad field a 400 that names it."""
import json

import httpx
import pytest
from test_server import LiveServer

from specdec import SpecDecoder, models
from specdec.server import create_app

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def sd(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    return SpecDecoder.from_models(model, tok, draft="ngram", tau=3)


@pytest.fixture(scope="module")
def live(sd):
    srv = LiveServer(create_app(sd, model_name="tiny"))
    yield srv
    srv.stop()


def post(live, path, body, **kw):
    return httpx.post(live.url + path, json=body, timeout=60, **kw)


def stream(live, path, body) -> list[dict]:
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def test_completion_answers_what_the_engine_answers(live, sd):
    want = sd.generate(PROMPT, max_new_tokens=24, chat=False)
    body = post(live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "return_tokens": True,
                                      "cache_prompt": True, "samplers": ["top_k"]}).json()
    assert body["content"] == want.text and body["tokens"] == want.token_ids
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 24
    assert body["tokens_evaluated"] == len(sd.encode(PROMPT, chat=False)) == body["timings"]["prompt_n"]
    assert body["generation_settings"]["n_predict"] == 24 and 0 < body["specdec"]["target_passes"] <= 24
    events = stream(live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0})
    assert "".join(e["content"] for e in events) == want.text
    assert sum((e["tokens"] for e in events), []) == want.token_ids
    assert [e["stop"] for e in events].count(True) == 1 and events[-1]["stop_type"] == "limit"
    assert events[-1]["tokens_predicted"] == 24
    assert post(live, "/completions", {"prompt": PROMPT, "n_predict": 24, "temperature": 0}).json()["content"] \
        == want.text


@pytest.mark.parametrize("kind", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_as_curl_d_sends_it_is_read_as_json(live, kind):
    """`curl -d '{...}'` says the body is a form; llama-server reads it as JSON, and so does every route here."""
    for path, body in (("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0}),
                       ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})):
        r = httpx.post(live.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": kind} if kind else {}, timeout=60)
        assert r.status_code == 200, (path, r.text)
    bad = httpx.post(live.url + "/completion", content=b"prompt=x", headers={"content-type": kind or ""})
    assert bad.status_code == 400 and "error" in bad.json()


def test_token_and_mixed_prompts(live, sd):
    ids = sd.encode(PROMPT, chat=False)
    text = post(live, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0}).json()["content"]
    assert post(live, "/completion", {"prompt": ids, "n_predict": 12, "temperature": 0}).json()["content"] == text
    head, tail = "The cat", " sat on"
    mixed = sd.encode(head, chat=False) + sd.tokenizer(tail, add_special_tokens=False).input_ids
    want = sd.generate("", prompt_ids=mixed, max_new_tokens=12, chat=False).text
    body = post(live, "/completion", {"prompt": [*sd.encode(head, chat=False), tail], "n_predict": 12,
                                      "temperature": 0}).json()
    assert body["content"] == want and body["tokens_evaluated"] == len(mixed)


def test_how_it_stopped_a_stop_string_and_the_end_of_text(live, sd):
    full = sd.generate(PROMPT, max_new_tokens=24, chat=False).text
    word = full[5:7]
    body = post(live, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "stop": [word]}).json()
    assert body["content"] == full[:full.index(word)] and body["stop_type"] == "word"
    assert body["stopping_word"] == word
    eos = [[sd.engine.eos_ids[0] if isinstance(sd.engine.eos_ids, list) else min(sd.engine.eos_ids), 100]]
    ended = post(live, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "logit_bias": eos}).json()
    assert ended["content"] == "" and ended["stop_type"] == "eos" and ended["tokens_predicted"] == 1
    ignored = post(live, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "logit_bias": eos,
                                         "ignore_eos": True}).json()
    assert ignored["stop_type"] == "limit" and ignored["tokens_predicted"] == 8


def test_an_unseeded_sampled_answer_reports_the_seed_that_reproduces_it(live):
    first = post(live, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 1.0}).json()
    seed = first["generation_settings"]["seed"]
    assert isinstance(seed, int)
    again = post(live, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 1.0, "seed": seed}).json()
    assert again["content"] == first["content"] and again["generation_settings"]["seed"] == seed


def test_probabilities_are_the_openai_logprobs(live, sd):
    body = post(live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3,
                                      "return_tokens": True}).json()
    probs = body["completion_probabilities"]
    oai = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}).json()
    lp = oai["choices"][0]["logprobs"]
    assert [p["id"] for p in probs] == body["tokens"] and [p["token"] for p in probs] == lp["tokens"]
    assert [p["logprob"] for p in probs] == lp["token_logprobs"]
    for p, top in zip(probs, lp["top_logprobs"]):
        assert len(p["top_logprobs"]) == 3 and {a["token"]: a["logprob"] for a in p["top_logprobs"]} == top
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest
    events = stream(live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3})
    assert sum((e.get("completion_probabilities", []) for e in events), []) == probs


def test_logit_bias_pairs_ban_tokens_and_text(live, sd):
    first = post(live, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                                       "return_tokens": True}).json()["tokens"][0]
    for bias in ([[first, False]], [[first, -100]], {str(first): -100},
                 [[sd.tokenizer.decode([first]), False]]):
        body = post(live, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "logit_bias": bias,
                                          "return_tokens": True}).json()
        assert first not in body["tokens"], bias


def test_repeat_penalty_counts_the_last_repeat_last_n_tokens(live, sd):
    def run(**kw):
        return post(live, "/completion", {"prompt": PROMPT, "n_predict": 30, "temperature": 0, **kw}).json()
    for n in (4, -1):
        want = sd.generate(PROMPT, max_new_tokens=30, chat=False, repetition_penalty=1.5,
                           repetition_window=None if n == -1 else n)
        assert run(repeat_penalty=1.5, repeat_last_n=n)["content"] == want.text
    assert run(repeat_penalty=1.5, repeat_last_n=0)["content"] == run()["content"]  # 0: no penalty
    assert run(repeat_penalty=1.5, repeat_last_n=4)["content"] != run(repeat_penalty=1.5, repeat_last_n=-1)["content"]


def test_infill_takes_the_shared_options(live):
    r = post(live, "/infill", {"input_prefix": "x", "repeat_penalty": 1.2, "n_probs": 2})
    assert r.status_code == 400 and "fill-in-the-middle" in r.text  # the tiny model has no FIM tokens


def test_tokenize_detokenize_apply_template_props(live, sd):
    ids = post(live, "/tokenize", {"content": "Hi there"}).json()["tokens"]
    assert ids == sd.tokenizer("Hi there", add_special_tokens=False).input_ids
    with_bos = post(live, "/tokenize", {"content": "Hi", "add_special": True}).json()["tokens"]
    assert with_bos == sd.tokenizer("Hi", add_special_tokens=True).input_ids
    pieces = post(live, "/tokenize", {"content": "Hi", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": t, "piece": sd.tokenizer.decode([t])} for t in ids[:2]]
    assert post(live, "/detokenize", {"tokens": ids}).json() == {"content": "Hi there"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = post(live, "/apply-template", {"messages": messages, "model": "tiny"}).json()["prompt"]
    assert prompt == sd.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    props = httpx.get(live.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == sd.context_window and props["model_alias"] == "tiny"


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
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [-1]}, "token ids"),
    ("/apply-template", {"messages": []}, "messages"),
])
def test_bad_fields_are_400s_that_name_them(live, path, body, says):
    r = post(live, path, body)
    assert r.status_code == 400 and says in r.text, r.text
    assert "error" in r.json()


# ---- the real default model: a byte-level vocabulary, which grammars and pieces need ---------------------------
@pytest.fixture(scope="module")
def real():
    srv = LiveServer(create_app(SpecDecoder(draft="ngram"), model_name="smol"))
    yield srv
    srv.stop()


@pytest.mark.real
def test_gbnf_grammars_and_json_schemas_constrain_the_output(real):
    for temperature in (0, 0.8):
        body = post(real, "/completion", {"prompt": "Is the sky blue? Answer:", "n_predict": 8, "seed": 3,
                                          "temperature": temperature, "grammar": 'root ::= " yes" | " no"'}).json()
        assert body["content"] in (" yes", " no") and body["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = post(real, "/completion", {"prompt": "A number as JSON:", "n_predict": 32, "temperature": 0,
                                     "json_schema": schema}).json()
    assert set(json.loads(out["content"])) == {"n"}
    bad = post(real, "/completion", {"prompt": "x", "grammar": "root ::= missing"})
    assert bad.status_code == 400 and "grammar" in bad.text
    chat = post(real, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                                               "max_tokens": 8, "grammar": 'root ::= "Yes" | "No"'})  # as llama-server
    assert chat.json()["choices"][0]["message"]["content"] in ("Yes", "No")
    both = post(real, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= x",
                                               "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "grammar" in both.text


@pytest.mark.real
def test_pieces_of_partial_characters_are_bytes(real):
    tokens = post(real, "/tokenize", {"content": "héllo ☃", "with_pieces": True}).json()["tokens"]
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in tokens)
    assert joined == "héllo ☃".encode()
    assert post(real, "/detokenize", {"tokens": [t["id"] for t in tokens]}).json()["content"] == "héllo ☃"
