"""KV-cache bookkeeping shared by the target and model drafters."""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from functools import cache, partial

import torch
from torch import nn
from torch.nn import functional as F

from . import kernels
from .runtime.slot_cache import common_prefix_len, fit_vocab


def cached_model(model, vocab_size: int):
    """A KV-cached view of `model` with the interface below: a slot of the runtime's KV cache, or a transformers
    DynamicCache."""
    if hasattr(model, "new_cache"):
        return model.new_cache(vocab_size)
    return CachedModel(model, vocab_size)


class CachedModel:
    """A causal LM plus a KV cache that tracks which tokens it holds.

    `forward(tokens, n_logits)` runs only the tokens the cache lacks (rolling back past any divergence first, which
    is how rejected drafts are discarded) and returns logits for the last `n_logits` positions of `tokens`.
    """

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        few_row_linears(model)
        self.reset()

    def reset(self) -> None:
        from transformers import (
            DynamicCache,  # imported here: the runtime path never needs transformers' models
        )
        self.cache = DynamicCache()
        self.tokens: list[int] = []

    def rollback(self, length: int) -> None:
        drop = len(self.tokens) - length
        if drop > 0:
            self.cache.crop(-drop)  # negative = remove this many (transformers 4.x and 5.x agree)
            del self.tokens[length:]

    @torch.inference_mode()
    def forward(self, tokens: list[int], n_logits: int = 1, hidden: bool = False, head_rows: int | None = None):
        """-> logits [n_logits, V]; with hidden=True also the final hidden states of the tokens run, which start
        at position `self.last_start`. head_rows: only the first head_rows ids' logits (the rest -inf), as the
        runtime's SlotCache gives them."""
        # keep at least n_logits tokens to run so their logits exist
        self.rollback(min(common_prefix_len(self.tokens, tokens), len(tokens) - n_logits))
        self.last_start = len(self.tokens)
        new = tokens[len(self.tokens):]
        cache_kw = {_cache_arg_name(): self.cache}  # the cache is updated in place
        ids = torch.tensor([new])
        self.tokens.extend(new)
        if not hidden:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=n_logits, **cache_kw)
            return fit_vocab(out.logits[0, -n_logits:, :head_rows], self.vocab_size)
        # the same computation as the causal LM's forward, split so the final hidden states are kept
        h = self.model.get_decoder()(input_ids=ids, use_cache=True, **cache_kw).last_hidden_state[0]
        logits = self.model.get_output_embeddings()(h[-n_logits:])
        return fit_vocab(logits[:, :head_rows], self.vocab_size), h


def few_row_linears(model) -> None:
    """Make a transformers model's linear layers fast for decode and verify passes on CPU (the transformers
    backend; specdec's runtime has its own decoder).

    y = x·Wᵀ through MKL streams W far below memory bandwidth on a 2-core CPU (MKL takes its GEMV path for one row
    and re-packs W on every call for a few rows): a SmolLM2-135M fp32 target pass over 1/2/3/4/5/8 tokens cost
    57/96/119/84/89/96 ms stock (docs/benchmarks.md, earlier releases). Here:
    - 1-6 rows: specdec's kernel (kernels/rows.cpp, fp32 weights) reads each weight row once for all rows: the
      linears of one pass took 18-23 ms for 1-6 rows (MKL/oneDNN below: 26-38 ms);
    - without the kernel (no AVX2/AVX-512 or no compiler), 1-2 rows: (W·xᵀ)ᵀ with x row-major, one row duplicated into
      two: MKL's GEMM kernel;
    - 7+ rows (and 3+ without the kernel): oneDNN's inner product on a weight packed once into its blocked layout
      (prompts and batched generation ~15% more FLOP/s than MKL).
    Same fp32 math (no reduced-precision modes; values agree to ~1e-6 relative). The packed copy is made on first
    use and redone if the weight changes; it costs one more copy of the weights in memory. Installed per instance:
    other models in the process are untouched."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and not hasattr(m, "_hf_hook") and not getattr(m, "_few_rows", False):
            m.forward, m._few_rows = partial(_few_row_linear, m), True


@contextmanager
def stock_linears(model):
    """Temporarily undo few_row_linears (to measure stock transformers on the same model object)."""
    patched = [m for m in model.modules() if getattr(m, "_few_rows", False)]
    for m in patched:
        del m.forward, m._few_rows
    try:
        yield
    finally:
        few_row_linears(model)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                packed=None) -> torch.Tensor:
    """F.linear(x, weight, bias) by the fastest path for its row count (see few_row_linears); `packed` is the
    weight in oneDNN's layout (packed_weight) or a function that makes it, asked only for 3+ rows the kernel does
    not take."""
    rows = x.numel() // x.shape[-1]
    if not x.is_cpu or rows == 0:
        return F.linear(x, weight, bias)
    if rows <= KERNEL_ROWS and not _needs_grad(x, weight, bias):
        y = kernels.few_rows_linear(x, weight, bias)
        if y is not None:
            return y
    if callable(packed):
        packed = packed() if rows >= 3 else None
    if packed is not None and rows >= 3:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), packed, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if rows > 8:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, -1).contiguous()  # row-major rows: W·x2ᵀ is then the fast (NT) GEMM
    y = (weight @ (torch.cat([x2, x2]) if rows == 1 else x2).t())[:, :rows]
    y = y.t().reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


# Up to 6 rows the kernel wins; at 7-8 rows of a 1536-wide input x no longer fits in L1 and oneDNN is faster
# (linears of one SmolLM2-135M pass: 35 vs 31 ms at 8 rows).
KERNEL_ROWS = 6


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_weight(m: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """m.weight in oneDNN's blocked layout (cached on the module, redone when the weight changes), or None where
    oneDNN cannot serve this call: no oneDNN, not fp32 on CPU, or autograd needs the graph."""
    w = m.weight
    if not (_ONEDNN and x.is_cpu and w.is_cpu and x.dtype == w.dtype == torch.float32) or _needs_grad(x, w):
        return None
    key = (w.data_ptr(), w._version, tuple(w.shape))
    cached = getattr(m, "_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8))
        m._packed = cached
    return cached[1]


def _few_row_linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rows_linear(x, m.weight, m.bias, partial(packed_weight, m, x))


@cache
def _cache_arg_name() -> str:
    """transformers 5.x renamed forward(past_key_values=) to forward(cache=)."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM
    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

