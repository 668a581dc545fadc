"""`specdec check`: the "fast but wrong" guard.

greedy   — speculative output vs the target alone (transformers' own generate with its stock layers on the same
           weights — for specdec's runtime in exact numerics, the fp32-dequantized model — an independent reference;
           in q8 numerics, which transformers does not have, the runtime's own one-token steps), token by token;
           every differing prompt is reported with the first divergent position and both continuations.
sampling — for every member of the draft chain, at a prefix where that member drafts (the prompt plus part of the
           target's own greedy continuation), the joint distribution of the next two tokens under speculation vs
           the target's exact distribution there (direct forward passes, top-k keeps it enumerable), chi-square.
           The draws needed come from a stated power: the sample size at which a distribution error of total
           variation --detect is caught with probability 0.8 at --alpha (simulated on the exact distribution).
           Only drafted tokens rejected where the target could have produced them exercise the resampling rule (the
           prefix is chosen where the drafter proposes such tokens): draws go on (doubling, up to 3200) until
           --min-events of them are seen; with fewer the test is reported inconclusive and fails.
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


@torch.inference_mode()
def stepwise_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The runtime alone, one token per pass: the reference for the q8 mode."""
    cache, out = model.new_cache(), []
    try:
        while len(out) < n and not (out and out[-1] in eos):
            out.append(int(cache.forward(ids + out)[-1].argmax()))  # the slot holds ids + out[:-1]: one new row
    finally:
        cache.close()
    return out


def reference_model(model):
    """transformers' model of the same weights: the model itself, or for specdec's runtime the fp32-dequantized
    model transformers makes of its file."""
    if not models.is_runtime(model):
        return model
    return models.load(model.source, backend="transformers")[0]


SHOWN_BEFORE, SHOWN_AFTER = 8, 24  # tokens shown around a divergence (`check --html`)


def check_greedy(decoder, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """-> one entry per prompt: ok, and for mismatches the first divergent position and both continuations."""
    tok, eos = decoder.tokenizer, decoder.engine.eos_ids
    q8 = getattr(decoder.model, "numerics", "exact") != "exact"  # transformers has no q8: the runtime's own steps
    ref = None if q8 else reference_model(decoder.model)
    results = []
    for p in prompts:
        ids = decoder.encode(p["prompt"], p["chat"])
        if ref is None:
            want = stepwise_greedy(decoder.model, ids, max_new_tokens, eos)
        else:
            with stock_linears(ref):  # transformers as its users run it: specdec's kernels must not be the reference
                want = reference_greedy(ref, ids, max_new_tokens, eos)
        got = decoder.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p["chat"]).token_ids
        entry = {"prompt": p["prompt"][:60], "ok": got == want}
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            piece = lambda ids: [tok.decode([t]) for t in ids]  # noqa: E731  (token by token, for the page)
            entry.update(first_divergence=i, speculative=tok.decode(got[i:], skip_special_tokens=True),
                         target=tok.decode(want[i:], skip_special_tokens=True),
                         tokens={"before": piece(want[max(0, i - SHOWN_BEFORE):i]),
                                 "speculative": piece(got[i:i + SHOWN_AFTER]), "target": piece(want[i:i + SHOWN_AFTER])})
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


POWER, SAMPLE_SIZES = 0.8, (200, 400, 800, 1600, 3200)


def detectable_tv(probs: list[float], n: int, alpha: float, trials: int = 200, seed: int = 0) -> float:
    """The smallest total-variation error the chi-square test catches with probability POWER from n draws, at the
    least detectable placement: mass moved between the two likeliest cells (found by simulation, bisection)."""
    p0 = torch.tensor(probs, dtype=torch.float64)
    order = torch.argsort(p0, descending=True)
    g = torch.Generator().manual_seed(seed)

    def power(tv: float) -> float:
        p1 = p0.clone()
        moved = min(tv, float(p1[order[0]]))
        p1[order[0]] -= moved
        p1[order[1 % len(p1)]] += moved
        draws = torch.multinomial(p1.expand(trials, -1), n, replacement=True, generator=g)
        counts = torch.zeros(trials, len(p0), dtype=torch.float64).scatter_add_(1, draws, torch.ones_like(draws,
                                                                                                      dtype=torch.float64))
        return sum(chi2_pvalue(c.tolist(), probs) < alpha for c in counts) / trials
    lo, hi = 0.0, 0.5
    if power(hi) < POWER:
        return 1.0
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power(mid) >= POWER else (mid, hi)
    return hi


def _events(records, joint: dict[tuple, float]) -> int:
    """Drafted tokens rejected at one of the first two generated positions where the target could have produced
    them (non-zero probability): only there does the resampling rule differ from plain sampling from p."""
    firsts = {a for a, _ in joint}
    pos, emitted, n = 0, [], 0
    for r in records:
        if pos >= 2:
            break
        if r.proposed and r.accepted < len(r.proposed) and pos + r.accepted < 2:
            at = pos + r.accepted  # 0: the first generated position, 1: the second
            x = r.proposed[r.accepted]
            before = (emitted + r.proposed[: r.accepted])[:1]
            n += (x in firsts) if at == 0 else ((before[0], x) in joint)
        emitted += r.emitted
        pos += len(r.emitted)
    return n


def drafted_prefix(decoder, ids: list[int], params: SamplingParams, search: int = 24, probes: int = 6):
    """The prompt plus the shortest part of the target's greedy continuation after which, in most probe runs, the
    drafter drafts at one of the next two positions a token the target could produce there but need not: where a
    rejection exercises the resampling rule (None if it never does)."""
    greedy = [t for r in decoder.engine.run(ids, search, SamplingParams(), decoder.tau) for t in r.emitted]
    vocab = decoder.model.config.vocab_size
    for t in range(len(greedy) + 1):
        prefix = ids + greedy[:t]
        p1 = warp(next_token_logits(decoder.model, prefix)[:vocab], params)
        useful = 0
        for i in range(probes):
            torch.manual_seed(10_000 + i)
            recs = list(decoder.engine.run(prefix, decoder.tau + 2, params, decoder.tau))
            if recs[0].proposed:  # drafted at the first position: often rejected, yet a token the target produces?
                useful += 0.05 <= float(p1[recs[0].proposed[0]]) <= 0.9
            elif len(recs) > 1 and len(recs[0].emitted) == 1 and recs[1].proposed:  # drafted at the second
                p2 = warp(next_token_logits(decoder.model, prefix + recs[0].emitted)[:vocab], params)
                useful += 0.05 <= float(p2[recs[1].proposed[0]]) <= 0.9
        if useful * 2 >= probes:
            return prefix
    return None


def check_sampling(decoder, prompt: dict, params: SamplingParams, alpha: float, detect: float, min_events: int,
                   samples: int | None = None) -> dict:
    """The sampling test for this decoder's drafter at a prefix where it drafts (see the module docstring)."""
    ids = decoder.encode(prompt["prompt"], prompt["chat"])
    entry = {"draft": decoder.draft_name, "prompt": prompt["prompt"][:60]}
    prefix = drafted_prefix(decoder, ids, params)
    if prefix is None:
        return {**entry, "verdict": "inconclusive", "events": 0, "reason": "the drafter never drafts here"}
    joint = exact_two_token_joint(decoder.model, decoder.model.config.vocab_size, prefix, params)
    for (a, b) in list(joint):  # a first token that is EOS ends generation: one (a, None) cell
        if a in decoder.engine.eos_ids:
            joint[(a, None)] = joint.get((a, None), 0.0) + joint.pop((a, b))
    cells = sorted(joint, key=str)
    probs = [joint[k] for k in cells]
    if samples is None:  # the fewest draws that catch an error of TV `detect` with probability POWER
        samples = next((n for n in SAMPLE_SIZES if detectable_tv(probs, n, alpha) <= detect), SAMPLE_SIZES[-1])
    counts: dict[tuple, int] = {}
    events, drawn = 0, 0
    while True:
        for seed in range(drawn, samples):  # unseeded requests' rule (rejection sampling), reproducibly
            torch.manual_seed(seed)
            recs = list(decoder.engine.run(prefix, decoder.tau + 2, params, decoder.tau))
            out = [t for r in recs for t in r.emitted][:2]
            key = tuple(out) if len(out) == 2 else (out[0], None)
            counts[key] = counts.get(key, 0) + 1
            events += _events(recs, joint)
        drawn = samples
        keys = sorted(set(joint) | set(counts), key=str)
        pv = chi2_pvalue([counts.get(k, 0) for k in keys], [joint.get(k, 0.0) for k in keys])
        if events >= min_events or pv < alpha or samples >= SAMPLE_SIZES[-1]:
            break
        samples = min(2 * samples, SAMPLE_SIZES[-1])  # too few rejections yet to trust a pass: draw more
    verdict = "differs" if pv < alpha else "inconclusive" if events < min_events else "ok"
    return {**entry, "prefix_tokens": len(prefix) - len(ids), "samples": samples, "cells": len(joint),
            "detectable_tv": round(detectable_tv(probs, samples, alpha), 4), "events": events,
            "p_value": pv, "verdict": verdict}


def members(decoder) -> list:
    """The decoder itself and, for a chain A+B, a decoder per member (each tested where it drafts)."""
    from .api import SpecDecoder
    chain = getattr(decoder.engine.drafter, "members", None)
    if not chain:
        return [decoder]
    return [decoder] + [SpecDecoder.from_models(decoder.model, decoder.tokenizer, draft=m, tau=decoder.tau)
                        for m in chain]


@torch.inference_mode()
def check_row_invariance(model, ids: list[int], rows: int = 32) -> dict | None:
    """On specdec's runtime: one pass over `rows` tokens against the same tokens as one-token steps, bitwise (what
    makes greedy speculation token-identical). None for the transformers backend."""
    from . import kernels
    if not models.is_runtime(model):
        return None
    ids = (ids * rows)[:rows]
    a, b = model.acquire_slot(), model.acquire_slot()
    try:
        whole = model.forward(ids, [a] * rows, list(range(rows)))
        steps = torch.cat([model.forward([t], [b], [i]) for i, t in enumerate(ids)])
    finally:
        model.release_slot(a), model.release_slot(b)
    return {"path": kernels.path_name(), "rows": rows, "bitwise": bool(torch.equal(whole, steps)),
            "max_abs_diff": float((whole - steps).abs().max())}


def cmd_check(args) -> int:
    from .api import SpecDecoder
    from .prompts import load_prompts

    if (args.samples is not None and args.samples < 50) or args.max_new_tokens < 1 or not 0 < args.alpha < 1 \
            or not 0 < args.detect < 1 or args.min_events < 0:
        raise InvalidRequest("--samples must be >= 50, --max-new-tokens >= 1, --alpha and --detect in (0, 1), "
                             "--min-events >= 0")
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    if params.greedy:
        raise InvalidRequest("the sampling check needs --temperature > 0")
    prompts = load_prompts(args.prompts)[: args.limit or None]
    decoder = SpecDecoder(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy,
                          backend=args.backend, numerics=args.numerics, chat_template=args.chat_template,
                          chat_template_kwargs=args.chat_template_kwargs)
    report = {"draft": decoder.draft_name, "tau": decoder.tau, "policy": decoder.policy, "numerics": decoder.numerics,
              "row_invariance": check_row_invariance(decoder.model,
                                                     decoder.encode(prompts[0]["prompt"], prompts[0]["chat"])),
              "greedy": check_greedy(decoder, prompts, args.max_new_tokens)}
    if args.sampling_prompts:
        report["sampling"] = []
        for d in members(decoder):  # each member on the first prompts where it drafts uncertain tokens
            tested = []
            for p in prompts:
                r = check_sampling(d, p, params, args.alpha, args.detect, args.min_events, args.samples)
                if "p_value" in r or (p is prompts[-1] and not tested):
                    tested.append(r)
                if len(tested) >= args.sampling_prompts:
                    break
            report["sampling"] += tested
    bad_greedy = [r for r in report["greedy"] if not r["ok"]]
    bad_sampling = [r for r in report.get("sampling", []) if r["verdict"] != "ok"]
    rows = report["row_invariance"]
    report["passed"] = not bad_greedy and not bad_sampling and (rows is None or rows["bitwise"])
    if args.html:
        from .report import check_page
        try:
            with open(args.html, "w") as f:
                f.write(check_page(report))
        except OSError as e:
            raise InvalidRequest(f"cannot write {args.html}: {e.strerror}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if rows is not None:
            print(f"runtime: {rows['path']}; a {rows['rows']}-row pass "
                  + ("equals the one-token steps bitwise (row-invariant)" if rows["bitwise"] else
                     f"DIFFERS from the one-token steps by up to {rows['max_abs_diff']:.3g} (not row-invariant)"))
        alone = "transformers' fp32" if report["numerics"] == "exact" else f"its one-token steps in {report['numerics']}"
        print(f"greedy: {len(report['greedy']) - len(bad_greedy)}/{len(report['greedy'])} prompts token-identical "
              f"to the target alone ({alone})")
        for r in bad_greedy:
            print(f"  DIFFERS at token {r['first_divergence']} of {r['prompt']!r}\n"
                  f"    speculative: {r['speculative'][:80]!r}\n    target:      {r['target'][:80]!r}")
        for r in report.get("sampling", []):
            if "p_value" not in r:
                print(f"sampling, draft {r['draft']}: {r['prompt']!r}: INCONCLUSIVE ({r['reason']})")
                continue
            print(f"sampling, draft {r['draft']}: {r['prompt']!r}, {r['prefix_tokens']} tokens in: next two tokens vs "
                  f"the target, {r['samples']} samples (catches TV >= {r['detectable_tv']} with power {POWER}), "
                  f"{r['events']} drafted-and-rejected, p={r['p_value']:.4g} {r['verdict'].upper()}")
        print("PASSED" if report["passed"] else "FAILED: speculative decoding is not lossless here")
    return 0 if report["passed"] else 1


def register(sub, model_args, sampling_args):
    c = sub.add_parser("check", help="verify that speculative output equals the target alone")
    model_args(c)
    c.add_argument("--prompts", default=None, help="JSONL of {prompt, mode}; default: the shipped sets")
    c.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--sampling-prompts", type=int, default=1,
                   help="prompts per drafter for the sampling test, the first where it drafts (0 = skip)")
    c.add_argument("--samples", type=int, default=None,
                   help="samples per sampling test (default: from --detect at power 0.8)")
    c.add_argument("--detect", type=float, default=0.1,
                   help="the total-variation error the sampling test must catch with probability 0.8")
    c.add_argument("--min-events", type=int, default=20,
                   help="drafted-and-rejected events below which the sampling test is inconclusive")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=8, help="keeps the exact reference enumerable")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--alpha", type=float, default=1e-3, help="fail when the p-value is below this")
    c.add_argument("--json", action="store_true")
    c.add_argument("--html", metavar="FILE", help="also write a page: each divergence token by token")
    c.set_defaults(func=cmd_check)
