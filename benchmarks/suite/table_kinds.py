"""One function per kind of table (benchmarks/suite/tables.py): each takes the JSON results a doc's marker names and
returns the Markdown table, so that a doc's numbers are always its results'."""
from __future__ import annotations

import re

NAMES = {"llama": "llama-server", "ours-none": "ours `none`", "ours": "ours `ngram`", "ours-0.5b": "ours 0.5B",
         "ours-0.5b-32k": "ours 0.5B, 32k head", "ours-0.5b-16k": "ours 0.5B, 16k head",
         "ours-feature": "ours feature draft", "ours-ngram-feature": "ours `ngram+distilled`"}
WORKLOADS = {"completion": "completion", "chat": "chat", "edits": "edits", "fim": "fill-in",
             "chat-sampled": "chat T0.7", "edits-predicted": "edits predicted", "all": "all"}


def grid(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pair_table(result: dict) -> str:
    """Decode tokens/s per workload and system (benchmarks/pair.py speed)."""
    systems = result["systems"]
    shown = [w for w in WORKLOADS if any(isinstance(c.get(w), dict) for c in systems.values())]
    rows = [[NAMES.get(name, name)] + [f"{cells[w]['decode_tps']:.1f}" if isinstance(cells.get(w), dict)
                                       and cells[w].get("decode_tps") else "–" for w in shown]
            for name, cells in systems.items()]
    return grid(["system"] + [WORKLOADS[w] for w in shown], rows)


def streams_table(result: dict) -> str:
    """Tokens/s and time to first token per stream count (pair.py speed --streams)."""
    report = result["streams"]
    levels = sorted({int(lv) for r in report.values() for lv in r})
    rows = []
    for name, r in report.items():
        same = [r[lv]["identical"].split("/") for lv in r]
        own = " its own" if name.startswith("llama") else ""
        rows.append([NAMES.get(name, name)]
                    + [f"{r[str(lv)]['tokens_per_s']:.1f} ({r[str(lv)]['ttft_p50_s']:.2f} s)" if str(lv) in r else "–"
                       for lv in levels]
                    + [f"{sum(int(a) for a, _ in same)}/{sum(int(b) for _, b in same)}{own}"])
    return grid(["system"] + [f"{lv} stream{'s' if lv > 1 else ''}" for lv in levels] + ["= target-only"], rows)


COPIES = {"none", "ngram", "suffix", "recycle", "datastore", "prediction"}  # drafters that run no model


def drafts_a_model(command: list[str]) -> bool:
    """Whether a server's command line drafts with a model (a file, `distilled`, an EAGLE-3 head) rather than only
    copying: a server without `--draft` on a target other than the default runs `ngram`."""
    if "--draft" not in command:
        return False
    chain = command[command.index("--draft") + 1].split("+")
    return any(part.split(":")[0] not in COPIES for part in chain)


def pair_bounds_table(result: dict) -> str:
    """Speed-up over target-only beside the bound the same run's curve sets (pair.py speed): a copy draft's against
    copying alone, a model draft's against copying plus the model at its measured per-token acceptance (shown) and
    step cost."""
    shown = [w for w in WORKLOADS if w != "all" and any(w in b for b in result["bounds"].values())]
    commands = result.get("config", {}).get("commands", {})
    rows = []
    for name, b in result["bounds"].items():
        model = drafts_a_model(commands[name]) if name in commands else b["draft_step"] >= 0.05
        bound = "copy+model@alpha" if model else "copy"
        label = NAMES.get(name, name).removeprefix("ours ") + (f" (step {b['draft_step']:.3f} of a pass)" if model else "")
        def cell(w):  # no bound where the run measured no acceptance (a sampled workload's α): not α = 1's
            if w not in b:
                return "–"
            if b[w].get(bound) is None:
                return f"{b[w]['measured']:.2f} \\| –"
            alpha = f" (α {b[w]['alpha']:.2f})" if model and b[w].get("alpha") is not None else ""
            return f"{b[w]['measured']:.2f} \\| {b[w][bound]:.2f}{alpha}"
        rows.append([label] + [cell(w) for w in shown])
    return grid(["system"] + [WORKLOADS[w] for w in shown], rows)


HEADLINE = {"llama": "llama-server", "ours-none": "`specdec serve --draft none`",
            "ours": "**`specdec serve`** (`ngram`)", "ours-0.5b": "`… --draft` 0.5B"}


def headline_table(one: dict, streams: dict) -> str:
    """The README's table: decode tokens/s per workload (one request at a time), then tokens/s at 1, 4 and 8 streams."""
    shown = [w for w in WORKLOADS if w != "all" and any(isinstance(c.get(w), dict) for c in one["systems"].values())]
    levels = sorted({int(lv) for r in streams["streams"].values() for lv in r})
    rows = []
    for name, label in HEADLINE.items():
        cells, r = one["systems"].get(name, {}), streams["streams"].get(name, {})
        rows.append([label] + [f"{cells[w]['decode_tps']:.1f}" if isinstance(cells.get(w), dict)
                               and cells[w].get("decode_tps") else "–" for w in shown]
                    + [f"{r[str(lv)]['tokens_per_s']:.1f}" if str(lv) in r else "–" for lv in levels])
    heads = {"chat-sampled": "chat T=0.7", "edits-predicted": "edits, predicted"}
    return grid(["tokens/s"] + [heads.get(w, WORKLOADS[w]) for w in shown]
                + [f"{lv} stream{'s' if lv > 1 else ''}" if lv == levels[0] else str(lv) for lv in levels], rows)


def verify_curve_table(result: dict) -> str:
    """One pass over n new tokens after a cached prompt, ms and relative to n = 1 (runtime.py verify-curve)."""
    ms, rel = result["verify_ms"], result["relative_to_one_token"]
    sizes = list(ms["runtime"])
    label = {"runtime": "specdec runtime", "llama.cpp": "llama.cpp"}
    rows = [[f"{label[s]}, ms"] + [f"{ms[s][n]:.2f}" for n in sizes] for s in ms]
    rows += [[f"{s} T(n)/T(1)"] + [f"{rel[s][n]:.2f}" for n in sizes] for s in rel]
    return grid(["n tokens"] + sizes, rows)


def numerics_curve_table(result: dict) -> str:
    """Pass ms per rows, exact against q8 against llama.cpp (runtime.py numerics)."""
    ms = result["pass_ms"]
    sizes = list(ms["q8"])
    label = {"exact": "exact, ms", "q8": "**q8, ms**", "llama.cpp": "llama.cpp (llama-cpp-python, same file), ms"}
    rows = [[label.get(s, s)] + [f"**{ms[s][n]:.2f}**" if s == "q8" else f"{ms[s][n]:.2f}" for n in sizes]
            for s in ms]
    return grid(["rows per pass"] + sizes, rows)


def structured_table(result: dict) -> str:
    """JSON-schema requests per draft (serve.py structured)."""
    rows = [[d, f"{r['tokens_per_s']:.1f}", f"{r['speedup']}x", r["tokens_per_pass"], r["forced_share"], r["valid"],
             r["identical"]] for d, r in result.items()]
    return grid(["draft", "tokens/s", "speedup", "tokens/pass", "share of tokens forced", "valid", "identical"], rows)


def gemma_table(result: dict) -> str:
    """A GGUF users have, speculative and target-only against llama.cpp (runtime.py gguf-target)."""
    s = result["speed"]
    draft = s["draft"].split(" (")[0]
    return grid(["", "tokens/s", "vs llama.cpp"], [
        ["llama.cpp (llama-cpp-python)", f"{s['llama.cpp']:.1f}", "1.00x"],
        ["specdec target-only (q8)", f"{s['target_only']:.1f}", f"{s['target_vs_llamacpp']:.2f}x"],
        [f"specdec default, `{draft}`", f"{s['speculative']:.1f}",
         f"{s['speculative_vs_llamacpp']:.2f}x ({s['speculative_vs_target']:.2f}x target-only)"]])


def synthetic_table(result: dict) -> str:
    """A synthetic 1B Q4_K_M: decode, pass ms per rows, peak memory (runtime.py synthetic-gguf)."""
    arms = {"q8": "specdec q8", "exact": "specdec exact", "llama.cpp": "llama.cpp"}
    sizes = list(result["q8"]["verify_ms"])
    rows = [[label, f"{result[a]['decode_tok_s']:.1f}", " / ".join(f"{result[a]['verify_ms'][n]:,.1f}" for n in sizes),
             f"{result[a]['peak_rss_mb']:,.0f}"] for a, label in arms.items()]
    return grid(["", "decode tokens/s", f"pass ms, {' / '.join(sizes)} rows", "peak RSS MB"], rows)


def memory_waves_table(result: dict) -> str:
    """Long prompts against a KV budget, step by step (serve.py memory-waves)."""
    steps, rows, seen = result["steps"], [], (0.0, 0.0)
    label = {"first": "{n} concurrent completions", "same texts, new last word":
             "{n} more: texts answered above, a different last word"}
    waves = [s for s in steps if s["step"].startswith("wave")]
    for s in steps:
        hits, asked = s.get("vllm:prefix_cache_hits_total", 0.0), s.get("vllm:prefix_cache_queries_total", 0.0)
        found, seen = (hits - seen[0], asked - seen[1]), (hits, asked) if "requests" in s else seen
        if s["step"].startswith("wave"):
            continue
        codes = ", ".join(f"{n} × {c}" + (" with `Retry-After`" if c == "429" and s.get("retry_after") else "")
                          for c, n in sorted(s.get("codes", {}).items()))
        shown = f"{codes} (slowest {s['slowest_s']:.1f} s)" if codes else "healthy"
        if found[0]:
            shown += f"; prefix cache: {found[0]:,.0f} of {found[1]:,.0f} prompt tokens found"
        rows.append([label.get(s["step"], s["step"]).format(n=s.get("requests")), shown, f"{s['rss_mb']:,} MB"])
    if waves:
        slow = [w["slowest_s"] for w in waves]
        ok = all(set(w.get("codes", {})) == {"200"} for w in waves)
        rows.append([f"{len(waves)} waves of {waves[0]['requests']}, each with fresh texts",
                     f"{'all 200' if ok else 'not all 200'}, {min(slow):.0f}–{max(slow):.0f} s a wave",
                     " / ".join(f"{w['rss_mb']:,}" for w in waves) + " MB"])
    return grid(["step", "result", "resident memory"], rows)


def trees_table(result: dict) -> str:
    """Chains against trees per workload, default model (draft.py trees)."""
    shown = ["recycle", "ngram", "datastore+ngram", "datastore+ngram+recycle"]
    label = {"chat+code": "chat + code", "grounded": "input-grounded", "sampled": "sampled T=0.7, 1.0 (chat, seeded)"}
    rows = []
    for workload, drafts in result["results"].items():
        for i, d in enumerate(x for x in shown if x in drafts):
            r = drafts[d]
            rows.append([label.get(workload, workload) if i == 0 else "", d + (" (default)" if d == "datastore+ngram"
                                                                           else ""),
                         f"{r['speedup']:.2f}x", f"{r['tokens_per_pass']:.2f}", f"{r['nodes_per_pass']:.2f}",
                         f"{r['accepted_per_pass']:.2f}", f"{r['draft_ms_per_cycle']:.2f}"])
    return grid(["workload", "draft", "speedup", "tokens/pass", "nodes/pass", "accepted/pass", "draft ms/cycle"], rows)


def bench_table(result: dict) -> str:
    """`specdec bench --json`: each configuration against target-only and llama.cpp, in one interleaved run."""
    rows, runs = [], result["results"]
    cpp = next((r["tokens_per_s"] for r in runs if r["engine"] == "llama.cpp"), None)
    for r in runs:
        draft, tau = r.get("draft") or "none", f" τ={r['tau']}" if r.get("tau") else ""
        if r["engine"] == "specdec":
            label = "specdec target-only" if draft == "none" else f"specdec `{draft}`{tau}"
            same = "yes" if r["identical_to_baseline"] else "**no**"
        elif r["engine"] == "llama.cpp":
            label, same = "llama.cpp (llama-cpp-python, same GGUF)", "no" if not r["identical_to_baseline"] else "yes"
        else:  # transformers on the fp32-dequantized weights: equal to target-only in `exact` numerics, not q8
            label = "transformers `generate`" if draft == "none" else f"transformers prompt lookup{tau}"
            same = "yes" if r["identical_to_baseline"] else f"no ({result['numerics']} vs fp32)"
        rows.append([label, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / cpp:.2f}x" if cpp else "–",
                     f"{r['speedup']:.2f}x", f"{r['acceptance_rate']:.2f}" if r.get("acceptance_rate") else "–",
                     f"{r['target_passes_per_token']:.2f}" if r.get("target_passes_per_token") else "–", same])
    return grid(["system", "tokens/s", "vs llama.cpp", "vs target-only", "acceptance", "passes/token",
                 "= target-only"], rows)


BUGS = {"none": "none", "resample_from_p": "resample from p after a rejection",
        "wrong_q": "a uniform q reported for the one-hot draft"}


def planted_bugs_table(result: list) -> str:
    """`specdec check` with each sampling bug planted (serve.py planted-bugs): the verdict, and per chain member the
    test's p-value (its informative drafted-and-rejected events)."""
    rows = []
    for r in result:
        chain = "+" in r["draft"]
        members = ", ".join(("chain " if chain and s["draft"] == r["draft"] else f"{s['draft']} " if chain else "")
                            + f"{s['p_value']:.2g} ({s['events']})" for s in r["sampling"])
        rows.append([f"`{r['draft']}`" + (" (default)" if r["draft"] == "datastore+ngram" and r["bug"] == "none"
                                          else ""),
                     BUGS.get(r["bug"], r["bug"]), "PASSED" if r["passed"] else "FAILED", members])
    return grid(["draft", "planted bug", "verdict", "per member: p-value (informative drafted-and-rejected events)"],
                rows)


def _drafts(options: list[str]) -> str:
    """A setup's options as typed, with the pair's draft file shown as 0.5B."""
    return re.sub(r"[^\s+]*/coder05\.gguf", "0.5B", " ".join(options))


PAIR_SETUPS = {"default": "default (`ngram`, the scheduler's τ up to 8)", "0.5B tau=8 fixed": "0.5B, τ fixed at 8"}


def diagnosis_pair_table(result: list) -> str:
    """The real pair's setups: bottleneck, fix, measured after (serve.py diagnosis --pair)."""
    rows = []
    for s in result:
        short = s.get("shortfalls") or {}
        fix = s.get("fix") or [[]]
        fixed = fix[0][fix[0].index("--draft") + 1] if "--draft" in fix[0] else ""
        fixed_tau = (fix[1] if len(fix) > 1 else {}).get("tau")
        rows.append([PAIR_SETUPS.get(s["setup"], f"`{_drafts(s['options'])}`"),
                     f"{s['proposal_rate']:.0%}" if s.get("proposal_rate") is not None else "–",
                     ", ".join(f"{k} {v}" for k, v in short.items()) or "–",
                     f"`{s['bottleneck']}`", f"{s['predicted']:.3f}x vs {s['measured']:.3f}x",
                     (f"`{_drafts([fixed])}`" + (f" τ {fixed_tau}" if fixed_tau else "")) if fixed else "–",
                     f"{s['predicted_after_fix']:.2f}x" if s.get("predicted_after_fix") else "–",
                     f"{s['measured_after_fix']:.2f}x" if s.get("measured_after_fix") else "–"])
    return grid(["setup", "proposal rate", "why fewer than τ were verified", "bottleneck", "cost model vs measured",
                 "fix applied", "its ceiling", "measured after"], rows)


GAINS = {"draft_cost": "drafting free", "verify_cost": "verify one step", "tau_too_large": "best τ",
         "tau_too_small": "best τ", "overhead": "overhead", "low_acceptance": "acceptance"}


def diagnosis_table(result: list) -> str:
    """The default model in process: bottleneck, what fixing each cause gains (serve.py diagnosis)."""
    rows = []
    for s in result:
        gains = sorted(((v, k) for k, v in s["gains"].items() if v and v > 1.0), reverse=True)
        draft, _, tau = s["setup"].partition(" tau=")
        rows.append([f"`--draft {draft} --tau {tau}`" + (" (default)" if draft == "datastore+ngram" else ""),
                     f"`{s['bottleneck']}`",
                     ", ".join(f"{GAINS.get(k, k)} {v:.2f}x" for v, k in gains) or "none above 1.0x",
                     f"{s['predicted']:.3f}x vs {s['measured']:.3f}x", f"{s['actual_end_to_end']:.2f}x"])
    return grid(["setup", "bottleneck", "gains (`speedup_if_fixed`)", "cost model vs measured", "end to end"], rows)


KINDS = {"pair": pair_table, "pair_bounds": pair_bounds_table, "streams": streams_table, "headline": headline_table, "verify_curve": verify_curve_table,
         "numerics_curve": numerics_curve_table, "structured": structured_table, "gemma": gemma_table,
         "synthetic": synthetic_table, "memory_waves": memory_waves_table, "trees": trees_table,
         "diagnosis_pair": diagnosis_pair_table, "bench": bench_table, "planted_bugs": planted_bugs_table, "diagnosis": diagnosis_table}
