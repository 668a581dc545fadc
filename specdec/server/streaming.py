"""A job's answer as it comes: collected whole (a non-streamed response), or as OpenAI's server-sent events, one or
several jobs (n choices, prompt lists) interleaved, each chunk naming its choice; tool calls held to a choice's end;
an error of our own when a worker stops answering."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from . import tools
from .api_errors import error_body, job_failure, stream_failure
from .openai_format import logprobs, spec_stats, usage
from .reasoning import ReasoningSplit, count


async def collect(job, request, overdue, on_first=None):
    """A job's text and result; None when the client hung up (`request` None: no client waits, a background
    response). `overdue(job)`: the error of a job past its deadline or on a dead worker, else None. `on_first()` is
    called when the first text comes."""
    text, result, checked = [], None, time.monotonic()
    try:
        while True:
            if request is not None and time.monotonic() - checked > 0.5:  # a client that hung up while it waits
                checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            item = await job.next(timeout=0.5)
            if item is None:
                if overdue(job):
                    raise overdue(job)
                continue
            ev, payload = item
            if ev == "end":
                break
            if ev == "error":
                raise job_failure(payload)
            if on_first is not None and not text:
                on_first()
            text.append(payload.text)
            result = payload.result or result
    finally:
        job.cancel()  # a no-op once the job has ended
    return "".join(text), result


async def chunks(job, overdue):
    """One job's chunks as they come (the other APIs' streams: llama_compat, responses_api, anthropic_api); an
    APIError should it fail, or its worker stop answering."""
    while True:
        item = await job.next(timeout=0.5)
        if item is None:
            if overdue(job):
                raise overdue(job)
            continue
        kind, payload = item
        if kind == "end":
            return
        if kind == "error":
            raise job_failure(payload)
        yield payload


async def pieces(job, overdue, inside: bool | None, hold: bool):
    """One job's answer as the other APIs stream it (anthropic_api, responses_api): ("reasoning", text) pieces of a
    thinking model's reasoning (`inside`: where its answer starts, reasoning.py; None: no split), the first, possibly
    empty, as soon as the tag opens it; then ("text", text) pieces of the rest (none when `hold`: the text is sent
    whole at the end, as with tools); last ("end", (the whole text, the result)), unless the job never finished."""
    split = None if inside is None else ReasoningSplit(inside)
    text, result, opened = [], None, False
    async for chunk in chunks(job, overdue):
        text.append(chunk.text)
        result = chunk.result or result
        thought, said = split.feed(chunk.text, result is not None) if split is not None else ("", chunk.text)
        if thought or (split is not None and split.reasoned and not opened):
            opened = True
            yield "reasoning", thought
        if said and not hold:
            yield "text", said
    if result is not None:
        yield "end", ("".join(text), result)


async def sse(decoder, jobs, meta, kind, include_usage, prompt_tokens: int, overdue, tool_list=None, echoed=None,
              reasoning=None, choices: int = 1):
    """Server-sent events of one or several jobs (n choices, prompt lists), each chunk with its choice's index.
    With tools (`tool_list`) a choice's text is held to its end, then sent as tool_calls or as content; with echo
    (`echoed`: each choice's prompt text) the prompt comes first. `reasoning`: per job, whether its answer starts
    inside a `<think>` (a thinking template's; reasoning.py), its reasoning then sent as `reasoning_content`."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    splits = [ReasoningSplit(inside) for inside in reasoning] if reasoning is not None else None

    def event(i, delta_text, finish=None, first=False, record=None, field="content"):
        lp = None if record is None or record.logprobs is None else logprobs(  # this cycle's tokens
            decoder, SimpleNamespace(token_ids=record.emitted, logprobs=record.logprobs), kind)
        if kind == "chat":
            delta = {"role": "assistant", "content": delta_text} if first else {field: delta_text}
            if finish:
                delta = {}
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta_text, "logprobs": lp, "finish_reason": finish}
        return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

    async def pump(i, job, out):  # one job's events, then None; an error of our own should its worker not answer
        while True:
            item = await job.next(timeout=0.5)
            if item is None:
                if overdue(job):
                    await out.put((i, ("error", overdue(job))))
                    return
                continue
            await out.put((i, None if item[0] == "end" else item))
            if item[0] == "end":
                return

    out: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(pump(i, job, out)) for i, job in enumerate(jobs)] if len(jobs) > 1 else []

    async def take():  # the next (choice, event or None at its end): one job is read directly, no relay task
        if tasks:
            return await out.get()
        while True:
            item = await jobs[0].next(timeout=0.5)
            if item is not None:
                return 0, None if item[0] == "end" else item
            if overdue(jobs[0]):
                return 0, ("error", overdue(jobs[0]))

    results, open_jobs = {}, len(jobs)
    try:  # a client that hangs up cancels this generator; the finally stops every generation
        held = {i: [] for i in range(len(jobs))}
        if kind == "chat":
            for i in range(len(jobs)):
                yield event(i, "", first=True)
        for i, text in enumerate(echoed or []):
            yield event(i, text)
        while open_jobs:
            i, item = await take()
            if item is None:
                open_jobs -= 1
                continue
            ev, payload = item
            if ev == "error":
                err = job_failure(payload)
                yield f"data: {json.dumps(error_body(err.message, err.type, err.code))}\n\n"
                break
            final = payload.result is not None
            if tool_list:
                held[i].append(payload.text)
            elif splits is not None:
                thought, said = splits[i].feed(payload.text, final)
                if thought:
                    yield event(i, thought, record=payload.record, field="reasoning_content")
                if said or (payload.record.logprobs and not thought):
                    yield event(i, said, record=None if thought else payload.record)
            elif payload.text or payload.record.logprobs:
                yield event(i, payload.text, record=payload.record)
            if final:
                results[i] = payload.result
                finish = payload.result.finish_reason
                if tool_list:
                    text = "".join(held[i])
                    if splits is not None:
                        thought, text = splits[i].feed(text, final=True)
                        if thought:
                            yield event(i, thought, field="reasoning_content")
                    calls = tools.parse_call(text, tool_list)
                    if calls:
                        finish = "tool_calls"
                        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                        yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"
                    elif text:
                        yield event(i, text)
                yield event(i, "", finish=finish)
        if include_usage and len(results) == len(jobs):
            ordered = [results[i] for i in sorted(results)]
            last = {**meta, "object": obj, "choices": [],
                    "usage": usage(prompt_tokens, ordered, choices, count(decoder, ordered, reasoning)),
                    "specdec": {**spec_stats(results[0]), **meta.get("specdec", {})}}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - this request's own failure ends its stream with an error chunk
        err = stream_failure(e)
        yield f"data: {json.dumps(error_body(err.message, err.type, err.code))}\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for job in jobs:
            job.cancel()
