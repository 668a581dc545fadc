"""The Python API: load once, generate many times.

    from specdec import SpecDecoder
    sd = SpecDecoder(target="default", draft="ngram", tau=4)
    out = sd.generate("Write a haiku about caches", max_new_tokens=64)
    print(out.text, out.stats["acceptance_rate"])
    for piece in sd.stream("Tell me a story"): print(piece, end="")
"""
from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from time import perf_counter

from . import models
from .constraints import Grammars, waiting_for_reasoning
from .drafters import ModelDrafter, registry
from .drafters.feature_files import is_feature_draft
from .drafters.prediction import PRIOR, QUOTED_PRIOR, quoted_block
from .drafters.registry import SHIPPED_DRAFT
from .engine import Engine
from .errors import InvalidRequest
from .penalties import Adjusted, penalties
from .policy import make_policy
from .prompts import encode_prompt  # noqa: F401 - part of the API (specdec.api.encode_prompt)
from .prompts import read_chat_template, template_kwargs, use_chat_template
from .sampling import SamplingParams
from .text import StopText
from .trace import CycleRecord, summarize

DEFAULT_DRAFT = None  # resolved per target by default_draft()


# stop strings: at most 4, as OpenAI allows, of bounded length (a 100,000-character stop held the model worker
# for the whole request timeout)
MAX_STOPS, MAX_STOP_CHARS = 4, 256
DEFAULT_TAU, DEFAULT_POLICY = 3, "fixed"  # the fastest measured setup on the runtime (docs/benchmarks.md)
# a chat prompt's quoted code block drafts like a prediction when none is sent (prepare); SPECDEC_QUOTED_DRAFTS=0: never
QUOTED_DRAFTS = os.environ.get("SPECDEC_QUOTED_DRAFTS", "1") != "0"
DEFAULT_NUMERICS = "auto"  # q8 where the runtime's kernels run: faster, perplexity within 0.3% (docs/numerics.md)


def default_draft(target: str) -> str:
    """For the default target: the shipped datastore's continuation when it has a confident one, else a copy from
    the context when an n-gram matches (the fastest measured setup on the runtime, docs/benchmarks.md: the shipped
    distilled draft, `datastore+ngram+shipped`, costs more per step than its extra accepted tokens save there); for
    any other target the same copies (the datastore once `specdec datastore build` made it), then the draft
    `specdec distill` installed for it where there is one (`distilled`): on Qwen2.5-Coder-1.5B, at one stream, that
    chain gave 1.65x target-only on completion, 1.64x on chat and 1.47x on fill-in where `ngram` alone gave 1.10x,
    1.22x and 0.75x (docs/draft.md)."""
    from .drafters.datastore import FILE, datastore_dir
    from .drafters.feature_files import installed_draft
    if target == models.DEFAULT_MODEL and is_feature_draft(SHIPPED_DRAFT):
        return "datastore+ngram"
    copies = "datastore+ngram" if (datastore_dir(target) / FILE).exists() else "ngram"
    return f"{copies}+distilled" if is_feature_draft(installed_draft(target)) else copies


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: dict
    records: list[CycleRecord] = field(repr=False, default_factory=list)
    logprobs: list | None = field(repr=False, default=None)  # per token [logprob, [[token, logprob], ...]]
    prompt_logprobs: list | None = field(repr=False, default=None)  # the same for prompt tokens 2..


@dataclass
class Chunk:
    """One cycle's worth of streamed output. `text` may be empty (held back: a stop string might be starting);
    the final chunk carries `result`."""
    text: str
    record: CycleRecord
    result: GenerationResult | None = None


def build_drafter(draft: str, model, tok, target_spec: str | None = None, draft_models: dict | None = None,
                  backend: str = "auto"):
    """A drafter from its name (drafters/registry.py). `draft_models` caches loaded draft models by name."""
    return registry.build(draft, registry.Target(model, tok, target_spec, backend,
                                                 {} if draft_models is None else draft_models))




def longest_token_chars(tokenizer) -> int | None:
    """Characters of the longest token's text (decoded), an upper bound on characters per token; None if unknown."""
    try:
        if hasattr(tokenizer, "longest_token_chars"):  # the runtime's wrapper: without a vocabulary dict
            return tokenizer.longest_token_chars()
        vocab = tokenizer.get_vocab()
        longest = max(vocab, key=len)
        return max(len(longest), len(tokenizer.decode([vocab[longest]])), 1)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no early bound
        return None


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}")
    return value


def set_kv_memory(model, gib: float | None) -> None:
    """Size the runtime's KV pool to `gib` GiB (None: its default); a budget that cannot hold one whole context, or a
    budget for a model on transformers, is refused."""
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0):
        raise InvalidRequest(f"kv_memory must be a number of GiB > 0, got {gib!r}")
    if not models.is_runtime(model):
        if gib is not None:
            raise InvalidRequest("kv_memory sizes specdec's runtime KV cache; this model runs on transformers")
        return
    try:
        model.set_kv_memory(None if gib is None else int(gib * 2**30))
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


class SpecDecoder:
    def __init__(self, target: str = models.DEFAULT_MODEL, draft: str | None = DEFAULT_DRAFT, tau: int = DEFAULT_TAU,
                 policy: str = DEFAULT_POLICY, backend: str = "auto", numerics: str = DEFAULT_NUMERICS,
                 kv_memory: float | None = None, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None):
        """`backend`: auto (specdec's runtime where it runs the model, else transformers), runtime, transformers.
        `numerics`: the runtime's arithmetic, exact (bitwise transformers' fp32 on the dequantized weights), q8
        (int8 activations, close to exact; speculation stays token-identical to q8 target-only), or auto (q8 where
        the runtime's kernels run, else exact). `kv_memory`: GiB for every sequence's K/V together on the runtime
        (default: half the available memory, at most 64 whole contexts; runtime/blocks.py). `chat_template`: a Jinja
        file's path or a template's text, used for chat prompts in place of the one the model's files carry;
        `chat_template_kwargs`: variables every chat prompt's template gets (a request's own override them)."""
        template = None if chat_template is None else read_chat_template(chat_template)  # before loading
        variables = template_kwargs(chat_template_kwargs)
        draft = draft or default_draft(target)
        model, tok = models.load(target, backend=backend, numerics=numerics)
        if template is not None:
            use_chat_template(tok, template)
        set_kv_memory(model, kv_memory)
        drafter = build_drafter(draft, model, tok, target, backend=backend)
        models.release_free_memory()  # loading's temporaries, before the first pass touches the weights
        self._setup(model, tok, drafter, tau, getattr(drafter, "name", draft), policy)
        self.template_variables = variables

    @classmethod
    def from_models(cls, model, tokenizer, draft="ngram", tau: int = 4, draft_tokenizer=None,
                    policy: str = "fixed") -> SpecDecoder:
        """Wrap already-loaded models. `draft` is a drafter name, a drafter object or a draft causal LM."""
        self = cls.__new__(cls)
        if isinstance(draft, str):
            drafter = build_drafter(draft, model, tokenizer)
        elif hasattr(draft, "propose"):
            drafter = draft
        else:
            models.check_compatible(tokenizer, draft_tokenizer or tokenizer, "model")
            drafter = ModelDrafter(draft, model.config.vocab_size)
        self._setup(model, tokenizer, drafter, tau, getattr(drafter, "name", str(draft)), policy)
        return self

    def _setup(self, model, tok, drafter, tau, draft_name, policy):
        self.model, self.tokenizer, self.draft_name = model, tok, draft_name
        self.numerics = getattr(model, "numerics", "exact")
        # the server encodes prompts on request threads while the model worker decodes text: each side has its own
        # copy of the tokenizer (transformers' fast tokenizers are not safe to share across threads), so a long
        # prompt being encoded never holds up the worker's streams
        self.tokenizer_lock = threading.Lock()
        self._encoder, self._encoder_lock = copy.deepcopy(tok), threading.Lock()
        self.max_token_chars = None  # measured at the first encode
        self.template_variables = {}  # chat_template_kwargs every chat prompt gets
        self.tau = _positive_int("tau", tau)
        self.policy = make_policy(policy, self.tau).name
        self._policies = {}  # (name, tau) -> policy; adaptive estimates persist across requests
        self.context_window = models.context_window(model)
        self.engine = Engine(model, drafter, model.config.vocab_size, models.eos_ids(model, tok), self.context_window)
        self.grammars = Grammars(tok, model.config.vocab_size, self.engine.eos_ids)  # structured outputs

    # ---- prompts -------------------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = True, tools: list[dict] | None = None,
               variables: dict | None = None) -> list[int]:
        """A string or a list of {role, content} messages -> prompt token ids (chat template unless chat=False;
        `tools` handed to a template that describes tools itself; `variables`: more for the template, a request's
        chat_template_kwargs)."""
        with self._encoder_lock:
            if self.max_token_chars is None:
                self.max_token_chars = longest_token_chars(self._encoder) or 0
            return encode_prompt(self._encoder, prompt, chat, self.context_window, self.max_token_chars, tools,
                                 {**self.template_variables, **template_kwargs(variables)})

    # ---- generation ----------------------------------------------------------------------------------------
    def prepare(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, seed: int | None = None, min_p: float = 0.0, stop: list[str] | str | None = None, chat: bool = True,
                tau: int | None = None, policy: str | None = None, prompt_ids: list[int] | None = None,
                response_format: dict | None = None, logprobs: int | None = None,
                prompt_logprobs: int | None = None, prediction: str | None = None, presence_penalty: float = 0.0,
                frequency_penalty: float = 0.0, logit_bias: dict | None = None, repetition_penalty: float = 1.0,
                repetition_window: int | None = None, chat_template_kwargs: dict | None = None,
                min_indent: int = 0, time_limit_ms: int | None = None) -> Request:
        """Validate and encode one request (InvalidRequest / PromptTooLong on bad input). `prompt_ids`: the prompt
        already encoded (the server encodes it once, off the model worker). `response_format`: OpenAI's
        ({"type": "json_object"}, or "json_schema" with {"json_schema": {"schema": ...}}): the output follows the
        grammar (constraints.py). `logprobs` (0..20): the result carries each token's logprob under the target and
        that many alternatives (sampling.token_logprobs); `prompt_logprobs` the same for the prompt's tokens (the
        first has none), and max_new_tokens may then be 0: scoring only. `prediction`: text the output is expected to
        mostly be (OpenAI's predicted outputs), drafted beside it; the output is the same without it. A chat prompt
        that sends none but quotes a code block drafts from that block (drafters/prediction.py, `quoted_block`),
        reported as no prediction; not with the drafter `none` (target-only), nor with QUOTED_DRAFTS off.
        `presence_penalty`, `frequency_penalty` ([-2, 2]) and `logit_bias` ({token id: bias in [-100, 100]}) adjust
        the target's scores as OpenAI's do, `repetition_penalty` ((0, 2]) as vLLM's (penalties.py), over the last
        `repetition_window` tokens of prompt and output where given (llama.cpp's repeat_last_n); the output is the
        adjusted target-only output. `chat_template_kwargs`: more variables for the chat template (such as Qwen3's
        `enable_thinking`), over the decoder's own. `min_indent` and `time_limit_ms` end the output early, as
        llama-server's n_indent and t_max_predict_ms do for editors (text.StopText): the output is then a prefix of
        the one without them."""
        if not (prompt_logprobs is not None and max_new_tokens == 0):
            _positive_int("max_new_tokens", max_new_tokens)
        tau = self.tau if tau is None else _positive_int("tau", tau)
        key = (policy or self.policy, tau)
        if key not in self._policies:
            self._policies[key] = make_policy(key[0], tau)
        params = SamplingParams(temperature, top_p, top_k, seed, min_p)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise InvalidRequest(f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                                 "characters")
        for name, value in (("min_indent", min_indent), ("time_limit_ms", time_limit_ms or 0)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
                raise InvalidRequest(f"{name} must be an integer >= 0, got {str(value)[:40]}")
        ids = self.encode(prompt, chat, None, chat_template_kwargs) if prompt_ids is None else prompt_ids
        text = StopText(self.tokenizer, stops, self.tokenizer_lock, min_indent,
                        time_limit_ms / 1000 if time_limit_ms else None)
        req = Request(ids, max_new_tokens, params, text, tau, self._policies[key])
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise InvalidRequest(f"{name} must be an integer in [0, 20], got {str(value)[:40]}")
        adjust = penalties(self.model.config.vocab_size, presence_penalty, frequency_penalty, logit_bias,
                           repetition_penalty, ids, repetition_window)
        if adjust is not None:  # a model draft adjusts its rows alike (it proposes what the adjusted target would)
            req.params = replace(req.params, penalties=adjust)
        if chat and response_format is not None:  # a thinking model reasons first, the grammar shapes the answer
            with self.tokenizer_lock:
                response_format = waiting_for_reasoning(self.tokenizer, ids, response_format)
        grammar = self.grammars.constraint(response_format)
        req.constraint = adjust if grammar is None else grammar if adjust is None else Adjusted(grammar, adjust)
        req.logprobs, req.prompt_logprobs = logprobs, prompt_logprobs
        if prediction is not None:
            if not isinstance(prediction, str):
                raise InvalidRequest("prediction must be a string")
            with self._encoder_lock:
                req.prediction = self._encoder.encode(prediction, add_special_tokens=False) or None
        elif chat and QUOTED_DRAFTS and self.draft_name != "none" and (block := quoted_block(prompt)) is not None:
            with self._encoder_lock:
                req.prediction = self._encoder.encode(block, add_special_tokens=False) or None
            req.prediction_prior, req.quoted = QUOTED_PRIOR, True
        return req

    def stream_chunks(self, prompt, **kwargs) -> Iterator[Chunk]:
        """One Chunk per cycle (keyword arguments as prepare)."""
        req = self.prepare(prompt, **kwargs)
        for rec in self.engine.run(req.prompt_ids, req.max_new_tokens, req.params, req.policy, req.stop_check,
                                   req.constraint, req.logprobs, req.prompt_logprobs, req.prediction,
                                   req.prediction_prior):
            yield req.chunk(rec)

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Text as it is committed."""
        for chunk in self.stream_chunks(prompt, **kwargs):
            if chunk.text:
                yield chunk.text

    def generate(self, prompt, **kwargs) -> GenerationResult:
        for chunk in self.stream_chunks(prompt, **kwargs):
            pass
        return chunk.result


class Request:
    """One validated request and its output so far: turns cycle records into streamed text chunks (held back while
    a stop string may be starting) and, with the last record, the GenerationResult."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, text: StopText, tau: int,
                 policy):
        self.prompt_ids, self.max_new_tokens, self.params, self.tau, self.policy = (
            prompt_ids, max_new_tokens, params, tau, policy)
        self.text = text
        self.stop_check = text.stop_check if text.active else None
        self.records: list[CycleRecord] = []
        self.logprobs: int | None = None  # alternatives asked for (prepare)
        self.token_logprobs: list = []  # per generated token, when asked for
        self.prompt_logprobs: int | None = None
        self.scored: list | None = None  # the prompt's logprobs, when asked for
        self.prediction: list[int] | None = None  # a predicted output's tokens (prepare)
        self.prediction_prior = PRIOR  # its acceptance assumed before any verification
        self.quoted = False  # the prediction is a block the prompt quotes, not the client's: not reported
        self.generated: list[int] = []
        self.sent = ""
        self.start = perf_counter()

    def chunk(self, rec: CycleRecord) -> Chunk:
        self.records.append(rec)
        self.generated.extend(rec.emitted)
        if rec.logprobs is not None:
            self.token_logprobs.extend(rec.logprobs)
        if rec.prompt_logprobs is not None:
            self.scored = rec.prompt_logprobs
        final = rec.finish_reason is not None
        visible = self.text.visible(self.generated, final=final)
        delta, self.sent = visible[len(self.sent):], visible
        if not final:
            return Chunk(delta, rec)
        stats = summarize(self.records, perf_counter() - self.start, len(self.generated))
        if self.quoted:  # no prediction was sent: none is reported
            stats = {k: v for k, v in stats.items() if not k.endswith("_prediction_tokens")}
        elif self.prediction is not None:  # reported whenever one was sent, as OpenAI does
            stats = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0, **stats}
        return Chunk(delta, rec, GenerationResult(self.sent, self.generated, len(self.prompt_ids),
                                                  rec.finish_reason, stats, self.records,
                                                  self.token_logprobs if self.logprobs is not None else None,
                                                  self.scored))
