"""OpenAI-compatible request bodies, validated by pydantic. Unknown fields are refused (extra="forbid") so a
client never silently gets a different behaviour than it asked for."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..api import MAX_STOP_CHARS, MAX_STOPS
from ..sampling import MAX_TEMPERATURE, SEED_RANGE


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # extensions: top_k, tau, policy
    tau: int | None = Field(default=None, ge=1, le=64)
    policy: Literal["fixed", "heuristic", "adaptive"] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-SEED_RANGE // 2, lt=SEED_RANGE)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS or not all(stops) or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                             "characters")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1, lt=2**31)  # OpenAI's default for completions
