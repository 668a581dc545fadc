"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (streaming or not), /v1/models, /health,
/metrics. Every error is a 4xx (or 429/504) with an OpenAI-style error object."""
from __future__ import annotations

import hmac

import asyncio
import json
import logging
import os
import threading
import time
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import models
from ..drafters.base import save as save_drafter
from ..errors import InvalidRequest, SpecDecError
from ..fim import fim_prompt
from ..sampling import SEED_RANGE
from .metrics import Metrics
from . import tools
from .schemas import ChatRequest, CompletionRequest, InfillRequest
from .worker import BatchWorker, Busy, JobTimeout, Worker, WorkerDown

log = logging.getLogger("specdec.server")


def _warm_grammars(decoder) -> None:
    """Read the vocabulary for structured outputs (about a second) at start, not in the first such request."""
    try:
        decoder.grammars.lltokenizer
    except Exception:  # noqa: BLE001 - no llguidance or a tokenizer it cannot read: such requests get a 400 later
        pass


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def create_app(decoder, model_name: str = "specdec", api_key: str | None = None, max_queue: int = 16,
               timeout_s: float = 300.0, max_tokens_default: int = 256, max_body_bytes: int = 1 << 20,
               trace_dir: str | None = None, batch: bool = True, max_batch_rows: int | None = None,
               prefill_chunk: int = 32, max_tau: int = 8) -> FastAPI:
    """`decoder`: a SpecDecoder, or a function that makes one on the model worker's thread (what `specdec serve`
    passes: see worker.Worker). `batch`: on specdec's runtime, serve all admitted requests in each target pass
    (BatchWorker) with `max_batch_rows` rows per pass (default: from the pass curve measured at start,
    batch.default_budget); the transformers backend, or batch=False, serves one request at a time."""
    metrics = Metrics()
    if (max_batch_rows is not None and max_batch_rows < 1) or prefill_chunk < 1 or max_tau < 0:
        raise InvalidRequest("--max-batch-rows and --prefill-chunk must be >= 1, --max-tau >= 0")
    if batch:
        worker = BatchWorker(decoder, metrics, max_queue, timeout_s, trace_dir,
                             lambda d: batch_engine(d, max_batch_rows, prefill_chunk), max_tau)
    else:
        worker = Worker(decoder, metrics, max_queue, timeout_s, trace_dir)
    worker.wait_ready()
    decoder = worker.decoder
    threading.Thread(target=_warm_grammars, args=(decoder,), daemon=True).start()
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    app.state.metrics, app.state.worker, app.state.decoder = metrics, worker, decoder

    def shutdown():
        worker.stop()
        try:  # what the drafter learned (recycle's table) is there at the next start
            save_drafter(decoder.engine.drafter)
        except OSError as e:
            log.warning("could not save the drafter's table: %s", e)

    app.router.add_event_handler("shutdown", shutdown)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.code), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")  # pydantic's prefix
        return JSONResponse(error_body(f"{where + ': ' if where else ''}{msg}"), 400)

    @app.exception_handler(SpecDecError)
    async def _specdec(request, exc: SpecDecError):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # never a plain-text traceback page
        return JSONResponse(error_body(f"internal error in this request: {type(exc).__name__}", "server_error",
                                       "internal_error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health")
    async def health():  # pid: which process answered (replicas behind Ray Serve's proxy)
        body = {"status": "ok" if worker.alive else "unavailable", "queue_depth": worker.pending,
                "worker_restarts": worker.restarts, "pid": os.getpid()}
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        messages = [m.for_template() for m in req.messages]
        if req.tools and req.tool_choice != "none":  # described to the model; a call may be forced (tools.py)
            messages = tools.with_tools(messages, req.tools)
        return await _serve(req, request, [messages], chat=True, kind="chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompts = req.prompt
        if req.suffix:  # fill-in-the-middle: each prompt is the code before the gap
            prompts = [await _fim(p, req.suffix) for p in prompts]
        return await _serve(req, request, prompts, chat=False, kind="text")

    @app.post("/infill")
    async def infill(req: InfillRequest, request: Request):
        """llama-server's fill-in-the-middle endpoint, answered in its format (`content`, `stop`; streamed as
        server-sent events of the same), served as a completion of the FIM prompt."""
        files = [(c.filename, c.text) for c in req.input_extra]
        ids = await _fim(req.input_prefix + req.prompt, req.input_suffix, files)
        seed = None if req.seed in (None, -1) else req.seed
        completion = CompletionRequest(prompt=ids, max_tokens=req.token_limit, temperature=req.temperature,
                                       top_p=req.top_p, top_k=req.top_k, seed=seed, stop=req.stop, stream=req.stream,
                                       model=req.model, cache_salt=req.cache_salt,
                                       stream_options={"include_usage": True} if req.stream else None)
        return as_infill(await _serve(completion, request, completion.prompt, chat=False, kind="text"), model_name)

    async def _fim(prefix: str, suffix: str, files=()) -> list[int]:
        try:  # on a thread, with the encoding copy of the tokenizer (as prompts are encoded)
            return await asyncio.to_thread(fim_prompt, decoder._encoder, prefix, suffix, list(files), None,
                                           decoder._encoder_lock)
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None

    async def _serve(req, request: Request, prompts: list, chat: bool, kind: str):
        """One job per (prompt, choice): separate sequences in the batch (the prefix cache shares a prompt's K/V
        once the first has been prefilled); a seeded request's choice i gets seed + i."""
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found")
        if not worker.alive:
            raise APIError(503, "the model worker is down; retry later", "server_error", "worker_down")
        # on a thread (the tokenizer releases the GIL), with its own copy of the tokenizer: neither the event loop
        # nor the model worker waits for a long prompt; raises InvalidRequest / PromptTooLong -> 400
        encoded = [await asyncio.to_thread(decoder.encode, p, chat) if chat or isinstance(p, str)
                   else _token_prompt(p) for p in prompts]
        if not chat:  # token-id prompts travel as their text (echo, the job's prompt) and their ids
            with decoder.tokenizer_lock:
                prompts = [p if isinstance(p, str) else decoder.tokenizer.decode(p) for p in prompts]
        limits = []
        for prompt_ids in encoded:
            room = decoder.context_window - len(prompt_ids)
            limits.append(req.token_limit if req.token_limit is not None else min(max_tokens_default, room))
            if limits[-1] > room:
                raise APIError(400, f"max_tokens {limits[-1]} + prompt {len(prompt_ids)} tokens exceed the context "
                                    f"window of {decoder.context_window}", code="context_length_exceeded")
            if getattr(worker, "engine", None) is not None:  # a prompt the whole KV memory cannot hold: 400 now
                try:
                    worker.engine.check_fits(prompt_ids)
                except InvalidRequest as e:
                    raise APIError(400, str(e), code="context_length_exceeded") from None
        calling = kind == "chat" and bool(req.tools) and req.tool_choice != "none"
        echo = kind == "text" and req.echo
        response_format = tools.call_format(req.tools, req.tool_choice) if calling else req.response_format
        jobs = []
        for prompt, prompt_ids, max_tokens in zip(prompts, encoded, limits):
            for c in range(req.n):
                seed = None if req.seed is None else (req.seed + c if req.seed + c < SEED_RANGE else req.seed + c -
                                                      SEED_RANGE)
                try:
                    job = worker.submit(dict(prompt=prompt, chat=chat, max_new_tokens=max_tokens,
                                             temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                             seed=seed, stop=req.stop, tau=req.tau, policy=req.policy,
                                             prompt_ids=prompt_ids, response_format=response_format,
                                             prediction=req.prediction.text if req.prediction else None,
                                             logprobs=req.logprob_count,
                                             prompt_logprobs=req.logprob_count if echo else None),
                                        salt=req.tenant_salt)
                except Busy as e:
                    for j in jobs:
                        j.cancel()
                    raise _as_api_error(e) from None
                jobs.append(job)
        meta = dict(id=("chatcmpl-" if kind == "chat" else "cmpl-") + jobs[0].id, created=int(time.time()),
                    model=model_name)
        if req.stream:
            return StreamingResponse(_sse(jobs, meta, kind, req.include_usage, sum(len(ids) for ids in encoded),
                                          req.tools if calling else None,
                                          [prompts[i // req.n] for i in range(len(jobs))] if echo else None),
                                     media_type="text/event-stream")
        try:
            done = await asyncio.gather(*(_collect(job, request) for job in jobs))
        finally:
            for job in jobs:
                job.cancel()  # a no-op once a job has ended
        if any(d is None for d in done):
            return Response(status_code=499)
        choices = []
        for i, (text, result) in enumerate(done):
            lp, finish = _logprobs(result, kind), result.finish_reason
            if echo:  # the prompt, then the completion; prompt tokens lead the logprobs (the first has none)
                text = prompts[i // req.n] + text
                lp = _echo_logprobs(encoded[i // req.n], result, lp)
            calls = tools.parse_call(text, req.tools) if calling else None
            message = ({"role": "assistant", "content": None, "tool_calls": calls} if calls else
                       {"role": "assistant", "content": text})
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": "tool_calls" if calls else finish} if kind == "chat" else
                           {"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        return {**meta, "object": "chat.completion" if kind == "chat" else "text_completion", "choices": choices,
                "usage": _usage(sum(len(ids) for ids in encoded), [r for _, r in done]),
                "specdec": _spec_stats(done[0][1])}

    async def _collect(job, request: Request):
        """A job's text and result; None when the client hung up."""
        text, result, checked = [], None, time.monotonic()
        try:
            while True:
                if time.monotonic() - checked > 0.5:  # notice a client that hung up while it waits or runs
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
                    raise _as_api_error(payload)
                text.append(payload.text)
                result = payload.result or result
        finally:
            job.cancel()  # a no-op once the job has ended
        return "".join(text), result

    async def _sse(jobs, meta, kind, include_usage, prompt_tokens: int, tool_list=None, echoed=None):
        """Server-sent events of one or several jobs (n choices, prompt lists), each chunk with its choice's index.
        With tools (`tool_list`) a choice's text is held to its end, then sent as tool_calls or as content; with echo
        (`echoed`: each choice's prompt text) the prompt comes first."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(i, delta_text, finish=None, first=False, record=None):
            lp = None if record is None or record.logprobs is None else _logprobs(
                SimpleNamespace(token_ids=record.emitted, logprobs=record.logprobs), kind)  # this cycle's tokens
            if kind == "chat":
                delta = {"role": "assistant", "content": delta_text} if first else {"content": delta_text}
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
                    err = _as_api_error(payload)
                    yield f"data: {json.dumps(error_body(err.message, err.type, err.code))}\n\n"
                    break
                if tool_list:
                    held[i].append(payload.text)
                elif payload.text or payload.record.logprobs:
                    yield event(i, payload.text, record=payload.record)
                if payload.result is not None:
                    results[i] = payload.result
                    finish = payload.result.finish_reason
                    if tool_list:
                        text = "".join(held[i])
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
                usage = {**meta, "object": obj, "choices": [], "usage": _usage(prompt_tokens, list(results.values())),
                         "specdec": _spec_stats(results[0])}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for job in jobs:
                job.cancel()

    def _logprobs(result, kind: str):
        """OpenAI's logprobs object for the generated tokens (an EOS, which adds no text, left out), or None."""
        if result.logprobs is None:
            return None
        eos = decoder.engine.eos_ids
        with decoder.tokenizer_lock:
            piece = lambda t: decoder.tokenizer.decode([t])  # noqa: E731
            rows = [(piece(t), lp, [(piece(a), alp) for a, alp in alts])
                    for t, (lp, alts) in zip(result.token_ids, result.logprobs) if t not in eos]
        if kind == "chat":
            entry = lambda tok, lp: {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}  # noqa: E731
            return {"content": [{**entry(tok, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                                for tok, lp, alts in rows]}
        offsets, at = [], 0
        for tok, _, _ in rows:
            offsets.append(at)
            at += len(tok)
        return {"tokens": [tok for tok, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(alts) for _, _, alts in rows], "text_offset": offsets}

    def _token_prompt(ids: list[int]) -> list[int]:
        vocab = decoder.model.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= decoder.context_window:
            raise APIError(400, f"prompt of {len(ids)} tokens does not fit the context window of "
                                f"{decoder.context_window}", code="context_length_exceeded")
        return list(ids)

    def _echo_logprobs(prompt_ids, result, lp):
        if result.prompt_logprobs is None:
            return lp
        with decoder.tokenizer_lock:
            piece = lambda t: decoder.tokenizer.decode([t])  # noqa: E731
            tokens = [piece(t) for t in prompt_ids]
            tops = [None] + [{piece(a): alp for a, alp in alts} for _, alts in result.prompt_logprobs]
        lps = [None] + [v for v, _ in result.prompt_logprobs]
        gen = lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens + gen["tokens"], "token_logprobs": lps + gen["token_logprobs"],
                "top_logprobs": tops + gen["top_logprobs"], "text_offset": offsets + [at + o for o in gen["text_offset"]]}

    def overdue(job) -> APIError | None:
        """The worker enforces timeouts; should it stop answering, the handler does: 503 at once for a dead worker,
        504 a grace period after the deadline."""
        if not worker.alive:
            return APIError(503, "the model worker stopped while serving this request; retry", "server_error",
                            "worker_down")
        if time.monotonic() > job.deadline + TIMEOUT_GRACE_S:
            return APIError(504, f"request exceeded the {timeout_s:g} s timeout", "timeout_error", "timeout")
        return None

    return app


TIMEOUT_GRACE_S = 5.0


def batch_engine(decoder, max_batch_rows: int | None, prefill_chunk: int):
    """The BatchEngine for a decoder on specdec's runtime, else None (one request at a time)."""
    from ..batch import BatchEngine, default_budget, measure_pass_curve, measure_row_cost
    if not models.is_runtime(decoder.model):
        return None
    from ..runtime.measured import remembered, remembered_curve
    model = decoder.model
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_batch_rows or 1})
    context, rows = min(64, decoder.context_window // 2), min(32, prefill_chunk)
    # measured once per model file, machine and numerics, then read back (runtime/measured.py); refined online
    curve = remembered_curve(model, "pass_curve", {"sizes": sizes, "context": context},
                             lambda: measure_pass_curve(model, sizes, context=context))
    engine = BatchEngine(model, decoder.engine.drafter, model.config.vocab_size, decoder.engine.eos_ids,
                         decoder.context_window, max_batch_rows or default_budget(curve), prefill_chunk, curve)
    row_ms, key_ms = remembered(model, "row_cost", {"rows": rows}, lambda: list(measure_row_cost(model, rows=rows)))
    engine.calibrate(row_ms, key_ms)  # what admission predicts with
    return engine


KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/infill"}


class _BodyTooLarge(Exception):
    pass


class Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the endpoints): API key and
    body-size checks before any parsing, and a request counter by endpoint and status."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        async def read_body() -> bytes:
            """The whole body, refused past max_body however it is sent (Content-Length or chunked): the size is
            checked here, before the app parses anything."""
            parts, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > self.max_body:
                    raise _BodyTooLarge
                more = message.get("more_body", False)
            return b"".join(parts)

        try:
            if self.api_key and path != "/health" and not hmac.compare_digest(  # constant time: no timing oracle
                    headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode()):
                await JSONResponse(error_body("missing or invalid API key", "authentication_error",
                                              "invalid_api_key"), 401)(scope, receive, send_counted)
            elif int(headers.get(b"content-length", b"0") or 0) > self.max_body:
                raise _BodyTooLarge
            else:
                body, replayed = await read_body(), False

                async def replay():  # the body once, then the real channel (disconnect detection)
                    nonlocal replayed
                    if replayed:
                        return await receive()
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await self.app(scope, replay, send_counted)
        except _BodyTooLarge:
            await JSONResponse(error_body(f"request body larger than {self.max_body} bytes"), 413)(
                scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(endpoint=path if path in KNOWN_PATHS else "other",
                                         status=str(status["code"])).inc()


def _as_api_error(exc) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, JobTimeout):
        return APIError(504, str(exc), "timeout_error", "timeout")
    if isinstance(exc, Busy):
        return APIError(429, str(exc), "rate_limit_error", exc.code, {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, SpecDecError):
        return APIError(400, str(exc))
    if isinstance(exc, WorkerDown):
        return APIError(503, str(exc), "server_error", "worker_down")
    # this request's own failure (the others go on): named, without internals
    return APIError(500, f"internal error in this request: {type(exc).__name__}", "server_error", "internal_error")


def as_infill(out, model_name: str):
    """A completion (a dict, or a stream of OpenAI chunks) in llama-server's /infill format."""
    if isinstance(out, StreamingResponse):
        async def events():
            counts = {}
            async for line in out.body_iterator:
                line = line.decode() if isinstance(line, bytes) else line
                if not line.startswith("data: "):
                    continue
                if line.strip() == "data: [DONE]":
                    yield f"data: {json.dumps({'content': '', 'stop': True, 'model': model_name, **counts})}\n\n"
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    yield line
                elif data.get("usage"):
                    counts = {"tokens_predicted": data["usage"]["completion_tokens"],
                              "tokens_evaluated": data["usage"]["prompt_tokens"]}
                elif data.get("choices") and data["choices"][0].get("text"):
                    yield f"data: {json.dumps({'content': data['choices'][0]['text'], 'stop': False})}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    if not isinstance(out, dict):
        return out  # the client hung up (499)
    choice, usage = out["choices"][0], out["usage"]
    return {"content": choice["text"], "stop": True, "model": model_name,
            "stop_type": "limit" if choice["finish_reason"] == "length" else "eos",
            "tokens_predicted": usage["completion_tokens"], "tokens_evaluated": usage["prompt_tokens"]}


def _usage(prompt_tokens: int, results: list) -> dict:
    """OpenAI's usage object; with a prediction, completion_tokens_details counts its drafted tokens the target
    accepted and rejected (every choice's together)."""
    completion = sum(len(r.token_ids) for r in results)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion}
    if any("accepted_prediction_tokens" in r.stats for r in results):
        usage["completion_tokens_details"] = {k: sum(r.stats.get(k, 0) for r in results) for k in
                                              ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    return usage


def _spec_stats(result) -> dict:
    s = result.stats
    return {k: s[k] for k in ("acceptance_rate", "mean_accepted_len", "target_passes", "proposed", "accepted",
                              "acceptance_by_position", "tokens_per_s")}
