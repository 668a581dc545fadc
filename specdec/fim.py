"""Fill-in-the-middle: the prompt for code between a prefix and a suffix, as code models were trained on it
(prefix-suffix-middle order), with other files of the repository before it when the tokenizer has the tokens.

Qwen2.5-Coder: <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, <|file_sep|>, <|repo_name|>; StarCoder-style
tokenizers: the same names without the bars. A tokenizer with neither has no FIM: a clear error, never a prompt the
model was not trained on. The prefix and suffix are in the context, so the n-gram drafter drafts from them.
"""
from __future__ import annotations

from .errors import InvalidRequest

STYLES = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>"),
          ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<repo_name>")]


def fim_tokens(tok) -> dict | None:
    """{"prefix", "suffix", "middle", "file_sep", "repo_name"} -> token id (the last two may be None), or None when
    the tokenizer has no FIM tokens. Looked up once per tokenizer."""
    if not hasattr(tok, "_specdec_fim"):
        vocab = tok.get_vocab()
        found = None
        for names in STYLES:
            ids = [vocab.get(n) for n in names]
            if all(i is not None for i in ids[:3]):
                found = dict(zip(("prefix", "suffix", "middle", "file_sep", "repo_name"), ids))
                break
        tok._specdec_fim = found
    return tok._specdec_fim


def fim_prompt(tok, prefix: str, suffix: str, files: list[tuple[str, str]] = (), repo: str | None = None,
               lock=None) -> list[int]:
    """Token ids of the FIM prompt; `files`: (name, text) of other files, before it (needs the file separator).
    InvalidRequest when the model has no FIM tokens."""
    t = fim_tokens(tok)
    if t is None:
        raise InvalidRequest("this model has no fill-in-the-middle tokens (<|fim_prefix|> or <fim_prefix>); "
                             "send a plain completion instead")
    if files and t["file_sep"] is None:
        raise InvalidRequest("this model has no file separator token: it cannot take other files as context")

    def enc(text: str) -> list[int]:  # the user's text as text: a special token's name in it is not that token
        if not text:
            return []
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the fill-in-the-middle text is not valid Unicode (a lone surrogate)") from None
        return tok(text, add_special_tokens=False, split_special_tokens=True).input_ids
    if lock is not None:
        with lock:
            return _assemble(t, enc, prefix, suffix, files, repo)
    return _assemble(t, enc, prefix, suffix, files, repo)


def _assemble(t, enc, prefix, suffix, files, repo) -> list[int]:
    ids = []
    if repo and files and t["repo_name"] is not None:
        ids += [t["repo_name"]] + enc(repo + "\n")
    for name, text in files:
        ids += [t["file_sep"]] + enc(f"{name}\n{text}\n")
    if files:
        ids.append(t["file_sep"])
    return ids + [t["prefix"]] + enc(prefix) + [t["suffix"]] + enc(suffix) + [t["middle"]]
