"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as the `anthropic` client and agents
written for it send it (an `x-api-key` header is taken as the API key): served as the chat completion of the same
conversation, answered in Anthropic's format, streamed as its typed events or not, errors in its error shape.

What maps: `system` (a string or text blocks), messages whose content is a string or blocks (`text`; the
assistant's `tool_use` as a chat tool call, the user's `tool_result` as a tool message; `thinking` blocks sent back
are skipped, as thinking templates drop earlier turns' reasoning), `max_tokens`, `stop_sequences`, `tools` (custom
tools: name, description, input_schema), `tool_choice` (auto, any, tool, none), `output_config.format` (a JSON
schema), `thinking` (disabled: the template's enable_thinking false), and the sampling fields earlier versions of
the API had (`temperature`, `top_p`, `top_k`; the current one samples at temperature 1). A thinking model's
reasoning (reasoning.py) comes back as a `thinking` block before the text or tool calls, its signature empty.
Images, documents, containers and Anthropic's server tools are 400s that name them."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from . import reasoning, tools
from .api_errors import APIError, stream_failure, validated
from .openai_format import spec_stats
from .schemas import ChatRequest
from .streaming import collect, pieces

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "api_error"}


def error(status: int, message: str) -> dict:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    messages: list[dict] = Field(min_length=1)
    max_tokens: int = Field(ge=1, lt=2**31)
    system: str | list[dict] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, lt=2**31)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": {...}}, "effort": ...}
    output_format: dict | None = None  # the same format, as its beta named it
    # accepted, ignored: they change no output here
    metadata: dict | None = None
    service_tier: str | None = None
    thinking: dict | None = None  # {"type": "disabled"}: enable_thinking false for the template (Qwen3's)
    cache_control: dict | None = None  # prompts are cached whole anyway (the prefix cache)
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # an extension, as on chat completions
    seed: int | None = None


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}: content must be a string or a list of content blocks")
    return content


def _block_text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: a text block needs its text")
    return block["text"]


def _system(system) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(_block_text(b, "system") for b in _blocks(system, "system"))


def chat_messages(req: MessagesRequest) -> list[dict]:
    """`system` and the messages as chat messages: tool_use blocks as the assistant's tool_calls, tool_result blocks
    as tool messages before the user's own text."""
    system = _system(req.system)
    out = [{"role": "system", "content": system}] if system else []
    for k, message in enumerate(req.messages):
        where, role = f"messages[{k}]", message.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}: role must be user or assistant")
        texts, calls = [], []
        for j, block in enumerate(_blocks(message.get("content"), where)):
            kind, at = block.get("type"), f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_block_text(block, at))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(400, f"{at}: a tool_use block needs its id and name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}: a tool_result block needs its tool_use_id")
                result = block.get("content", "")
                text = result if isinstance(result, str) else "\n".join(
                    _block_text(b, at) for b in _blocks(result, at) if b.get("type") == "text")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": ("Error: " if block.get("is_error") else "") + text})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # another model's thinking: nothing here reads it
            else:
                raise APIError(400, f"{at}: content blocks of type {str(kind)[:40]!r} are not supported here "
                                    "(text, tool_use, tool_result)")
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
        elif texts or role == "assistant":
            out.append({"role": role, "content": "\n".join(texts)})
    return out


def chat_tools(req: MessagesRequest):
    """Anthropic's custom tools and tool_choice in chat's shapes."""
    if not req.tools:
        return None, None
    converted = []
    for t in req.tools:
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools of type {str(t.get('type'))[:40]!r} are not supported here (custom tools: "
                                "name, description, input_schema)")
        converted.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}})
    choice = req.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind == "tool":
        return converted, {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise APIError(400, "tool_choice type must be auto, any, tool or none")
    return converted, {"auto": "auto", "any": "required", "none": "none"}[kind]


def thinking_variables(thinking: dict | None) -> dict | None:
    """Anthropic's `thinking` as the template variable thinking models read (Qwen3's enable_thinking)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise APIError(400, "thinking.type must be enabled, disabled or adaptive")
    return {"enable_thinking": thinking["type"] != "disabled"}


def as_chat(req: MessagesRequest) -> ChatRequest:
    tool_list, choice = chat_tools(req)
    fmt = (req.output_config or {}).get("format") or req.output_format
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                            or not isinstance(fmt.get("schema"), dict)):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}')
    return validated(ChatRequest, messages=chat_messages(req), max_tokens=req.max_tokens,
                     temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
                     seed=req.seed, stream=req.stream, tools=tool_list, tool_choice=choice, model=req.model,
                     chat_template_kwargs=thinking_variables(req.thinking),
                     response_format=None if fmt is None else {
                         "type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}})


class Reply:
    """One answer's Anthropic objects: its id, content blocks and stop reason from the finished text."""

    def __init__(self, job, req: MessagesRequest, chat: ChatRequest, decoder, model_name: str, prompt_ids: list[int]):
        self.id, self.req, self.chat, self.decoder = "msg_" + job.id, req, chat, decoder
        self.model, self.prompt_tokens, self.seed = req.model or model_name, len(prompt_ids), job.kwargs.get("seed")
        self.calling = bool(chat.tools) and chat.tool_choice != "none"
        self.inside = None  # a thinking template's answer: whether it starts inside <think> (reasoning.py); else None
        if reasoning.thinks(decoder.tokenizer):  # (an answer a GBNF writes from its first token starts outside)
            with decoder.tokenizer_lock:
                self.inside = not chat.grammar_writes_reasoning and reasoning.opens_inside(decoder.tokenizer,
                                                                                           prompt_ids)

    def content(self, text: str) -> list[dict]:
        """The blocks of a whole answer: its thinking (a thinking model's), then its text or tool calls."""
        thought = None
        if self.inside is not None:
            thought, text = reasoning.split(text, self.inside)
        first = [] if thought is None else [{"type": "thinking", "thinking": thought, "signature": ""}]
        calls = tools.parse_call(text, self.chat.tools) if self.calling else None
        if calls:
            return first + [{"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                             "input": json.loads(c["function"]["arguments"])} for c in calls]
        return first + [{"type": "text", "text": text}]

    def stop(self, content: list[dict], result, text: str) -> tuple[str, str | None]:
        if content[-1]["type"] == "tool_use":
            return "tool_use", None
        if result.finish_reason == "length":
            return "max_tokens", None
        ids = result.token_ids
        if ids and ids[-1] in self.decoder.engine.eos_ids or not self.req.stop_sequences:
            return "end_turn", None
        with self.decoder.tokenizer_lock:
            rest = self.decoder.tokenizer.decode(ids)[len(text):]
        hits = [s for s in self.req.stop_sequences if s in rest]
        return "stop_sequence", min(hits, key=rest.find) if hits else self.req.stop_sequences[0]

    def message(self, content: list[dict], result, text: str) -> dict:
        reason, sequence = self.stop(content, result, text)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(len(result.token_ids), result.stats.get("cached_tokens", 0)),
                "specdec": {**spec_stats(result), "seed": self.seed}}

    def usage(self, output_tokens: int, cached: int = 0) -> dict:
        """Anthropic's: input_tokens are those not read from the cache (every prompt is cached, none written apart)."""
        return {"input_tokens": self.prompt_tokens - cached, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def add_routes(app, serve, overdue, decoder, model_name: str) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app`, through `serve` (app.py's chat path)."""

    def prompt(req: MessagesRequest) -> tuple[ChatRequest, list[dict]]:
        chat = as_chat(req)
        messages = [m.for_template() for m in chat.messages]  # tools described in serve, as on chat completions
        return chat, messages

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        chat, conversation = prompt(req)

        async def respond(jobs, encoded, prompts):
            reply = Reply(jobs[0], req, chat, decoder, model_name, encoded[0])
            if req.stream:
                return StreamingResponse(_events(jobs[0], reply, overdue), media_type="text/event-stream")
            done = await collect(jobs[0], request, overdue)
            if done is None:
                return Response(status_code=499)  # the client hung up
            text, result = done
            return reply.message(reply.content(text), result, text)
        return await serve(chat, request, [conversation], True, "chat", None, respond)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountRequest):
        messages, listed = tools.chat_prompt(decoder.tokenizer, as_chat(MessagesRequest(**req.model_dump(
            exclude_none=True), max_tokens=1)))
        return {"input_tokens": len(await asyncio.to_thread(decoder.encode, messages, True, listed))}


class CountRequest(BaseModel):
    """/v1/messages/count_tokens: what a message request would send, without max_tokens."""
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


async def _events(job, reply: Reply, overdue):
    """Anthropic's stream: message_start, a text block opened, text_delta events as text comes, the block closed,
    message_delta with the stop reason and usage, message_stop; a thinking model's reasoning first, in a thinking
    block of thinking_delta events. With tools the text is held to its end and sent as tool_use blocks (their input
    in one input_json_delta) or as text. An error is an `error` event."""
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    start = {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": reply.usage(0)}
    blocks = []  # the types of the blocks opened so far; the last is open

    def block(kind: str) -> list[str]:  # open a block of this kind (the one before closed), unless it is open
        if blocks and blocks[-1] == kind:
            return []
        out = [event("content_block_stop", index=len(blocks) - 1)] if blocks else []
        blocks.append(kind)
        body = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": kind,
                                                                                                  "text": ""}
        return out + [event("content_block_start", index=len(blocks) - 1, content_block=body)]
    try:
        yield event("message_start", message=start)
        answer = None
        async for kind, piece in pieces(job, overdue, reply.inside, reply.calling):
            if kind == "end":
                answer = piece
                continue
            for e in block("thinking" if kind == "reasoning" else "text"):
                yield e
            if piece:
                delta = {"type": "thinking_delta", "thinking": piece} if kind == "reasoning" else {
                    "type": "text_delta", "text": piece}
                yield event("content_block_delta", index=len(blocks) - 1, delta=delta)
        if answer is None:
            return
        text, result = answer
        content = reply.content(text)  # begins with the blocks streamed, in their order
        for k, part in enumerate(content):
            if k < len(blocks) - 1:
                continue  # closed when the next one opened
            if k >= len(blocks):  # not streamed: a call (the text was held for it), or an empty answer's text
                if part["type"] == "tool_use":
                    yield event("content_block_start", index=k, content_block={**part, "input": {}})
                    yield event("content_block_delta", index=k, delta={"type": "input_json_delta",
                                                                       "partial_json": json.dumps(part["input"])})
                else:
                    yield event("content_block_start", index=k, content_block={"type": "text", "text": ""})
                    if part["text"]:
                        yield event("content_block_delta", index=k, delta={"type": "text_delta", "text": part["text"]})
            yield event("content_block_stop", index=k)
        final = reply.message(content, result, text)
        yield event("message_delta", delta={"stop_reason": final["stop_reason"],
                                            "stop_sequence": final["stop_sequence"]},
                    usage=final["usage"], specdec=final["specdec"])
        yield event("message_stop")
    except Exception as e:  # noqa: BLE001 - this request's own failure ends its stream with an error event
        err = stream_failure(e)
        yield f"event: error\ndata: {json.dumps(error(err.status, err.message))}\n\n"
    finally:
        job.cancel()
