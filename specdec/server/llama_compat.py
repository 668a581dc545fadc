"""llama-server's own endpoints, so that clients written for llama.cpp (editors, chat front ends, scripts) can point
at specdec: POST /completion (and /completions), /infill, /tokenize, /detokenize, /apply-template, and GET /props.
Requests take llama-server's field names and defaults; answers come in its format, with specdec's figures beside
them (`specdec`). Its tuning fields that change nothing here are accepted and ignored by name (IGNORED); any other
field is refused, as are the ones it has that this server does not (a 400 that names them).

What differs from llama-server, on purpose: sampling is specdec's (sampling.warp: temperature, then min-p, top-k,
top-p; llama.cpp applies the temperature last), and presence and frequency penalties count the output only
(OpenAI's rule; llama.cpp counts the last `repeat_last_n` tokens of prompt and output). `repeat_penalty` counts
the last `repeat_last_n` tokens of prompt and output, as llama.cpp's does."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..penalties import MAX_BIAS, MAX_PENALTY, MAX_REPETITION
from ..prompts import template_kwargs
from ..sampling import MAX_TEMPERATURE, SEED_RANGE
from .api_errors import APIError, error_body, stream_failure, validated
from .openai_format import spec_stats
from .schemas import CompletionRequest, Message
from .streaming import chunks, collect

IGNORED = ("cache_prompt", "t_max_prompt_ms", "samplers", "id_slot",
           "timings_per_token", "response_fields", "n_keep", "n_cache_reuse", "return_progress", "sse_ping_interval")


class LlamaOptions(BaseModel):
    """The options /completion and /infill share, with llama-server's defaults."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_predict: int = Field(default=-1, ge=-1, lt=2**31)  # -1: until the end of text; 0: the prompt cached only
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    temperature: float = Field(default=0.8, ge=0, le=MAX_TEMPERATURE)
    top_k: int = Field(default=40, ge=0, lt=2**31)
    top_p: float = Field(default=0.95, gt=0, le=1)
    min_p: float = Field(default=0.05, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-1, lt=SEED_RANGE)  # -1: none (llama-server's "random")
    stop: list[str] | None = None
    stream: bool = False
    model: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    n_probs: int = Field(default=0, ge=0, le=20)  # each token's top alternatives (completion_probabilities)
    return_tokens: bool = False
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repeat_penalty: float = Field(default=1.0, gt=0, le=MAX_REPETITION)
    repeat_last_n: int = Field(default=64, ge=-1, lt=2**31)  # -1: the whole context, 0: no repetition penalty
    logit_bias: list | dict | None = None  # [[token id or text, bias or false], ...] or {"token id": bias}
    json_schema: dict | None = None
    grammar: str | None = None  # GBNF
    ignore_eos: bool = False
    n_indent: int = Field(default=0, ge=0, lt=2**31)  # a later line indented less ends the answer (text.StopText)
    t_max_predict_ms: int = Field(default=0, ge=0, lt=2**31)  # past it, the answer ends at a line's end
    # llama-server's fields that specdec does not have: refused by name (_unsupported) when set
    mirostat: int = 0
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    post_sampling_probs: bool = False
    n_cmpl: int = 1
    lora: list | None = None
    # accepted, ignored (IGNORED)
    cache_prompt: bool | None = None
    t_max_prompt_ms: int | None = None
    samplers: list[str] | None = None
    id_slot: int | None = None
    timings_per_token: bool | None = None
    response_fields: list[str] | None = None
    n_keep: int | None = None
    n_cache_reuse: int | None = None
    return_progress: bool | None = None
    sse_ping_interval: float | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        unsupported = {"mirostat": self.mirostat != 0, "typical_p": self.typical_p != 1.0,
                       "dynatemp_range": self.dynatemp_range != 0, "dry_multiplier": self.dry_multiplier != 0,
                       "xtc_probability": self.xtc_probability != 0, "post_sampling_probs": self.post_sampling_probs,
                       "n_cmpl": self.n_cmpl != 1, "lora": bool(self.lora)}
        named = [k for k, bad in unsupported.items() if bad]
        if named:
            raise ValueError(f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} not supported by this server "
                             "(send the default)")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("send json_schema or grammar, not both")
        return self

    @property
    def warm_only(self) -> bool:
        """n_predict 0: the prompt is prefilled into the prefix cache and nothing is answered (editors send such
        requests to have a file's context ready before it is needed); one token is generated and dropped."""
        return self.n_predict == 0 and self.max_tokens is None

    @property
    def token_limit(self) -> int | None:
        if self.max_tokens is not None:
            return self.max_tokens
        return self.n_predict if self.n_predict > 0 else 1 if self.warm_only else None

    def completion(self, prompt, vocab_size: int, eos_ids, tokenize) -> tuple[CompletionRequest, dict]:
        """The OpenAI completion request these options ask for, and what the job needs beside it (the repetition
        penalty's window, a grammar)."""
        bias = _bias(self.logit_bias, vocab_size, tokenize)
        if self.ignore_eos:  # llama.cpp bans the end-of-text tokens; -100 is OpenAI's ban
            bias.update({str(t): -MAX_BIAS for t in eos_ids})
        repetition = self.repeat_penalty if self.repeat_last_n != 0 else 1.0
        req = validated(CompletionRequest, prompt=prompt, max_tokens=self.token_limit, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                seed=None if self.seed in (None, -1) else self.seed, stop=self.stop,
                                stream=self.stream, model=self.model, cache_salt=self.cache_salt,
                                presence_penalty=float(self.presence_penalty),
                                frequency_penalty=float(self.frequency_penalty), logit_bias=bias or None,
                                repetition_penalty=float(repetition), logprobs=self.n_probs or None)
        extra = {"repetition_window": self.repeat_last_n if self.repeat_last_n > 0 and repetition != 1 else None,
                 "min_indent": self.n_indent, "time_limit_ms": self.t_max_predict_ms or None}
        if self.json_schema is not None:
            extra["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.json_schema}}
        elif self.grammar is not None:
            extra["response_format"] = {"type": "gbnf", "grammar": self.grammar}
        return req, extra


class LlamaCompletion(LlamaOptions):
    """POST /completion: a prompt as text, token ids, or both mixed ([12, 34, "text", 56])."""
    prompt: str | list[int | str] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and all(isinstance(p, str) for p in self.prompt) and len(self.prompt) > 1:
            raise ValueError("one prompt per request here (send several requests, or use /v1/completions)")
        return self


class FileChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: str = Field(default="", max_length=1024)
    text: str


class InfillRequest(LlamaOptions):
    """POST /infill, as editors (llama.vscode) send it: the code before and after the cursor, other files as
    context."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[FileChunk] = Field(default_factory=list, max_length=256)
    prompt: str = ""  # appended to the prefix (the text typed on the current line)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a chat request's other fields (model, stream, ...) change nothing
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


def _bias(raw, vocab_size: int, tokenize) -> dict[str, float]:
    """llama-server's logit_bias -> OpenAI's {"token id": bias}: pairs [token id or text, bias or false] (text: each
    of its tokens; false: banned, as OpenAI's -100), or OpenAI's object (penalties.py checks ids and values)."""
    if raw is None or isinstance(raw, dict):
        return dict(raw or {})
    out = {}
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, str))
                and not isinstance(pair[0], bool) and isinstance(pair[1], (int, float))):
            raise APIError(400, 'logit_bias must be [[token id or text, bias or false], ...] or {"token id": bias}')
        bias = -MAX_BIAS if pair[1] is False else pair[1]
        if pair[1] is True:
            raise APIError(400, "logit_bias: a bias is a number, or false to ban the token")
        for token in ([pair[0]] if isinstance(pair[0], int) else tokenize(pair[0])):
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: {token} is not a token id of this model (0..{vocab_size - 1})")
            out[str(token)] = bias
    return out


def add_routes(app, serve, fim, overdue, decoder, model_name: str, context_window: int) -> None:
    """llama-server's endpoints on `app`. `serve(req, request, prompts, chat, kind, job_extra, respond)`: the
    OpenAI completion path (validation, the queue), answering through `respond(jobs, encoded, prompts)`;
    `fim(prefix, suffix, files)`: the FIM prompt's token ids; `overdue(job)`: the error of a job past its deadline
    or on a dead worker."""
    vocab = decoder.model.config.vocab_size
    eos = decoder.engine.eos_ids

    def encode(text: str, special: bool) -> list[int]:
        _unicode(text)
        with decoder._encoder_lock:
            return decoder._encoder(text, add_special_tokens=special).input_ids

    async def complete(options: LlamaOptions, ids: list[int], request: Request):
        req, extra = options.completion(ids, vocab, eos, lambda s: encode(s, False))

        async def respond(jobs, encoded, prompts):
            return (_events(decoder, jobs[0], encoded[0], options, model_name, overdue) if options.stream
                    else await _answer(decoder, jobs[0], encoded[0], prompts[0], options, model_name, request,
                                       overdue))
        return await serve(req, request, [ids], False, "text", extra, respond)

    @app.post("/completion")
    @app.post("/completions")
    async def completion(req: LlamaCompletion, request: Request):
        """llama-server's native completion: the prompt's text and token ids in order (text before any id gets the
        model's start-of-text token, as llama-server adds its BOS)."""
        parts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        ids = []
        for k, part in enumerate(parts):
            if isinstance(part, str):
                ids += await asyncio.to_thread(encode, part, k == 0)
            elif 0 <= part < vocab:
                ids.append(part)
            else:
                raise APIError(400, f"prompt token ids must be in [0, {vocab})")
        if not ids:
            raise APIError(400, "the prompt is empty")
        return await complete(req, ids, request)

    @app.post("/infill")
    async def infill(req: InfillRequest, request: Request):
        """Fill-in-the-middle, answered as /completion: a completion of the FIM prompt."""
        files = [(c.filename, c.text) for c in req.input_extra]
        return await complete(req, await fim(req.input_prefix + req.prompt, req.input_suffix, files), request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if not req.parse_special:
            raise APIError(400, "parse_special false is not supported by this server (special tokens are parsed)")
        ids = await asyncio.to_thread(encode, req.content, req.add_special)
        return {"tokens": [{"id": t, "piece": _piece(decoder, t)} for t in ids] if req.with_pieces else ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if not all(0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})")
        with decoder.tokenizer_lock:
            return {"content": decoder.tokenizer.decode(req.tokens)}

    @app.post("/apply-template")
    async def apply_template(req: ApplyTemplateRequest):
        messages = [m.for_template() for m in req.messages]
        variables = {**decoder.template_variables, **template_kwargs(req.chat_template_kwargs)}
        try:
            with decoder._encoder_lock:
                text = decoder._encoder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                            **variables)
        except Exception as e:  # noqa: BLE001 - no template, or one that raises on these messages
            raise APIError(400, f"the chat template cannot format these messages: {str(e)[:200]}") from None
        return {"prompt": _unicode(text)}

    @app.get("/props")
    async def props():
        template = getattr(decoder.tokenizer, "chat_template", None)
        return {"model_alias": model_name, "model_path": model_name, "total_slots": 1, "chat_template": template or "",
                "default_generation_settings": {"n_ctx": context_window, "params": _settings(LlamaOptions())},
                "modalities": {"vision": False, "audio": False}, "build_info": "specdec"}


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the text is not valid Unicode (a lone surrogate such as \\ud800)") from None
    return text


def _settings(options: LlamaOptions) -> dict:
    return {k: getattr(options, k) for k in ("n_predict", "temperature", "top_k", "top_p", "min_p", "seed",
                                              "presence_penalty", "frequency_penalty", "repeat_penalty",
                                              "repeat_last_n", "n_probs")} | {"stop": options.stop or []}


def _piece(decoder, token: int):
    """A token's text, or its bytes where they are not whole UTF-8 (llama-server's `piece`)."""
    with decoder.tokenizer_lock:
        text = decoder.tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    try:
        return list(decoder.grammars.lltokenizer.decode_bytes([token]))
    except Exception:  # noqa: BLE001 - no llguidance: the decoded text's bytes
        return list(text.encode("utf-8"))


def _probs(decoder, token_ids, logprobs) -> list[dict]:
    """llama-server's completion_probabilities for generated tokens (an end-of-text token left out)."""
    def entry(t, lp):
        piece = _piece(decoder, t)
        text = piece if isinstance(piece, str) else bytes(piece).decode("utf-8", "replace")
        return {"id": t, "token": text, "logprob": lp, "bytes": list(text.encode("utf-8")) if isinstance(piece, str)
                else piece}
    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
            for t, (lp, alts) in zip(token_ids, logprobs or []) if t not in decoder.engine.eos_ids]


def _ending(decoder, result, text: str, options) -> tuple[str, str]:
    """(stop_type, stopping_word) as llama-server reports them: the token limit (also n_indent's and
    t_max_predict_ms's ends), an end-of-text token, or a stop string (the first that starts where the text was
    cut)."""
    stops = options.stop or []
    if result.finish_reason == "length":
        return "limit", ""
    if result.token_ids and result.token_ids[-1] in decoder.engine.eos_ids or not (
            stops or options.n_indent or options.t_max_predict_ms):
        return "eos", ""
    with decoder.tokenizer_lock:
        rest = decoder.tokenizer.decode(result.token_ids)[len(text):]
    hits = [s for s in stops if s in rest]
    if not hits:
        return "limit", ""
    return "word", min(hits, key=lambda s: (rest.find(s), -len(s)))


def _final(decoder, job, result, text, prompt_ids, options, model_name) -> dict:
    """The totals of a finished completion; generation_settings' seed is the one it ran with (drawn from the OS for
    an unseeded sampled request: sent back, it reproduces the text)."""
    stop_type, word = ("limit", "") if options.warm_only else _ending(decoder, result, text, options)
    # an end-of-text token counted, as llama-server counts it (and OpenAI's usage); a warm-up's token is not
    n = 0 if options.warm_only else len(result.token_ids)
    rate = result.stats.get("tokens_per_s") or 0.0
    cached, stats = result.stats.get("cached_tokens", 0), result.stats
    timings = {"cache_n": cached, "prompt_n": len(prompt_ids) - cached, "predicted_n": n,
               "predicted_ms": 1e3 * n / rate if rate else 0.0, "predicted_per_second": rate,
               "draft_n": stats["proposed"], "draft_n_accepted": stats["accepted"]}  # llama-server's speculation
    return {"stop": True, "model": model_name, "stop_type": stop_type, "stopping_word": word,
            "tokens_predicted": n, "tokens_evaluated": len(prompt_ids), "truncated": False,
            "generation_settings": _settings(options) | {"seed": job.kwargs.get("seed")}, "timings": timings,
            "specdec": spec_stats(result)}


async def _answer(decoder, job, prompt_ids, prompt, options, model_name, request, overdue):
    done = await collect(job, request, overdue)
    if done is None:
        return Response(status_code=499)  # the client hung up
    text, result = done
    if options.warm_only:
        text, result.token_ids, result.logprobs = "", [], None if result.logprobs is None else []
    body = {"index": 0, "content": text, "tokens": [t for t in result.token_ids if t not in decoder.engine.eos_ids]
            if options.return_tokens else [], "id_slot": 0, "prompt": prompt,
            **_final(decoder, job, result, text, prompt_ids, options, model_name)}
    if options.n_probs:
        body["completion_probabilities"] = _probs(decoder, result.token_ids, result.logprobs)
    return body


def _events(decoder, job, prompt_ids, options, model_name, overdue) -> StreamingResponse:
    """Server-sent events as llama-server sends them: {content, tokens, stop: false} as text comes, then one
    {content: "", stop: true, ...} with the totals; an error event should the worker stop answering."""
    async def events():
        text = []
        try:
            async for chunk in chunks(job, overdue):
                emitted = [t for t in chunk.record.emitted if t not in decoder.engine.eos_ids]
                if (chunk.text or emitted) and not options.warm_only:
                    event = {"index": 0, "content": chunk.text, "tokens": emitted, "stop": False, "id_slot": 0}
                    if options.n_probs and chunk.record.logprobs is not None:
                        event["completion_probabilities"] = _probs(decoder, chunk.record.emitted,
                                                                   chunk.record.logprobs)
                    yield f"data: {json.dumps(event)}\n\n"
                text.append(chunk.text)
                if chunk.result is not None:
                    final = _final(decoder, job, chunk.result, "".join(text), prompt_ids, options, model_name)
                    yield f"data: {json.dumps({'index': 0, 'content': '', 'tokens': [], **final})}\n\n"
        except Exception as e:  # noqa: BLE001 - this request's own failure ends its stream with an error event
            err = stream_failure(e)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.code))}\n\n"
        finally:
            job.cancel()
    return StreamingResponse(events(), media_type="text/event-stream")
