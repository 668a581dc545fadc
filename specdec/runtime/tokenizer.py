"""The tokenizer of a saved model directory without importing transformers: Hugging Face `tokenizers` for the
vocabulary, jinja2 for the chat template (rendered as transformers renders it: a sandbox, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`). It offers the part of transformers' tokenizer API specdec's
generation path uses; a cold `specdec generate` saves about a second and 60 MB with it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..cachedir import remembered_of_file


@dataclass
class Encoding:
    input_ids: list[int]


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend
        path = Path(path)
        self.path = path
        self._tok = Backend.from_file(str(path / "tokenizer.json"))
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = path / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else cfg.get("chat_template")
        self.special = {k: _content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        for k, v in self.special.items():
            setattr(self, k, v)
            setattr(self, f"{k}_id", None if v is None else self._tok.token_to_id(v))
        self._template = None
        self._plain_box = [None]  # the backend that reads special tokens' text as text (_plain), once made

    def __deepcopy__(self, memo) -> Tokenizer:
        """An independent copy (the server encodes on request threads with one); its chat template is compiled again
        at first use (a compiled jinja Template cannot be copied). The vocabulary itself is shared: this wrapper only
        ever calls the backend's read-only methods (encode, decode, lookups; never truncation or padding, which
        mutate it and make a shared transformers tokenizer unsafe), which any number of threads may run at once.
        Copying it would cost a serialisation round trip (0.3 s at start for a 152k vocabulary)."""
        import copy
        new = object.__new__(Tokenizer)
        for k, v in vars(self).items():
            shared = k in ("_tok", "_plain_box")
            setattr(new, k, None if k == "_template" else v if shared else copy.deepcopy(v, memo))
        return new

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> Encoding:
        """`split_special_tokens`: a special token's text (`<|fim_middle|>` in a user's file) is plain text, as
        transformers' flag of that name does."""
        # encode_batch releases the GIL while it works (encode holds it: a long prompt stalled every other thread)
        backend = self._plain() if split_special_tokens else self._tok
        return Encoding(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def _plain(self):
        """A second backend that reads special tokens' text as text, made once and shared by the copies (the
        setting is the backend's own: flipping it on the shared one would race with other threads)."""
        if self._plain_box[0] is None:
            from tokenizers import Tokenizer as Backend
            plain = Backend.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_box[0] = plain
        return self._plain_box[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens).input_ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """One token's id (None if the vocabulary lacks it), without building get_vocab()'s dict: a 152k
        vocabulary's costs about 40 MB that the allocator keeps after it is freed."""
        return self._tok.token_to_id(token)

    def longest_token_chars(self) -> int:
        """Characters of the longest token, as a token string or decoded: one token at a time, so no vocabulary
        dict is ever built (see token_to_id); remembered by tokenizer.json's identity (0.15 s for 152k tokens)."""
        def measure(_) -> int:
            longest = max(range(len(self)), key=lambda i: len(self._tok.id_to_token(i) or ""))
            return max(len(self._tok.id_to_token(longest) or ""), len(self.decode([longest])), 1)
        return remembered_of_file(self.path / "tokenizer.json", "tokenizer-facts", "longest_token_chars", measure, int)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False, **kw):
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{**{k: v for k, v in self.special.items() if v is not None}, **kw})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _content(token):
    return token.get("content") if isinstance(token, dict) else token


def compile_template(text: str):
    """A chat template compiled as transformers compiles it (jinja2's TemplateSyntaxError if it is not one)."""
    return _environment().from_string(text)


def _environment():
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env


def has_files(path: Path) -> bool:
    return (Path(path) / "tokenizer.json").is_file() and (Path(path) / "tokenizer_config.json").is_file()
