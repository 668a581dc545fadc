"""Per-cycle trace records and the summary computed from them."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class CycleRecord:
    cycle: int
    tau: int  # the τ set for this cycle: the policy's (engine), the request's limit (batch: its τ or --max-tau)
    proposed: list[int]  # the draft token ids verified (may be fewer than tau: `short` says why)
    accepted: int  # drafted tokens the target accepted
    emitted: list[int]  # tokens appended this cycle: accepted drafts + the target's own token (cut at stops)
    draft_ms: float
    verify_ms: float
    cycle_ms: float
    finish_reason: str | None = None  # set on the last record: "stop" or "length"
    parents: list[int] | None = None  # a token tree's shape (drafters/tree.py); None: `proposed` is a chain
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf
    forced: int = 0  # leading drafts the grammar forced (structured outputs: drafted for free)
    logprobs: list | None = None  # per emitted token [logprob, [[token, logprob], ...]] when asked for
    prompt_logprobs: list | None = None  # the same for prompt tokens 2.. (first record; echo / scoring)
    asked: int | None = None  # tokens the drafter was asked for (τ cut by the room left, or by the scheduler)
    drafted: int | None = None  # tokens (a tree: nodes) the drafter returned, before any cut
    short: str | None = None  # why fewer than τ drafts were verified (SHORTFALLS); None: all τ (or no record of it)
    by: str | None = None  # who proposed this cycle's draft: "prediction" (the request's predicted output), or the
    # drafter's name (a chain's member: `ngram`, a model draft's spec); None when nothing was proposed
    draft_prefill_ms: float = 0.0  # of draft_ms, a model draft's catch-up on unseen tokens (Draft.prefill_ms)
    cached_tokens: int = 0  # (first record) prompt positions found computed: the prefix cache's or a twin's

    def to_dict(self) -> dict:
        return asdict(self)


# why a cycle verified fewer than τ drafts, in the cycle's order: the first cause that applies
SHORTFALLS = {
    "room": "the request's room left (max_tokens, the context) cut what was asked",
    "budget": "the verification budget (the scheduler, or a tree sized by the cost model) asked for or kept fewer",
    "put_off": "a model draft's catch-up on the prompt could not pay at the batch's load: it drafts nothing for the "
               "request (drafters/draft_cache.py)",
    "no_match": "the drafter proposed nothing",
    "drafter": "the drafter stopped before τ",
    "grammar": "the grammar refused a drafted token",
}


def asked_of(r: CycleRecord) -> int:
    """Tokens the drafter was asked for (traces from before `asked` was recorded: τ)."""
    return r.asked if r.asked is not None else r.tau


def shortfall(tau: int, asked: int, drafted: int, verified: int, asked_cut: str = "room",
              later_cut: str | None = None) -> str | None:
    """Why `verified` < `tau`: the ask was cut (`asked_cut`: room, or the scheduler's budget), the drafter gave
    nothing or stopped early, or what it gave was cut after (`later_cut`: grammar or budget). None when all τ were
    verified, or τ was 0 (nothing to explain)."""
    if verified >= tau:
        return None
    if asked < tau:
        return asked_cut
    if drafted == 0:
        return "no_match"
    if drafted < asked:
        return "drafter"
    return later_cut or "budget"


def draft_depth(r: CycleRecord) -> int:
    """How deep the draft went: a chain's length, a tree's deepest node."""
    if r.parents is None:
        return len(r.proposed)
    from .drafters.tree import depths
    return max(depths(r.parents), default=0)


def acceptance_by_position(records: list[CycleRecord]) -> list[float | None]:
    """alpha_k = P(draft k accepted | drafts 1..k-1 accepted), estimated over the cycles that reached k (a tree
    counts by depth: some node at depth k accepted)."""
    depth = max((draft_depth(r) for r in records), default=0)
    reached, passed = [0] * depth, [0] * depth
    for r in records:
        for k in range(min(draft_depth(r), r.accepted + 1)):
            reached[k] += 1
            passed[k] += k < r.accepted
    return [round(p / n, 4) if n else None for p, n in zip(passed, reached)]


def tree_stats(records: list[CycleRecord], curve: dict[int, float] | None = None) -> dict | None:
    """Token-tree passes: nodes per pass, accepted depth, acceptance by depth and by sibling rank (the share of
    reached children of that rank that were accepted), and, given the verify curve, the counterfactual speedup
    over target-only had every tree been cut to its first n nodes (best-first order: a cut tree accepts the part of
    the path it keeps). None when no pass verified a tree."""
    from .costs import interpolate
    from .drafters.tree import depths
    trees = [r for r in records if r.parents is not None and r.path is not None]
    if not trees:
        return None
    by_rank: dict[int, list[int]] = {}
    for r in trees:
        ok, seen = set(r.path), {}
        for i, p in enumerate(r.parents):
            rank = seen[p] = seen.get(p, -1) + 1
            if p < 0 or p in ok:  # reached: its parent was accepted
                by_rank.setdefault(rank, [0, 0])[0] += 1
                by_rank[rank][1] += i in ok
    out = {"tree_passes": len(trees), "nodes_per_pass": round(sum(len(r.proposed) for r in trees) / len(trees), 3),
           "accepted_depth": round(sum(len(r.path) for r in trees) / len(trees), 3),
           "acceptance_by_depth": acceptance_by_position(trees),
           "acceptance_by_rank": {str(k): round(a / n, 4) for k, (n, a) in sorted(by_rank.items()) if n},
           "max_depth": max(max(depths(r.parents), default=0) for r in trees)}
    if curve:
        most = max(len(r.proposed) for r in trees)
        step = interpolate(curve, 1)
        out["speedup_with_nodes"] = {
            str(n): round(sum(1 + sum(1 for i in r.path if i < n) for r in trees) * step
                          / sum(interpolate(curve, min(n, len(r.proposed)) + 1) for r in trees), 3)
            for n in range(most + 1)}
        out["best_nodes"] = int(max(out["speedup_with_nodes"], key=lambda n: out["speedup_with_nodes"][n]))
    return out


def summarize(records: list[CycleRecord], wall_s: float, new_tokens: int) -> dict:
    proposed = sum(len(r.proposed) for r in records)
    accepted = sum(r.accepted for r in records)
    cycles = len(records)
    return {
        "new_tokens": new_tokens,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(new_tokens / wall_s, 3) if wall_s > 0 else None,
        "cycles": cycles,
        "target_passes": cycles,  # one verification forward per cycle
        "target_passes_per_token": round(cycles / new_tokens, 4) if new_tokens else None,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "mean_accepted_len": round(accepted / cycles, 4) if cycles else None,
        "acceptance_by_position": acceptance_by_position(records),
        "draft_ms": round(sum(r.draft_ms for r in records), 3),
        "verify_ms": round(sum(r.verify_ms for r in records), 3),
        "finish_reason": records[-1].finish_reason if records else None,
        "cached_tokens": records[0].cached_tokens if records else 0,
        **prediction_usage(records),
        **({"trees": trees} if (trees := tree_stats(records)) else {}),
    }


def prediction_usage(records: list[CycleRecord]) -> dict:
    """OpenAI's usage of a predicted output: its drafted tokens the target accepted and those it rejected (empty
    when no cycle drafted from a prediction)."""
    by = [r for r in records if r.by == "prediction"]
    if not by:
        return {}
    accepted = sum(r.accepted for r in by)
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(len(r.proposed) for r in by) - accepted}


def write_jsonl(records: list[CycleRecord], path, meta: dict | None = None) -> None:
    """One JSON record per cycle; `meta` (e.g. the target's measured verify curve) first, as {"meta": {...}}."""
    with open(path, "w") as f:
        if meta:
            f.write(json.dumps({"meta": meta}) + "\n")
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_trace(path) -> tuple[list[CycleRecord], dict]:
    records, meta = [], {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if "meta" in row and len(row) == 1:
                    meta = row["meta"]
                else:
                    records.append(CycleRecord(**row))
    return records, meta


def read_jsonl(path) -> list[CycleRecord]:
    return read_trace(path)[0]


def step_curve(meta: dict) -> dict[int, float] | None:
    """The target's measured ms by tokens verified, from a trace's meta (keys come back from JSON as strings)."""
    curve = meta.get("verify_curve")
    return {int(k): float(v) for k, v in curve.items()} if curve else None
