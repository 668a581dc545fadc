"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions (streaming or not), /v1/responses
(responses_api.py), /v1/models, /health, /metrics; Anthropic's /v1/messages (anthropic_api.py) and llama-server's own
endpoints (llama_compat.py) beside them. Every error is a 4xx (or 429/504) with an
OpenAI-style error object."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import models
from ..batch.calibration import run_beside
from ..drafters.base import save as save_drafter
from ..errors import InvalidRequest, SpecDecError
from ..fim import fim_prompt
from ..penalties import penalties
from ..sampling import SEED_RANGE
from . import anthropic_api, conversations, dashboard, llama_compat, reasoning, responses_api, tools
from .api_errors import APIError, as_api_error, error_body
from .guard import Guard
from .metrics import Metrics
from .openai_format import echo_logprobs, logprobs, spec_stats, usage
from .response_store import ResponseStore
from .schemas import ChatRequest, CompletionRequest
from .streaming import collect, sse
from .worker import BatchWorker, Busy, Worker

log = logging.getLogger("specdec.server")


class SafeJSON(JSONResponse):
    """A JSON answer that can always be sent: text that is not valid Unicode (a lone surrogate a client sent, kept in
    a conversation or in metadata) goes out as its \\u escape instead of failing the UTF-8 encoding (a 500)."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _warm_grammars(decoder) -> None:
    """Read the vocabulary for structured outputs and mask once (2-5 s here the first time in a process, a few ms
    after) at start, not in the first such request."""
    try:
        import torch
        decoder.grammars.constraint({"type": "json_object"}).masked(torch.zeros(decoder.grammars.vocab_size))
    except Exception:  # noqa: BLE001 - no llguidance or a tokenizer it cannot read: such requests get a 400 later
        pass


def create_app(decoder, model_name: str = "specdec", api_key: str | list[str] | None = None,
               max_queue: int = 16, timeout_s: float = 300.0, max_tokens_default: int = 256,
               max_body_bytes: int = 1 << 20, trace_dir: str | None = None, batch: bool = True,
               max_batch_rows: int | None = None, prefill_chunk: int = 32, max_tau: int = 8,
               reasoning_format: str = "auto", response_store_mb: float = 64, pass_log: str | None = None) -> FastAPI:
    """`decoder`: a SpecDecoder, or a function that makes one on the model worker's thread (what `specdec serve`
    passes: see worker.Worker). `batch`: on specdec's runtime, serve all admitted requests in each target pass
    (BatchWorker) with `max_batch_rows` rows per pass (default: from the pass curve measured at start,
    batch.default_budget); the transformers backend, or batch=False, serves one request at a time.
    `reasoning_format`: auto (a thinking template's reasoning goes to `reasoning_content`, reasoning.py) or none
    (left in the content), a request's own `reasoning_format` over it. `response_store_mb`: the memory for stored
    Responses API responses and for conversations, each (response_store.py, conversations.py; 0 keeps none).
    `max_tokens_default`: the answer's length for a request that sets none (0: until the context window).
    `pass_log`: a file the batch engine appends each pass's record to (batch/pass_log.py)."""
    metrics = Metrics()
    if (max_batch_rows is not None and max_batch_rows < 1) or prefill_chunk < 1 or max_tau < 0:
        raise InvalidRequest("--max-batch-rows and --prefill-chunk must be >= 1, --max-tau >= 0")
    if not response_store_mb >= 0 or max_tokens_default < 0:
        raise InvalidRequest("--response-store-mb and --max-tokens must be >= 0")
    if reasoning_format not in reasoning.FORMATS:
        raise InvalidRequest(f"--reasoning-format must be one of {', '.join(reasoning.FORMATS)}")
    log_passes = open_pass_log(pass_log, batch)
    if batch:
        worker = BatchWorker(decoder, metrics, max_queue, timeout_s, trace_dir,
                             lambda d: logging_passes(batch_engine(d, max_batch_rows, prefill_chunk), log_passes),
                             max_tau)
    else:
        worker = Worker(decoder, metrics, max_queue, timeout_s, trace_dir)
    if isinstance(api_key, list):  # a key given twice is one tenant, not two (it would halve every key's share)
        api_key = list(dict.fromkeys(api_key))
    keys = 1 if isinstance(api_key, str) else max(1, len(api_key or []))
    worker.keys = keys  # each key's first request finds a place in the queue
    worker.wait_ready()
    decoder = worker.decoder
    run_beside(_warm_grammars, decoder)  # (its passes' times price nothing meanwhile: calibration)
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, default_response_class=SafeJSON)
    app.state.metrics, app.state.worker, app.state.decoder = metrics, worker, decoder

    app.state.history = dashboard.History(metrics.registry)  # the dashboard's last minutes

    def shutdown():
        app.state.history.stop()
        worker.stop()
        if log_passes is not None:
            log_passes.close()
        try:  # what the drafter learned (recycle's table) is there at the next start
            save_drafter(decoder.engine.drafter)
        except OSError as e:
            log.warning("could not save the drafter's table: %s", e)
        keep = getattr(getattr(worker, "engine", None), "keep_refined_curve", None)
        if keep is not None:  # and the pass times it saw, for the next start's scheduler
            keep()

    app.router.add_event_handler("shutdown", shutdown)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

    def failed(request, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
               headers: dict | None = None) -> JSONResponse:
        """An error in the shape its API's clients parse: Anthropic's on /v1/messages, else OpenAI's."""
        body = anthropic_api.error(status, message) if request.url.path.startswith("/v1/messages") else \
            error_body(message, type_, code)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return failed(request, exc.status, exc.message, exc.type, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")  # pydantic's prefix
        return failed(request, 400, f"{where + ': ' if where else ''}{msg}")

    @app.exception_handler(SpecDecError)
    async def _specdec(request, exc: SpecDecError):
        return failed(request, 400, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # never a plain-text traceback page
        return failed(request, 500, f"internal error in this request: {type(exc).__name__}", "server_error",
                      "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return failed(request, exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():  # pid: which process answered (replicas behind Ray Serve's proxy)
        body = {"status": "ok" if worker.alive else "unavailable", "queue_depth": worker.pending,
                "worker_restarts": worker.restarts, "pid": os.getpid()}
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def live_page():  # the metrics above, drawn over the last minutes (dashboard.py)
        return HTMLResponse(dashboard.page(model_name, getattr(decoder.engine.drafter, "name", "none")))

    @app.get("/dashboard/data")
    async def live_data(history: bool = False):
        now = dashboard.snapshot(metrics.registry)
        return {"now": now, "history": list(app.state.history.snapshots)} if history else {"now": now}

    # the model as OpenAI's clients read it, with the fields Anthropic's read beside them
    served = {"id": model_name, "object": "model", "created": 0, "owned_by": "specdec", "type": "model",
              "display_name": model_name, "created_at": "1970-01-01T00:00:00Z"}

    @app.get("/v1/models")
    async def list_models(after_id: str | None = None, before_id: str | None = None):
        """One model; Anthropic's cursor (`after_id`, `before_id`) past it is an empty page, whose null ids end a
        client's paging (clients before anthropic 2.x page on until `last_id` is null)."""
        if after_id is not None or before_id is not None:
            return {"object": "list", "data": [], "has_more": False, "first_id": None, "last_id": None}
        return {"object": "list", "data": [served], "has_more": False, "first_id": model_name, "last_id": model_name}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found")
        return served

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await _serve(req, request, [[m.for_template() for m in req.messages]], chat=True, kind="chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompts = req.prompt
        if req.suffix:  # fill-in-the-middle: each prompt is the code before the gap
            prompts = [await _fim(p, req.suffix) for p in prompts]
        return await _serve(req, request, prompts, chat=False, kind="text")

    async def _fim(prefix: str, suffix: str, files=()) -> list[int]:
        try:  # on a thread, with the encoding copy of the tokenizer (as prompts are encoded)
            return await asyncio.to_thread(fim_prompt, decoder._encoder, prefix, suffix, list(files), None,
                                           decoder._encoder_lock)
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None

    async def _serve(req, request: Request, prompts: list, chat: bool, kind: str, job_extra: dict | None = None,
                     respond=None):
        """One job per (prompt, choice): separate sequences in the batch (the prefix cache shares a prompt's K/V
        once the first has been prefilled); a seeded request's choice i gets seed + i. `job_extra`: what the jobs
        take beside the request's fields; `respond(jobs, encoded, prompts)`: the answer in another API's format
        (llama_compat.py), else OpenAI's."""
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found")
        if not worker.alive:
            raise APIError(503, "the model worker is down; retry later", "server_error", "worker_down")
        # tools are described to the model: by its own chat template where it has a tool format, else in a system
        # message; a call may be forced (tools.py)
        calling = kind == "chat" and bool(req.tools) and req.tool_choice != "none"
        template_tools = None
        if calling:
            described = [tools.described(decoder.tokenizer, p, req.tools) for p in prompts]
            prompts, template_tools = [m for m, _ in described], described[0][1]
        # on a thread (the tokenizer releases the GIL), with its own copy of the tokenizer: neither the event loop
        # nor the model worker waits for a long prompt; raises InvalidRequest / PromptTooLong -> 400
        variables = req.template_variables if kind == "chat" else None
        encoded = [await asyncio.to_thread(decoder.encode, p, chat, template_tools, variables)
                   if chat or isinstance(p, str) else _token_prompt(p) for p in prompts]
        if not chat:  # token-id prompts travel as their text (echo, the job's prompt) and their ids
            with decoder.tokenizer_lock:
                prompts = [p if isinstance(p, str) else decoder.tokenizer.decode(p) for p in prompts]
        limits = []
        for prompt_ids in encoded:
            room = decoder.context_window - len(prompt_ids)
            limits.append(req.token_limit if req.token_limit is not None else
                          min(max_tokens_default, room) if max_tokens_default else room)
            if limits[-1] > room:
                raise APIError(400, f"max_tokens {limits[-1]} + prompt {len(prompt_ids)} tokens exceed the context "
                                    f"window of {decoder.context_window}", code="context_length_exceeded")
            if getattr(worker, "load", None) is not None:  # a prompt the whole KV memory cannot hold: 400 now
                try:
                    worker.load.check_fits(prompt_ids)
                except InvalidRequest as e:
                    raise APIError(400, str(e), code="context_length_exceeded") from None
        echo = kind == "text" and req.echo
        if calling:
            response_format = tools.call_format(req.tools, req.tool_choice, tools.native(decoder.tokenizer))
        else:
            response_format = req.response_format or (
                {"type": "gbnf", "grammar": req.grammar} if req.grammar is not None else None)
        # a bias on a token the model lacks: a 400 before any stream starts (the worker checks again in prepare)
        penalties(decoder.model.config.vocab_size, req.presence_penalty or 0.0, req.frequency_penalty or 0.0,
                  req.logit_bias, req.repetition_penalty or 1.0)
        # an unseeded sampled request gets a seed from the OS, reported in `specdec.seed`: any answer can be
        # reproduced by sending it back (and a retry elsewhere regenerates the same text)
        base = req.seed if req.seed is not None or req.temperature == 0 else secrets.randbits(63)
        jobs = []
        for prompt, prompt_ids, max_tokens in zip(prompts, encoded, limits):
            for c in range(req.n):
                seed = None if base is None else (base + c if base + c < SEED_RANGE else base + c - SEED_RANGE)
                try:
                    job = worker.submit(dict(prompt=prompt, chat=chat, max_new_tokens=max_tokens,
                                             temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                             min_p=req.min_p,
                                             seed=seed, stop=req.stop, tau=req.tau, policy=req.policy,
                                             prompt_ids=prompt_ids, response_format=response_format,
                                             prediction=req.prediction.text if req.prediction else None,
                                             presence_penalty=req.presence_penalty or 0.0,
                                             frequency_penalty=req.frequency_penalty or 0.0,
                                             logit_bias=req.logit_bias,
                                             repetition_penalty=req.repetition_penalty or 1.0,
                                             logprobs=req.logprob_count,
                                             prompt_logprobs=req.logprob_count if echo else None) | (job_extra or {}),
                                        salt=req.tenant_salt(getattr(request.state, "tenant", b"")),
                                        key=getattr(request.state, "tenant", b""))
                except Busy as e:
                    for j in jobs:
                        j.cancel()
                    raise as_api_error(e) from None
                jobs.append(job)
        if respond is not None:
            return await respond(jobs, encoded, prompts)
        # a thinking template's answers: reasoning apart from content, each choice from where its prompt leaves it
        thinking = None
        if kind == "chat" and (req.reasoning_format or reasoning_format) != "none" and reasoning.thinks(
                decoder.tokenizer):  # (an answer a grammar writes from its first token starts outside any <think>)
            with decoder.tokenizer_lock:
                thinking = [not req.grammar_writes_reasoning and reasoning.opens_inside(decoder.tokenizer,
                                                                                        encoded[i // req.n])
                            for i in range(len(jobs))]
        meta = dict(id=("chatcmpl-" if kind == "chat" else "cmpl-") + jobs[0].id, created=int(time.time()),
                    model=model_name, specdec={"seed": base})
        if req.stream:
            return StreamingResponse(sse(decoder, jobs, meta, kind, req.include_usage, sum(len(ids) for ids in encoded),
                                         overdue, req.tools if calling else None,
                                         [prompts[i // req.n] for i in range(len(jobs))] if echo else None,
                                         thinking, req.n),
                                     media_type="text/event-stream")
        try:
            done = await asyncio.gather(*(collect(job, request, overdue) for job in jobs))
        finally:
            for job in jobs:
                job.cancel()  # a no-op once a job has ended
        if any(d is None for d in done):
            return Response(status_code=499)
        choices = []
        for i, (text, result) in enumerate(done):
            lp, finish = logprobs(decoder, result, kind), result.finish_reason
            if echo:  # the prompt, then the completion; prompt tokens lead the logprobs (the first has none)
                text = prompts[i // req.n] + text
                lp = echo_logprobs(decoder, encoded[i // req.n], result, lp)
            thought = None
            if thinking is not None:
                thought, text = reasoning.split(text, thinking[i])
            calls = tools.parse_call(text, req.tools) if calling else None
            message = ({"role": "assistant", "content": None, "tool_calls": calls} if calls else
                       {"role": "assistant", "content": text})
            if thought is not None:
                message["reasoning_content"] = thought
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": "tool_calls" if calls else finish} if kind == "chat" else
                           {"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        return {**meta, "object": "chat.completion" if kind == "chat" else "text_completion", "choices": choices,
                "usage": usage(sum(len(ids) for ids in encoded), [r for _, r in done], req.n,
                               reasoning.count(decoder, [r for _, r in done], thinking)),
                "specdec": {**spec_stats(done[0][1]), "seed": base}}

    def _token_prompt(ids: list[int]) -> list[int]:
        vocab = decoder.model.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= decoder.context_window:
            raise APIError(400, f"prompt of {len(ids)} tokens does not fit the context window of "
                                f"{decoder.context_window}", code="context_length_exceeded")
        return list(ids)

    def overdue(job) -> APIError | None:
        """The worker enforces timeouts; should it stop answering, the handler does: 503 at once for a dead worker,
        504 a grace period after the deadline."""
        if not worker.alive:
            return APIError(503, "the model worker stopped while serving this request; retry", "server_error",
                            "worker_down")
        if time.monotonic() > job.deadline + TIMEOUT_GRACE_S:
            return APIError(504, f"request exceeded the {timeout_s:g} s timeout", "timeout_error", "timeout")
        return None

    llama_compat.add_routes(app, _serve, _fim, overdue, decoder, model_name, decoder.context_window)
    app.state.responses = ResponseStore(int(response_store_mb * 2**20), keys)  # a share per key
    app.state.conversations = conversations.Conversations(int(response_store_mb * 2**20), keys)
    for kind, store in (("responses", app.state.responses), ("conversations", app.state.conversations)):
        metrics.stored.labels(kind).set_function(lambda store=store: store.bytes)  # read at each scrape
    responses_api.add_routes(app, _serve, overdue, decoder, model_name, app.state.responses, app.state.conversations,
                             max_tokens_default)
    conversations.add_routes(app, app.state.conversations)
    anthropic_api.add_routes(app, _serve, overdue, decoder, model_name)
    return app


TIMEOUT_GRACE_S = 5.0


def open_pass_log(path: str | None, batch: bool):
    """--pass-log's writer, or None; a path it cannot write is refused in one line."""
    if path is None:
        return None
    if not batch:
        raise InvalidRequest("--pass-log logs the batch engine's passes: it cannot go with --no-batch")
    from ..batch.pass_log import PassLog
    try:
        return PassLog(path)
    except OSError as e:
        raise InvalidRequest(f"--pass-log {path}: {e.strerror or e}") from None


def logging_passes(engine, log):
    """The engine with its passes logged to `log`; a model only transformers runs has no batch engine to log."""
    if log is not None and engine is None:
        raise InvalidRequest("--pass-log needs a model specdec's runtime runs (the batch engine's passes)")
    if engine is not None:
        engine.pass_log = log
    return engine


def batch_engine(decoder, max_batch_rows: int | None, prefill_chunk: int):
    """The BatchEngine for a decoder on specdec's runtime, else None (one request at a time)."""
    from ..batch import (
        BatchEngine,
        default_budget,
        measure_pass_curve,
        measure_row_cost,
    )
    from ..batch.calibration import Disturbed, server_curve
    from ..costs import interpolate
    from ..runtime.progress import Step
    if not models.is_runtime(decoder.model):
        return None
    from ..drafters.base import draft_caches
    from ..runtime.measured import remembered, remembered_curve, store_curve
    model = decoder.model
    sizes, context, params = server_curve(decoder.context_window, max_batch_rows)
    rows = min(32, prefill_chunk)
    # measured once per model file, machine and numerics, then read back (runtime/measured.py); refined online, and
    # the refinement stored when the server stops (keep_refined_curve)
    measured = []  # whether this process measured the curve (else the stored one is only a prior)

    def measure():
        measured.append(1)
        said = bool(getattr(model, "fingerprint", None))  # (one file: measured once, stored, and said)
        with Step(f"measuring the pass curve ({len(sizes)} sizes up to {max(sizes)} rows; once on this machine)",
                  quiet=not said) as step:
            return measure_pass_curve(model, sizes, context=context, check=said, step=step)  # (checked if stored)

    def row_cost():
        ahead = 1024 // rows + 8  # a 1,024-position prompt, then 8 chunks at two depths (measure_row_cost)
        with Step(f"measuring a prompt row's cost ({rows}-row chunks; once on this machine)",
                  ahead * interpolate(curve, rows) / 1e3, quiet=not getattr(model, "fingerprint", None)):
            return list(measure_row_cost(model, rows=rows))
    try:
        curve = remembered_curve(model, "pass_curve", params, measure)
    except Disturbed as e:  # used for this run, not stored: the next start measures again
        print(f"specdec: the machine was busy while the pass curve was measured ({e}); it serves this run only and "
              "is not stored", file=sys.stderr)
        curve = e.curve
        measured.clear()  # a prior, then: only the sizes its passes time are stored when it stops
    engine = BatchEngine(model, decoder.engine.drafter, model.config.vocab_size, decoder.engine.eos_ids,
                         decoder.context_window, max_batch_rows or default_budget(curve), prefill_chunk, curve,
                         curve_is_prior=not measured)
    engine.budget_from_curve = max_batch_rows is None
    engine.keep_refined_curve = lambda: store_curve(model, "pass_curve", params, engine.refined_pass_curve())
    row_ms, key_ms = remembered(model, "row_cost", {"rows": rows}, row_cost)
    engine.calibrate(row_ms, key_ms)  # what admission predicts with
    for cache in draft_caches(decoder.engine.drafter):  # what a model draft's catch-up costs (drafters/draft_cache.py)
        if cache.ms_per_token is None:
            cache.ms_per_token = remembered(cache.model, "catch_up_ms", {}, cache.measure)
    return engine


