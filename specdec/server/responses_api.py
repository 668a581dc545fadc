"""OpenAI's Responses API (POST /v1/responses), as `client.responses.create` and agents written for it send it:
served as the chat completion it amounts to, so it gets everything a chat request gets (speculation, batching,
structured outputs, function calling, seeded sampling) and answers in the Responses format, streamed as its typed
events or not.

`input` carries the conversation (text, messages, earlier `function_call`s and their `function_call_output`s;
`reasoning` items sent back are skipped, as thinking templates drop earlier turns' reasoning), `instructions` the
system message. A response is stored unless the request says `store: false` (response_store.py: per API key, in
memory, bounded): `previous_response_id` continues its conversation (its instructions are not carried on, as on
OpenAI's), and GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items read and remove it. Or a
response is made in a `conversation` (conversations.py), whose items it reads first and then joins. A `background`
response is generated with no client waiting: returned queued, then polled (or cancelled); with `stream` its events
are also kept, and any client follows them from any sequence number (GET /v1/responses/{id}?stream=true&
starting_after=N), while it runs and after. `prompt` and item references need state this server does not keep: 400s
that say so.

A thinking model's reasoning (reasoning.py) comes back as a `reasoning` item (its text as `reasoning_text`, streamed
as `response.reasoning_text.delta` events) before the message or calls; `reasoning.effort: "none"` sets the
template's enable_thinking false."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Literal

from fastapi import Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import PromptTooLong
from ..sampling import MAX_TEMPERATURE, SEED_RANGE
from . import reasoning, tools
from .api_errors import APIError, stream_failure, validated
from .openai_format import logprobs, spec_stats
from .conversations import Conversations, conversation_id
from .response_items import as_items, as_messages, page
from .responses_events import EventLog, events
from .response_store import Background, ResponseStore, Stored
from .schemas import ChatRequest
from .streaming import collect

LOGPROBS = "message.output_text.logprobs"  # what `include` asks for to get each token's logprob


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    include: list[str] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    # extensions, as on chat completions
    seed: int | None = Field(default=None, ge=-SEED_RANGE // 2, lt=SEED_RANGE)
    top_k: int = Field(default=0, ge=0, lt=2**31)
    min_p: float = Field(default=0.0, ge=0, le=1)
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id} (OpenAI's default too)
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns dropped to fit (fit_window)
    previous_response_id: str | None = Field(default=None, max_length=256)
    # accepted, ignored: they change no output here
    metadata: dict | None = None
    client_metadata: dict | None = None  # Codex's
    user: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict | None = None
    conversation: str | dict | None = None  # conversations.py
    # what needs state this server does not keep: refused by name (unstored)
    background: bool | None = None
    prompt: dict | None = None


def unstored(req: ResponsesRequest) -> None:
    for name in ("prompt",):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} needs stored state, which this server does not keep: send the whole "
                                "conversation as input")
    if req.background and not req.store:
        raise APIError(400, "background: a background response is stored and polled (GET /v1/responses/{id}): send "
                            "it with store")


def chat_messages(req: ResponsesRequest, history: list[dict] = ()) -> list[dict]:
    """`instructions`, the stored conversation before this response (`history`) and `input` as chat messages
    (ChatRequest's)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    return ([{"role": "system", "content": req.instructions}] if req.instructions else []) + list(history) + \
        as_messages(items, "input")


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as the items GET /v1/responses/{id}/input_items lists."""
    return as_items([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)


def hosted_tools(req: ResponsesRequest) -> list[str]:
    """The types of the request's tools this server cannot run (OpenAI's hosted ones: web_search, file_search, mcp,
    Codex's namespaces, ...): left out of the prompt, as llama-server leaves them, and named in `specdec`."""
    return [str(t.get("type"))[:40] for t in req.tools or [] if isinstance(t, dict) and t.get("type") != "function"]


def chat_tools(req: ResponsesRequest):
    """Responses' function tools ({"type": "function", "name", "parameters", ...}) and tool_choice in chat's shapes;
    hosted tools are left out (hosted_tools). No function tool (the Agents SDK sends `tools: []` for an agent without
    any; Codex sends hosted ones beside its functions) is no tools, with nothing to choose among."""
    if req.tools is None:
        return None, req.tool_choice
    if not all(isinstance(t, dict) for t in req.tools):
        raise APIError(400, "tools must be objects ({\"type\": \"function\", \"name\": ...})")
    converted = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in req.tools if t.get("type") == "function"]
    if not converted:
        if req.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice: there are no function tools to choose")
        return None, None
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice must be none, auto, required or {"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return converted, choice


def response_format(req: ResponsesRequest) -> dict | None:
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, 'text.format must be an object: {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return fmt  # json_object, or what ChatRequest refuses


def as_chat(req: ResponsesRequest, history: list[dict] = ()) -> ChatRequest:
    """The chat request a response amounts to; `history`: the stored conversation its previous_response_id names."""
    unstored(req)
    tool_list, choice = chat_tools(req)
    want_logprobs = req.top_logprobs is not None or LOGPROBS in (req.include or [])
    return validated(ChatRequest, messages=chat_messages(req, history), max_completion_tokens=req.max_output_tokens,
                     temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                     seed=req.seed, stream=req.stream, tools=tool_list, tool_choice=choice,
                     response_format=response_format(req), logprobs=want_logprobs or None,
                     top_logprobs=req.top_logprobs if want_logprobs else None,
                     prompt_cache_key=req.prompt_cache_key, model=req.model,
                     # effort "none": a thinking template's enable_thinking false (Qwen3's; anything else as it is)
                     chat_template_kwargs={"enable_thinking": False} if (req.reasoning or {}).get(
                         "effort") == "none" else None)


def turns(messages: list) -> list[int]:
    """Where each droppable turn of a conversation starts: the first message after the leading system ones, then
    each user message (a turn is a user message and all that answers it: roles keep alternating, as some chat
    templates require, and tool calls stay with their results)."""
    first = next((k for k, m in enumerate(messages) if m.role not in ("system", "developer")), None)
    if first is None:
        return []
    return [first] + [k for k, m in enumerate(messages) if k > first and m.role == "user"]


def answer_room(decoder, max_tokens_default: int) -> int:
    """The answer truncation "auto" makes room for when the request names no max_output_tokens (agents send none):
    the server's default answer length, or a quarter of the window where answers run until it is full."""
    return min(max_tokens_default, decoder.context_window // 2) if max_tokens_default else decoder.context_window // 4


async def fit_window(chat: ChatRequest, decoder, room_for_answer: int) -> ChatRequest:
    """truncation "auto" (OpenAI's): the fewest oldest turns dropped (never the system message, nor the last turn) so
    that the prompt and `room_for_answer` tokens fit the context window; a conversation that fits is kept whole,
    and one whose last turn alone does not fit is left for the usual 400. Binary search: the prompt's length falls
    as turns are dropped."""
    starts = turns(chat.messages)
    lead = chat.messages[:starts[0]] if starts else chat.messages

    def dropped(k: int) -> ChatRequest:
        return chat.model_copy(update={"messages": lead + chat.messages[starts[k]:]}) if k else chat

    async def fits(k: int) -> bool:
        messages, listed = tools.chat_prompt(decoder.tokenizer, dropped(k))
        try:
            ids = await asyncio.to_thread(decoder.encode, messages, True, listed, chat.template_variables)
        except PromptTooLong:
            return False
        return len(ids) + room_for_answer <= decoder.context_window
    if len(starts) < 2 or await fits(0):
        return chat
    low, high = 1, len(starts) - 1  # the answer lies in [low, high]; high (the last turn alone) is the fallback
    while low < high:
        mid = (low + high) // 2
        if await fits(mid):
            high = mid
        else:
            low = mid + 1
    return dropped(high)


class Answer:
    """One response's objects: its id, its output items from the finished text, and the response itself."""

    def __init__(self, job, req: ResponsesRequest, chat: ChatRequest, model_name: str, decoder, prompt_ids: list[int]):
        self.id, self.created = "resp_" + secrets.token_hex(16), int(time.time())  # random: ids name stored state
        self.req, self.chat, self.model, self.prompt_tokens = req, chat, model_name, len(prompt_ids)
        self.calling = bool(chat.tools) and chat.tool_choice != "none"
        self.seed = job.kwargs.get("seed")
        self.decoder = decoder
        self.stored = False  # set by add_routes where the server keeps it
        self.inside = None  # a thinking template's answer: whether it starts inside <think> (reasoning.py); else None
        if reasoning.thinks(decoder.tokenizer):  # (an answer a GBNF writes from its first token starts outside)
            with decoder.tokenizer_lock:
                self.inside = not chat.grammar_writes_reasoning and reasoning.opens_inside(decoder.tokenizer,
                                                                                           prompt_ids)

    def thought_tokens(self, result) -> int:
        return reasoning.count(self.decoder, [result], [self.inside]) if self.inside is not None else 0

    def reasoning(self, text: str, status: str) -> dict:
        return {"type": "reasoning", "id": "rs_" + self.id[5:], "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def message(self, text: str, status: str, lp=None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if lp is not None:
            part["logprobs"] = lp
        return {"type": "message", "id": "msg_" + self.id[5:], "status": status, "role": "assistant",
                "content": [part] if text or status == "completed" else []}

    def items(self, decoder, text: str, result) -> list[dict]:
        """The output items of a whole answer: its reasoning (a thinking model's), then its message or calls."""
        thought = None
        if self.inside is not None:
            thought, text = reasoning.split(text, self.inside)
        first = [] if thought is None else [self.reasoning(thought, "completed")]
        calls = tools.parse_call(text, self.chat.tools) if self.calling else None
        if calls:
            return first + [{"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"],
                             "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                             "status": "completed"} for c in calls]
        lp = logprobs(decoder, result, "chat")
        return first + [self.message(text, "completed", lp["content"] if lp else None)]

    def response(self, status: str, output: list, result=None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
                "temperature": self.req.temperature, "top_p": self.req.top_p, "tools": self.req.tools or [],
                "tool_choice": self.req.tool_choice or "auto", "parallel_tool_calls": False,
                "text": self.req.text or {"format": {"type": "text"}},
                "previous_response_id": self.req.previous_response_id,
                "conversation": None if self.req.conversation is None else {
                    "id": conversation_id(self.req.conversation)},
                "reasoning": {"effort": None, "summary": None}, "store": self.stored,
                "background": bool(self.req.background),
                "truncation": self.req.truncation or "disabled",
                "metadata": self.req.metadata or {}, "usage": None}
        if result is not None:
            n = len(result.token_ids)
            body["usage"] = {"input_tokens": self.prompt_tokens, "input_tokens_details": {
                "cached_tokens": result.stats.get("cached_tokens", 0)},
                             "output_tokens": n, "output_tokens_details": {"reasoning_tokens": self.thought_tokens(
                                 result)},
                             "total_tokens": self.prompt_tokens + n}
            body["specdec"] = {**spec_stats(result), "seed": self.seed}
            if hosted_tools(self.req):
                body["specdec"]["tools_left_out"] = hosted_tools(self.req)
        return body


def add_routes(app, serve, overdue, decoder, model_name: str, store: ResponseStore,
               conversations: Conversations, max_tokens_default: int = 256) -> None:
    """POST /v1/responses on `app`, through `serve` (app.py's chat path) with its own `respond`; the stored
    responses' routes over `store`; a response's `conversation` in `conversations`; background responses.
    `max_tokens_default`: the server's answer length for a request that sets none (0: until the context window):
    what truncation "auto" leaves room for when max_output_tokens is not set."""
    background = Background()

    def tenant(request: Request) -> bytes:
        return getattr(request.state, "tenant", b"")  # the API key's (guard.py)

    def history(req, request: Request) -> list[dict]:
        """The conversation a response continues: its previous response's chain, or its conversation's items."""
        if req.conversation is not None:
            if req.previous_response_id is not None:
                raise APIError(400, "send previous_response_id or conversation, not both")
            return conversations.messages(tenant(request), conversation_id(req.conversation))
        return [] if req.previous_response_id is None else store.history(tenant(request), req.previous_response_id)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        chat = as_chat(req, history(req, request))
        if req.truncation == "auto":
            chat = await fit_window(chat, decoder, req.max_output_tokens or answer_room(decoder, max_tokens_default))
        messages = [m.for_template() for m in chat.messages]  # tools described in serve, as on chat completions
        items = input_items(req)

        log = EventLog() if req.background and req.stream else None  # a background stream's events, kept

        def keep(answer: Answer, body: dict) -> None:  # a finished response, stored as returned
            if answer.stored:
                added = as_messages(items, "input") + as_messages(body["output"], "output")
                store.put(tenant(request), Stored(answer.id, req.previous_response_id, added, items, body, log))
            if req.conversation is not None:  # its input and output join the conversation (unless it has left)
                try:
                    conversations.add(tenant(request), conversation_id(req.conversation), items + body["output"],
                                      limit=None, fresh_ids=True)
                except APIError:
                    pass  # deleted or evicted while this response ran: nothing to add to

        async def run_in_background(answer: Answer, job) -> None:
            """Collect the job with no client waiting; the stored response goes from queued to in_progress to its
            end (completed, incomplete, or failed with the error), unless it was deleted meanwhile."""
            key = tenant(request)
            try:
                text, result = await collect(job, None, overdue,
                                             on_first=lambda: _mark(store, key, answer.id, status="in_progress"))
                status = "incomplete" if result.finish_reason == "length" else "completed"
                body = answer.response(status, answer.items(decoder, text, result), result)
            except Exception as e:  # noqa: BLE001 - its own failure (a bug too): failed, the server goes on
                err = stream_failure(e)
                _mark(store, key, answer.id, status="failed", error={"code": err.code or err.type,
                                                                     "message": err.message})
                return
            if _mark(store, key, answer.id, status=body["status"]) is not None:
                keep(answer, body)

        async def stream_in_background(answer: Answer, job) -> None:
            """The same with its stream's events kept in `log` as they come (keep stores the ended response with
            it); an error event marks it failed. The log closes however it ends (cancelled too)."""
            key, started = tenant(request), False

            def keep_unless_ended(answer: Answer, body: dict) -> None:
                if _mark(store, key, answer.id, status=body["status"]) is not None:
                    keep(answer, body)
            try:
                async for e in events(decoder, job, answer, overdue, keep_unless_ended, status="queued"):
                    log.append(e)
                    if not started and e.startswith("event: response.output_"):
                        started = True
                        _mark(store, key, answer.id, status="in_progress")
                    if e.startswith("event: error\n"):
                        err = json.loads(e.split("data: ", 1)[1])
                        _mark(store, key, answer.id, status="failed",
                             error={"code": err["code"] or "server_error", "message": err["message"]})
            except asyncio.CancelledError:  # cancelled (or deleted): its followers see the end, not a silence
                end = {"type": "error", "sequence_number": len(log.events), "code": "cancelled",
                       "message": "the response was cancelled", "param": None}
                log.append(f"event: error\ndata: {json.dumps(end)}\n\n")
                raise
            finally:
                log.close()
                try:
                    store.put(key, store.get(key, answer.id))  # measured again with its whole log
                except APIError:
                    pass  # deleted meanwhile

        async def respond(jobs, encoded, prompts):
            answer = Answer(jobs[0], req, chat, model_name, decoder, encoded[0])
            answer.stored = req.store and store.enabled
            if req.background:
                if not answer.stored:
                    jobs[0].cancel()
                    raise APIError(400, "background: this server stores no responses (serve --response-store-mb 0, "
                                        "or replicas behind Ray), so none can be polled")
                queued = answer.response("queued", [])
                store.put(tenant(request), Stored(answer.id, req.previous_response_id, [], items, queued, log))
                work = stream_in_background if log is not None else run_in_background
                background.start((tenant(request), answer.id), jobs[0], work(answer, jobs[0]))
                if log is not None:  # this client follows the events; hanging up stops only its following
                    return StreamingResponse(log.follow(), media_type="text/event-stream")
                return queued
            if req.stream:
                return StreamingResponse(events(decoder, jobs[0], answer, overdue, keep),
                                         media_type="text/event-stream")
            done = await collect(jobs[0], request, overdue)
            if done is None:
                return Response(status_code=499)  # the client hung up
            text, result = done
            status = "incomplete" if result.finish_reason == "length" else "completed"
            body = answer.response(status, answer.items(decoder, text, result), result)
            keep(answer, body)
            return body
        return await serve(chat, request, [messages], True, "chat", None, respond)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = Query(None, ge=0)):
        """A stored response; with stream=true a background stream's events after `starting_after`, followed until
        it ends (OpenAI resumes only those)."""
        stored = store.get(tenant(request), response_id)
        if not stream:
            return stored.response
        if stored.events is None:
            raise APIError(400, "stream: only a response created with background and stream can be streamed again; "
                                "GET it without stream")
        after = -1 if starting_after is None else starting_after
        return StreamingResponse(stored.events.follow(after), media_type="text/event-stream")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        store.delete(tenant(request), response_id)
        background.cancel((tenant(request), response_id))  # a background one still running stops
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        """A background response stops where it is (status cancelled); one that has ended is returned as it is."""
        stored = store.get(tenant(request), response_id)
        if not stored.response.get("background"):
            raise APIError(400, "Only background responses can be cancelled.")
        if _mark(store, tenant(request), response_id, status="cancelled") is not None:  # (not if it has ended)
            background.cancel((tenant(request), response_id))  # its work stops; its log ends with a last event
        return stored.response

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: str | None = None):
        """A stored response's input items, OpenAI's cursor page (newest first unless order=asc; `after` an id)."""
        return page(store.get(tenant(request), response_id).input_items, limit, order, after)

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(req: InputTokensRequest, request: Request):
        """The prompt tokens a response to this request would start from (the client's `responses.input_tokens`)."""
        body = ResponsesRequest(**req.model_dump(exclude_none=True, exclude={"personality"}))
        chat = as_chat(body, history(body, request))
        if body.truncation == "auto":  # as a response that names no max_output_tokens would be cut
            chat = await fit_window(chat, decoder, answer_room(decoder, max_tokens_default))
        messages, listed = tools.chat_prompt(decoder.tokenizer, chat)
        count = len(await asyncio.to_thread(decoder.encode, messages, True, listed))
        return {"object": "response.input_tokens", "input_tokens": count}


class InputTokensRequest(BaseModel):
    """/v1/responses/input_tokens: the fields of a response request that shape its prompt."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    text: dict | None = None
    reasoning: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    personality: str | None = None  # changes no prompt here
    previous_response_id: str | None = Field(default=None, max_length=256)
    conversation: str | dict | None = None


ENDED = ("completed", "incomplete", "failed", "cancelled")


def _mark(store: ResponseStore, key: bytes, response_id: str, **fields) -> dict | None:
    """Update a stored response's fields (its status, its error) -> the response; None if it was deleted or has
    ended. The stored response is the one place a background response's status lives: once ended (cancelled
    included) nothing moves it again."""
    try:
        response = store.get(key, response_id).response
    except APIError:
        return None
    if response.get("status") in ENDED:
        return None
    response.update(fields)
    return response
