"""Build the runtime's Llama from a GGUF file or a Hugging Face directory (safetensors), or say why it cannot."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from .model import LayerWeights, Llama
from .weights import GGUFFile, SafetensorsDir, Unsupported

# GGUF architecture -> transformers model_type
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}
HF_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"}
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: every 6th layer attends to everything, the others to a sliding window
GEMMA3_LOCAL_THETA = 10000.0  # ... with their own rotary base (llama.cpp and transformers' default)
MAX_CONTEXT = 1 << 21  # positions a file may declare: its rotary tables are made for all of them at load
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
    for key, value, most in (("attention.head_count", heads, 1 << 12), ("embedding_length", hidden, 1 << 17),
                             ("block_count", m("block_count"), 1 << 12), ("context_length", m("context_length", 2048),
                                                                       MAX_CONTEXT)):
        if not isinstance(value, int) or not 0 < value <= most:
            raise Unsupported(f"GGUF metadata {arch}.{key} = {value!r} is not a size the runtime can run "
                              f"(1..{most})")
    hd = m("attention.key_length") or hidden // heads
    if m("rope.dimension_count", hd) != hd:
        raise Unsupported("partial rotary embedding is not supported by the runtime")
    if f.has("rope_factors_long.weight"):
        raise Unsupported("LongRoPE (rope_factors_long/short: Phi-3 128k files) is not supported by the runtime")
    rope = {"rope_type": "default", "rope_theta": float(m("rope.freq_base", 10000.0))}
    kind = m("rope.scaling.type")
    if kind and kind != "none":
        rope.update(rope_type=kind, factor=float(m("rope.scaling.factor", 1.0)))
        if m("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(m("rope.scaling.original_context_length"))
    embed = f.qtensor("token_embd.weight")
    tied = not f.has("output.weight")
    layers_n, inter = m("block_count"), m("feed_forward_length")
    config = _config(GGUF_ARCHS[arch], hidden_size=hidden, intermediate_size=m("feed_forward_length"),
                     num_hidden_layers=m("block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=hd, rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
                     hidden_act="gelu_pytorch_tanh" if arch == "gemma3" else "silu",
                     max_position_embeddings=int(m("context_length", 2048)), vocab_size=embed.n,
                     rope_parameters=rope, tie_word_embeddings=tied,
                     bos_token_id=f.meta("tokenizer.ggml.bos_token_id"), eos_token_id=f.meta("tokenizer.ggml.eos_token_id"))
    # llama.cpp's converter interleaves the rotary halves of Q and K rows for the llama architecture: rotate pairs
    # (2i, 2i+1) there (the same rotated values as transformers' halves, in llama.cpp's order; no copy of Q and K)
    config.rope_interleaved = arch == "llama"
    if f.has("rope_freqs.weight"):  # Llama 3.1+ files: per-frequency factors of the rotary scaling, precomputed
        config.rope_freq_factors = f.vector("rope_freqs.weight")
        if tuple(config.rope_freq_factors.shape) != (hd // 2,):
            raise Unsupported(f"rope_freqs.weight has {config.rope_freq_factors.numel()} factors, the head needs {hd // 2}")
    window = int(m("attention.sliding_window") or 0)
    if arch == "gemma3":  # as llama.cpp runs it: embeddings x sqrt(d); 27B scales scores by 1/sqrt(d / heads)
        config.embed_scale = hidden ** 0.5
        config.query_pre_attn_scalar = hidden // heads if layers_n == 62 else None
    nq, nkv = heads * hd, kv_heads * hd
    layers = []
    for i in range(layers_n):
        b = f"blk.{i}."
        opt = lambda name: f.vector(b + name) if f.has(b + name) else None  # noqa: E731

        if f.has(b + "attn_qkv.weight"):  # phi3: q, k, v in one matrix, and gate, up in ffn_up
            q, k, v = f.qtensor(b + "attn_qkv.weight").split([nq, nkv, nkv])
            gate, up = f.qtensor(b + "ffn_up.weight").split([inter, inter])
        else:
            q, k, v = (f.qtensor(b + f"attn_{x}.weight") for x in "qkv")
            gate, up = f.qtensor(b + "ffn_gate.weight"), f.qtensor(b + "ffn_up.weight")
        local = arch == "gemma3" and (i + 1) % GEMMA3_GLOBAL_EVERY != 0
        layers.append(LayerWeights(
            f.vector(b + "attn_norm.weight"), q, k, v, f.qtensor(b + "attn_output.weight"),
            f.vector(b + "ffn_norm.weight"), gate, up, f.qtensor(b + "ffn_down.weight"),
            *[opt(f"attn_{x}.bias") for x in "qkv"], opt("attn_q_norm.weight"), opt("attn_k_norm.weight"),
            opt("post_attention_norm.weight"), opt("post_ffw_norm.weight"),
            window=window if arch != "gemma3" or local else 0,
            rope_theta=GEMMA3_LOCAL_THETA if local else None))
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
    gemma = config.model_type == "gemma3_text"
    if gemma:  # Gemma's norms multiply by (1 + w): the runtime's norm takes that sum (fp32, as transformers forms it)
        norm_of = lambda name: 1.0 + w.vector(name)  # noqa: E731
        config.embed_scale = config.hidden_size ** 0.5
        config.hidden_act = config.hidden_activation
        _check_softcap(config)
    else:
        norm_of = w.vector
    types = getattr(config, "layer_types", None) or []
    window = int(getattr(config, "sliding_window", None) or 0)
    if getattr(config, "use_sliding_window", True) is False:
        window = 0
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    nq, nkv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    p = "model."
    layers = []
    for i in range(config.num_hidden_layers):
        b = f"{p}layers.{i}."
        a = b + "self_attn."
        opt = lambda name, norm=False: (norm_of if norm else w.vector)(name) if w.has(name) else None  # noqa: E731
        if w.has(a + "qkv_proj.weight"):  # phi3
            q, k, v = w.qtensor(a + "qkv_proj.weight").split([nq, nkv, nkv])
            gate, up = w.qtensor(b + "mlp.gate_up_proj.weight").split([inter, inter])
        else:
            q, k, v = (w.qtensor(a + f"{x}_proj.weight") for x in "qkv")
            gate, up = w.qtensor(b + "mlp.gate_proj.weight"), w.qtensor(b + "mlp.up_proj.weight")
        sliding = types[i] == "sliding_attention" if types else bool(window)
        layers.append(LayerWeights(
            norm_of(b + "input_layernorm.weight"), q, k, v, w.qtensor(a + "o_proj.weight"),
            norm_of(b + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
            gate, up, w.qtensor(b + "mlp.down_proj.weight"),
            *[opt(a + f"{x}_proj.bias") for x in "qkv"], opt(a + "q_norm.weight", True), opt(a + "k_norm.weight", True),
            opt(b + "post_attention_layernorm.weight", True) if gemma else None,
            opt(b + "post_feedforward_layernorm.weight", True) if gemma else None,
            window=window if sliding else 0, rope_theta=_layer_theta(config, types[i] if types else None)))
    embed = w.qtensor(p + "embed_tokens.weight")
    head = w.qtensor("lm_head.weight") if w.has("lm_head.weight") else embed
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        gen = SimpleNamespace(eos_token_id=config.eos_token_id)
    if gemma:  # one rotary table per layer type: the global one is the model's
        config.rope_parameters = config.rope_parameters["full_attention"]
    return _build(config, embed, layers, norm_of(p + "norm.weight"), head, gen, max_len, str(path))


def _layer_theta(config, layer_type):
    """A layer's own rotary base where the config gives one per layer type (Gemma 3's sliding layers)."""
    per_type = getattr(config, "rope_parameters", None) or {}
    if layer_type != "sliding_attention" or layer_type not in per_type:
        return None
    params = per_type[layer_type]
    if params.get("rope_type", "default") != "default":
        raise Unsupported(f"rotary scaling {params['rope_type']!r} on sliding-window layers is not supported")
    return float(params["rope_theta"])


def _check_softcap(config):
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None):
            raise Unsupported(f"{name} is not supported by the runtime")


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
        if (w.q_norm is None) != (w.k_norm is None):
            raise Unsupported(f"layer {i} has a q norm or a k norm, not both")
        for name, t, shape in [("attn_norm", w.attn_norm, (D,)), ("q", w.q, (nq, D)), ("k", w.k, (nkv, D)),
                               ("v", w.v, (nkv, D)), ("o", w.o, (D, nq)), ("ffn_norm", w.ffn_norm, (D,)),
                               ("gate", w.gate, (I, D)), ("up", w.up, (I, D)), ("down", w.down, (D, I)),
                               ("q_bias", w.q_bias, (nq,)), ("k_bias", w.k_bias, (nkv,)), ("v_bias", w.v_bias, (nkv,)),
                               ("q_norm", w.q_norm, (hd,)), ("k_norm", w.k_norm, (hd,)),
                               ("post_attn_norm", w.post_attn_norm, (D,)), ("post_ffn_norm", w.post_ffn_norm, (D,))]:
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
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise Unsupported("partial rotary embedding is not supported by the runtime")
    if kind not in ROPE_TYPES:
        raise Unsupported(f"rotary scaling {kind!r} is not supported by the runtime ({sorted(ROPE_TYPES)} are)")
    return Llama(config, embed, layers, norm, head, gen, max_len=min(max_len or config.max_position_embeddings,
                                                                     config.max_position_embeddings), source=source)
