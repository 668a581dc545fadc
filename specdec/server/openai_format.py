"""OpenAI's response objects from specdec's results: logprobs (chat's and completions' shapes, an echoed prompt's
first), usage (with predicted outputs' accepted and rejected tokens), specdec's own statistics."""
from __future__ import annotations


def logprobs(decoder, result, kind: str):
    """OpenAI's logprobs object for the generated tokens (an EOS, which adds no text, left out), or None."""
    if result.logprobs is None:
        return None
    eos = decoder.engine.eos_ids
    with decoder.tokenizer_lock:
        piece = lambda t: decoder.tokenizer.decode([t])  # noqa: E731
        rows = [(piece(t), lp, [(piece(a), alp) for a, alp in alts])
                for t, (lp, alts) in zip(result.token_ids, result.logprobs) if t not in eos]
    if kind == "chat":
        entry = lambda tok, lp: {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}  # noqa: E731
        return {"content": [{**entry(tok, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                            for tok, lp, alts in rows]}
    offsets, at = [], 0
    for tok, _, _ in rows:
        offsets.append(at)
        at += len(tok)
    return {"tokens": [tok for tok, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [dict(alts) for _, _, alts in rows], "text_offset": offsets}


def echo_logprobs(decoder, prompt_ids, result, lp):
    """A completion's logprobs with its echoed prompt's before them (the first prompt token has none)."""
    if result.prompt_logprobs is None:
        return lp
    with decoder.tokenizer_lock:
        piece = lambda t: decoder.tokenizer.decode([t])  # noqa: E731
        tokens = [piece(t) for t in prompt_ids]
        tops = [None] + [{piece(a): alp for a, alp in alts} for _, alts in result.prompt_logprobs]
    lps = [None] + [v for v, _ in result.prompt_logprobs]
    gen = lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens + gen["tokens"], "token_logprobs": lps + gen["token_logprobs"],
            "top_logprobs": tops + gen["top_logprobs"], "text_offset": offsets + [at + o for o in gen["text_offset"]]}


def usage(prompt_tokens: int, results: list, choices: int = 1, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object: `results` in job order, `choices` a prompt (n). prompt_tokens_details.cached_tokens: of
    each prompt, the positions its first choice found computed (the prefix cache's; its other choices reuse that
    prefill). With a prediction, completion_tokens_details counts its drafted tokens the target accepted and rejected
    (every choice's together); `reasoning_tokens` (a thinking model's, reasoning.py) go there too."""
    completion = sum(len(r.token_ids) for r in results)
    cached = sum(min(r.stats.get("cached_tokens", 0) for r in results[i:i + choices])
                 for i in range(0, len(results), choices))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    if any("accepted_prediction_tokens" in r.stats for r in results):
        usage["completion_tokens_details"] = {k: sum(r.stats.get(k, 0) for r in results) for k in
                                              ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {**usage.get("completion_tokens_details", {}),
                                              "reasoning_tokens": reasoning_tokens}
    return usage


def spec_stats(result) -> dict:
    s = result.stats
    return {k: s[k] for k in ("acceptance_rate", "mean_accepted_len", "target_passes", "proposed", "accepted",
                              "acceptance_by_position", "tokens_per_s", "draft_ms", "verify_ms")}
