"""Fill-in-the-middle: the FIM prompt in prefix-suffix-middle order (other files before it), llama-server's /infill
and OpenAI's `suffix` over real HTTP answering what the engine answers for that prompt, and a clear 400 (or one CLI
line) for a model without FIM tokens."""
import json

import httpx
import pytest
from test_server import LiveServer
from tiny import char_tokenizer, tiny_llama

from specdec import InvalidRequest, SpecDecoder, models
from specdec.cli import main
from specdec.fim import fim_prompt, fim_tokens
from specdec.server import create_app

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny model whose tokenizer has Qwen2.5-Coder's FIM tokens, on the runtime."""
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": FIM})
    path = tmp_path_factory.mktemp("coder")
    tiny_llama(seed=3, vocab=len(tok)).float().save_pretrained(path)
    tok.save_pretrained(path)
    model, rt_tok = models.load(str(path), backend="runtime")
    return SpecDecoder.from_models(model, rt_tok, draft="ngram", tau=3), str(path)


def test_the_fim_prompt_is_prefix_suffix_middle_with_files_first(coder):
    sd, _ = coder
    t = fim_tokens(sd.tokenizer)
    enc = lambda s: sd.tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    assert fim_prompt(sd.tokenizer, PREFIX, SUFFIX) == [t["prefix"], *enc(PREFIX), t["suffix"], *enc(SUFFIX),
                                                        t["middle"]]
    with_files = fim_prompt(sd.tokenizer, PREFIX, SUFFIX, [("util.py", "X = 1")], repo="proj")
    assert with_files[:2] == [t["repo_name"], *enc("p")] and with_files.count(t["file_sep"]) == 2
    assert with_files[-len(fim_prompt(sd.tokenizer, PREFIX, SUFFIX)):] == fim_prompt(sd.tokenizer, PREFIX, SUFFIX)


def test_a_model_without_fim_tokens_is_refused(tok):
    with pytest.raises(InvalidRequest, match="fill-in-the-middle"):
        fim_prompt(tok, PREFIX, SUFFIX)


@pytest.fixture(scope="module")
def live(coder):
    srv = LiveServer(create_app(coder[0], model_name="coder"))
    yield srv
    srv.stop()


def test_infill_and_suffix_answer_what_the_engine_answers_for_the_fim_prompt(live, coder):
    sd, _ = coder
    ids = fim_prompt(sd.tokenizer, PREFIX, SUFFIX)
    want = sd.generate("", prompt_ids=ids, max_new_tokens=20, chat=False).text
    r = httpx.post(live.url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 20,
                                               "temperature": 0, "cache_prompt": True, "t_max_predict_ms": 500,
                                               "samplers": ["top_k", "top_p", "infill"]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == want and body["stop"] is True and body["tokens_evaluated"] == len(ids)
    assert 0 < body["specdec"]["target_passes"] <= body["tokens_predicted"]  # what the pair benchmark reports
    streamed, last = "", None
    with httpx.stream("POST", live.url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                          "n_predict": 20, "temperature": 0, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                streamed += last["content"]
    assert streamed == want and last["stop"] is True and last["tokens_predicted"] == body["tokens_predicted"]
    assert last["specdec"]["target_passes"] == body["specdec"]["target_passes"]
    c = httpx.post(live.url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 20,
                                                       "temperature": 0}, timeout=30)
    assert c.status_code == 200 and c.json()["choices"][0]["text"] == want
    extra = httpx.post(live.url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4,
                                                   "input_extra": [{"filename": "util.py", "text": "X = 1"}]})
    assert extra.status_code == 200 and extra.json()["tokens_evaluated"] > len(ids)


@pytest.mark.parametrize("body", [{"input_prefix": 3}, {"input_extra": [{"name": "a.py", "text": "x"}]},
                                  {"min_p": 1.5}, {"mirostat": 2}, {"n_predict": -5}, {"temperature": -1}])
def test_infill_field_validation(live, body):
    r = httpx.post(live.url + "/infill", json={"input_prefix": PREFIX, **body})
    assert r.status_code == 400, r.text


def test_fim_on_a_model_without_fim_tokens_is_a_400_and_one_cli_line(rt_plain, tiny_dirs, capsys):
    srv = LiveServer(create_app(rt_plain, model_name="tiny"))
    try:
        for path, body in (("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX}),
                           ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 400 and "fill-in-the-middle" in r.text, path
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True})
        assert r.status_code == 400 and "suffix" in r.text
    finally:
        srv.stop()
    assert main(["generate", PREFIX, "--target", tiny_dirs["target"], "--suffix", SUFFIX]) == 2
    err = capsys.readouterr().err
    assert "fill-in-the-middle" in err and len(err.strip().splitlines()) == 1


def test_generate_suffix_fills_the_middle(coder, capsys):
    sd, path = coder
    want = sd.generate("", prompt_ids=fim_prompt(sd.tokenizer, PREFIX, SUFFIX), max_new_tokens=12, chat=False)
    assert main(["generate", PREFIX, "--target", path, "--suffix", SUFFIX, "--max-new-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids


@pytest.fixture(scope="module")
def rt_plain(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    return SpecDecoder.from_models(model, tok, draft="ngram", tau=3)


def test_a_middle_ends_at_the_models_end_of_text_tokens(tmp_path):
    """A GGUF names one EOS (Qwen's <|im_end|>), but a FIM answer ends with <|endoftext|> or a FIM token: those end
    the generation too, as llama.cpp's vocabulary marks them (it ran on, repeating the file, before)."""
    from types import SimpleNamespace
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|fim_pad|>", *FIM]})
    ids = models.eos_ids(SimpleNamespace(generation_config=None), tok)
    vocab = tok.get_vocab()
    assert {vocab[t] for t in ["<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"]} <= ids
    assert tok.eos_token_id in ids and vocab["a"] not in ids


def test_special_token_text_in_the_users_code_is_text(coder):
    """`<|fim_middle|>` inside a source file is the characters, not the control token (llama.cpp tokenizes infill
    text without parsing specials); a lone surrogate is a 400, not a 500."""
    sd, _ = coder
    t = fim_tokens(sd.tokenizer)
    ids = fim_prompt(sd.tokenizer, "x = '<|fim_middle|>'", SUFFIX)
    assert ids.count(t["middle"]) == 1 and ids[-1] == t["middle"]  # only the prompt's own
    assert sd.tokenizer.decode(ids[1: ids.index(t["suffix"])]) == "x = '<|fim_middle|>'"
    with pytest.raises(InvalidRequest, match="surrogate"):
        fim_prompt(sd.tokenizer, "def f(\ud800", SUFFIX)


def test_a_lone_surrogate_in_an_infill_is_a_400(live):
    for body in ({"input_prefix": "def f(\ud800", "input_suffix": "\n", "n_predict": 4},
                 {"input_prefix": "x", "input_extra": [{"filename": "a.py", "text": "y\udfff"}], "n_predict": 4}):
        r = httpx.post(live.url + "/infill", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_distill_answers_a_fill_in_prompt_as_infill_would_and_trains_on_the_middle(coder, tmp_path):
    """A `mode: fim` line in a distill prompt file is the prompt /infill sends; the target's greedy middle is the
    answer the draft is trained on (its loss starts after the prompt)."""
    from specdec.distill import distill
    sd, _ = coder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": PREFIX, "suffix": SUFFIX, "mode": "fim"}, {"prompt": "x = 1", "mode": "completion"},
        {"prompt": "def f(a):\n", "suffix": "\n    return a\n", "mode": "fim", "max_new_tokens": 6}]))
    rep = distill("coder", str(tmp_path / "d"), [str(prompts)], [], max_new_tokens=12, gen_batch=2, reduced=30,
                  epochs=1, batch=2, self_chat=0, val_every=0, eval_limit=1, features="fused",
                  loaded=(sd.model, sd.tokenizer))
    seqs = [json.loads(line)["ids"] for line in (tmp_path / "d" / "work" / "sequences.jsonl").read_text().splitlines()]
    for (prefix, suffix, n), ids in zip([(PREFIX, SUFFIX, 12), ("def f(a):\n", "\n    return a\n", 6)],
                                        [seqs[0], seqs[2]]):
        prompt = fim_prompt(sd.tokenizer, prefix, suffix)
        want = sd.generate("", prompt_ids=prompt, max_new_tokens=n, chat=False).token_ids
        assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(want)] == want
    assert rep["answer_tokens"] > 0 and rep["held_out"]["identical_to_target"]


def test_fill_in_prompts_are_refused_for_a_target_without_fim_tokens_and_outside_distill(rt_plain, tmp_path):
    from specdec.distill import distill
    from specdec.errors import SpecDecError
    from specdec.prompts import load_prompts
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PREFIX, "suffix": SUFFIX, "mode": "fim"}) + "\n")
    with pytest.raises(InvalidRequest, match="no FIM tokens"):
        distill("plain", str(tmp_path / "d"), [str(prompts)], [], features="fused", reduced=30,
                loaded=(rt_plain.model, rt_plain.tokenizer))
    assert not (tmp_path / "d" / "work" / "sequences.jsonl").exists()  # refused before any data
    with pytest.raises(SpecDecError, match="mode must be 'chat' or 'completion', got 'fim'"):
        load_prompts(prompts)  # bench, tune, check: a prompt without its suffix would be another request
    prompts.write_text(json.dumps({"prompt": PREFIX, "mode": "fim"}) + "\n")
    with pytest.raises(SpecDecError, match="suffix"):
        load_prompts(prompts, fim=True)


def test_bench_runs_fill_in_prompts_as_infill_sends_them(coder, rt_plain, tiny_dirs, tmp_path, capsys):
    from rich.console import Console

    from specdec.bench import Bench
    from specdec.prompts import load_prompts
    sd, path = coder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PREFIX, "suffix": SUFFIX, "mode": "fim"}) + "\n"
                       + json.dumps({"prompt": "x = 1", "mode": "completion"}) + "\n")
    bench = Bench(path, ["ngram"], [3], 12, False)
    rows = bench.run(load_prompts(prompts, fim=True), Console(quiet=True))
    want = sd.generate("", prompt_ids=fim_prompt(sd.tokenizer, PREFIX, SUFFIX), max_new_tokens=12, chat=False)
    assert all(c.outputs[0] == want.token_ids for c in bench.configs) and rows[1]["identical_to_baseline"]
    assert main(["bench", "--target", tiny_dirs["target"], "--prompts", str(prompts), "--tau", "2",
                 "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fill-in-the-middle" in err[0]
