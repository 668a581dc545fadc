"""JSON-schema requests with and without speculation, in ONE interleaved run (prompt by prompt).

    python benchmarks/serve.py structured [--out docs/structured.json]

Three schemas (a person, a product list, an event with nested fields), 4 prompts each, greedy, 128 tokens at most.
Reports tokens/s for constrained target-only (`none`: no drafts at all, not even forced tokens) and for each draft,
the share of emitted tokens that the grammar forced (drafted free), whether every output parses and follows its
schema's required keys, and whether each speculative output equals constrained target-only's token for token."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from time import perf_counter

from specdec import SpecDecoder

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid"]},
        "email": {"type": "string"}}, "required": ["name", "age", "city", "email"], "additionalProperties": False},
    "products": {"type": "object", "properties": {"products": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                                         "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "in_stock"], "additionalProperties": False}}},
        "required": ["products"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string"},
        "location": {"type": "object", "properties": {"venue": {"type": "string"}, "city": {"type": "string"}},
                     "required": ["venue", "city"], "additionalProperties": False},
        "attendees": {"type": "integer"}}, "required": ["title", "date", "location", "attendees"],
        "additionalProperties": False},
}
PROMPTS = {
    "person": ["Describe a person as JSON.", "Invent a customer record.", "Create a profile for a teacher.",
               "Give me a JSON record of a football player."],
    "products": ["List some fruit for sale as JSON.", "A small electronics catalogue, please.",
                 "Three books a shop sells, as JSON.", "Give me a bakery's products."],
    "event": ["Describe a concert as JSON.", "Plan a team meeting.", "Invent a wedding event record.",
              "A science conference, as JSON."],
}
DRAFTS = ["datastore+ngram", "ngram"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = SpecDecoder(draft="none")
    decoders = {"none": base} | {d: SpecDecoder.from_models(base.model, base.tokenizer, d, tau=3) for d in DRAFTS}
    base.generate("warm up", max_new_tokens=4, response_format={"type": "json_object"})
    rows = {d: dict(tokens=0, seconds=0.0, forced=0, passes=0, valid=0, identical=0, runs=0) for d in decoders}
    for kind, prompts in PROMPTS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind], "strict": True}}
        for p in prompts:
            ref = None
            for d, sd in decoders.items():
                t = perf_counter()
                out = sd.generate(p, max_new_tokens=args.max_new_tokens, response_format=fmt)
                r = rows[d]
                r["seconds"] += perf_counter() - t
                r["tokens"] += len(out.token_ids)
                r["passes"] += len(out.records)
                r["forced"] += sum(min(c.forced, c.accepted) for c in out.records)
                r["runs"] += 1
                try:
                    obj = json.loads(out.text)
                    r["valid"] += set(SCHEMAS[kind]["required"]) <= set(obj)
                except ValueError:
                    pass
                ref = out.token_ids if d == "none" else ref
                r["identical"] += out.token_ids == ref
    t0 = rows["none"]["tokens"] / rows["none"]["seconds"]
    result = {d: {"tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                  "speedup": round(r["tokens"] / r["seconds"] / t0, 3),
                  "tokens_per_pass": round(r["tokens"] / r["passes"], 3),
                  "forced_share": round(r["forced"] / r["tokens"], 3),
                  "valid": f"{r['valid']}/{r['runs']}", "identical": f"{r['identical']}/{r['runs']}"}
              for d, r in rows.items()}
    print("| draft | tokens/s | speedup | tokens/pass | forced share | valid | identical |\n|---|---|---|---|---|---|---|")
    for d, r in result.items():
        print(f"| {d} | {r['tokens_per_s']} | {r['speedup']}x | {r['tokens_per_pass']} | {r['forced_share']} | "
              f"{r['valid']} | {r['identical']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
