"""layer.h in numpy: one decoder layer over a sequence's rows, and a whole pass from token ids to logits, as the
runtime's model runs it on the kernels (`forward`). The model is read through the attributes runtime/model.py's
Llama has (duck-typed: the kernels' reference imports nothing above the kernels).

A layer: h = rmsnorm(x); q, k, v = the fused linear of h (the q8 mode: int8 h against each integer-format weight,
exact for the rest); q and k per-head RMS-normed (Qwen3, Gemma 3), rotated, K/V stored (fp16 in the q8 mode);
each row attends to its keys 0..pos; x += o(att) (or x += norm(o(att)) with a post-norm); h = rmsnorm(x);
x += down(act(gate(h)) · up(h)) (the same post-norm rule)."""
from __future__ import annotations

import numpy as np

from .. import formats
from .attention import attend
from .formats import dequantize
from .linear import linear_blocks
from .norms import rmsnorm, rope
from .q8 import q8_linear
from .simd import F32, gelu, silu


def _np(t) -> np.ndarray | None:
    return None if t is None else np.asarray(t.detach().float().numpy(), F32)


def linear(w, x: np.ndarray, bias=None, q8: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """One segment of a fused linear: `w` a QTensor (fmt, data, n, packed()). q8 runs where rows.cpp's does: an
    integer format whose repack exists (a tensor whose scales fp16 cannot hold runs exact)."""
    data = w.data.numpy()
    if q8 and formats.of(w.fmt).q8 and w.packed() is not None:
        return q8_linear(w.fmt, x, data, w.n, _np(bias), out)
    return linear_blocks(w.fmt, x, data, w.n, _np(bias), out)


def _residual(w_out, post_norm, x_in, x, q8, eps):
    """x + W·in, or x + norm(W·in) with a post-norm."""
    if post_norm is None:
        return linear(w_out, x_in, q8=q8, out=x)
    return x + rmsnorm(linear(w_out, x_in, q8=q8), _np(post_norm), eps)


def layer(model, w, x: np.ndarray) -> np.ndarray:
    """Layer weights `w` over rows x [T, hidden] at positions 0..T-1 of one sequence -> the new residual stream."""
    H, G, hd, eps, q8 = model.heads, model.kv_heads, model.hd, model.eps, model.q8
    T = len(x)
    h = rmsnorm(x, _np(w.attn_norm), eps)
    q = linear(w.q, h, w.q_bias, q8)
    k = linear(w.k, h, w.k_bias, q8)
    v = linear(w.v, h, w.v_bias, q8)
    if w.q_norm is not None:
        q = rmsnorm(q.reshape(T * H, hd), _np(w.q_norm), eps).reshape(T, H * hd)
    if w.k_norm is not None:
        k = rmsnorm(k.reshape(T * G, hd), _np(w.k_norm), eps).reshape(T, G * hd)
    cos, sin = model._layer_rope.get(w.rope_theta, (model.cos, model.sin))
    cos, sin = _np(cos)[:T], _np(sin)[:T]
    q, k = rope(q, H, hd, cos, sin, model.interleaved), rope(k, G, hd, cos, sin, model.interleaved)
    if q8:  # K/V stored as fp16, rounded to nearest even
        k, v = k.astype(np.float16).astype(F32), v.astype(np.float16).astype(F32)
    rep = H // G
    att = np.zeros((T, H * hd), F32)
    for r in range(T):
        for g in range(G):
            heads = q[r, g * rep * hd: (g + 1) * rep * hd].reshape(rep, hd)
            att[r, g * rep * hd: (g + 1) * rep * hd] = attend(
                heads, k[: r + 1, g * hd: (g + 1) * hd], v[: r + 1, g * hd: (g + 1) * hd], w.window,
                model.attn_scale).reshape(-1)
    x = _residual(w.o, w.post_attn_norm, att, x, q8, eps)
    h = rmsnorm(x, _np(w.ffn_norm), eps)
    gate, up = linear(w.gate, h, None, q8), linear(w.up, h, None, q8)
    act = (gelu(gate) if model.act == "gelu_pytorch_tanh" else silu(gate)) * up
    return _residual(w.down, w.post_ffn_norm, act, x, q8, eps)


def forward(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A pass over `tokens` at positions 0.. of a fresh sequence -> (logits [T, vocab], final normed hidden
    [T, hidden]), each row as the kernels compute it."""
    e = model.embed
    rows = e.data.numpy()[np.asarray(tokens)]
    x = dequantize(e.fmt, rows, len(tokens), e.k)
    if model.embed_scale is not None:
        x = x * F32(model.embed_scale)
    for w in model.layers:
        x = layer(model, w, x)
    h = rmsnorm(x, _np(model.norm), model.eps)
    return linear(model.head, h, None, model.q8), h
