"""OpenAI-compatible request bodies, validated by pydantic. Unknown fields are refused (extra="forbid") so a
client never silently gets a different behaviour than it asked for."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..api import MAX_STOP_CHARS, MAX_STOPS
from ..constraints import writes_tags
from ..penalties import MAX_PENALTY, MAX_REPETITION
from ..sampling import MAX_TEMPERATURE, SEED_RANGE
from . import tools

# Sent by SDK helpers and gateways; they change no output of this server, so they are accepted and ignored.
IGNORED = ("store", "metadata", "service_tier", "user", "parallel_tool_calls", "modalities", "safety_identifier")


MAX_PROMPTS = 16  # sequences one request may start (prompts x n): each takes a place in the queue


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """{"type": "content", "content": text or [{"type": "text", "text": ...}, ...]}, as OpenAI takes it."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**31)  # OpenAI's current name (chat)
    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # extensions: top_k, min_p (vLLM's), tau, policy
    min_p: float = Field(default=0.0, ge=0, le=1)
    tau: int | None = Field(default=None, ge=1, le=64)
    policy: Literal["fixed", "heuristic", "adaptive"] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-SEED_RANGE // 2, lt=SEED_RANGE)
    n: int = Field(default=1, ge=1, le=MAX_PROMPTS)
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, strict=True)  # penalties.py
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, strict=True)
    logit_bias: dict[str, Any] | None = None  # token id -> bias in [-100, 100]: penalties.py checks both
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION, strict=True)  # vLLM's extension
    # accepted, ignored (IGNORED)
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # "none": a thinking template's enable_thinking false (template_variables)
    modalities: list[str] | None = None
    # the tenant whose cached prompts this request may use (vLLM's cache_salt, else OpenAI's prompt_cache_key)
    cache_salt: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = None
    logprobs: bool | int | None = None  # chat: a bool (with top_logprobs); completions: the alternatives wanted
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None  # text, json_object, json_schema (constraints.py)
    grammar: str | None = None  # llama-server's extension: a GBNF grammar
    prediction: Prediction | None = None  # OpenAI's predicted outputs: drafted beside the output, never changing it
    tools: Any = None
    tool_choice: Any = None
    # OpenAI's deprecated function calling: refused by name (_unsupported), tools serve instead
    functions: Any = None
    function_call: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS or not all(stops) or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                             "characters")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        refuse = {
            "tools with response_format": bool(self.tools) and self.response_format is not None,
            "grammar with response_format or tools": self.grammar is not None and (
                self.response_format is not None or bool(self.tools)),
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
        }
        for name, bad in refuse.items():
            if bad:
                raise ValueError(f"{name} is not supported by this server yet (send it unset)")
        if self.tools is not None:
            tools.check(self.tools, self.tool_choice)
        elif self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        rf = self.response_format
        if rf is not None and (rf.get("type") not in ("text", "json_object", "json_schema") or (
                rf.get("type") == "json_schema" and not isinstance((rf.get("json_schema") or {}).get("schema"), dict))):
            raise ValueError("response_format must be {\"type\": \"text\" | \"json_object\"} or {\"type\": "
                             "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report, or None: no logprobs."""
        if isinstance(self, ChatRequest):
            return (self.top_logprobs or 0) if self.logprobs else None
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tenant_salt(self, key_tenant: bytes = b"") -> bytes:
        """The prefix cache's salt for this request: its prompts are cached, found and shared only with requests of
        the same API key (`key_tenant`, when the server has keys) naming the same tenant (`cache_salt`, else
        `prompt_cache_key`); nothing named and no keys: the shared tenant."""
        name = self.cache_salt if self.cache_salt is not None else self.prompt_cache_key
        if not name and not key_tenant:
            return b""
        return hashlib.blake2b(key_tenant + b"|tenant:" + (name or "").encode(), digest_size=16).digest()

    @property
    def grammar_writes_reasoning(self) -> bool:
        """Whether the request's own grammar (llama.cpp's GBNF) writes thinking tags: it then applies from the
        first token, and the answer starts outside any <think> the prompt opened. Every other grammar (structured
        outputs, a forced call) waits for a thinking model's reasoning (constraints.after_thinking)."""
        return writes_tags({"grammar": self.grammar})

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(BaseModel):
    """A chat message as OpenAI's clients send it: content a string or a list of text parts (joined by newlines),
    `developer` as `system`, assistant `tool_calls` and `tool` results passed to the chat template."""
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if not isinstance(v, list):
            return v
        texts = []
        for part in v:
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part type {str(kind)[:40]!r} is not supported (text parts only)"
                                 if kind != "text" else "a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        return self

    def for_template(self) -> dict:
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_tool_call(c) for c in self.tool_calls]
        return out


def _tool_call(call: dict) -> dict:
    """OpenAI's tool call, arguments as a JSON string, in the form chat templates read (arguments as an object
    where the string parses)."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "type": call.get("type", "function"), "function": fn}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and llama-server's: variables for the template
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None  # llama-server's: none keeps <think> in content

    @property
    def template_variables(self) -> dict | None:
        """chat_template_kwargs, with reasoning_effort "none" as enable_thinking false (Qwen3's switch) where they
        do not set it."""
        if self.reasoning_effort != "none" or not isinstance(self.chat_template_kwargs, (dict, type(None))):
            return self.chat_template_kwargs
        return {"enable_thinking": False, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _chat_logprobs(self):
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ValueError("logprobs must be true or false (top_logprobs: how many alternatives)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)  # text or token ids
    max_tokens: int | None = Field(default=16, ge=0, lt=2**31)  # OpenAI's default; 0: score the prompt (echo)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        """-> a list of prompts (text, or token ids as lm-evaluation-harness sends them), each a choice (or n) of
        its own."""
        prompts = [v] if isinstance(v, str) or (v and all(isinstance(t, int) for t in v)) else v
        if not 1 <= len(prompts) <= MAX_PROMPTS or not all(prompts):
            raise ValueError(f"prompt must be a non-empty string or a list of 1..{MAX_PROMPTS} of them")
        return prompts

    @model_validator(mode="after")
    def _completion_only(self):
        if len(self.prompt) * self.n > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} choices (prompts x n) per request")
        if self.top_logprobs is not None:
            raise ValueError("top_logprobs is a chat field; completions take logprobs: N")
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool) and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be an integer in [0, 20]")
        if self.max_tokens == 0 and not (self.echo and self.logprob_count is not None):
            raise ValueError("max_tokens 0 needs echo and logprobs (scoring the prompt)")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by this server yet (send it unset)")
        if self.suffix and (self.echo or not all(isinstance(p, str) for p in self.prompt)):
            raise ValueError("suffix (fill-in-the-middle) takes text prompts, without echo")
        return self
