"""An EAGLE-3 draft head's network (Li et al. 2025, the layout vLLM, SGLang and SpecForge load), in torch: the
target's hidden states at three layers, concatenated and fused by `fc` into one feature; one decoder layer whose
attention reads [norm(embedding of the next token); norm(feature)] (2 x hidden wide); a final norm and a head over
the draft's own vocabulary, each draft id mapped to the target's by `d2t` (target id = draft id + d2t[draft id]).
A drafted position's feature is the layer's output before the final norm (what the next step is fed)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..runtime.rope import rope_tables
from .feature_net import RMSNorm, attend


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, from half tables cos/sin [T, hd/2] (runtime/rope.py)."""
    cos, sin = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Eagle3Net(nn.Module):
    def __init__(self, config, draft_vocab: int, target_hidden: int, max_len: int = 8192):
        """`config`: a transformers LlamaConfig of the head (hidden_size, heads, head_dim, rope, norms)."""
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.hd = getattr(config, "head_dim", None) or d // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.cfg = {"hidden": d}
        self.fc = nn.Linear(3 * target_hidden, d, bias=False)
        self.input_norm, self.hidden_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.q = nn.Linear(2 * d, self.heads * self.hd, bias=bias)
        self.k = nn.Linear(2 * d, self.kv_heads * self.hd, bias=bias)
        self.v = nn.Linear(2 * d, self.kv_heads * self.hd, bias=bias)
        self.o = nn.Linear(self.heads * self.hd, d, bias=False)
        self.post_norm = RMSNorm(d, eps)
        self.gate = nn.Linear(d, config.intermediate_size, bias=False)
        self.up = nn.Linear(d, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        config.head_dim = self.hd
        cos, sin = rope_tables(config, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, emb, feat, start: int, cache=None):
        """emb [B, T, d] (the tokens' embeddings), feat [B, T, d] (fused target features, or the draft's own) ->
        the next features [B, T, d] (before the final norm) and the updated (k, v) cache."""
        B, T, _ = emb.shape
        normed = self.hidden_norm(feat)
        residual = normed if self.norm_before_residual else feat
        x = torch.cat([self.input_norm(emb), normed], -1)
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        q = rotate(self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2), cos, sin)
        k = rotate(self.k(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2), cos, sin)
        v = self.v(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        a, cache = attend(q, k, v, cache, self.heads // self.kv_heads)
        h = residual + self.o(a.transpose(1, 2).reshape(B, T, -1))
        y = self.post_norm(h)
        return h + self.down(F.silu(self.gate(y)) * self.up(y)), cache

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a feature the layer produced."""
        return self.lm_head(self.norm(feat))
