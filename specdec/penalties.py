"""OpenAI's presence and frequency penalties and logit_bias, and vLLM's repetition_penalty: each row of the target's
logits adjusted by what the request has generated so far, before temperature, min-p, top-k and top-p (sampling.warp)
or the argmax.

For every token v that was generated c_v > 0 times, has a bias b_v or, with a repetition penalty r != 1, occurs in
the prompt or the output (the presence and frequency penalties count the output only, as OpenAI's; the repetition
penalty both, as vLLM's and transformers', or only their last `window` tokens, as llama.cpp's `repeat_last_n`), in
float64 and rounded to float32 once:

    l = logit[v];  if seen and r != 1: l = l / r if l > 0 else l * r
    logit[v] = float32(l + (b_v - c_v * frequency_penalty - [c_v > 0] * presence_penalty))

With speculation each verify row is adjusted with the counts after the draft tokens before it, then chosen as
target-only would choose from it (verification.verify_constrained, the path a grammar takes), so the output is the
adjusted target-only output: greedy token for token, seeded sampling text for text. A model draft adjusts its own
rows alike (SamplingParams.penalties, drafters/model.py); other drafters propose as they would: a penalty may cost
acceptance, never correctness.
"""
from __future__ import annotations

import copy
import math

import torch

from .errors import InvalidRequest

MAX_PENALTY = 2.0  # OpenAI's range for both penalties: [-2, 2]
MAX_BIAS = 100.0  # and for a bias: [-100, 100]; -100 bans a token, +100 all but forces it
MAX_BIASES = 1024  # entries in one request's logit_bias
MAX_REPETITION = 2.0  # vLLM's range for repetition_penalty: (0, 2]


class Penalties:
    """One request's penalties and biases over the tokens it has committed (the Constraint protocol of
    constraints.py: `masked` adjusts a row, `accept` commits a token)."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0, bias: dict[int, float] | None = None,
                 repetition: float = 1.0, prompt=(), window: int | None = None):
        self.presence, self.frequency, self.bias = float(presence), float(frequency), dict(bias or {})
        self.repetition, self.window = float(repetition), window
        self.prompt = frozenset(prompt) if self.repetition != 1.0 and window is None else frozenset()  # seen before
        self.recent = list(prompt)[-window:] if window else []  # a window's context: its last `window` tokens
        self.start = len(prompt)  # where the output begins in a context
        self.counts: dict[int, int] = {}

    def after(self, context: list[int]) -> Penalties:
        """A copy whose counts are those of `context`'s output (a draft's view: its context may run past what the
        request committed, with forced or copied tokens)."""
        view = copy.copy(self)
        view.counts = {}
        for t in context[self.start:]:
            view.counts[t] = view.counts.get(t, 0) + 1
        view.recent = list(context[-self.window:]) if self.window else []
        return view

    def _seen(self) -> set[int] | frozenset[int]:
        """The tokens the repetition penalty lowers, beside the output's (all of it, without a window)."""
        return set(self.recent) if self.window else self.prompt

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits, adjusted (the rule above)."""
        row = logits.float().clone()
        before = self._seen()
        ids = sorted(set(self.counts) | set(self.bias) | before)
        if ids:
            at = torch.tensor(ids)
            value = row[at].double()
            if self.repetition != 1.0:  # seen: in the window, else in the prompt or the output
                seen = torch.tensor([v in before if self.window else v in self.counts or v in before for v in ids])
                value = torch.where(seen, torch.where(value > 0, value / self.repetition, value * self.repetition),
                                    value)
            delta = torch.tensor([self.bias.get(v, 0.0) - self.counts.get(v, 0) * self.frequency
                                  - (self.presence if v in self.counts else 0.0) for v in ids], dtype=torch.float64)
            row[at] = (value + delta).float()
        return row

    def accept(self, token: int) -> bool:
        self.counts[int(token)] = self.counts.get(int(token), 0) + 1
        if self.window:
            self.recent = (self.recent + [int(token)])[-self.window:]
        return True

    def valid_prefix(self, tokens: list[int]) -> int:
        return len(tokens)  # any token may come next

    def forced(self, limit: int) -> list[int]:
        return []


class Adjusted:
    """A grammar (constraints.Constraint) and penalties together: the row adjusted, then masked, so a token the
    grammar forbids stays at -inf whatever its bias."""

    def __init__(self, grammar, penalties: Penalties):
        self.grammar, self.penalties = grammar, penalties

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        return self.grammar.masked(self.penalties.masked(logits))

    def accept(self, token: int) -> bool:
        self.penalties.accept(token)
        return self.grammar.accept(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        return self.grammar.valid_prefix(tokens)

    def forced(self, limit: int) -> list[int]:
        return self.grammar.forced(limit)


def penalties(vocab_size: int | None, presence: float = 0.0, frequency: float = 0.0, logit_bias=None,
              repetition: float = 1.0, prompt=(), repetition_window: int | None = None) -> Penalties | None:
    """A request's Penalties from OpenAI's fields (logit_bias: {"token id": bias}) and vLLM's repetition_penalty
    (over `prompt`, its token ids, and the output; or their last `repetition_window` tokens, llama.cpp's
    repeat_last_n), or None where none applies; InvalidRequest for a value out of range or a token id outside the
    vocabulary (vocab_size None: any id)."""
    if repetition_window is not None and (isinstance(repetition_window, bool) or not isinstance(
            repetition_window, int) or repetition_window < 1):
        raise InvalidRequest("the repetition penalty's window must be an integer >= 1 (None: the whole context)")
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not _number(value) or abs(value) > MAX_PENALTY:
            raise InvalidRequest(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
    if not _number(repetition) or not 0 < repetition <= MAX_REPETITION:
        raise InvalidRequest(f"repetition_penalty must be a number in (0, {MAX_REPETITION:g}] (1: none)")
    bias = _bias(vocab_size, logit_bias)
    if not presence and not frequency and not any(bias.values()) and repetition == 1:
        return None
    return Penalties(presence, frequency, {v: b for v, b in bias.items() if b}, repetition, prompt,
                     repetition_window if repetition != 1 else None)


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _bias(vocab_size: int | None, raw) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest('logit_bias must be an object of token ids to biases, e.g. {"1234": -100}')
    if len(raw) > MAX_BIASES:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_BIASES} tokens")
    out = {}
    for key, value in raw.items():
        token = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12) else -1
        if token < 0 or vocab_size is not None and token >= vocab_size:
            raise InvalidRequest(f"logit_bias: {str(key)[:40]!r} is not a token id" + (
                "" if vocab_size is None else f" of this model (0..{vocab_size - 1})"))
        if not _number(value) or abs(value) > MAX_BIAS:
            raise InvalidRequest(f"logit_bias: the bias of token {token} must be a number in "
                                 f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        out[token] = float(value)
    return out
