"""`specdec check`: the "fast but wrong" guard.

greedy   — speculative output vs the target alone (transformers' own generate with its stock layers on the same
           weights — for specdec's runtime, the fp32-dequantized model — an independent reference), token by token;
           every differing prompt is reported with the first divergent position and both continuations.
sampling — the joint distribution of the first two generated tokens under speculation vs the target's exact
           distribution at the same prefix (computed by direct forward passes), chi-square test with a p-value.
"""
from __future__ import annotations

import json

import torch

from . import models
from .errors import InvalidRequest
from .kv import stock_linears
from .sampling import SamplingParams, warp


def chi2_pvalue(observed: list[float], expected_probs: list[float]) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled (one pooled cell)."""
    n = sum(observed)
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for o, p in zip(observed, expected_probs):
        if p == 0:
            if o > 0:
                return 0.0  # a token the target can never produce
            continue
        if n * p < 5:
            pool_o, pool_e = pool_o + o, pool_e + n * p
        else:
            obs.append(o)
            exp.append(n * p)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if len(obs) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@torch.inference_mode()
def reference_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=min(eos) if eos else 0, eos_token_id=sorted(eos) or None)
    return out[0, len(ids):].tolist()


def reference_model(model):
    """transformers' model of the same weights: the model itself, or for specdec's runtime the fp32-dequantized
    model transformers makes of its file."""
    if not models.is_runtime(model):
        return model
    return models.load(model.source, backend="transformers")[0]


def check_greedy(decoder, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """-> one entry per prompt: ok, and for mismatches the first divergent position and both continuations."""
    tok, eos = decoder.tokenizer, decoder.engine.eos_ids
    ref = reference_model(decoder.model)
    results = []
    for p in prompts:
        ids = decoder.encode(p["prompt"], p["chat"])
        with stock_linears(ref):  # transformers as its users run it: specdec's kernels must not be the reference
            want = reference_greedy(ref, ids, max_new_tokens, eos)
        got = decoder.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p["chat"]).token_ids
        entry = {"prompt": p["prompt"][:60], "ok": got == want}
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            entry.update(first_divergence=i, speculative=tok.decode(got[i:], skip_special_tokens=True),
                         target=tok.decode(want[i:], skip_special_tokens=True))
        results.append(entry)
    return results


@torch.inference_mode()
def next_token_logits(model, seq: list[int]) -> torch.Tensor:
    if models.is_runtime(model):
        cache = model.new_cache()
        try:
            return cache.forward(seq)[-1]
        finally:
            cache.close()
    return model(torch.tensor([seq])).logits[0, -1]


@torch.inference_mode()
def exact_two_token_joint(model, vocab: int, ids: list[int], params: SamplingParams) -> dict[tuple, float]:
    def dist(seq):
        return warp(next_token_logits(model, seq)[:vocab], params)
    p1 = dist(ids)
    joint = {}
    for a in p1.nonzero().flatten().tolist():
        p2 = dist(ids + [a])
        for b in p2.nonzero().flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def check_sampling(decoder, prompt: dict, samples: int, params: SamplingParams) -> dict:
    ids = decoder.encode(prompt["prompt"], prompt["chat"])
    joint = exact_two_token_joint(decoder.model, decoder.model.config.vocab_size, ids, params)
    counts: dict[tuple, int] = {}
    for seed in range(samples):  # a full first block is drafted (tau + 1 tokens); its first two are tested
        torch.manual_seed(seed)  # unseeded requests' rule (rejection sampling), reproducibly
        out = decoder.generate(prompt["prompt"], max_new_tokens=decoder.tau + 1, chat=prompt["chat"],
                               temperature=params.temperature, top_p=params.top_p, top_k=params.top_k).token_ids[:2]
        key = tuple(out) if len(out) == 2 else (out[0], None)
        counts[key] = counts.get(key, 0) + 1
    # a first token that is EOS ends generation: fold the joint of that token into one (a, None) cell
    for (a, b) in list(joint):
        if a in decoder.engine.eos_ids:
            joint[(a, None)] = joint.get((a, None), 0.0) + joint.pop((a, b))
    keys = sorted(set(joint) | set(counts), key=str)
    pv = chi2_pvalue([counts.get(k, 0) for k in keys], [joint.get(k, 0.0) for k in keys])
    return {"prompt": prompt["prompt"][:60], "samples": samples, "cells": len(joint), "p_value": pv}


def cmd_check(args) -> int:
    from .api import SpecDecoder
    from .prompts import load_prompts

    if args.samples < 50 or args.max_new_tokens < 1 or not 0 < args.alpha < 1:
        raise InvalidRequest("--samples must be >= 50, --max-new-tokens >= 1 and --alpha in (0, 1)")
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    if params.greedy:
        raise InvalidRequest("the sampling check needs --temperature > 0")
    prompts = load_prompts(args.prompts)[: args.limit or None]
    decoder = SpecDecoder(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy,
                          backend=args.backend)
    report = {"draft": decoder.draft_name, "tau": decoder.tau, "policy": decoder.policy,
              "greedy": check_greedy(decoder, prompts, args.max_new_tokens)}
    if args.sampling_prompts:
        report["sampling"] = [check_sampling(decoder, p, args.samples, params)
                              for p in prompts[: args.sampling_prompts]]
    bad_greedy = [r for r in report["greedy"] if not r["ok"]]
    bad_sampling = [r for r in report.get("sampling", []) if r["p_value"] < args.alpha]
    report["passed"] = not bad_greedy and not bad_sampling
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"greedy: {len(report['greedy']) - len(bad_greedy)}/{len(report['greedy'])} prompts token-identical "
              f"to the target alone")
        for r in bad_greedy:
            print(f"  DIFFERS at token {r['first_divergence']} of {r['prompt']!r}\n"
                  f"    speculative: {r['speculative'][:80]!r}\n    target:      {r['target'][:80]!r}")
        for r in report.get("sampling", []):
            verdict = "ok" if r["p_value"] >= args.alpha else "DIFFERS"
            print(f"sampling: {r['prompt']!r}: first-two-token distribution vs target, {r['samples']} samples, "
                  f"p={r['p_value']:.4g} {verdict}")
        print("PASSED" if report["passed"] else "FAILED: speculative decoding is not lossless here")
    return 0 if report["passed"] else 1


def register(sub, model_args, sampling_args):
    c = sub.add_parser("check", help="verify that speculative output equals the target alone")
    model_args(c)
    c.add_argument("--prompts", default=None, help="JSONL of {prompt, mode}; default: the shipped sets")
    c.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--sampling-prompts", type=int, default=1, help="prompts for the sampling test (0 = skip)")
    c.add_argument("--samples", type=int, default=400, help="samples per sampling test")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=8, help="keeps the exact reference enumerable")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--alpha", type=float, default=1e-3, help="fail when the p-value is below this")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
