"""`--chat-template` (a template in place of the model's own) and chat_template_kwargs (variables the template
reads, such as Qwen3's `enable_thinking`): in the API, the CLI and over HTTP, with clear errors."""
import json

import httpx
import pytest
import torch
from test_server import LiveServer

from specdec import SpecDecoder
from specdec.cli import main
from specdec.errors import InvalidRequest, SpecDecError
from specdec.prompts import read_chat_template
from specdec.server import create_app

# a template with a variable of its own, as Qwen3's reads enable_thinking
THINKING = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
            "(no thinking){% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "abc"}]


def rendered(variables=None) -> str:
    text = "[user]abc\n[assistant]"
    return text + "(no thinking)" if variables and variables.get("enable_thinking") is False else text


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING)
    return path


@pytest.fixture(scope="module")
def sd(tiny_dirs, template_file):
    """The tiny target on the runtime, built as the CLI builds it, with the template file."""
    return SpecDecoder(target=tiny_dirs["target"], draft="ngram", chat_template=str(template_file))


def ids(sd, text: str) -> list[int]:
    return sd.tokenizer(text, add_special_tokens=False).input_ids


def test_a_template_is_read_from_a_file_or_given_as_text(template_file, tmp_path):
    assert read_chat_template(str(template_file)) == THINKING
    assert read_chat_template(THINKING) == THINKING
    with pytest.raises(SpecDecError, match="cannot read the chat template .*missing.jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(SpecDecError, match="does not compile"):
        read_chat_template("{% for m in messages %}{{ m }}")  # no endfor
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    with pytest.raises(SpecDecError, match="not UTF-8"):
        read_chat_template(str(tmp_path / "latin1.jinja"))


def test_the_decoder_prompts_with_the_given_template_and_its_variables(sd, tiny_dirs, template_file):
    assert sd.tokenizer.chat_template == THINKING
    assert sd.encode(MESSAGES) == ids(sd, rendered())
    off = {"enable_thinking": False}
    assert sd.encode(MESSAGES, variables=off) == ids(sd, rendered(off))
    out = sd.generate(MESSAGES, max_new_tokens=12, chat_template_kwargs=off)
    assert out.token_ids == sd.generate(MESSAGES, max_new_tokens=12, prompt_ids=ids(sd, rendered(off))).token_ids
    # decoder-wide variables (serve --chat-template-kwargs); a request's own override them
    quiet = SpecDecoder(target=tiny_dirs["target"], draft="ngram", chat_template=str(template_file),
                        chat_template_kwargs=off)
    assert quiet.encode(MESSAGES) == ids(sd, rendered(off))
    assert quiet.encode(MESSAGES, variables={"enable_thinking": True}) == ids(sd, rendered())


@pytest.mark.parametrize("bad, message", [
    ([1], "must be an object"),
    ({"not a name": 1}, "must be an object"),
    ({"messages": []}, "may not set messages"),
    ({"add_generation_prompt": False, "tools": []}, "may not set add_generation_prompt, tools"),
    ({f"v{i}": i for i in range(65)}, "at most 64"),
])
def test_bad_template_variables_are_refused(sd, bad, message):
    with pytest.raises(InvalidRequest, match=message):
        sd.encode(MESSAGES, variables=bad)
    with pytest.raises(InvalidRequest, match=message):
        sd.generate(MESSAGES, max_new_tokens=4, chat_template_kwargs=bad)


def test_over_http_chat_template_kwargs_reach_the_template(sd):
    srv = LiveServer(create_app(sd, model_name="tiny"))
    try:
        off = {"enable_thinking": False}
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "chat_template_kwargs": off}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids(sd, rendered(off)))
        alone = sd.generate(MESSAGES, max_new_tokens=12, chat_template_kwargs=off)
        assert r.json()["choices"][0]["message"]["content"] == alone.text
        r = httpx.post(srv.url + "/apply-template", json={"messages": MESSAGES, "chat_template_kwargs": off})
        assert r.json() == {"prompt": rendered(off)}
        assert httpx.get(srv.url + "/props").json()["chat_template"] == THINKING
        for path in ("/v1/chat/completions", "/apply-template"):
            r = httpx.post(srv.url + path, json={**body, "chat_template_kwargs": {"messages": 1}}, timeout=60)
            assert r.status_code == 400 and "may not set messages" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": "x"}, timeout=60)
        assert r.status_code == 400 and "chat_template_kwargs" in r.text
    finally:
        srv.stop()


def test_the_cli_takes_a_template_and_refuses_a_bad_one_in_one_line(tiny_dirs, template_file, tmp_path, capsys):
    common = ["generate", "abc", "--target", tiny_dirs["target"], "--draft", "ngram", "--max-new-tokens", "8"]
    assert main(common + ["--chat-template", str(template_file), "--chat-template-kwargs",
                          '{"enable_thinking": false}', "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sd = SpecDecoder(target=tiny_dirs["target"], draft="ngram", chat_template=THINKING)
    off = {"enable_thinking": False}
    assert out["token_ids"] == sd.generate(MESSAGES, max_new_tokens=8, prompt_ids=ids(sd, rendered(off))).token_ids
    assert main(common + ["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: cannot read the chat template") and err.count("\n") == 1
    (tmp_path / "broken.jinja").write_text("{% if %}")
    assert main(common + ["--chat-template", str(tmp_path / "broken.jinja")]) == 2
    assert "does not compile" in capsys.readouterr().err
    for flag, value in (("--chat-template-kwargs", "[1]"), ("--threads", "0"), ("--threads", "two")):
        with pytest.raises(SystemExit) as e:
            main(common + [flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and err.count("\n") == 1


def test_the_thread_count_changes_no_output(tiny_dirs, capsys):
    """--threads sets torch's thread count, over which the kernels split their work; every row is computed the
    same whatever the split, so the tokens are the same."""
    before = torch.get_num_threads()
    common = ["generate", "abc", "--target", tiny_dirs["target"], "--draft", "ngram", "--max-new-tokens", "16",
              "--json"]
    try:
        outs = []
        for threads in ("1", "3"):
            assert main(common + ["--threads", threads]) == 0
            assert torch.get_num_threads() == int(threads)
            outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    finally:
        torch.set_num_threads(before)
    assert outs[0] == outs[1]
