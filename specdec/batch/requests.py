"""A request in the batch: its tokens, its slot's progress (`fed`), its drafter's and sampler's state, and its life
cycle. Every change of state goes through one of Sequence's transition methods below, each of which says what
happens to the request's blocks, `fed`, its scored prompt logprobs and its streamed output:

    waiting ──join──> waiting_for_twin ──release──> prefilling ──advance──> decoding ──emit──> decoding
       │                    │                          │  ▲                     │
       └──join──> prefilling / decoding                preempt──> preempted ──resume──┘
    any state in the batch ──finish──> finished

A request's output is a function of its tokens alone (the runtime is row-invariant; sampling draws per-position
noise), so a preempted request recomputes its K/V and goes on: it never re-sends text or logprobs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from ..drafters.prediction import PRIOR, PredictionDrafter
from ..engine import StopCheck
from ..sampling import SamplingParams


class State(str, Enum):
    WAITING = "waiting"  # not in the batch yet (the worker's queue); holds nothing
    WAITING_FOR_TWIN = "waiting_for_twin"  # in the batch behind a request prefilling the same prompt; holds a slot only
    PREFILLING = "prefilling"  # its tokens' K/V are being computed, a chunk a pass; emits nothing
    DECODING = "decoding"  # all but its newest token are in its slot; each cycle verifies drafts and emits
    PREEMPTED = "preempted"  # its blocks were taken back; waits for memory, then recomputes its tokens
    FINISHED = "finished"  # left the batch (stop, length, cancel, error); its slot is free


MOVES = {  # the transitions a request may make
    State.WAITING: {State.WAITING_FOR_TWIN, State.PREFILLING, State.DECODING},
    State.WAITING_FOR_TWIN: {State.PREFILLING, State.DECODING, State.PREEMPTED, State.FINISHED},
    State.PREFILLING: {State.PREFILLING, State.DECODING, State.PREEMPTED, State.FINISHED},
    State.DECODING: {State.DECODING, State.PREEMPTED, State.FINISHED},
    State.PREEMPTED: {State.PREFILLING, State.DECODING, State.FINISHED},
    State.FINISHED: set(),
}


class BadTransition(RuntimeError):
    """A transition the life cycle does not allow: a bug in the engine, never a request's fault."""


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
    prediction_prior: float = PRIOR  # its acceptance assumed before any verification (a quoted block's: lower)
    cache_salt: bytes = b""  # its tenant: prompts are cached, found and shared only within one tenant
    id: int = field(default_factory=itertools.count().__next__)
    finish_reason: str | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.fed = 0  # positions of `tokens` already in the KV slot
        self.cached = 0  # prompt positions it found computed when it joined (the prefix cache's, or its twin's)
        self.cycle = 0
        self.idle = 0  # cycles in a row it could have drafted and got no rows
        self.generator = self.params.generator()
        self.scored: list = []  # prompt logprobs so far
        self.predicted = PredictionDrafter(self.prediction, len(self.prompt), self.prediction_prior) \
            if self.prediction and self.constraint is None else None
        self.joined = False  # in the batch (join)
        self.after: int | None = None  # waits for this request's prefill of the same prompt, then copies its K/V
        self.preempted = False  # its blocks were taken back: it waits for memory, then recomputes its tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    # ---- the life cycle ------------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        if self.finish_reason is not None:
            return State.FINISHED
        if not self.joined:
            return State.WAITING
        if self.preempted:
            return State.PREEMPTED
        if self.after is not None:
            return State.WAITING_FOR_TWIN
        return State.PREFILLING if len(self.tokens) - self.fed > 1 else State.DECODING

    @property
    def prefilling(self) -> bool:
        """Its K/V are still to compute (prefilling, or waiting for a twin's): no draft rows for it yet."""
        return self.state in (State.PREFILLING, State.WAITING_FOR_TWIN)

    def _move(self, name: str, change, *sources: State) -> None:
        """Apply `change` if the request is in one of `sources` (checked before anything changes), and check that
        where it lands is a transition from there."""
        before = self.state
        if before not in sources:
            raise BadTransition(f"request {self.id}: {name} in state {before.value}")
        change()
        if self.state not in MOVES[before]:
            raise BadTransition(f"request {self.id}: {before.value} -> {self.state.value} is not a transition")

    def join(self, fed: int, twin: int | None = None) -> None:
        """waiting -> in the batch. With a twin (a request prefilling the same prompt): waiting_for_twin, holding its
        slot and no blocks. Else its slot holds the cached prefix (`fed` positions) and blocks reserved for all its
        tokens: prefilling, or decoding when only the last prompt token is left to feed."""
        def change():
            self.joined, self.fed, self.after = True, 0 if twin is not None else fed, twin
            self.cached = self.fed
        self._move("join", change, State.WAITING)

    def release(self, fed: int) -> None:
        """waiting_for_twin -> prefilling / decoding: its slot holds `fed` positions (the cache's blocks and those
        copied from its twin, bitwise what its own prefill would write) and blocks reserved for the rest."""
        def change():
            self.after, self.fed, self.cached = None, fed, fed
        self._move("release", change, State.WAITING_FOR_TWIN)

    def advance(self, rows: int) -> None:
        """prefilling: a chunk of `rows` positions was written by a pass."""
        def change():
            self.fed += rows
        self._move("advance", change, State.PREFILLING)

    def emit(self, tokens: list[int]) -> None:
        """decoding: verified tokens join the output (streamed by the caller, once); the committed prefix stays in
        the slot and the newest token is fed next cycle (the caller returns rejected drafts' blocks)."""
        def change():
            self.tokens.extend(tokens)
            self.fed = len(self.tokens) - 1
        self._move("emit", change, State.PREFILLING, State.DECODING)

    def preempt(self) -> None:
        """-> preempted: its blocks were freed (by the caller); fed = 0. Its tokens and what was streamed stay: they
        are recomputed, never re-sent. A prompt being scored (prompt logprobs, first cycle) is scored again from its
        first token, so what it had scored goes; logprobs already emitted stay with their tokens."""
        def change():
            self.fed, self.after, self.preempted = 0, None, True
            if self.cycle == 0:
                self.scored = []
        self._move("preempt", change, State.WAITING_FOR_TWIN, State.PREFILLING, State.DECODING)

    def resume(self, fed: int) -> None:
        """preempted -> prefilling / decoding: memory was found; its slot holds `fed` cached positions and blocks
        reserved for all its tokens, which it recomputes without emitting (its next token comes after them)."""
        def change():
            self.preempted, self.fed = False, fed
        self._move("resume", change, State.PREEMPTED)

    def finish(self, reason: str) -> None:
        """-> finished ("stop", "length", "error", ...): the caller frees its slot and drafter."""
        def change():
            self.finish_reason = reason
        self._move("finish", change, State.WAITING_FOR_TWIN, State.PREFILLING, State.DECODING, State.PREEMPTED)
