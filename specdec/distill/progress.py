"""What every phase of `specdec distill` shares: its console, its progress bar, its default prompt sets."""
from __future__ import annotations

from rich.console import Console
from rich.progress import Progress

from ..prompts import HERE as PROMPT_DIR

console = Console(stderr=True)


DEFAULT_PROMPTS = [PROMPT_DIR / "distill.jsonl", PROMPT_DIR / "distill_stdlib.jsonl"]  # templated + stdlib-cut


def _progress():
    return Progress(console=console, transient=False)
