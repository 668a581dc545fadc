"""Failover without a visible break (`serve --ray`): a router in front of the model replicas gives every sampled
request a seed before it reaches one, so its answer is a function of (seed, prompt) alone (greedy answers are that
already). When the replica serving a request dies, the request is sent again to another replica, which regenerates
the same text; what the client already has is not sent again, and the stream goes on. Non-streamed requests are
simply sent again.

What the router needs of a replica is in `asgi_stream`: the replica's own FastAPI app (create_app), called with
one request, its response's start and body chunks yielded as they come (server-sent events stay incremental).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable

from .api_errors import error_body

log = logging.getLogger("specdec.server")
RETRIED = {429, 500, 502, 503, 504}  # a retry refused with these is tried again on another replica while tries last

DEFAULT_TEMPERATURE = {"/v1/chat/completions": 1.0, "/v1/completions": 1.0, "/v1/responses": 1.0, "/v1/messages": 1.0,
                       "/infill": 0.8, "/completion": 0.8, "/completions": 0.8}  # the routes' schemas' defaults


class ReplicaLost(RuntimeError):
    """Every attempt to serve a request ended with its replica gone."""


async def asgi_stream(app, method: str, path: str, query: bytes, headers: list, body: bytes) -> AsyncIterator:
    """Run one request through an ASGI app -> ("start", status, headers), then each body chunk (bytes) as the app
    sends it. The request never disconnects on its own: cancelling the iteration cancels the app's handler."""
    messages: asyncio.Queue = asyncio.Queue()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: waits until cancelled

    async def send(message):
        await messages.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.create_task(messages.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()  # the app ended without finishing its response: its error
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield ("start", message["status"], [(k.decode(), v.decode()) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        task.cancel()


def with_seed(path: str, body: bytes) -> bytes:
    """A sampled completion request without a seed gets one here, before any replica sees it: every attempt at it
    then samples the same text. Anything that is not such a request passes unchanged (the replica judges it)."""
    if path not in DEFAULT_TEMPERATURE:
        return body
    try:
        req = json.loads(body)
    except ValueError:
        return body
    if not isinstance(req, dict) or req.get("seed") not in (None, -1):
        return body
    temperature = req.get("temperature", DEFAULT_TEMPERATURE[path])
    if not isinstance(temperature, (int, float)) or temperature == 0:
        return body
    return json.dumps({**req, "seed": secrets.randbits(63)}).encode()


async def resumed_events(first, again: Callable, tries: int, wait_s: float) -> AsyncIterator[str]:
    """One stream's server-sent events for its client. `first`: the attempt under way (its 200 start already read);
    when its replica dies, `again()` makes another attempt (up to `tries` in all), whose events go on from where the
    client is (Resumer). A retry that a replica refuses (429, 503: its start's status) is tried again elsewhere
    while tries last, else its error body becomes the stream's last event. Every stream ends with [DONE], its API's
    own end, or an error event: never by just stopping."""
    resumer, gen, used = Resumer(), first, 1
    while True:
        buffer, refused = "", None
        try:
            async for chunk in gen:
                if isinstance(chunk, tuple):  # a retry's response start
                    if chunk[1] != 200:
                        refused = [chunk[1], b""]
                    continue
                if refused is not None:  # a refusal's body: JSON, not events
                    refused[1] += chunk
                    continue
                buffer += chunk.decode()
                while "\n\n" in buffer:
                    event, buffer = buffer.split("\n\n", 1)
                    named, data = split_event(event)
                    if data is None:
                        yield event + "\n\n"
                    elif (out := resumer.event(data)) is not None:
                        yield f"{named}data: {out}\n\n"
            if refused is None:
                if not resumer.ended:
                    lost = error_body("the stream ended before its answer did; retry", "server_error", "worker_down")
                    yield f"data: {json.dumps(lost)}\n\n"
                return
            problem = f"a replica refused the retry ({refused[0]})"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            problem, refused = f"a replica failed mid-stream ({type(e).__name__})", None
        if used >= tries or (refused is not None and refused[0] not in RETRIED):
            yield f"data: {json.dumps(_refusal(refused))}\n\n"
            return
        log.warning("%s; resuming on another", problem)
        used += 1
        await asyncio.sleep(wait_s)
        resumer.restart()
        gen = again()


def _refusal(refused: list | None) -> dict:
    """The error event that ends a stream no replica would finish: a refusal's own JSON error, if it has one."""
    if refused is not None:
        try:
            body = json.loads(refused[1])
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return body
        except ValueError:
            pass
    return error_body("the replica serving this stream stopped; retry", "server_error", "worker_down")


ANTHROPIC_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop")


# events that carry a piece of a text (cut like a choice's text on a retry, each output item or block its own)
TEXT_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta")
TEXT_DELTAS = {"text_delta": "text", "thinking_delta": "thinking"}  # Anthropic's, and the field with the text


def split_event(event: str) -> tuple[str, str | None]:
    """A server-sent event -> (what comes before its data: a typed event's `event: ...` line, or nothing; its data),
    or (the event, None) where it has no data line."""
    if event.startswith("data: "):
        return "", event[6:]
    head, sep, data = event.partition("\ndata: ")
    return (head + "\n", data) if sep and head.startswith("event: ") else (event, None)


class Resumer:
    """The text each choice of a stream has sent so far, and what of a retried stream's events is new: a chunk's
    text that the client already has is dropped, a chunk that straddles the point is cut, and every event after it
    goes on unchanged but for the first attempt's id and timestamp (one stream to the client)."""

    def __init__(self):
        self.sent: dict = {}  # choice (or a Responses output item) -> characters the client has
        self.seen: dict = {}  # the same -> characters of the current attempt so far
        self.done: set = set()  # (choice, "finish") and ("usage",) markers sent
        self.ident: dict = {}
        self.counted: dict = {}  # chunks with no text to cut (tool calls, a token of no text yet) -> sent so far
        self.counting: dict = {}  # the same -> of the current attempt so far
        self.ended = False  # its end was sent: [DONE], an error, its API's last event

    def restart(self) -> None:
        self.seen, self.counting = {}, {}

    def _new(self, key) -> bool:
        """Whether the current attempt's next chunk of kind `key` is one the client lacks (an attempt regenerates
        the same chunks: the first ones the client has are sent once)."""
        n = self.counting[key] = self.counting.get(key, 0) + 1
        if n <= self.counted.get(key, 0):
            return False
        self.counted[key] = n
        return True

    def event(self, data: str) -> str | None:
        """One `data: ...` payload of the current attempt -> what to send the client, or None."""
        if data.strip() == "[DONE]":
            self.ended = True
            return None if ("done",) in self.done else self._mark(("done",), data)
        try:
            obj = json.loads(data)
        except ValueError:
            return data
        if not isinstance(obj, dict) or "error" in obj or obj.get("type") == "error":
            self.ended = True
            return data
        if str(obj.get("type", "")).startswith("response.") or obj.get("type") in ANTHROPIC_EVENTS:
            return self._typed_event(obj)
        for k in ("id", "created"):
            if k in obj:
                obj[k] = self.ident.setdefault(k, obj[k])
        if "choices" not in obj and "content" in obj:  # llama-server's events (/completion, /infill): {content, stop}
            if obj.get("stop"):
                self.ended = True  # (llama-server's streams end with it, no [DONE])
                return None if (0, "finish") in self.done else self._mark((0, "finish"), json.dumps(obj))
            fresh = self._fresh(0, obj["content"])
            if fresh is None:
                return None
            if fresh != obj["content"]:  # a cut event: its tokens and their probabilities no longer match it
                obj.pop("tokens", None), obj.pop("completion_probabilities", None)
            obj["content"] = fresh
            return json.dumps(obj)
        if not obj.get("choices"):  # the usage chunk
            return None if ("usage",) in self.done else self._mark(("usage",), json.dumps(obj))
        choice = obj["choices"][0]
        i = choice.get("index", 0)
        delta = choice.get("delta")
        field = "reasoning_content" if isinstance((delta or {}).get("reasoning_content"), str) else "content"
        text = (delta or {}).get(field) if delta is not None else choice.get("text")
        if choice.get("finish_reason"):
            return None if (i, "finish") in self.done else self._mark((i, "finish"), json.dumps(obj))
        if delta is not None and "role" in delta:
            return None if (i, "role") in self.done else self._mark((i, "role"), json.dumps(obj))
        if not isinstance(text, str) or text == "":  # tool calls, a token with no text yet: sent once each
            kind = "tool_calls" if (delta or {}).get("tool_calls") else "other"
            return json.dumps(obj) if self._new((i, kind)) else None
        fresh = self._fresh(i if field == "content" else (i, field), text)  # a reasoning's text counts apart
        if fresh is None:
            return None
        if delta is not None:
            delta[field] = fresh
        else:
            choice["text"] = fresh
        if choice.get("logprobs") and fresh != text:  # a cut chunk: its tokens' logprobs no longer line up
            choice["logprobs"] = None
        return json.dumps(obj)

    def _typed_event(self, obj: dict) -> str | None:
        """An event of the Responses API (responses_api.py) or of Anthropic's (anthropic_api.py): text deltas cut as
        a choice's text is, every other event sent once (by type and position), Responses events numbered on from
        the client's last, all under the first attempt's ids."""
        kind = obj["type"]
        if kind in ("response.completed", "response.failed", "response.incomplete", "message_stop"):
            self.ended = True
        if kind in ("response.created", "message_start"):  # each attempt's ids end in its job's: the first's stay
            first = (obj.get("response") or obj.get("message") or {}).get("id", "")
            self.ident.setdefault("first", first)
            self.ident["alias"] = (first.partition("_")[2], self.ident["first"].partition("_")[2])
        delta = obj.get("delta") if kind == "content_block_delta" else None
        if kind in TEXT_EVENTS or (isinstance(delta, dict) and delta.get("type") in TEXT_DELTAS):
            holder, field = (obj, "delta") if delta is None else (delta, TEXT_DELTAS[delta["type"]])
            fresh = self._fresh(("output", obj.get("output_index", obj.get("index"))), holder.get(field, ""))
            if fresh is None:
                return None
            holder[field] = fresh
        else:
            key = (kind, obj.get("output_index", obj.get("index")), obj.get("content_index"))
            if key in self.done:
                return None
            self.done.add(key)
        if "sequence_number" in obj:
            obj["sequence_number"] = self.ident["sequence"] = self.ident.get("sequence", -1) + 1
        new, old = self.ident.get("alias", ("", ""))
        text = json.dumps(obj)
        return text.replace(new, old) if new and new != old else text

    def _fresh(self, i, text: str) -> str | None:
        """What of choice i's next `text` the client lacks (None: all of it it has)."""
        start = self.seen.get(i, 0)
        self.seen[i] = start + len(text)
        have = self.sent.get(i, 0)
        if self.seen[i] <= have:
            return None
        self.sent[i] = self.seen[i]
        return text[max(0, have - start):]

    def _mark(self, key, data: str) -> str:
        self.done.add(key)
        return data
