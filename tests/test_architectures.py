"""Each architecture the runtime runs beyond Llama (Qwen3, Gemma 3, Phi-3, Llama 3.1 rope_freqs, Mistral's sliding
window): a tiny random model written as GGUF (K-quant and 5-bit tensors included) and as safetensors, against
transformers on the same values; sliding-window passes stay row-invariant."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.runtime.load import load_gguf, load_hf_dir
from specdec.runtime.quantize import quantize
from specdec.runtime.weights import Unsupported
from test_runtime import _greedy, _hf_greedy  # noqa: E402 - tests/ is on sys.path (conftest)

T = gguf.GGMLQuantizationType
PROMPT = [5, 17, 33, 8, 61, 2, 40, 12, 90, 3, 77, 9, 14, 21, 50, 66, 70, 80, 97, 31]  # longer than the windows
BASE = dict(vocab_size=99, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            initializer_range=0.3)
# linears cycle through these (every K here is a multiple of 256)
QTYPES = [T.Q4_K, T.Q6_K, T.Q5_K, T.Q5_0, T.Q3_K, T.Q2_K, T.Q5_1, T.Q8_0, T.Q4_0]


def hf_model(arch: str):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config
    torch.manual_seed(3)
    if arch == "qwen3":
        cfg = Qwen3Config(**BASE, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False)
    elif arch == "gemma3":  # 6 layers: 5 sliding (base 10000), the 6th global (base 1e6)
        cfg = Gemma3TextConfig(**{**BASE, "num_key_value_heads": 1}, num_hidden_layers=6, sliding_window=7,
                               query_pre_attn_scalar=64, tie_word_embeddings=True)
    elif arch == "phi3":
        cfg = Phi3Config(**{k: v for k, v in BASE.items() if k != "head_dim"}, num_hidden_layers=2, sliding_window=7,
                         tie_word_embeddings=False, pad_token_id=0)
    else:  # llama3: rotary scaling as a GGUF carries it (rope_freqs.weight)
        cfg = LlamaConfig(**BASE, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=10000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # norms away from their init (ones, or Gemma's zeros) so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    n = w.shape[0]
    return w.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path) -> None:
    """The model as llama.cpp's converter lays it out (names, fused phi3 matrices, llama's Q/K row order, Gemma's
    norms + 1), linears quantized; the model's weights are replaced by the dequantized values the file holds."""
    cfg, sd = model.config, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg.num_hidden_layers), wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size), wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads), wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_key_length(hd), wr.add_value_length(hd), wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_bos_token_id(1), wr.add_eos_token_id(2)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    wr.add_rope_freq_base(rope["rope_theta"])
    if getattr(cfg, "sliding_window", None):
        wr.add_sliding_window(cfg.sliding_window)
    state, count = {}, iter(range(10 ** 6))

    def put(gname, hfnames, qtype=None, heads=0, plus_one=False):
        w = np.concatenate([sd[n] for n in hfnames]) if len(hfnames) > 1 else sd[hfnames[0]]
        if plus_one:
            w = w + np.float32(1)
        if w.ndim == 1:
            wr.add_tensor(gname, w.astype(np.float32))
            back = w - np.float32(1) if plus_one else w
        else:
            qtype = qtype or QTYPES[next(count) % len(QTYPES)]
            stored = _permute(w, heads) if heads else w
            data = quantize(stored, int(qtype))
            wr.add_tensor(gname, data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)
            back = _unpermute(back, heads) if heads else back
        start = 0
        for n in hfnames:
            state[n] = torch.from_numpy(np.ascontiguousarray(back[start:start + sd[n].shape[0]]))
            start += sd[n].shape[0]

    gemma = arch == "gemma3"
    put("token_embd.weight", ["model.embed_tokens.weight"], T.Q8_0)
    if not cfg.tie_word_embeddings:
        put("output.weight", ["lm_head.weight"], T.Q6_K)
    put("output_norm.weight", ["model.norm.weight"], plus_one=gemma)
    for i in range(cfg.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        a = p + "self_attn."
        put(b + "attn_norm.weight", [p + "input_layernorm.weight"], plus_one=gemma)
        put(b + "ffn_norm.weight", [p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
                                    + ".weight"], plus_one=gemma)
        if arch == "phi3":
            put(b + "attn_qkv.weight", [a + "qkv_proj.weight"])
            put(b + "ffn_up.weight", [p + "mlp.gate_up_proj.weight"])
        else:
            heads = (cfg.num_attention_heads, cfg.num_key_value_heads) if arch == "llama" else (0, 0)
            put(b + "attn_q.weight", [a + "q_proj.weight"], heads=heads[0])
            put(b + "attn_k.weight", [a + "k_proj.weight"], heads=heads[1])
            put(b + "attn_v.weight", [a + "v_proj.weight"])
            put(b + "ffn_gate.weight", [p + "mlp.gate_proj.weight"])
            put(b + "ffn_up.weight", [p + "mlp.up_proj.weight"])
        put(b + "attn_output.weight", [a + "o_proj.weight"])
        put(b + "ffn_down.weight", [p + "mlp.down_proj.weight"])
        if arch in ("qwen3", "gemma3"):
            put(b + "attn_q_norm.weight", [a + "q_norm.weight"], plus_one=gemma)
            put(b + "attn_k_norm.weight", [a + "k_norm.weight"], plus_one=gemma)
        if gemma:
            put(b + "post_attention_norm.weight", [p + "post_attention_layernorm.weight"], plus_one=True)
            put(b + "post_ffw_norm.weight", [p + "post_feedforward_layernorm.weight"], plus_one=True)
    if arch == "llama":  # llama.cpp's converter: the llama3 scaling as one factor per frequency
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        wr.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)


def _logits(rt, ids):
    s = rt.acquire_slot()
    try:
        return rt.forward(ids, [s] * len(ids), list(range(len(ids))))
    finally:
        rt.release_slot(s)


ARCHS = ["qwen3", "gemma3", "phi3", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, tmp_path_factory):
    arch = request.param
    model = hf_model(arch)
    d = tmp_path_factory.mktemp(arch)
    model.save_pretrained(d / "hf")
    write_gguf(model, arch, d / "tiny.gguf")  # the model now holds the file's dequantized values
    return arch, model, d


def test_safetensors_match_transformers(arch_pair):
    arch, _, d = arch_pair
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d / "hf").float().eval()
    rt = load_hf_dir(d / "hf")
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    got = _logits(rt, PROMPT)
    print(f"{arch} safetensors: max |logit difference| {float((got - ref).abs().max()):.2e}")
    assert (got - ref).abs().max() < 2e-4
    assert _greedy(rt, PROMPT[:6], 10) == _hf_greedy(hf, PROMPT[:6], 10)


def test_gguf_matches_transformers_on_the_files_values(arch_pair):
    arch, model, d = arch_pair
    rt = load_gguf(d / "tiny.gguf")
    if arch == "gemma3":
        assert [w.window for w in rt.layers] == [7] * 5 + [0] and rt.layers[0].rope_theta == 10000.0
        assert rt.act == "gelu_pytorch_tanh" and rt.embed_scale == 16.0
    formats = {w.fmt for layer in rt.layers for w in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.down)}
    assert {kernels.Q4_K, kernels.Q6_K, kernels.Q5_0} <= formats
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0]
    got = _logits(rt, PROMPT)
    print(f"{arch} GGUF: max |logit difference| {float((got - ref).abs().max()):.2e}")
    assert (got - ref).abs().max() < 2e-4
    assert _greedy(rt, PROMPT[:6], 10) == _hf_greedy(model, PROMPT[:6], 10)


@pytest.mark.parametrize("numerics", ["exact", "q8"])
def test_sliding_window_pass_is_row_invariant(arch_pair, numerics):
    """A pass of rows past the window gives each row bitwise a one-token step's logits; a tree's nodes equal their
    paths' one-token steps; and the window really hides old positions (changing a token before it changes
    nothing after it, on the sliding layers)."""
    arch, _, d = arch_pair
    if arch not in ("gemma3", "phi3"):
        pytest.skip("no sliding window")
    rt = load_gguf(d / "tiny.gguf")
    rt.set_numerics(numerics)
    a, b = rt.acquire_slot(), rt.acquire_slot()
    full = rt.forward(PROMPT, [a] * len(PROMPT), list(range(len(PROMPT))))
    one = torch.cat([rt.forward([t], [b], [i]) for i, t in enumerate(PROMPT)])
    assert torch.equal(full, one)
    # a tree hanging from position 11: nodes [x, y | x] with the path storage after the prefix
    n = 12
    tree = rt.forward(PROMPT[:n] + [44, 45, 46], [a] * (n + 3), list(range(n)) + [n, n + 1, n],
                      paths=[None] * n + [[n], [n, n + 1], [n + 2]])
    rt.truncate(b, 0)
    for path in ([44], [44, 45], [46]):
        ids = PROMPT[:n] + path
        step = rt.forward(ids, [b] * len(ids), list(range(len(ids))))[-1]
        node = {(44,): 0, (44, 45): 1, (46,): 2}[tuple(path)]
        assert torch.equal(tree[n + node], step)
        rt.truncate(b, 0)
    rt.release_slot(a), rt.release_slot(b)
    if arch == "phi3":  # every layer slides: a token more than a window back cannot matter
        other = list(PROMPT)
        other[2] = 60
        assert torch.equal(_logits(rt, other)[-1], _logits(rt, PROMPT)[-1])


def test_unsupported_gguf_inputs_are_one_line(tmp_path):
    model = hf_model("qwen3")
    write_gguf(model, "qwen3", tmp_path / "ok.gguf")
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(Unsupported, match="truncated"):
        load_gguf(tmp_path / "cut.gguf")
    wr = gguf.GGUFWriter(str(tmp_path / "lying.gguf"), "qwen3")  # metadata says 3 heads of 64, the tensors 4
    wr.add_block_count(1), wr.add_embedding_length(256), wr.add_head_count(3), wr.add_head_count_kv(1)
    wr.add_feed_forward_length(512), wr.add_key_length(64)
    for name, shape in [("token_embd", (99, 256)), ("blk.0.attn_q", (256, 256)), ("blk.0.attn_k", (64, 256)),
                        ("blk.0.attn_v", (64, 256)), ("blk.0.attn_output", (256, 256)),
                        ("blk.0.ffn_gate", (512, 256)), ("blk.0.ffn_up", (512, 256)), ("blk.0.ffn_down", (256, 512))]:
        wr.add_tensor(name + ".weight", np.zeros(shape, np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        wr.add_tensor(name + ".weight", np.ones(256, np.float32))
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    with pytest.raises(Unsupported, match="attn_q|layer 0 q|disagree"):
        load_gguf(tmp_path / "lying.gguf")


def test_torch_fallback_and_avx2_build_run_each_architecture(arch_pair, monkeypatch):
    """Without kernels the torch layer runs the same architecture (q/k norms, post-norms, GeGLU, windows, per-layer
    rotary bases); on an AVX-512 machine the forced AVX2 build gives its bits in exact and q8."""
    arch, model, d = arch_pair
    rt = load_gguf(d / "tiny.gguf")
    ref = _logits(rt, PROMPT)
    rt.set_numerics("q8")
    ref_q8 = _logits(rt, PROMPT)
    isa = rt._lib.isa if rt._lib is not None else None
    monkeypatch.setenv("SPECDEC_CPU_KERNEL", "0")
    kernels.library.cache_clear()
    try:
        slow = load_gguf(d / "tiny.gguf")
        assert slow._lib is None and (_logits(slow, PROMPT) - ref).abs().max() < 1e-4
        if isa == "avx512":
            monkeypatch.setenv("SPECDEC_CPU_KERNEL", "avx2")
            kernels.library.cache_clear()
            avx2 = load_gguf(d / "tiny.gguf")
            assert torch.equal(_logits(avx2, PROMPT), ref)
            avx2.set_numerics("q8")
            assert torch.equal(_logits(avx2, PROMPT), ref_q8)
    finally:
        monkeypatch.delenv("SPECDEC_CPU_KERNEL")
        kernels.library.cache_clear()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_distill_trains_a_feature_draft_for_another_architecture(arch, tmp_path):
    """`specdec distill` on a Gemma 3 / Qwen3 target (its data generated on the runtime): the draft loads on the
    runtime target, drafts, and speculation stays token-identical to the target alone."""
    import json

    from tiny import char_tokenizer

    from specdec.distill import distill
    from specdec.drafters.feature import FeatureDrafter
    from specdec.models import tokenizer_fingerprint
    from specdec.api import SpecDecoder
    model = hf_model(arch)
    tok = char_tokenizer(chat=True)
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    rt = load_hf_dir(tmp_path / "t")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "mode": "chat"}) + "\n" for p in ["Hello", "abc", "xyz q"]))
    rep = distill("tiny", str(tmp_path / "d"), [str(prompts)], [], max_new_tokens=12, gen_batch=4, reduced=40,
                  epochs=1, batch=4, seed=0, eval_limit=2, device="cpu", self_chat=2, val_every=0,
                  loaded=(model, tok, rt))
    assert rep["held_out"]["identical_to_target"]
    drafter = FeatureDrafter.load(tmp_path / "d", rt, tokenizer_fingerprint(tok))
    sd = SpecDecoder.from_models(rt, tok, draft=drafter, tau=3)
    plain = SpecDecoder.from_models(rt, tok, draft="none")
    for prompt in ["Hello", "abc"]:
        got = sd.generate(prompt, max_new_tokens=16)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids and got.stats["proposed"] > 0
