"""A request in the batch: its tokens, its slot's progress (`fed`), its drafter's and sampler's state."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..drafters.prediction import PredictionDrafter
from ..engine import StopCheck
from ..sampling import SamplingParams


@dataclass
class Sequence:
    """One request in the batch: its tokens, its slot, its drafter, its randomness and acceptance estimates."""
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop: StopCheck | None = None
    max_tau: int = 8  # the most draft rows it may get per cycle
    fixed_tau: bool = False  # a fixed-τ request drafts exactly max_tau whenever the budget allows
    constraint: object = None  # constraints.Constraint: a grammar the output follows (structured outputs)
    logprobs: int | None = None  # report the emitted tokens' logprobs and this many alternatives
    prompt_logprobs: int | None = None  # report the prompt's too (every prefill row's logits; max_new_tokens may be 0)
    prediction: list[int] | None = None  # a predicted output's tokens: drafted first (drafters/prediction.py)
    cache_salt: bytes = b""  # its tenant: prompts are cached, found and shared only within one tenant
    id: int = field(default_factory=itertools.count().__next__)
    finish_reason: str | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.fed = 0  # positions of `tokens` already in the KV slot
        self.cycle = 0
        self.idle = 0  # cycles in a row it could have drafted and got no rows
        self.generator = self.params.generator()
        self.scored: list = []  # prompt logprobs so far
        self.predicted = PredictionDrafter(self.prediction) if self.prediction and self.constraint is None else None
        self.after: int | None = None  # waits for this request's prefill of the same prompt, then copies its K/V
        self.preempted = False  # its blocks were taken back: it waits for memory, then recomputes its tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        return len(self.tokens) - self.fed > 1 and not self.preempted
