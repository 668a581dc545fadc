"""`specdec bench`: target-only and every (draft, tau) configuration on the same prompts in one process,
interleaved prompt by prompt so machine noise hits every configuration alike, after a warm-up."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from time import perf_counter

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from . import charts, check, hf_assist, llamacpp, models
from .api import SpecDecoder, build_drafter
from .drafters.feature import FeatureDrafter
from .errors import InvalidRequest, SpecDecError
from .cli import backend_arg
from .kv import stock_linears
from .policy import make_policy
from .sampling import SamplingParams
from .trace import acceptance_by_position
from .prompts import load_prompts, prompt_ids


@dataclass
class Config:
    draft: str
    tau: int
    policy: str = "fixed"
    hf: bool = False  # transformers' generate / assisted generation, the peer reference
    llamacpp: bool = False  # llama.cpp's autoregressive decoding of the same GGUF (llama-cpp-python)
    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    cycles: int = 0
    draft_ms: float = 0.0
    outputs: list = field(default_factory=list)
    records: list = field(default_factory=list)  # specdec's cycles (acceptance by position)

    @property
    def label(self) -> str:
        if self.llamacpp:
            return "llama.cpp"
        who = "hf" if self.hf else "specdec"
        pol = "" if self.hf or self.policy == "fixed" else f" {self.policy}"
        return f"{who}:{self.draft}" + ("" if self.draft == "none" else f" tau={self.tau}{pol}")


class Bench:
    """`loaded` = (model, tokenizer, {draft name: model}) reuses loaded models; `configs` = [(draft, tau)] or
    [(draft, tau, policy)] replaces the drafts x taus x policies grid."""

    def __init__(self, target: str, drafts: list[str], taus: list[int], max_new_tokens: int, compare_hf: bool,
                 policies: list[str] | None = None, loaded=None, configs=None, backend: str = "auto",
                 compare_llamacpp: bool = False, sampling: SamplingParams | None = None, numerics: str = "auto"):
        """`sampling`: sampled decoding for every row (None: greedy); the output is then not compared token by
        token (a speculative run draws its randomness differently from target-only, the same distribution)."""
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        policies = policies or ["fixed"]
        if max_new_tokens < 1 or any(t < 1 for t in taus):
            raise InvalidRequest("max-new-tokens and tau must be >= 1")
        for p in policies:
            make_policy(p, 1)
        self.model, self.tok, self.draft_models = loaded if loaded else (
            *models.load(target, backend=backend, numerics=numerics), {})
        self.backend, self.target = backend, target
        self._llama = llamacpp.load(models.resolve(target)) if compare_llamacpp else None
        self._hf_models = {}  # transformers' models of the same weights, for the transformers rows
        self.max_new_tokens = max_new_tokens
        # each draft built once (fails early on a bad or incompatible draft); its configurations share the instance
        # (they run one at a time, and every generation starts with a reset)
        self._drafters = {d: build_drafter(d, self.model, self.tok, target, draft_models=self.draft_models,
                                           backend=backend)
                          for d in dict.fromkeys(["none", *drafts, *(c[0] for c in configs or [])])}
        # EAGLE-style drafts (specdec distill): they ride on the target's features
        self.feature_drafts = {d for d, drafter in self._drafters.items() if isinstance(drafter, FeatureDrafter)}
        grid = configs or [(d, t, p) for d in drafts if d != "none" for t in taus for p in policies]
        self.configs = [Config("none", 1)] + [Config(*c) for c in grid]
        if compare_hf:  # transformers has prompt lookup, assistant models and (via hf_assist) our feature drafts
            hf_drafts = [d for d in drafts if d in ("ngram", "target") or d in self.draft_models
                         or (d in self.feature_drafts and hf_assist.SUPPORTED and self.sampling is None)]
            self.configs += [Config("none", 1, hf=True)] + [Config(d, t, hf=True) for d in hf_drafts for t in taus]
        if compare_llamacpp:
            self.configs.append(Config("none", 1, llamacpp=True))
        self._decoders = {c.label: self.decoder_for(c.draft, c.tau, c.policy) for c in self.configs
                          if not (c.hf or c.llamacpp)}

    def decoder_for(self, draft: str, tau: int, policy: str = "fixed") -> SpecDecoder:
        if draft not in self._drafters:
            self._drafters[draft] = build_drafter(draft, self.model, self.tok, self.target,
                                                  draft_models=self.draft_models, backend=self.backend)
        return SpecDecoder.from_models(self.model, self.tok, self._drafters[draft], tau, policy=policy)

    def _twin(self, c: Config) -> str:
        """Our decoder for the same draft (its drafter instance is reused by the transformers row)."""
        return next(o.label for o in self.configs if not (o.hf or o.llamacpp) and o.draft == c.draft)

    def _hf(self, model):
        """transformers' model of these weights (specdec's runtime: the fp32-dequantized model), loaded once."""
        if id(model) not in self._hf_models:
            self._hf_models[id(model)] = check.reference_model(model)
        return self._hf_models[id(model)]

    def _run_one(self, c: Config, prompt: dict, max_new_tokens: int):
        if c.llamacpp:
            ids = self._prompt_ids(prompt)
            t0 = perf_counter()
            out = llamacpp.decode(self._llama, ids, max_new_tokens,
                                  self._decoders[self.configs[0].label].engine.eos_ids, self.sampling)
            return out, perf_counter() - t0, 0, 0, 0, 0.0, []
        if not c.hf:
            s = self.sampling or SamplingParams()
            fim = {"prompt_ids": self._prompt_ids(prompt)} if "suffix" in prompt else {}  # code to fill in
            out = self._decoders[c.label].generate("" if fim else prompt["prompt"], max_new_tokens=max_new_tokens,
                                                   chat=prompt["chat"], temperature=s.temperature, top_p=s.top_p,
                                                   top_k=s.top_k, seed=s.seed, **fim)
            s = out.stats
            return out.token_ids, s["wall_s"], s["proposed"], s["accepted"], s["cycles"], s["draft_ms"], out.records
        ids = self._prompt_ids(prompt)
        with stock_linears(self._hf(self.model)):  # transformers as its users run it
            return *self._run_hf(c, ids, max_new_tokens), []

    def _prompt_ids(self, prompt: dict) -> list[int]:
        """The prompt's ids as every configuration gets them: a fill-in one's as /infill sends it (prompt_ids)."""
        decoder = self._decoders[self.configs[0].label]
        return prompt_ids(decoder.tokenizer, prompt) if "suffix" in prompt else decoder.encode(prompt["prompt"],
                                                                                             prompt["chat"])

    def _run_hf(self, c: Config, ids: list[int], max_new_tokens: int):
        if c.draft in self.feature_drafts:
            drafter = self._decoders[self._twin(c)].engine.drafter
            t0 = perf_counter()
            out = hf_assist.generate(self._hf(self.model), ids, drafter, c.tau, max_new_tokens, self.tok.eos_token_id)
            return out, perf_counter() - t0, 0, 0, 0, 0.0
        kw = {}
        if c.draft == "ngram":
            kw = dict(prompt_lookup_num_tokens=c.tau)
        elif c.draft != "none":
            kw = dict(assistant_model=self._hf(self.model if c.draft == "target" else self.draft_models[c.draft]),
                      num_assistant_tokens=c.tau,
                      num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        if self.sampling is not None:
            torch.manual_seed(self.sampling.seed or 0)
            kw.update(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                      top_k=self.sampling.top_k)
        else:
            kw.update(do_sample=False)
        x = torch.tensor([ids])
        t0 = perf_counter()
        with torch.inference_mode():
            out = self._hf(self.model).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                                pad_token_id=self.tok.eos_token_id, **kw)
        return out[0, len(ids):].tolist(), perf_counter() - t0, 0, 0, 0, 0.0

    def run(self, prompts: list[dict], console: Console | None = None) -> list[dict]:
        for c in self.configs:  # warm-up: first-call costs (allocations, kernels) stay out of the numbers
            self._run_one(c, prompts[0], 4)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("bench", total=len(prompts) * len(self.configs))
            for i, p in enumerate(prompts):
                order = self.configs[i % len(self.configs):] + self.configs[: i % len(self.configs)]
                for c in order:  # rotate the order per prompt: no configuration always runs first
                    ids, secs, prop, acc, cyc, draft_ms, records = self._run_one(c, p, self.max_new_tokens)
                    c.records += records
                    c.outputs.append(ids)
                    c.tokens += len(ids)
                    c.seconds += secs
                    c.proposed, c.accepted, c.cycles = c.proposed + prop, c.accepted + acc, c.cycles + cyc
                    c.draft_ms += draft_ms
                    bar.advance(task)
        return self.results()

    def results(self) -> list[dict]:
        base = self.configs[0]
        base_tps = base.tokens / base.seconds
        step_ms = 1e3 * base.seconds / base.tokens  # target-only: one pass per token, everything included
        rows = []
        for c in self.configs:
            tps = c.tokens / c.seconds
            rows.append({
                "config": c.label, "engine": "llama.cpp" if c.llamacpp else "transformers" if c.hf else "specdec",
                "draft": c.draft,
                "tau": None if c.draft == "none" else c.tau, "policy": None if c.hf or c.llamacpp else c.policy,
                "tokens": c.tokens, "seconds": round(c.seconds, 3), "tokens_per_s": round(tps, 3),
                "speedup": round(tps / base_tps, 3),
                "acceptance_rate": round(c.accepted / c.proposed, 4) if c.proposed else None,
                "mean_accepted_len": round(c.accepted / c.cycles, 4) if c.cycles else None,
                # alpha_k = P(draft k accepted | 1..k-1 were) over every prompt's cycles: what a tau is chosen by
                "acceptance_by_position": acceptance_by_position(c.records) if c.proposed else None,
                "target_passes_per_token": round(c.cycles / c.tokens, 4) if c.cycles else None,
                # what drafting costs: ms per drafted token, and as a share of a target-only step (the cost model's c)
                "draft_ms_per_token": round(c.draft_ms / c.proposed, 3) if c.proposed else None,
                "draft_share_of_pass": round(c.draft_ms / c.proposed / step_ms, 4) if c.proposed else None,
                "identical_to_baseline": None if self.sampling else c.outputs == base.outputs,
            })
        return rows


def print_table(rows: list[dict], console: Console, numerics: str = "exact") -> None:
    table = Table(title=f"specdec bench, numerics {numerics} (speedup vs specdec target-only, same run)")
    for col in ["config", "tokens/s", "speedup", "accept", "α by position", "mean acc len", "passes/tok",
                "draft ms/tok", "draft/pass", "identical"]:
        table.add_column(col, justify="left" if col == "config" else "right")
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        by_position = "/".join(fmt(a) for a in (r.get("acceptance_by_position") or [])[:4]) or "-"
        table.add_row(r["config"], fmt(r["tokens_per_s"]), fmt(r["speedup"], "{:.2f}x"), fmt(r["acceptance_rate"]),
                      by_position, fmt(r["mean_accepted_len"]), fmt(r["target_passes_per_token"]),
                      fmt(r["draft_ms_per_token"], "{:.3f}"), fmt(r["draft_share_of_pass"], "{:.3f}"),
                      "-" if r["identical_to_baseline"] is None else "yes" if r["identical_to_baseline"] else "NO")
    console.print(table)


def cmd_bench(args) -> int:
    from .api import default_draft
    prompts = load_prompts(args.prompts, fim=True)  # fill-in lines too: {"prompt": prefix, "suffix", "mode": "fim"}
    if args.limit:
        prompts = prompts[: args.limit]
    bench = Bench(args.target, args.draft or [default_draft(args.target)], args.tau or [2, 4, 6], args.max_new_tokens,
                  args.compare_hf, policies=args.policy, backend=args.backend, compare_llamacpp=args.compare_llamacpp,
                  sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed), numerics=args.numerics)
    console = Console(stderr=True)
    rows = bench.run(prompts, console)
    print_table(rows, Console(width=max(120, Console().width)), getattr(bench.model, "numerics", "exact"))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                           "numerics": getattr(bench.model, "numerics", "exact"),
                           "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                           "seed": args.seed, "results": rows}, f,
                          indent=2)
            charts.speedups({r["config"]: {"all prompts": r["speedup"]} for r in rows}, charts.beside(args.json),
                            f"specdec bench: {len(prompts)} prompts, {args.max_new_tokens} tokens each")
        except OSError as e:
            raise SpecDecError(f"cannot write {args.json}: {e.strerror}")
    return 0


def register(sub, model_args, sampling_args):
    b = sub.add_parser("bench", help="compare target-only and speculative configurations side by side")
    b.add_argument("--prompts", default=None, help="JSONL of {prompt, mode}; default: the shipped prompt sets")
    b.add_argument("--target", default="default")
    b.add_argument("--draft", action="append",
                   help="repeatable: shipped, ngram, target, a draft dir/.gguf, or A+B (A, else B)")
    b.add_argument("--tau", action="append", type=int, help="repeatable (default 2 4 6)")
    b.add_argument("--policy", action="append", help="repeatable: fixed (default), heuristic, adaptive")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    b.add_argument("--compare-hf", action="store_true", help="add transformers' (assisted) generate as reference")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples every row")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--compare-llamacpp", action="store_true",
                   help="add llama.cpp's decoding of the same GGUF (needs llama-cpp-python)")
    backend_arg(b)
    b.add_argument("--json", default=None, help="write per-configuration results here (and a chart: x.json -> x.png)")
    b.set_defaults(func=cmd_bench)
