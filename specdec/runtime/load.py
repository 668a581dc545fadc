"""Build the runtime's Llama from a GGUF file or a Hugging Face directory (safetensors), or say why it cannot."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from .model import LayerWeights, Llama
from .weights import GGUFFile, SafetensorsDir, Unsupported

GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}  # GGUF architecture -> transformers model_type
HF_TYPES = {"llama", "mistral", "qwen2"}
ROPE_TYPES = {"default", "linear", "llama3", "yarn"}  # position-independent tables (not dynamic / longrope)


def load_gguf(path: Path, max_len: int | None = None) -> Llama:
    f = GGUFFile(path)
    arch = f.meta("general.architecture")
    if arch not in GGUF_ARCHS:
        raise Unsupported(f"GGUF architecture {arch!r} is not Llama-family (the runtime runs {sorted(GGUF_ARCHS)})")

    def m(key, default=None):
        return f.meta(f"{arch}.{key}", default)

    heads, kv_heads, hidden = m("attention.head_count"), m("attention.head_count_kv") or m("attention.head_count"), \
        m("embedding_length")
    hd = m("attention.key_length") or hidden // heads
    if m("rope.dimension_count", hd) != hd:
        raise Unsupported("partial rotary embedding is not supported by the runtime")
    if f.has("rope_freqs.weight"):  # llama.cpp's Llama 3.1+ rotary scaling: per-frequency factors, no scaling type
        raise Unsupported("rotary frequency factors (rope_freqs.weight, Llama 3.1/3.2 files) are not applied by the "
                          "runtime yet; running without them would be wrong")
    rope = {"rope_type": "default", "rope_theta": float(m("rope.freq_base", 10000.0))}
    kind = m("rope.scaling.type")
    if kind and kind != "none":
        rope.update(rope_type=kind, factor=float(m("rope.scaling.factor", 1.0)))
        if m("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(m("rope.scaling.original_context_length"))
    embed = f.qtensor("token_embd.weight")
    tied = not f.has("output.weight")
    config = _config(GGUF_ARCHS[arch], hidden_size=hidden, intermediate_size=m("feed_forward_length"),
                     num_hidden_layers=m("block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=hd, rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
                     max_position_embeddings=int(m("context_length", 2048)), vocab_size=embed.n,
                     rope_parameters=rope, tie_word_embeddings=tied,
                     bos_token_id=f.meta("tokenizer.ggml.bos_token_id"), eos_token_id=f.meta("tokenizer.ggml.eos_token_id"))
    # llama.cpp's converter interleaves the rotary halves of Q and K rows for the llama architecture: rotate pairs
    # (2i, 2i+1) there (the same rotated values as transformers' halves, in llama.cpp's order; no copy of Q and K)
    config.rope_interleaved = arch == "llama"
    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        q, k = f.qtensor(b + "attn_q.weight"), f.qtensor(b + "attn_k.weight")
        layers.append(LayerWeights(
            f.vector(b + "attn_norm.weight"), q, k, f.qtensor(b + "attn_v.weight"), f.qtensor(b + "attn_output.weight"),
            f.vector(b + "ffn_norm.weight"), f.qtensor(b + "ffn_gate.weight"), f.qtensor(b + "ffn_up.weight"),
            f.qtensor(b + "ffn_down.weight"),
            *[f.vector(b + f"attn_{x}.bias") if f.has(b + f"attn_{x}.bias") else None for x in "qkv"]))
    head = embed if tied else f.qtensor("output.weight")
    gen = SimpleNamespace(eos_token_id=config.eos_token_id)
    return _build(config, embed, layers, f.vector("output_norm.weight"), head, gen, max_len, str(path))


def load_hf_dir(path: Path, max_len: int | None = None) -> Llama:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise Unsupported(f"{path} has no config.json")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") not in HF_TYPES:
        raise Unsupported(f"model type {raw.get('model_type')!r} is not Llama-family (the runtime runs "
                          f"{sorted(HF_TYPES)})")
    from transformers import AutoConfig, GenerationConfig
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "mlp_bias", False) or getattr(config, "attention_bias", False) and config.model_type != "qwen2":
        raise Unsupported("attention/MLP output biases are not supported by the runtime")
    w = SafetensorsDir(path)
    p = "model."
    layers = []
    for i in range(config.num_hidden_layers):
        b = f"{p}layers.{i}."
        a = b + "self_attn."
        layers.append(LayerWeights(
            w.vector(b + "input_layernorm.weight"), w.qtensor(a + "q_proj.weight"), w.qtensor(a + "k_proj.weight"),
            w.qtensor(a + "v_proj.weight"), w.qtensor(a + "o_proj.weight"), w.vector(b + "post_attention_layernorm.weight"),
            w.qtensor(b + "mlp.gate_proj.weight"), w.qtensor(b + "mlp.up_proj.weight"), w.qtensor(b + "mlp.down_proj.weight"),
            *[w.vector(a + f"{x}_proj.bias") if w.has(a + f"{x}_proj.bias") else None for x in "qkv"]))
    embed = w.qtensor(p + "embed_tokens.weight")
    head = w.qtensor("lm_head.weight") if w.has("lm_head.weight") else embed
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        gen = SimpleNamespace(eos_token_id=config.eos_token_id)
    return _build(config, embed, layers, w.vector(p + "norm.weight"), head, gen, max_len, str(path))


def _config(model_type: str, **kw):
    """The fields the runtime and the rest of specdec read (a transformers config is built only for rotary
    scaling variants, whose tables transformers computes)."""
    return SimpleNamespace(model_type=model_type, **kw)


def check_shapes(config, embed, layers, norm, head) -> None:
    """Every tensor's shape against the config, before any pointer reaches the kernels (a mismatch would read or
    write out of bounds there): Unsupported naming the first tensor that differs."""
    D, hd, I = config.hidden_size, config.head_dim, config.intermediate_size
    nq, nkv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def want(name, t, shape):
        got = (t.n, t.k) if hasattr(t, "k") else tuple(t.shape)
        if got != shape:
            raise Unsupported(f"tensor {name} is {got}, the config says {shape}: the file and its config disagree")
    if len(layers) != config.num_hidden_layers:
        raise Unsupported(f"{len(layers)} layers, the config says {config.num_hidden_layers}")
    want("embedding", embed, (embed.n, D))
    want("head", head, (head.n, D))
    want("output norm", norm, (D,))
    for i, w in enumerate(layers):
        for name, t, shape in [("attn_norm", w.attn_norm, (D,)), ("q", w.q, (nq, D)), ("k", w.k, (nkv, D)),
                               ("v", w.v, (nkv, D)), ("o", w.o, (D, nq)), ("ffn_norm", w.ffn_norm, (D,)),
                               ("gate", w.gate, (I, D)), ("up", w.up, (I, D)), ("down", w.down, (D, I)),
                               ("q_bias", w.q_bias, (nq,)), ("k_bias", w.k_bias, (nkv,)), ("v_bias", w.v_bias, (nkv,))]:
            if t is not None:
                want(f"layer {i} {name}", t, shape)


def _build(config, embed, layers, norm, head, gen, max_len, source) -> Llama:
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    check_shapes(config, embed, layers, norm, head)
    if config.head_dim % 16 or config.head_dim > 256:
        raise Unsupported(f"head size {config.head_dim} (the runtime needs a multiple of 16, at most 256)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise Unsupported("query heads are not a multiple of key/value heads")
    kind = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise Unsupported(f"rotary scaling {kind!r} is not supported by the runtime ({sorted(ROPE_TYPES)} are)")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        # attention over at most `window` positions equals full attention while sequences fit in the window
        config.max_position_embeddings = min(config.max_position_embeddings, int(window))
    return Llama(config, embed, layers, norm, head, gen, max_len=min(max_len or config.max_position_embeddings,
                                                                     config.max_position_embeddings), source=source)
