"""Structured outputs: a grammar (any JSON value, a JSON schema, or a GBNF grammar) decides which tokens may come next, and the
target chooses among those only. llguidance computes the token mask (0.013 ms, and 0.044 ms to apply it to a row of
the default model's 49k logits, here) and needs nothing beside it; xgrammar, the other engine made for this, pulls
in triton (1 GB) on a CPU-only install.

With speculation (verification.verify_constrained):
- each verify row is masked with the grammar's state after the draft tokens before it, so the output is exactly the
  constrained target-only output, greedy or sampled;
- a draft is cut at the first token the grammar forbids, before the pass (no row spent on it);
- the tokens the grammar forces (llguidance's fast-forward tokens: keys, punctuation, the rest of an enum value
  once it is unambiguous) are drafted for free, ahead of the drafter's own proposal.

A thinking model's grammar waits for its reasoning (`after_thinking`, as vLLM applies structured outputs after the
reasoning): the answer may open with `<think>` (or starts inside one the prompt opened), any text runs up to the
first `</think>`, and the grammar applies from the first non-space character after it.
"""
from __future__ import annotations

import json
from functools import cached_property

import torch

from .errors import InvalidRequest
from .thinking import CLOSE as THINK_CLOSE
from .thinking import OPEN as THINK_OPEN
from .thinking import opens_inside, thinks


class Grammars:
    """Grammar support for one tokenizer: its vocabulary as llguidance reads it, built once at first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)

    @cached_property
    def lltokenizer(self):
        try:
            import llguidance
        except ImportError:
            raise InvalidRequest("structured outputs need llguidance: pip install 'specdec[server]'")
        tok = self.tokenizer
        backend = tok._tok if hasattr(tok, "_tok") else tok.backend_tokenizer  # tokenizers' own object
        try:
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
        except ValueError as e:  # a tokenizer llguidance cannot read (e.g. no byte-level decoder)
            raise InvalidRequest(f"structured outputs are not available for this model's tokenizer: {e}")

    def constraint(self, response_format: dict | None) -> Constraint | None:
        """OpenAI's response_format -> a Constraint (None for text); {"type": "gbnf", "grammar": text} is llama.cpp's
        grammar format (what llama-server's `grammar` field takes), {"type": "lark", ...} llguidance's, and
        {"type": "after_thinking", "inside": bool, "format": {...}} another format applied after a thinking model's
        reasoning (the server's own: never from a client, whose response_format schemas.py checks). InvalidRequest
        for what cannot be compiled."""
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "after_thinking":
            grammar, what = self._grammar(response_format["format"])
            return self._compiled(after_thinking(grammar, response_format["inside"]), what)
        return self._compiled(*self._grammar(response_format))

    def _grammar(self, response_format: dict) -> tuple[str, str]:
        """A format's llguidance grammar (Lark text or a JSON TopLevelGrammar) and what to call it in an error."""
        import llguidance
        kind = response_format.get("type")
        if kind == "gbnf":  # llama.cpp's grammar format (llama-server's `grammar` field), through llguidance's Lark
            return self._gbnf(response_format.get("grammar")), "grammar"
        if kind == "lark":  # llguidance's own (server/tools.py: a call in its chat template's tags)
            return llguidance.LLMatcher.grammar_from_lark(response_format["grammar"]), "the grammar"
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object")
        else:
            raise InvalidRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                     defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"response_format: not a JSON schema: {str(e)[:200]}")
        return grammar, "response_format: this schema"

    @staticmethod
    def _gbnf(text) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("grammar must be a non-empty GBNF grammar (llama.cpp's format)")
        try:
            return LLMatcher.grammar_from_lark(gbnf_to_lark(text))
        except Exception as e:  # noqa: BLE001 - the converter raises its own errors and ValueError alike
            raise InvalidRequest(f"grammar: not a GBNF grammar: {str(e).splitlines()[0][:200] if str(e) else e!r}")

    def _compiled(self, grammar: str, what: str) -> Constraint:
        import llguidance
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{what} cannot be used: {matcher.get_error()[:200]}")
        return Constraint(matcher, self.vocab_size)


def writes_tags(response_format: dict | None) -> bool:
    """Whether a format writes thinking tags itself (a GBNF or Lark grammar naming them): applied from the first
    token, never after the reasoning."""
    grammar = (response_format or {}).get("grammar")
    return isinstance(grammar, str) and (THINK_OPEN in grammar or THINK_CLOSE in grammar)


def waiting_for_reasoning(tokenizer, prompt_ids: list[int], response_format: dict | None) -> dict | None:
    """A chat prompt's format as it applies: after the reasoning where the template thinks (and the format does not
    write the tags itself), else as it is."""
    if response_format is None or response_format.get("type", "text") in ("text", "after_thinking") or \
            not thinks(tokenizer) or writes_tags(response_format):
        return response_format
    return {"type": "after_thinking", "inside": opens_inside(tokenizer, prompt_ids), "format": response_format}


def after_thinking(grammar: str, inside: bool) -> str:
    """`grammar` (Lark text or a JSON TopLevelGrammar of one grammar) as the answer after a reasoning: `inside` (the
    prompt opened <think>) the text up to the first </think> is free; else the answer may open with <think> and
    such a block. The reasoning is one lexeme, text that ends with its only </think> (a lazy lexeme took 1.9 s for
    its first mask here); whitespace may follow it."""
    try:
        top = json.loads(grammar)
        answer = {**top["grammars"][0], "name": "answer"}
    except ValueError:  # Lark text
        answer = {"name": "answer", "lark_grammar": grammar}
    lark = ('start: REASONING GAP @answer\n' if inside else f'start: ("{THINK_OPEN}" REASONING GAP)? @answer\n') + \
        'REASONING: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/\nGAP: /[ \\t\\r\\n]*/\n'
    return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": lark}, answer]})


class Constraint:
    """One request's grammar state (an llguidance matcher) over the tokens committed so far."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.torch as llt
        self.matcher, self.vocab_size, self._llt = matcher, vocab_size, llt
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits with every token the grammar forbids now at -inf."""
        self._llt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        row = logits.float().clone()[None]
        self._llt.apply_token_bitmask_inplace(row, self._bitmask)
        return row[0]

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(int(token)))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows in order (nothing is consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces from here, at most `limit`."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
