"""Batched generation on the runtime (`specdec distill`'s data): every sequence in its own KV slot, all prompts
prefilled in one pass, then one pass per step with a row per unfinished sequence. No padding: each row sits at its
own position, so a sequence gets exactly the tokens and hidden states it would get alone (row-invariance)."""
from __future__ import annotations

import torch

from .kernels import argmax as row_argmax
from .sampling import SamplingParams, warp
from .runtime.model import Llama


@torch.inference_mode()
def generate_batch(model: Llama, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                   params: SamplingParams | None = None, generator: torch.Generator | None = None,
                   prefill_rows: int = 2048) -> list[tuple[list[int], torch.Tensor]]:
    """-> per prompt (prompt + continuation cut after its first EOS, fp16 final hidden states of every position but
    the last, whose token was never fed back). Greedy unless `params` (then sampled with `generator`)."""
    slots = [model.acquire_slot() for _ in prompts]
    try:
        seqs = [list(p) for p in prompts]
        hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
        nxt = [0] * len(prompts)
        for group in _groups(prompts, prefill_rows):  # prompts in passes of about prefill_rows rows
            rows = [(i, pos) for i in group for pos in range(len(prompts[i]))]
            last = [k for k, (i, pos) in enumerate(rows) if pos == len(prompts[i]) - 1]
            logits, h = model.forward([prompts[i][pos] for i, pos in rows], [slots[i] for i, _ in rows],
                                      [pos for _, pos in rows], last, hidden=True)
            start = 0
            for i, row in zip(group, _pick(logits, params, generator)):
                hidden[i].append(h[start: start + len(prompts[i])].half())
                start += len(prompts[i])
                nxt[i] = row
        active = list(range(len(prompts)))
        for step in range(max_new_tokens):
            for i in active:
                seqs[i].append(nxt[i])
            active = [i for i in active if nxt[i] not in eos and step + 1 < max_new_tokens]
            if not active:
                break
            logits, h = model.forward([seqs[i][-1] for i in active], [slots[i] for i in active],
                                      [len(seqs[i]) - 1 for i in active], hidden=True)
            for k, (i, row) in enumerate(zip(active, _pick(logits, params, generator))):
                hidden[i].append(h[k: k + 1].half())
                nxt[i] = row
        return [(s, torch.cat(h)) for s, h in zip(seqs, hidden)]
    finally:
        for s in slots:
            model.release_slot(s)


def _pick(logits: torch.Tensor, params, generator) -> list[int]:
    if params is None or params.greedy:
        return row_argmax(logits)
    return torch.multinomial(warp(logits, params), 1, generator=generator)[:, 0].tolist()


def _groups(prompts, rows):
    group, n = [], 0
    for i, p in enumerate(prompts):
        if group and n + len(p) > rows:
            yield group
            group, n = [], 0
        group.append(i)
        n += len(p)
    if group:
        yield group
