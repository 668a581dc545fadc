"""Prompt sets written for this project (conversational questions, code completion, summarising a given text), and
how a prompt becomes the target's token ids (`encode_prompt`)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidRequest, PromptTooLong, SpecDecError

HERE = Path(__file__).parent
SETS = ("chat", "code", "summarize")


def load_prompts(path=None, fim: bool = False) -> list[dict]:
    """Read a JSONL file of {"prompt": str, "mode": "chat"|"completion", "max_new_tokens": int (optional: the
    length `specdec distill` answers it at)} (extra fields ignored). With `fim` (`specdec distill`'s files), also
    {"prompt": prefix, "suffix": str, "mode": "fim"}: code to fill in between the two (`prompt_ids`).
    With no path: all shipped sets."""
    files = [Path(path)] if path else [HERE / f"{name}.jsonl" for name in SETS]
    out = []
    for f in files:
        try:
            lines = f.read_text().splitlines()
        except OSError as e:
            raise SpecDecError(f"cannot read prompts file {f}: {e.strerror}")
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise SpecDecError(f"{f}:{i}: not valid JSON")
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise SpecDecError(f"{f}:{i}: each line needs a non-empty string field 'prompt'")
            mode = obj.get("mode", "chat")
            if mode not in ("chat", "completion", *(("fim",) if fim else ())):
                raise SpecDecError(f"{f}:{i}: mode must be 'chat' or 'completion'{' or fim' if fim else ''}, "
                                   f"got {mode!r}")
            if mode == "fim" and not isinstance(obj.get("suffix"), str):
                raise SpecDecError(f"{f}:{i}: a fim prompt needs a string field 'suffix' (the code after the gap)")
            limit = obj.get("max_new_tokens")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise SpecDecError(f"{f}:{i}: max_new_tokens must be a positive integer, got {limit!r}")
            out.append({"prompt": obj["prompt"], "chat": mode == "chat", **({"max_new_tokens": limit} if limit else {}),
                        **({"suffix": obj["suffix"]} if mode == "fim" else {})})
    if not out:
        raise SpecDecError(f"no prompts in {path}")
    return out


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    """A loaded prompt (load_prompts) -> the target's prompt ids: the fill-in-the-middle prompt for a fim one
    (fim.fim_prompt: what /infill sends the model), else encode_prompt's."""
    if "suffix" in prompt:
        from ..fim import fim_prompt
        return fim_prompt(tokenizer, prompt["prompt"], prompt["suffix"])
    return encode_prompt(tokenizer, prompt["prompt"], prompt["chat"])


# what a template is rendered with by specdec itself, which a request's chat_template_kwargs may not replace
RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt")
MAX_TEMPLATE_VARS = 64


def read_chat_template(value: str) -> str:
    """`--chat-template`: a Jinja file's path, or the template's text itself (vLLM's convention) -> the text; a
    missing file or a template that does not compile is refused in one line."""
    from ..runtime.tokenizer import compile_template
    text = value
    if "{{" not in value and "{%" not in value:  # not a template: a path
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as e:
            raise SpecDecError(f"cannot read the chat template {value}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SpecDecError(f"the chat template {value} is not UTF-8 text") from None
    try:
        compile_template(text)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateSyntaxError and the like
        raise SpecDecError(f"the chat template does not compile: {e}") from None
    return text


def use_chat_template(tokenizer, text: str) -> None:
    """Render chat prompts with `text` in place of the template the model's files carry (transformers' tokenizers
    and the runtime's alike read `chat_template`)."""
    tokenizer.chat_template = text
    if hasattr(tokenizer, "_template"):  # the runtime's wrapper compiles it at first use
        tokenizer._template = None


def template_kwargs(kwargs) -> dict:
    """A request's chat_template_kwargs (vLLM's and llama-server's: variables the template reads, such as
    `enable_thinking`), checked: an object of at most MAX_TEMPLATE_VARS names, none of RESERVED_TEMPLATE_VARS."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise InvalidRequest("chat_template_kwargs must be an object whose keys are template variable names")
    if len(kwargs) > MAX_TEMPLATE_VARS:
        raise InvalidRequest(f"chat_template_kwargs has {len(kwargs)} variables; at most {MAX_TEMPLATE_VARS}")
    taken = [k for k in kwargs if k in RESERVED_TEMPLATE_VARS]
    if taken:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields set "
                             f"them)")
    return dict(kwargs)


def encode_prompt(tokenizer, prompt, chat: bool = True, context_window: int | None = None,
                  max_token_chars: int | None = None, tools: list[dict] | None = None,
                  variables: dict | None = None) -> list[int]:
    """A string or a list of {role, content} messages -> prompt token ids, as `generate` prompts the target (chat
    template unless chat=False); PromptTooLong at or past `context_window`. With `max_token_chars` (the longest
    token's text), a prompt too long to fit whatever its tokens is refused before it is tokenized. `tools`: OpenAI
    tools for a chat template that describes them itself (server/tools.py, `native`). `variables`: more variables
    for the template (a request's chat_template_kwargs, checked by template_kwargs)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in messages):
        raise InvalidRequest("prompt must be a non-empty string or a list of {role, content} messages")
    if not any(m["content"].strip() for m in messages):
        raise InvalidRequest("prompt is empty")
    for m in messages:
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("prompt is not valid Unicode text (a lone surrogate such as \\ud800)") from None
    chars = sum(len(m["content"]) for m in messages)
    if context_window is not None and max_token_chars and chars >= context_window * max_token_chars:
        raise PromptTooLong(f"prompt is {chars} characters, more than {context_window} tokens of at most "
                            f"{max_token_chars} characters each: it cannot fit the target's context window")
    extra = template_kwargs(variables)
    if chat and tokenizer.chat_template:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **extra, **({"tools": tools} if tools else {}))
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception ("roles must alternate") and the like
            raise InvalidRequest(f"the chat template refused these messages: {e}") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages)).input_ids
    if context_window is not None and len(ids) >= context_window:
        raise PromptTooLong(f"prompt is {len(ids)} tokens; the target's context window is {context_window}")
    return ids
