"""The runtime's path without the CPU kernels: one decoder layer in torch for ONE row, on the weights dequantized
exactly as gguf's reference does (row-invariant: a single row's products always sum in the same order; not the
kernels' bits)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .blocks import BLOCK


def layer(model, i, w, x, slot: int, pos: int, path: list[int] | None = None):
    """One layer for ONE row x [1, hidden] at position `pos` of `slot` (rows go one by one: torch's matrix
    products change their summation order with the number of rows, a single row's never does). A tree row's
    `path` maps its last logical positions to where they are stored (forward())."""
    hd = model.hd
    h = x if w.attn_norm is None else rmsnorm(x, w.attn_norm, model.eps)
    q = F.linear(h, w.q.dequantize(), w.q_bias).view(model.heads, hd)
    k = F.linear(h, w.k.dequantize(), w.k_bias).view(model.kv_heads, hd)
    v = F.linear(h, w.v.dequantize(), w.v_bias).view(model.kv_heads, hd)
    if w.q_norm is not None:
        q, k = rmsnorm(q, w.q_norm, model.eps), rmsnorm(k, w.k_norm, model.eps)
    cos, sin = model._layer_rope.get(w.rope_theta, (model.cos, model.sin))
    cos, sin = _pairs(cos[pos], model.interleaved), _pairs(sin[pos], model.interleaved)
    rot = _rotate_pairs if model.interleaved else _rotate_half
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    kc, vc, table = model._kpool, model._vpool, torch.from_numpy(model._tables[slot]).long()
    st = pos if path is None else path[-1]
    kc[table[st // BLOCK], i, :, :, st % BLOCK], vc[table[st // BLOCK], i, :, st % BLOCK] = k, v
    rep = model.heads // model.kv_heads
    # the logical key sequence: positions 0..pos, a tree row's last ones at its path's storage positions
    at = torch.tensor(list(range(pos + 1 - len(path))) + list(path)) if path is not None else torch.arange(pos + 1)
    keys = kc[table[at // BLOCK], i, :, :, at % BLOCK].transpose(0, 1)  # [kv_heads, L, hd]
    vals = vc[table[at // BLOCK], i, :, at % BLOCK].transpose(0, 1)
    keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
    scores = (keys @ q[:, :, None])[..., 0] * (model.attn_scale or 1 / hd ** 0.5)  # [heads, L]
    if w.window and len(at) > w.window:
        scores[:, : len(at) - w.window] = float("-inf")
    att = (torch.softmax(scores, -1)[:, None] @ vals)[:, 0].reshape(1, -1)
    x = x + _post(F.linear(att, w.o.dequantize()), w.post_attn_norm, model.eps)
    h = rmsnorm(x, w.ffn_norm, model.eps)
    gate = F.linear(h, w.gate.dequantize())
    gate = F.gelu(gate, approximate="tanh") if model.act == "gelu_pytorch_tanh" else F.silu(gate)
    return x + _post(F.linear(gate * F.linear(h, w.up.dequantize()), w.down.dequantize()), w.post_ffn_norm,
                     model.eps)


def _post(out, norm, eps):
    """A post-norm (Gemma's post-attention / post-MLP norms) or nothing."""
    return out if norm is None else rmsnorm(out, norm, eps)


def rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _rotate_pairs(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): rotate-half for llama.cpp's interleaved row order."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)


def _pairs(table, interleaved):
    """A half table (c0..c_{h-1}) laid out for the row order: (c0..c_{h-1}, c0..c_{h-1}) or (c0, c0, c1, c1, ...)."""
    return table.repeat_interleave(2, -1) if interleaved else torch.cat([table, table], -1)
