"""The Responses API's stream (responses_api.py): its typed server-sent events for one answer (responses_api.Answer),
as OpenAI sends them and its clients' stream helpers accumulate them; and a background stream's log, which any
number of clients follow from any sequence number."""
from __future__ import annotations

import asyncio
import json

from .api_errors import stream_failure
from .streaming import pieces


class EventLog:
    """A background stream's events as sent (their SSE text, index = sequence_number), kept with its stored response
    so that a client can follow it from any point (GET /v1/responses/{id}?stream=true&starting_after=N) until it
    ends, and replay it afterwards."""

    def __init__(self):
        self.events: list[str] = []
        self.closed = False
        self._grew = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:  # every follower waiting wakes; later ones wait on a fresh event
        self._grew.set()
        self._grew = asyncio.Event()

    @property
    def bytes(self) -> int:
        return sum(map(len, self.events))

    async def follow(self, after: int = -1):
        """The events after sequence number `after`, then each as it comes, until the log closes (a follower that
        hangs up stops only itself)."""
        at = max(-1, after) + 1
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.closed:
                return
            await self._grew.wait()


async def events(decoder, job, answer, overdue, keep=None, status: str = "in_progress"):
    """The Responses stream: response.created, the message's item and part opened, output_text deltas as text
    comes, each closed with its whole text, then response.completed (or .incomplete) with the whole response.
    With tools the text is held to its end and sent as function_call items (arguments in one delta) or as the
    message. An error (any: the answer's own failure) is an `error` event. `status`: the response's in response.created (a background one's is
    queued)."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    thought = []
    msg_id, rs_id = "msg_" + answer.id[5:], "rs_" + answer.id[5:]
    items = []  # the kinds of the items opened so far ("reasoning", "message"); the last is open

    def close(k: int, item: dict | None = None) -> list[str]:  # the events that close open item k
        if items[k] == "reasoning":
            item = item or answer.reasoning("".join(thought), "completed")
            return [event("response.reasoning_text.done", item_id=rs_id, output_index=k, content_index=0,
                          text=item["content"][0]["text"]),
                    event("response.output_item.done", output_index=k, item=item)]
        part = item["content"][0]
        return [event("response.output_text.done", item_id=msg_id, output_index=k, content_index=0,
                      text=part["text"], logprobs=part.get("logprobs", [])),
                event("response.content_part.done", item_id=msg_id, output_index=k, content_index=0, part=part),
                event("response.output_item.done", output_index=k, item=item)]

    def open_item(kind: str) -> list[str]:  # open an item of this kind (the one before closed), unless it is open
        if items and items[-1] == kind:
            return []
        out = close(len(items) - 1) if items else []
        items.append(kind)
        k = len(items) - 1
        if kind == "reasoning":
            return out + [event("response.output_item.added", output_index=k,
                                item={**answer.reasoning("", "in_progress"), "content": []})]
        return out + [event("response.output_item.added", output_index=k, item=answer.message("", "in_progress")),
                      event("response.content_part.added", item_id=msg_id, output_index=k, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]
    try:
        yield event("response.created", response=answer.response(status, []))
        yield event("response.in_progress", response=answer.response("in_progress", []))
        done = None
        async for kind, piece in pieces(job, overdue, answer.inside, answer.calling):
            if kind == "end":
                done = piece
                continue
            for e in open_item("reasoning" if kind == "reasoning" else "message"):
                yield e
            if kind == "reasoning" and piece:
                thought.append(piece)
                yield event("response.reasoning_text.delta", item_id=rs_id, output_index=len(items) - 1,
                            content_index=0, delta=piece)
            elif piece:
                yield event("response.output_text.delta", item_id=msg_id, output_index=len(items) - 1,
                            content_index=0, delta=piece, logprobs=[])
        if done is None:
            return
        text, result = done
        output = answer.items(decoder, text, result)  # begins with the items streamed, in their order
        for k, item in enumerate(output):
            if k < len(items) - 1:
                continue  # closed when the next one opened
            if k == len(items) - 1:
                for e in close(k, item):
                    yield e
                continue
            if item["type"] == "function_call":
                yield event("response.output_item.added", output_index=k, item={**item, "arguments": "",
                                                                                "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
                continue
            items.append("message")  # not streamed: the text held for calls that did not come, or an empty answer
            part = item["content"][0]
            yield event("response.output_item.added", output_index=k, item=answer.message("", "in_progress"))
            yield event("response.content_part.added", item_id=msg_id, output_index=k, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})
            if part["text"]:
                yield event("response.output_text.delta", item_id=msg_id, output_index=k, content_index=0,
                            delta=part["text"], logprobs=[])
            for e in close(k, item):
                yield e
        status = "incomplete" if result.finish_reason == "length" else "completed"
        body = answer.response(status, output, result)
        if keep is not None:
            keep(answer, body)  # stored before the client reads its end: a follow-up finds it
        yield event(f"response.{status}", response=body)
    except Exception as e:  # noqa: BLE001 - this answer's own failure ends its stream with an error event
        err = stream_failure(e)
        yield event("error", code=err.code, message=err.message, param=None)
    finally:
        job.cancel()
