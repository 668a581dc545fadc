"""What every phase of `specdec distill` shares: its console, its progress bar, its default prompt sets."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from time import monotonic, perf_counter

from rich.console import Console
from rich.progress import Progress

from ..prompts import HERE as PROMPT_DIR

console = Console(stderr=True)


# templated, cut from the standard library, programming questions (templated: concepts, comparisons, small tasks),
# code to complete (templated: function and class heads in seven languages). A later set goes last: a resumed run
# keeps the answers to the sets before it.
DEFAULT_PROMPTS = [PROMPT_DIR / "distill.jsonl", PROMPT_DIR / "distill_stdlib.jsonl",
                   PROMPT_DIR / "distill_code_chat.jsonl", PROMPT_DIR / "distill_code_completion.jsonl"]


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


class Ledger:
    """Each phase's wall time over every run that worked on it, in WORK/seconds.json: a run in budgeted chunks, or
    one resumed after a crash, still reports what the whole took (its own run's seconds are the report's
    `seconds`)."""

    def __init__(self, path: Path):
        self.path = path
        self.totals: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    @contextmanager
    def phase(self, name: str):
        t0 = perf_counter()  # (not the budget's clock)
        try:
            yield
        finally:  # also when the budget ran out: that chunk's time was spent on this phase
            self.totals[name] = round(self.totals.get(name, 0.0) + perf_counter() - t0, 3)
            self.path.write_text(json.dumps(self.totals))
