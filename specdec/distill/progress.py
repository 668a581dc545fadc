"""What every phase of `specdec distill` shares: its console, its progress bar, its default prompt sets."""
from __future__ import annotations

from time import monotonic

from rich.console import Console
from rich.progress import Progress

from ..prompts import HERE as PROMPT_DIR

console = Console(stderr=True)


DEFAULT_PROMPTS = [PROMPT_DIR / "distill.jsonl", PROMPT_DIR / "distill_stdlib.jsonl"]  # templated + stdlib-cut


def _progress():
    return Progress(console=console, transient=False)


class BudgetSpent(Exception):
    """`--budget-minutes` ran out: what was done is stored, and the same command goes on from there."""


class Budget:
    """A deadline every phase checks between its units of work (a batch generated, a sequence labelled, a training
    step), so a long distill runs in chunks of a fixed wall time."""

    def __init__(self, minutes: float | None = None):
        self.deadline = None if not minutes else monotonic() + 60 * minutes

    def spent(self) -> bool:
        return self.deadline is not None and monotonic() >= self.deadline

    def check(self, phase: str) -> None:
        if self.spent():
            raise BudgetSpent(phase)
