"""specdec's runtime: quantized kernels against gguf's reference, whole-pass row-invariance, logits against
transformers (a tiny random Llama written as a GGUF with quantized tensors and as safetensors), KV slots, the
AVX2 build, the torch fallback, greedy speculation on the runtime, and what it refuses."""
import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import kernels, models
from specdec.api import SpecDecoder
from specdec.runtime.load import load_gguf, load_hf_dir
from specdec.runtime.quantize import quantize
from specdec.runtime.weights import GGML_BLOCK, QTensor, Unsupported, qlinear, scales_of

T = gguf.GGMLQuantizationType
FORMATS = [(T.Q4_0, kernels.Q4_0), (T.Q4_1, kernels.Q4_1), (T.Q8_0, kernels.Q8_0), (T.F16, kernels.F16),
           (T.BF16, kernels.BF16), (T.F32, kernels.F32), (T.Q5_0, kernels.Q5_0), (T.Q5_1, kernels.Q5_1),
           (T.Q2_K, kernels.Q2_K), (T.Q3_K, kernels.Q3_K), (T.Q4_K, kernels.Q4_K), (T.Q5_K, kernels.Q5_K),
           (T.Q6_K, kernels.Q6_K)]
BLOCK_FORMATS = {kernels.Q4_0, kernels.Q4_1, kernels.Q8_0, kernels.Q5_0, kernels.Q5_1}
K_FORMATS = {kernels.Q2_K, kernels.Q3_K, kernels.Q4_K, kernels.Q5_K, kernels.Q6_K}
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX2/AVX-512 CPU or no C++ compiler")
needs_avx512 = pytest.mark.skipif(kernels.best_isa() != "avx512", reason="needs an AVX-512 CPU")


def quantized(w: np.ndarray, qtype) -> tuple[QTensor, torch.Tensor]:
    """w [n, k] in gguf format `qtype` -> (QTensor, gguf's reference dequantization in fp32)."""
    blocks = quantize(w, int(qtype)) if int(qtype) in K_FORMATS else np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32)).reshape(w.shape)
    return QTensor(int(qtype), torch.from_numpy(blocks).view(torch.uint8).reshape(w.shape[0], -1), *w.shape), ref


# ---- kernels ---------------------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("qtype,fmt", FORMATS, ids=[f[0].name for f in FORMATS])
def test_quantized_linear_equals_gguf_dequantization_then_linear(qtype, fmt):
    """Every format, rows 1..8 and beyond (4-row tiles; 12+ rows on a dequantized buffer, 6 rows at a time), K with tails for float
    formats, a bias: (1) bitwise the F32 kernel on gguf's dequantized weights, (2) F.linear within fp32 rounding,
    (3) each row as if alone."""
    rng = np.random.default_rng(int(qtype))
    for k in ((256, 768) if fmt in K_FORMATS else (64, 576) if fmt in BLOCK_FORMATS else (37, 576)):
        w = rng.standard_normal((67, k)).astype(np.float32)
        qt, ref = quantized(w, qtype)
        dense = QTensor.from_float(ref)
        b = torch.randn(67)
        for rows in [*range(1, 9), 11, 12, 13, 18, 29]:  # 12+: weights dequantized once into a buffer
            x = torch.randn(rows, k)
            y = qlinear(x, qt, b)
            assert torch.equal(y, qlinear(x, dense, b)), (rows, k)
            assert torch.allclose(y, F.linear(x, ref, b), rtol=1e-5, atol=1e-5 * k ** 0.5 * 4), (rows, k)
            alone = torch.cat([qlinear(x[i:i + 1], qt, b) for i in range(rows)])
            assert torch.equal(alone, y)


@needs_avx512
@pytest.mark.parametrize("qtype,fmt", FORMATS, ids=[f[0].name for f in FORMATS])
def test_avx2_build_gives_the_avx512_bits(qtype, fmt):
    """The AVX2 build (forced on this machine) computes the same 16-lane sums in the same order."""
    k = 768 if fmt in K_FORMATS else 576
    w = np.random.default_rng(0).standard_normal((45, k)).astype(np.float32)
    qt, _ = quantized(w, qtype)
    for rows in (1, 3, 8, 9, 13, 20):
        x = torch.randn(rows, k)
        a = kernels.linear(qt.fmt, x, qt.data, qt.n, None, kernels.library("avx512"))
        b = kernels.linear(qt.fmt, x, qt.data, qt.n, None, kernels.library("avx2"))
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", [q for q, f in FORMATS if f in BLOCK_FORMATS | K_FORMATS], ids=lambda t: t.name)
def test_torch_dequantization_is_gguf_reference_bitwise(qtype):
    """Embedding lookups and the torch fallback dequantize in torch: the same fp32 values as gguf's numpy reference."""
    w = (np.random.default_rng(int(qtype)).standard_normal((33, 512 if int(qtype) in K_FORMATS else 96)) * 3
         ).astype(np.float32)
    qt, ref = quantized(w, qtype)
    assert torch.equal(qt.dequantize(), ref)
    for idx in ([3], [3, 7, 7, 0], list(range(8)), list(range(9))):  # <= 8 rows take numpy's path, 9 torch's
        assert torch.equal(qt.rows(idx), ref[idx])


@pytest.mark.parametrize("fmt", sorted(K_FORMATS), ids=lambda f: kernels.FORMATS[f])
def test_our_k_quantizer_writes_blocks_gguf_reads_back(fmt):
    """Our quantizer (synthetic files, tests): gguf's reference dequantization of its bytes is close to the input,
    as close as the type's bits allow, and every sub-block's scale is used (no zeroed blocks)."""
    rng = np.random.default_rng(fmt)
    w = (rng.standard_normal((9, 512)) * rng.uniform(0.01, 3, (9, 1))).astype(np.float32)
    w[0, :256] = 0  # an all-zero super-block stays zero
    blocks = quantize(w, fmt)
    assert blocks.shape == (9, 2 * GGML_BLOCK[fmt][1])
    back = gguf.quants.dequantize(blocks, T(fmt)).reshape(w.shape)
    rel = np.abs(back - w).mean() / np.abs(w).mean()
    assert rel < {kernels.Q2_K: 0.4, kernels.Q3_K: 0.2, kernels.Q4_K: 0.1, kernels.Q5_K: 0.05, kernels.Q6_K: 0.03}[fmt]
    assert not back[0, :256].any() and np.isfinite(back).all()
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(w[:, :100], fmt)


def test_scales_are_the_blocks_fp16_values():
    w = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, T.Q4_1)
    sc = scales_of(kernels.Q4_1, torch.from_numpy(blocks))
    assert sc.shape == (3, 2, 2)
    assert torch.equal(sc[0, 1], torch.from_numpy(blocks[0, 20:24].copy().view(np.float16).astype(np.float32)))


# ---- a tiny random Llama as GGUF and as safetensors -------------------------------------------------------------
CFG = dict(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
           tie_word_embeddings=False, rope_theta=10000.0)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order of Q/K rows (the runtime undoes it when it loads)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """(GGUF path, transformers fp32 model holding exactly the GGUF's dequantized weights)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, initializer_range=0.3)).float().eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(2), wr.add_context_length(128), wr.add_embedding_length(64), wr.add_feed_forward_length(128)
    wr.add_head_count(4), wr.add_head_count_kv(2), wr.add_layer_norm_rms_eps(1e-5), wr.add_rope_freq_base(10000.0)
    wr.add_bos_token_id(1), wr.add_eos_token_id(2)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"self_attn.q_proj": ("attn_q", T.Q4_1), "self_attn.k_proj": ("attn_k", T.Q4_0),
             "self_attn.v_proj": ("attn_v", T.Q8_0), "self_attn.o_proj": ("attn_output", T.F16),
             "mlp.gate_proj": ("ffn_gate", T.Q4_1), "mlp.up_proj": ("ffn_up", T.BF16), "mlp.down_proj": ("ffn_down", T.Q4_1)}
    state = {}

    def put(gname, hfname, w, qtype, permute_heads=0):
        stored = _permute(w, permute_heads) if permute_heads else w
        data = gguf.quants.quantize(stored, qtype) if qtype != T.F32 else stored
        wr.add_tensor(gname, data, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape) if qtype != T.F32 else w
        if permute_heads:  # the runtime (like transformers' GGUF loader) undoes the permutation
            n = w.shape[0]
            back = back.reshape(permute_heads, n // permute_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        state[hfname] = torch.from_numpy(np.ascontiguousarray(back))

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"], T.Q8_0)
    put("output.weight", "lm_head.weight", sd["lm_head.weight"], T.Q8_0)
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], T.F32)
    for i in range(2):
        pre = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", pre + "input_layernorm.weight", sd[pre + "input_layernorm.weight"], T.F32)
        put(f"blk.{i}.ffn_norm.weight", pre + "post_attention_layernorm.weight",
            sd[pre + "post_attention_layernorm.weight"], T.F32)
        for hf, (g, qtype) in names.items():
            heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}.get(hf, 0)
            put(f"blk.{i}.{g}.weight", f"{pre}{hf}.weight", sd[f"{pre}{hf}.weight"], qtype, heads)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    model.load_state_dict(state)
    return path, model


@pytest.fixture(scope="module")
def runtime_model(gguf_pair):
    return load_gguf(gguf_pair[0])


PROMPT = [5, 17, 33, 8, 61, 2, 40, 12, 90, 3, 77]


@torch.inference_mode()
def _hf_greedy(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def _greedy(rt, ids, n):
    cache, seq = rt.new_cache(), list(ids)
    for _ in range(n):
        seq.append(int(cache.forward(seq)[-1].argmax()))
    cache.close()
    return seq[len(ids):]


def test_gguf_logits_match_transformers_on_the_dequantized_model(gguf_pair, runtime_model):
    path, hf = gguf_pair
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    s = runtime_model.acquire_slot()
    got = runtime_model.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))))
    runtime_model.release_slot(s)
    assert (got - ref).abs().max() < 1e-4  # fp32 rounding of a different summation order, nothing more
    assert _greedy(runtime_model, PROMPT, 20) == _hf_greedy(hf, PROMPT, 20)
    assert runtime_model.layers[0].q.format_name == "Q4_1" and runtime_model.layers[0].up.format_name == "BF16"


def test_safetensors_logits_match_transformers(tmp_path):
    torch.manual_seed(3)
    hf = LlamaForCausalLM(LlamaConfig(**{**CFG, "attention_bias": False}, initializer_range=0.3)).eval()
    hf.to(torch.bfloat16).save_pretrained(tmp_path)  # kept in its own dtype by the runtime
    rt = load_hf_dir(tmp_path)
    assert rt.layers[0].q.format_name == "BF16"
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # the bf16 values, widened
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    s = rt.acquire_slot()
    got = rt.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))))
    assert (got - ref).abs().max() < 1e-4
    assert _greedy(rt, PROMPT, 16) == _hf_greedy(hf, PROMPT, 16)


# ---- row-invariance and KV slots ---------------------------------------------------------------------------------
def test_whole_pass_is_row_invariant(runtime_model):
    """A pass over n rows gives each row bitwise the logits of a one-row pass (attention, norms, rotary, linears);
    rows of two slots in one pass equal each slot's rows alone."""
    rt = runtime_model
    seq = PROMPT + [9, 14, 21, 50, 66, 70, 80, 97]
    a, b = rt.acquire_slot(), rt.acquire_slot()
    longer = seq + [(7 * i) % 90 + 3 for i in range(54)]  # 73 keys: whole 16-key blocks and a tail
    full = rt.forward(longer, [a] * len(longer), list(range(len(longer))))
    one = torch.cat([rt.forward([t], [b], [i]) for i, t in enumerate(longer)])
    assert torch.equal(full, one)
    full = full[: len(seq)]
    # 8 rows of slot a verified after a prefix, interleaved with 3 rows of slot b in the same pass
    rt.forward(seq[:10], [a] * 10, list(range(10)))
    rt.forward(seq[:4], [b] * 4, list(range(4)))
    mixed = rt.forward(seq[10:18] + seq[4:7], [a] * 8 + [b] * 3, list(range(10, 18)) + [4, 5, 6])
    assert torch.equal(mixed[:8], full[10:18]) and torch.equal(mixed[8:], full[4:7])
    rt.release_slot(a), rt.release_slot(b)


def test_kv_slot_rollback_and_independence(runtime_model):
    c1, c2 = runtime_model.new_cache(), runtime_model.new_cache()
    assert c1.slot != c2.slot
    base = c1.forward(PROMPT + [4, 4, 4], 3)
    c2.forward([7, 7, 7, 7, 7])  # another sequence in another slot
    c1.rollback(len(PROMPT))  # rollback = a length; the three positions are simply overwritten next
    assert len(c1.tokens) == len(PROMPT)
    again = c1.forward(PROMPT + [4, 4, 4], 3)
    assert torch.equal(again, base)
    other = c1.forward(PROMPT + [5, 6], 2)  # diverges after the prompt: rolls back by itself
    fresh = runtime_model.new_cache()
    assert torch.equal(other, fresh.forward(PROMPT + [5, 6], 2))
    for c in (c1, c2, fresh):
        c.close()


def test_torch_fallback_and_avx2_build(gguf_pair, monkeypatch):
    """Without kernels the torch layer serves the same model (fp32 rounding apart); the AVX2 build (forced here)
    gives the AVX-512 build's logits bit for bit, in exact and in q8."""
    path, _ = gguf_pair
    ref_rt = load_gguf(path)
    ref = _logits(ref_rt)
    ref_rt.set_numerics("q8")
    ref_q8 = _logits(ref_rt) if ref_rt.q8 else None
    monkeypatch.setenv("SPECDEC_CPU_KERNEL", "0")
    kernels.library.cache_clear()
    try:
        slow = load_gguf(path)
        assert slow._lib is None
        assert (_logits(slow) - ref).abs().max() < 1e-4
        if ref_rt._lib is not None and ref_rt._lib.isa == "avx512":
            monkeypatch.setenv("SPECDEC_CPU_KERNEL", "avx2")
            kernels.library.cache_clear()
            avx2 = load_gguf(path)
            assert avx2._lib.isa == "avx2" and torch.equal(_logits(avx2), ref)
            avx2.set_numerics("q8")  # q8 (integer sums, fp16 K/V): the same bits, and a pass equals one-token steps
            assert torch.equal(_logits(avx2), ref_q8)
            s = avx2.acquire_slot()
            steps = torch.cat([avx2.forward([t], [s], [i]) for i, t in enumerate(PROMPT)])
            assert torch.equal(steps, ref_q8)
    finally:
        monkeypatch.delenv("SPECDEC_CPU_KERNEL")
        kernels.library.cache_clear()


def _logits(rt):
    s = rt.acquire_slot()
    out = rt.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))))
    rt.release_slot(s)
    return out


# ---- speculation on the runtime (production dtype and kernels) ------------------------------------------------------
def test_greedy_speculation_on_the_runtime_is_token_identical(runtime_model, tok):
    """Every drafter x tau 1..8 on the runtime equals the runtime's target-only output, token by token (rows 2-9
    per verify pass: the kernel's 8-row tiles and the row-count switch are crossed)."""
    out = assert_speculation_equals_target_only(runtime_model, tok)
    assert out.stats["accepted"] > 0  # the target drafting for itself is always right


@needs_kernel
@pytest.mark.parametrize("cut", [48, 40])  # whole 16-row groups of the head's q8 layout, and not
def test_a_model_draft_reads_only_its_heads_first_rows_and_stays_lossless(runtime_model, tok, monkeypatch, cut):
    """A draft's logits for the first HEAD_ROWS ids are the whole head's, bitwise (q8 and exact); it proposes no
    id beyond them; and speculation with such a draft equals target-only, greedy and seeded."""
    from specdec.drafters import model as model_draft
    rt, mode = runtime_model, runtime_model.numerics
    for numerics in ("q8", "exact"):
        rt.set_numerics(numerics)
        s = rt.acquire_slot()
        full = rt.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))))
        part = rt.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))), head_rows=cut)
        rt.release_slot(s)
        assert part.shape[1] == cut and torch.equal(part, full[:, :cut]), numerics
    rt.set_numerics(mode)
    monkeypatch.setattr(model_draft, "HEAD_ROWS", cut)
    proposed = []
    honest = model_draft.ModelDrafter.propose

    def seen(self, *a, **k):
        d = honest(self, *a, **k)
        proposed.extend(d.tokens)
        return d
    monkeypatch.setattr(model_draft.ModelDrafter, "propose", seen)
    prompt = "Hello there, general"
    for params in ({}, {"temperature": 0.9, "seed": 3}):
        base = SpecDecoder.from_models(rt, tok, "none").generate(prompt, max_new_tokens=40, chat=False, **params)
        out = SpecDecoder.from_models(rt, tok, "target", tau=4).generate(prompt, max_new_tokens=40, chat=False,
                                                                          **params)
        assert out.token_ids == base.token_ids, params
        assert proposed and max(proposed) < cut
    assert max(base.token_ids) >= cut  # the target wrote ids the draft could not propose


def assert_speculation_equals_target_only(model, tok):
    """ngram and the target as its own draft, tau 1..8, against the same model's target-only output -> the last
    speculative result."""
    prompt = "Hello there, general"
    base = SpecDecoder.from_models(model, tok, "none").generate(prompt, max_new_tokens=40, chat=False)
    for draft in ["ngram", "target"]:
        for tau in range(1, 9):
            out = SpecDecoder.from_models(model, tok, draft, tau=tau).generate(prompt, max_new_tokens=40, chat=False)
            assert out.token_ids == base.token_ids, (draft, tau)
    return out


# ---- what the runtime refuses ----------------------------------------------------------------------------------------
def test_unsupported_quant_type_is_one_clear_line(tmp_path):
    path = tmp_path / "iq4.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(1), wr.add_embedding_length(64), wr.add_head_count(4), wr.add_feed_forward_length(128)
    wr.add_tensor("token_embd.weight", np.zeros((99, 2 * 18), np.uint8), raw_dtype=T.IQ4_NL)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    with pytest.raises(Unsupported, match="token_embd.weight is IQ4_NL; the runtime runs .*Q4_K"):
        load_gguf(path)
    with pytest.raises(models.ModelLoadError, match="the runtime cannot run"):
        models.load(str(path), backend="runtime")


def test_unsupported_architecture_falls_back_to_transformers(tmp_path, tok, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capsys.readouterr()  # saving's progress bar
    model, _ = models.load(str(tmp_path))
    assert not models.is_runtime(model)
    err = capsys.readouterr().err.strip()
    assert "'gpt2' is not Llama-family" in err and "transformers backend" in err and "\n" not in err
    with pytest.raises(models.ModelLoadError, match="the runtime cannot run"):
        models.load(str(tmp_path), backend="runtime")


def test_positions_beyond_the_slots_are_refused(runtime_model):
    s = runtime_model.acquire_slot()
    with pytest.raises(ValueError, match="position outside"):
        runtime_model.forward([1], [s], [runtime_model.max_len])
    with pytest.raises(ValueError, match="never acquired"):  # the kernel must never index past its slots
        runtime_model.forward([1], [len(runtime_model._tables)], [0])
    runtime_model.release_slot(s)



# ---- batched generation (distill's data) ------------------------------------------------------------------------------
def test_batched_generation_equals_each_sequence_alone(runtime_model):
    """All prompts prefilled in one pass, then one row per unfinished sequence per step: every sequence gets bitwise
    the tokens and hidden states it gets alone, and stops at its own EOS."""
    from specdec.generate import generate_batch
    prompts = [PROMPT, [3, 4, 5], PROMPT[:7] + [88], [42] * 9]
    batch = generate_batch(runtime_model, prompts, 12, eos={2, 17})
    for p, (seq, h) in zip(prompts, batch):
        alone_seq, alone_h = generate_batch(runtime_model, [p], 12, eos={2, 17})[0]
        assert seq == alone_seq and torch.equal(h, alone_h)
        assert len(h) == len(seq) - 1 and seq[:len(p)] == p
        gen = seq[len(p):]
        greedy = _greedy(runtime_model, p, 12)  # the target alone, 12 steps, then cut at its first EOS
        end = next((i + 1 for i, t in enumerate(greedy) if t in {2, 17}), 12)
        assert gen == greedy[:end]
    assert runtime_model._free  # the slots went back


def test_distill_generates_its_data_on_the_runtime(tmp_path, gguf_pair, runtime_model, tok):
    """`specdec distill` on CPU takes its data (greedy responses, self-chat, labels) from the runtime twin."""
    from specdec.distill import distill
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join('{"prompt": "%s", "mode": "completion"}' % p for p in ["ab", "Hello", "xyz q"]))
    _, hf = gguf_pair
    calls = []
    original = runtime_model.forward
    runtime_model.forward = lambda *a, **kw: calls.append(len(a[0])) or original(*a, **kw)
    try:
        rep = distill("tiny", str(tmp_path / "d"), [str(prompts)], [], max_new_tokens=6, gen_batch=3, reduced=20,
                      epochs=1, batch=2, device="cpu", self_chat=3, val_every=0, eval_limit=1,
                      loaded=(hf, tok, runtime_model))
    finally:
        del runtime_model.forward
    assert rep["sequences"] == 6 and max(calls) >= 3  # batched passes: several rows per pass


@pytest.mark.parametrize("kind", ["qwen2-bias", "llama3-rope", "mistral", "yarn-rope"])
def test_llama_family_variants_match_transformers(tmp_path, kind):
    """Qwen2 (q/k/v bias), Llama 3 rotary scaling, Mistral (a sliding window shorter than the prompt), yarn: the runtime's
    logits match transformers' on the same fp32 safetensors, and greedy tokens agree."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config
    torch.manual_seed(5)
    base = {k: v for k, v in CFG.items() if k != "rope_theta"}
    if kind == "qwen2-bias":
        cfg = Qwen2Config(**base, rope_theta=10000.0)
    elif kind == "mistral":
        cfg = MistralConfig(**base, rope_theta=10000.0, sliding_window=7)
    elif kind == "llama3-rope":
        cfg = LlamaConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                          rope_theta=10000.0)
    else:
        cfg = LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32}, rope_theta=10000.0)
    cfg.initializer_range = 0.3
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    if kind == "qwen2-bias":
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    rt = load_hf_dir(tmp_path)
    if kind == "qwen2-bias":
        assert rt.layers[0].q_bias is not None
    if kind == "mistral":  # every layer attends to its last 7 positions, over the whole context
        assert [w.window for w in rt.layers] == [7, 7] and rt.max_len == 128
    prompt = PROMPT * 3  # past the llama3/yarn original context of 32 positions
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    s = rt.acquire_slot()
    got = rt.forward(prompt, [s] * len(prompt), list(range(len(prompt))))
    assert (got - ref).abs().max() < 2e-4
    assert _greedy(rt, PROMPT, 12) == _hf_greedy(hf, PROMPT, 12)


def test_compare_llamacpp_says_how_to_install_it(monkeypatch, gguf_pair, tiny_dirs, capsys):
    import builtins

    from specdec import llamacpp
    from specdec.cli import main
    from specdec.errors import InvalidRequest
    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kw):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(InvalidRequest, match="needs llama-cpp-python: pip install llama-cpp-python"):
        llamacpp.load(gguf_pair[0])
    assert main(["bench", "--target", tiny_dirs["target"], "--compare-llamacpp", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a .gguf target" in err and "\n" not in err
