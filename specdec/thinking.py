"""Thinking models' tags (Qwen3, QwQ, DeepSeek-R1 and its distills): whether a chat template writes them, and
whether a prompt leaves the answer inside one. What reads them: server/reasoning.py (the reasoning apart from the
answer) and constraints.after_thinking (a grammar that waits for the reasoning)."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(tokenizer) -> bool:
    """Whether the chat template writes thinking tags (its answers may carry reasoning)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and OPEN in template and CLOSE in template


def opens_inside(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends with an open `<think>` (the answer starts as reasoning)."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(OPEN)
