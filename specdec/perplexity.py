"""`specdec perplexity FILE`: how well the target predicts a text, in each numerics mode (as llama.cpp's
llama-perplexity): the text is cut into windows of --context tokens; in each, every token after the window's first
half is scored given all before it in the window (so every scored token has at least context/2 tokens of history).
Perplexity = exp(mean negative log-likelihood). With both modes, the greedy agreement is the share of scored
positions where exact and q8 pick the same next token."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from . import models
from .cli import threads_arg
from .errors import InvalidRequest, SpecDecError


@torch.inference_mode()
def score(model, ids: list[int], context: int) -> tuple[list[float], list[int]]:
    """Negative log-likelihoods and argmax predictions of the scored positions of `ids` under `model` (runtime)."""
    nll, top = [], []
    slot = model.acquire_slot()
    try:
        for start in range(0, len(ids) - context + 1, context):
            window = ids[start: start + context]
            logits = model.forward(window, [slot] * context, list(range(context))).double()
            first = context // 2
            logp = logits[first - 1: context - 1].log_softmax(-1)
            target = torch.tensor(window[first:])
            nll += (-logp.gather(1, target[:, None])[:, 0]).tolist()
            top += logp.argmax(-1).tolist()
    finally:
        model.release_slot(slot)
    return nll, top


def perplexity(target: str, text: str, context: int, modes: list[str], max_tokens: int | None = None) -> dict:
    model, tok = models.load(target, backend="runtime")
    ids = tok(text).input_ids[: max_tokens or None]
    if context < 4 or context > models.context_window(model):
        raise InvalidRequest(f"--context must be in [4, {models.context_window(model)}]")
    if len(ids) < context:
        raise InvalidRequest(f"the text is {len(ids)} tokens; --context {context} needs at least that many")
    report, tops = {"tokens": len(ids), "context": context}, {}
    for mode in modes:
        model.set_numerics(mode)
        nll, tops[mode] = score(model, ids, context)
        report[mode] = {"perplexity": round(math.exp(sum(nll) / len(nll)), 4), "scored": len(nll)}
    if len(modes) == 2:
        a, b = (tops[m] for m in modes)
        report["greedy_agreement"] = round(sum(x == y for x, y in zip(a, b)) / len(a), 4)
        report["q8_vs_exact"] = round(report[modes[1]]["perplexity"] / report[modes[0]]["perplexity"] - 1, 5)
    return report


def cmd_perplexity(args) -> int:
    try:
        text = Path(args.file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecDecError(f"cannot read {args.file}: {getattr(e, 'strerror', None) or e}")
    modes = ["exact", "q8"] if args.numerics == "both" else [args.numerics]
    report = perplexity(args.target, text, args.context, modes, args.max_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for m in modes:
        print(f"{m}: perplexity {report[m]['perplexity']:.4f} over {report[m]['scored']} tokens "
              f"(context {args.context})")
    if "greedy_agreement" in report:
        print(f"q8 vs exact: perplexity {100 * report['q8_vs_exact']:+.3f}%, greedy agreement "
              f"{100 * report['greedy_agreement']:.2f}%")
    return 0


def register(sub, model_args, sampling_args):
    p = sub.add_parser("perplexity", help="perplexity of the target over a text file, per numerics mode")
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--target", default="default", help="a .gguf file, a model directory, or 'default'")
    p.add_argument("--numerics", default="both", choices=["exact", "q8", "both"])
    p.add_argument("--context", type=int, default=512, help="tokens per window (the second half is scored)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the text's first N tokens")
    p.add_argument("--json", action="store_true")
    threads_arg(p)
    p.set_defaults(func=cmd_perplexity)
