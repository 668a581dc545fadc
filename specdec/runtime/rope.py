"""Rotary tables: transformers' cos/sin for each position (one half of each row: both halves are equal)."""
from __future__ import annotations

import torch


def rope_tables(config, max_len: int, theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim / 2]: transformers' Llama tables (fp32 inv_freq x position, scaled), whose two
    halves are equal, one half kept.
    `theta`: a layer's own base, unscaled (Gemma 3's local layers). A GGUF's per-frequency factors
    (config.rope_freq_factors, Llama 3.1+ files) divide the frequencies, as llama.cpp applies them."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default") if theta is None else "default"
    hd = config.head_dim
    if kind in ("default", "linear"):
        base = params["rope_theta"] if theta is None else theta
        inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        factors = getattr(config, "rope_freq_factors", None)
        if factors is not None and theta is None:
            inv = inv / factors.float()
        if kind == "linear":  # position interpolation: every frequency divided by the factor
            inv = inv / params["factor"]
        scale = 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if not hasattr(config, "to_dict"):  # the GGUF loader's plain namespace
            config = AutoConfig.for_model(config.model_type, **{k: v for k, v in vars(config).items()
                                                                if k != "model_type"})
        inv, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    # transformers' tables repeat each angle in both halves of a row: one half is all the kernel reads (pair i's),
    # and cos/sin are elementwise, so the half computed alone is the same numbers without the 4x transient memory
    ang = torch.arange(max_len).float()[:, None] * inv.float()[None]
    cos, sin = ang.cos(), ang.sin()
    return (cos * scale if scale != 1.0 else cos), (sin * scale if scale != 1.0 else sin)
