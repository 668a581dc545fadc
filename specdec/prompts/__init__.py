"""Prompt sets written for this project: conversational questions, code completion, summarising a given text."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecDecError

HERE = Path(__file__).parent
SETS = ("chat", "code", "summarize")


def load_prompts(path=None) -> list[dict]:
    """Read a JSONL file of {"prompt": str, "mode": "chat"|"completion"} (extra fields ignored).
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
            if mode not in ("chat", "completion"):
                raise SpecDecError(f"{f}:{i}: mode must be 'chat' or 'completion', got {mode!r}")
            out.append({"prompt": obj["prompt"], "chat": mode == "chat"})
    if not out:
        raise SpecDecError(f"no prompts in {path}")
    return out
