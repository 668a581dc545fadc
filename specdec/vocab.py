"""`specdec vocab --target FILE`: count the token ids of the target's own text (the shipped prompts and the target's
greedy answers to them, batched on the runtime) and store the counts for that target. A draft run as
`--draft DRAFT:vocab=N` then keeps the N most frequent ids in its head (drafters/vocab.py). Prints how much of the
counted text the most frequent 8k, 16k, 32k and 64k ids cover: what each N gives up."""
from __future__ import annotations

import json
import sys

from . import models
from .drafters.vocab import count_tokens, store_counts
from .errors import InvalidRequest, SpecDecError
from .prompts import HERE, encode_prompt, load_prompts

SETS = ("chat", "code", "summarize", "completion", "more", "grounded", "distill")  # not the pair's held-out prompts
SIZES = (8192, 16384, 32768, 65536)
GROUP = 16  # prompts generated together (one KV slot each)


def coverage(counts, sizes=SIZES) -> dict[int, float]:
    """The share of counted tokens the most frequent n ids cover, per n."""
    total, ranked = sum(counts.values()), [c for _, c in counts.most_common()]
    return {n: round(sum(ranked[:n]) / total, 4) for n in sizes} if total else {}


def count_target_text(target: str, prompts: list[dict], max_new_tokens: int, progress=None):
    from .generate import generate_batch

    model, tok = models.load(target, backend="runtime")
    window = models.context_window(model)
    encoded = [encode_prompt(tok, p["prompt"], chat=p.get("mode", "chat") == "chat",
                             context_window=window - max_new_tokens) for p in prompts]
    eos, texts = models.eos_ids(model, tok), []
    for start in range(0, len(encoded), GROUP):
        for seq, _ in generate_batch(model, encoded[start:start + GROUP], max_new_tokens, eos):
            texts.append(seq)
        if progress:
            progress(min(start + GROUP, len(encoded)), len(encoded))
    return count_tokens(texts), model.config.vocab_size


def cmd_vocab(args) -> int:
    if args.max_new_tokens < 1:
        raise InvalidRequest("--max-new-tokens must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise InvalidRequest("--limit must be at least 1")
    prompts = load_prompts(args.prompts) if args.prompts else [
        p for name in SETS for p in load_prompts(HERE / f"{name}.jsonl")]
    prompts = prompts[: args.limit] if args.limit else prompts
    if not prompts:
        raise InvalidRequest("no prompts to count")
    counts, vocab = count_target_text(args.target, prompts, args.max_new_tokens, lambda d, n: print(
        f"specdec vocab: {d}/{n} prompts", file=sys.stderr))
    meta = {"target": args.target, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "tokens": sum(counts.values()), "distinct": len(counts), "vocab": vocab, "coverage": coverage(counts)}
    try:
        path = store_counts(args.target, counts, meta)
    except OSError as e:
        raise SpecDecError(f"cannot store the counts: {e.strerror}")
    if args.json:
        print(json.dumps({**meta, "stored": str(path)}, indent=2))
    else:
        print(f"{meta['tokens']:,} tokens counted ({meta['distinct']:,} distinct ids of {vocab:,}), stored in {path}")
        for n, share in meta["coverage"].items():
            print(f"  the most frequent {n:>6,} ids cover {share:.2%} of them")
    return 0


def register(sub, model_args, sampling_args):
    p = sub.add_parser("vocab", help="count the target's own tokens: what a draft's trimmed head (DRAFT:vocab=N) keeps")
    p.add_argument("--target", required=True, help="a .gguf file (run on specdec's runtime)")
    p.add_argument("--prompts", default=None, help="a JSONL of {prompt, mode}; default: the shipped sets")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_vocab)
