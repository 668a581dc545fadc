"""Ablations in process: the pair's prompts through the server's batch engine, one request at a time, under arms
that differ only in module constants (`--arm "name: module.CONSTANT=value; ..."`) or in their draft. The arms alternate prompt by
prompt (A B, then B A), so this machine's drift hits each alike. Reports per workload the decode tokens a pass
(the pass that emits the first token excluded), decode tokens/s, and whether every arm's output is the same.

    python benchmarks/draft.py ablate --draft ngram+distilled --workloads edits,edits-predicted \
        --arm "no renames: specdec.drafters.prediction.MAX_REPLACED=0" --arm "renames:"

An arm may also name its own draft (`draft=SPEC`; each draft gets its own engine and target copy):

    python benchmarks/draft.py ablate --workloads completion,chat,edits \
        --arm "file: draft=keep:$HOME/.cache/specdec/pair/coder05.gguf" --arm "4-bit: draft=$HOME/.cache/specdec/pair/coder05.gguf"
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys
from pathlib import Path
from time import perf_counter

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
WORKS = ("completion", "chat", "edits", "edits-predicted")  # (sampling: --temperature)


def parse_arm(text: str) -> tuple[str, list[tuple[object, str, object]], str | None]:
    """"name: pkg.module.NAME=value; ...[; draft=SPEC]" -> (name, [(module, NAME, value)], SPEC or None); a value is
    a Python literal."""
    name, _, sets = text.partition(":")
    out, draft = [], None
    for item in filter(None, (s.strip() for s in sets.split(";"))):
        path, _, value = item.partition("=")
        if path.strip() == "draft":
            draft = value.strip()
            continue
        module, _, attr = path.strip().rpartition(".")
        try:
            mod = importlib.import_module(module)
            out.append((mod, attr, ast.literal_eval(value.strip())))
        except (ImportError, ValueError, SyntaxError) as e:
            raise SystemExit(f"ablate: --arm {text!r}: {item!r} is not module.CONSTANT=literal ({e})") from None
        if not hasattr(mod, attr):
            raise SystemExit(f"ablate: {module} has no {attr}")
    return name.strip(), out, draft


def main(argv=None) -> int:
    from pair import PROMPTS, fenced, fetch_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="ngram+distilled")
    ap.add_argument("--workloads", default="completion,chat,edits,edits-predicted")
    ap.add_argument("--arm", action="append", required=True, help='"name: module.CONSTANT=value; ..." (2 or more)')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    works = args.workloads.split(",")
    if len(arms) < 2 or set(works) - set(WORKS):
        raise SystemExit(f"ablate: two or more --arm, and workloads among {', '.join(WORKS)}")
    from specdec.api import SpecDecoder, encode_prompt
    from specdec.batch import Sequence
    from specdec.sampling import SamplingParams
    from specdec.server.app import batch_engine
    engines = {}
    for spec in {d or args.draft for _, _, d in arms}:
        dec = SpecDecoder(target=str(fetch_model("coder15")), draft=spec)
        engines[spec] = batch_engine(dec, None, 32), dec.tokenizer
    base = {(m, a): getattr(m, a) for _, sets, _ in arms for m, a, _ in sets}
    stats, outputs, i = {}, {}, 0
    for work in works:
        prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
        for p in [p for p in prompts if p["workload"] == work.replace("-predicted", "")]:
            for name, sets, draft in arms if i % 2 == 0 else arms[::-1]:
                engine, tok = engines[draft or args.draft]
                for (m, a), v in base.items():
                    setattr(m, a, v)
                for m, a, v in sets:
                    setattr(m, a, v)
                ids = encode_prompt(tok, p["prompt"], chat=work != "completion")
                pred = tok(fenced(p["prompt"])).input_ids if work == "edits-predicted" else None
                params = SamplingParams(temperature=args.temperature, seed=7 + i) if args.temperature else \
                    SamplingParams()
                s = engine.add(Sequence(list(ids), args.max_tokens, params, prediction=pred))
                passes, ms, first = 0, 0.0, None
                while engine.running:
                    decoding, t = bool(s.generated), perf_counter()
                    engine.step()
                    if decoding:
                        ms += (perf_counter() - t) * 1e3
                        passes += bool(engine.last)
                    elif s.generated:
                        first = len(s.generated)
                row = stats.setdefault((work, name), [0, 0, 0.0])
                row[0], row[1], row[2] = row[0] + len(s.generated) - (first or 0), row[1] + passes, row[2] + ms
                outputs.setdefault((work, i), set()).add(tuple(s.generated))
            i += 1
    report = {work: {name: {"tokens_per_pass": round(t / max(n, 1), 3), "decode_tokens_per_s": round(1e3 * t / ms, 1)}
                     for (w, name), (t, n, ms) in stats.items() if w == work} for work in works}
    report["identical"] = all(len(v) == 1 for v in outputs.values())
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
