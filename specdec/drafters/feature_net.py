"""The feature draft's network (EAGLE's one decoder layer over [embedding; target feature]), in torch for training,
and the same weights as a one-layer runtime model for drafting (runtime_layer: Q4_0 blocks in the q8 mode); how a
draft directory is written."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from ..runtime.model import LayerWeights, Llama
from ..runtime.weights import QTensor
from .feature_files import MARKER


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (as Llama). x [..., T, hd], pos [T], inv [hd/2] frequencies."""
    hd = x.shape[-1]
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attend(q, k, v, cache, rep: int):
    """Causal attention of a block of new positions q [B, h, T, hd] over the cached keys and values and their own
    (k, v [B, kv_heads, T, hd]; each kv head serves `rep` query heads) -> (output [B, h, T, hd], the new cache)."""
    T = q.shape[2]
    if cache is not None:
        k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if T == 1:
        a = F.scaled_dot_product_attention(q, ke, ve)
    elif cache is None or cache[0].shape[2] == 0:
        a = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    else:  # new block after a cached prefix: causal within the block
        L = ke.shape[2]
        allowed = torch.ones(T, L, dtype=torch.bool).tril(L - T)
        a = F.scaled_dot_product_attention(q, ke, ve, attn_mask=allowed)
    return a, (k, v)


def tap_norm(taps: torch.Tensor, n: int) -> torch.Tensor:
    """Each of the n target states side by side in `taps` [..., n x d] scaled to unit RMS: the residual stream's
    scale grows with depth (and Qwen's carries a few huge dimensions), so unscaled the deepest would drown the rest."""
    parts = taps.float().unflatten(-1, (n, -1))
    return (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2)


class FeatureDraftNet(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, rope_theta: float, eps: float,
                 taps: list[int] | None = None):
        """`taps`: EAGLE-3's fused features. The draft reads the target's residual stream before these layers (low,
        middle and high), fused by `fuse` into one feature, in place of the target's final hidden state."""
        super().__init__()
        self.cfg = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                        rope_theta=rope_theta, eps=eps, **({"taps": list(taps)} if taps else {}))
        self.hd = hidden // heads
        if taps:
            self.fuse = nn.Linear(len(taps) * hidden, hidden, bias=False)
            self.fuse_norm = RMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.q = nn.Linear(hidden, heads * self.hd, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.out_norm = RMSNorm(hidden, eps)
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, self.hd, 2).float() / self.hd),
                             persistent=False)

    def fused(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's states at the tapped layers [..., taps x d] -> the feature the draft reads [..., d]."""
        return self.fuse_norm(self.fuse(tap_norm(taps, len(self.cfg["taps"])).to(self.fuse.weight.dtype)))

    def forward(self, emb, feat, start: int, cache=None, mask=None):
        """emb, feat [B, T, d] -> predicted next features [B, T, d], updated (k, v) cache.
        Batched training passes mask=None with start=0 (causal); drafting passes B=1 and a cache."""
        B, T, _ = emb.shape
        h, kvh = self.cfg["heads"], self.cfg["kv_heads"]
        x = self.fc(torch.cat([emb, feat], -1))
        pos = torch.arange(start, start + T)
        q = rope(self.q(x).view(B, T, h, self.hd).transpose(1, 2), pos, self.inv_freq)
        k = rope(self.k(x).view(B, T, kvh, self.hd).transpose(1, 2), pos, self.inv_freq)
        v = self.v(x).view(B, T, kvh, self.hd).transpose(1, 2)
        a, cache = attend(q, k, v, cache, h // kvh)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        y = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.out_norm(x), cache


def _compact(w: torch.Tensor) -> torch.Tensor:
    """bf16 where that keeps every value (the shipped draft is stored in bf16): half the bytes per draft step."""
    w = w.detach().float()
    b = w.bfloat16()
    return b if torch.equal(b.float(), w) else w


def quantized(w: torch.Tensor, fmt: int | None) -> QTensor:
    """A draft matrix for the runtime: in ggml block format `fmt` (run in the q8 mode), or with fmt None (or rows
    that are not whole blocks) bf16 where that keeps every value, run exactly."""
    if fmt is None or w.shape[1] % 32:
        return QTensor.from_float(_compact(w))
    from ..runtime.quantize import quantize
    w = w.detach().float()
    return QTensor(fmt, torch.from_numpy(quantize(w.numpy(), fmt)), w.shape[0], w.shape[1])


def runtime_layer(net: FeatureDraftNet, max_len: int, fmt: int | None = None) -> Llama:
    """The draft layer as a one-layer runtime model: no norm before attention (EAGLE), out_norm as the final
    norm; the caller applies fc before and the reduced head after. With a block format `fmt` it runs in the q8
    mode."""
    c = net.cfg
    config = SimpleNamespace(model_type="llama", hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                             num_hidden_layers=1, num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                             head_dim=c["hidden"] // c["heads"], rms_norm_eps=c["eps"], max_position_embeddings=max_len,
                             vocab_size=0, rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    w = {name: quantized(getattr(net, name).weight, fmt) for name in ("q", "k", "v", "o", "gate", "up", "down")}
    vec = lambda t: t.detach().float().contiguous()  # noqa: E731
    layer = LayerWeights(None, w["q"], w["k"], w["v"], w["o"], vec(net.mlp_norm.weight), w["gate"], w["up"], w["down"])
    return Llama(config, None, [layer], vec(net.out_norm.weight), None, max_len=max_len,
                 numerics="exact" if fmt is None else "q8")


def save_draft(net: FeatureDraftNet, vocab_map: torch.Tensor, out: Path, target_fingerprint: str,
               target_name: str = "", dtype=torch.bfloat16, extra: dict | None = None) -> None:
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in net.state_dict().items()}
    tensors["vocab_map"] = vocab_map.to(torch.int32).contiguous()
    meta = {"type": "feature", "net": net.cfg, "reduced_vocab": len(vocab_map),
            "target_fingerprint": target_fingerprint, "target_name": target_name, **(extra or {})}
    # the file alone is the draft too (a copy a user publishes): its header carries the same metadata
    save_file(tensors, out / "model.safetensors", metadata={MARKER: json.dumps(meta)})
    (out / MARKER).write_text(json.dumps(meta, indent=2))


def last_layer(model) -> dict[str, torch.Tensor] | None:
    """A target's last decoder layer and final norm as float tensors, by the draft net's names (a transformers
    model or specdec's runtime); None where its layer is not Llama-shaped (Gemma's (1 + w) norms and post-norms,
    Qwen3's q/k norms, Phi-3's fused matrices start the draft from random)."""
    if getattr(model.config, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
        return None
    if hasattr(model, "get_decoder"):
        dec = model.get_decoder()
        layer, a, m = dec.layers[-1], dec.layers[-1].self_attn, dec.layers[-1].mlp
        mats = {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": m.gate_proj, "up": m.up_proj,
                "down": m.down_proj}
        return {**{k: v.weight.detach().float() for k, v in mats.items()},
                "mlp_norm": layer.post_attention_layernorm.weight.detach().float(),
                "out_norm": dec.norm.weight.detach().float()}
    w = model.layers[-1]
    return {**{k: getattr(w, k).dequantize() for k in ("q", "k", "v", "o", "gate", "up", "down")},
            "mlp_norm": w.ffn_norm.float(), "out_norm": model.norm.float()}


def net_for_target(config, init_from: dict | None = None, ffn: int | None = None,
                   taps: list[int] | None = None) -> FeatureDraftNet:
    """A draft layer shaped like one of the target's layers (optionally initialised from it: `last_layer`). `ffn`: a
    narrower feed-forward width than the target's (a cheaper step: the 1.5B's 8,960-wide layer makes a step cost
    ~0.12 of a target pass), initialised from the target layer's first `ffn` units. `taps`: EAGLE-3's fused
    features from those layers."""
    ffn = ffn or config.intermediate_size
    net = FeatureDraftNet(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                          ffn, float(getattr(config, "rope_theta", None) or
                                     (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                          config.rms_norm_eps, taps)
    with torch.no_grad():
        nn.init.normal_(net.fc.weight, std=1 / math.sqrt(2 * config.hidden_size))
        if taps:
            nn.init.normal_(net.fuse.weight, std=1 / math.sqrt(len(taps) * config.hidden_size))
        # a Llama-family layer's weights are a head start (where its head size is hidden / heads)
        if init_from is not None and init_from["q"].shape == net.q.weight.shape:
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                mine = getattr(net, name).weight
                rows, cols = mine.shape  # the FFN's first `ffn` units where it is narrower
                mine.copy_(init_from[name][:rows, :cols])
            net.mlp_norm.weight.copy_(init_from["mlp_norm"])
            net.out_norm.weight.copy_(init_from["out_norm"])
    return net
