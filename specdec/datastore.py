"""`specdec datastore build --target FILE`: a retrieval datastore (drafters/datastore.py) of the target's own greedy
outputs on the shipped prompt sets, so `--draft datastore` (and the default draft) works for any target.

The outputs are generated on the runtime where it runs the target, a batch of sequences per pass, with a progress
bar; the run resumes where it stopped. The datastore lands in the cache, keyed by the target file, where the
`datastore` drafter and default_draft() look for it; `--out DIR` puts it elsewhere (`--draft datastore:DIR`)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import models
from .cli import threads_arg
from .drafters.datastore import META, check_datastore, datastore_dir  # noqa: F401 (where they were)
from .errors import InvalidRequest, SpecDecError
from .prompts import HERE as PROMPT_DIR, load_prompts

PROMPT_SETS = [PROMPT_DIR / "distill.jsonl", PROMPT_DIR / "distill_stdlib.jsonl"]  # not the held-out eval sets


def build_datastore(target: str, out: str | None = None, prompt_files: list[str] | None = None, limit: int = 0,
                    max_new_tokens: int = 128, batch: int = 16) -> dict:
    from .distill import generate_responses
    from .drafters.datastore import DatastoreDrafter
    if max_new_tokens < 1 or batch < 1 or limit < 0:
        raise InvalidRequest("--max-new-tokens and --batch must be >= 1, --limit >= 0")
    out_dir = Path(out) if out else datastore_dir(target)
    work = out_dir / "work"
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecDecError(f"cannot write to {out_dir}: {e.strerror}")
    prompts = [p for f in (prompt_files or PROMPT_SETS) for p in load_prompts(f)]
    prompts = prompts[:limit] if limit else prompts
    model, tok = models.load(target)
    if not getattr(tok, "chat_template", None):  # a base model: the prompts as plain text
        prompts = [{**p, "chat": False} for p in prompts]
    key = hashlib.sha256(json.dumps([prompts, max_new_tokens]).encode()).hexdigest()[:16]
    stamp = work / "inputs.key"
    if stamp.exists() and stamp.read_text() != key:  # other prompts or lengths: start again
        for f in work.glob("*"):
            if f.is_file():
                f.unlink()
    stamp.write_text(key)
    items = generate_responses(model, tok, prompts, work / "sequences.jsonl", max_new_tokens, batch, "cpu")
    seqs = [list(map(int, it["ids"])) for it in items]
    DatastoreDrafter.save(seqs, out_dir)
    meta = {"target": str(target), "fingerprint": models.tokenizer_fingerprint(tok), "sequences": len(seqs),
            "tokens": sum(map(len, seqs)), "max_new_tokens": max_new_tokens}
    (out_dir / META).write_text(json.dumps(meta, indent=2))
    return {**meta, "out": str(out_dir)}


def cmd_datastore(args) -> int:
    rep = build_datastore(args.target, args.out, args.prompts, args.limit, args.max_new_tokens, args.batch)
    print(f"datastore of {rep['sequences']} sequences ({rep['tokens']:,} tokens) saved to {rep['out']}; "
          f"`--draft datastore` now uses it for this target")
    return 0


def register(sub, model_args, sampling_args):
    d = sub.add_parser("datastore", help="build a retrieval datastore of a target's own outputs")
    d.add_argument("action", choices=["build"])
    d.add_argument("--target", default="default")
    d.add_argument("--out", default=None, help="directory (default: the cache, where `--draft datastore` looks)")
    d.add_argument("--prompts", action="append", help="JSONL prompt files (default: the shipped distill sets)")
    d.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    d.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's responses")
    d.add_argument("--batch", type=int, default=16, help="sequences generated together")
    threads_arg(d)
    d.set_defaults(func=cmd_datastore)
