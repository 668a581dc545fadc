"""EAGLE-3 heads in the layout the ecosystem publishes (drafters/eagle3.py), made here: the target's layers are tapped
where the head says (bitwise the target's own logits still), the head's logits are the reference computation's,
the output is the target's (greedy, seeded, batched), and a malformed head is one clear error."""
import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import VOCAB

from specdec import SpecDecoder, models
from specdec.drafters import registry
from specdec.drafters.eagle3 import Eagle3Drafter, is_eagle3
from specdec.errors import IncompatibleDraft, ModelLoadError
from specdec.sampling import SamplingParams

DRAFT_VOCAB, LAYERS = 48, (0, 1, 1)  # the tiny target has 2 layers: the inputs of layers 0 (embeddings) and 1


@pytest.fixture(scope="module")
def rt(tiny_dirs):
    return models.load(tiny_dirs["target"], backend="runtime")


def head_files(d, target, layout="midlayer", seed=0, **config):
    """An EAGLE-3 head for the tiny target in a published layout: `midlayer` (EAGLE's and SpecForge's), `layers`
    (vLLM's `model.layers.0.`), `speculators` (a nested transformer_layer_config)."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    H, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    hd, inter = H // heads, 96
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    layer = {"input_layernorm.weight": 1 + r(H), "hidden_norm.weight": 1 + r(H),
             "self_attn.q_proj.weight": r(heads * hd, 2 * H), "self_attn.k_proj.weight": r(kv * hd, 2 * H),
             "self_attn.v_proj.weight": r(kv * hd, 2 * H), "self_attn.o_proj.weight": r(H, heads * hd),
             "post_attention_layernorm.weight": 1 + r(H), "mlp.gate_proj.weight": r(inter, H),
             "mlp.up_proj.weight": r(inter, H), "mlp.down_proj.weight": r(H, inter)}
    prefix = {"midlayer": "midlayer.", "layers": "model.layers.0.", "speculators": "layers.0."}[layout]
    # draft id i is target id 3 + 2i for the first ids, then the rest in order: d2t holds the offsets
    targets = torch.tensor(sorted(set(range(3, VOCAB, 2)) | set(range(VOCAB)))[:0] or
                           (list(range(3, 3 + 2 * 20, 2)) + [t for t in range(VOCAB) if t not in
                                                              range(3, 3 + 2 * 20, 2)])[:DRAFT_VOCAB])
    weights = {prefix + k: v for k, v in layer.items()} | {
        "fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(DRAFT_VOCAB, H),
        "d2t": targets - torch.arange(DRAFT_VOCAB), "t2d": torch.isin(torch.arange(VOCAB), targets)}
    body = {"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": VOCAB,
            "max_position_embeddings": 2048, **config}
    if layout == "speculators":
        cfg = {"speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H,
               "eagle_aux_hidden_state_layer_ids": list(LAYERS), "transformer_layer_config": body}
    else:
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}, **body}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, d / "model.safetensors")
    return d, targets


def test_tapped_layers_are_the_residual_stream_and_the_logits_stay_bitwise(rt, tiny_dirs):
    model, tok = rt
    ids = tok("hello there, how are you").input_ids
    plain = model.forward(ids, [model.acquire_slot()] * len(ids), list(range(len(ids))), hidden=True)
    model.feature_layers = LAYERS
    try:
        logits, aux = model.forward(ids, [model.acquire_slot()] * len(ids), list(range(len(ids))), hidden=True)
    finally:
        model.feature_layers = None
    assert torch.equal(logits, plain[0]) and aux.shape == (len(ids), 3 * model.config.hidden_size)
    model.feature_layers = LAYERS  # row-invariant: the rows of a many-row pass are one-token steps' states, bitwise
    try:
        slot = model.acquire_slot()
        model.forward(ids[:-3], [slot] * (len(ids) - 3), list(range(len(ids) - 3)), hidden=True)
        for n in range(len(ids) - 3, len(ids)):
            step = model.forward([ids[n]], [slot], [n], hidden=True)
            assert torch.equal(step[1][0], aux[n]) and torch.equal(step[0][0], logits[n])
    finally:
        model.feature_layers = None
    exact = models.load(tiny_dirs["target"], backend="runtime", numerics="exact")[0]  # transformers' fp32, bitwise
    exact.feature_layers = LAYERS
    aux = exact.forward(ids, [exact.acquire_slot()] * len(ids), list(range(len(ids))), hidden=True)[1]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], torch_dtype=torch.float32)
    states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: the input of layer i
    want = torch.cat([states[i][0] for i in LAYERS], -1)
    assert torch.allclose(aux, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("layout", ["midlayer", "layers", "speculators"])
def test_the_heads_logits_are_the_reference_computation(rt, tmp_path, layout):
    model, tok = rt
    path, targets = head_files(tmp_path / layout, model, layout)
    assert is_eagle3(path)
    drafter = registry.build(str(path), registry.Target(model, tok))
    assert isinstance(drafter, Eagle3Drafter) and drafter.target_layers == LAYERS
    assert torch.equal(drafter.vocab_map, targets)
    ids = tok("the cat sat on").input_ids
    model.feature_layers = LAYERS
    try:
        _, aux = model.forward(ids, [model.acquire_slot()] * len(ids), list(range(len(ids))), hidden=True)
    finally:
        model.feature_layers = None
    drafter.observe_target(0, aux[:-1])  # the target has scored every position but the newest token's
    net = drafter.net
    with torch.inference_mode():  # the reference: position j reads the fused target feature at j - 1
        feats = torch.cat([torch.zeros(1, net.cfg["hidden"]), net.fc(aux[:-1])])
        out, _ = net(model.embed.rows(ids)[None], feats[None], 0)
        logits = net.logits(out[0, -1])
    draft = drafter.propose(ids, 1, SamplingParams(), torch.Generator())
    assert draft.tokens == [int(targets[logits.argmax()])]
    assert torch.equal(drafter._head([drafter], [out[0, -1]])[0], logits)


@pytest.fixture(scope="module")
def head_dir(rt, tmp_path_factory):
    return head_files(tmp_path_factory.mktemp("eagle3") / "head", rt[0])[0]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}])
def test_the_output_is_the_targets_with_an_eagle3_head(rt, head_dir, sampling):
    model, tok = rt
    plain = SpecDecoder.from_models(model, tok, draft="none")
    sd = SpecDecoder.from_models(model, tok, draft=str(head_dir), tau=4)
    try:
        for prompt in ["Hello, world", "count: one two three"]:
            want = plain.generate(prompt, max_new_tokens=30, **sampling).token_ids
            out = sd.generate(prompt, max_new_tokens=30, **sampling)
            assert out.token_ids == want
            assert any(r.proposed for r in out.records)  # it drafted
            assert all(set(r.proposed) <= set(sd.engine.drafter.vocab_map.tolist()) for r in out.records)
    finally:
        model.feature_layers = None


def batched_http_is_target_only(model, tok, draft: str) -> None:
    """Four greedy requests at once over HTTP to a server drafting with `draft`: each gets target-only's text, and
    the server drafted."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import LiveServer

    from specdec.server import create_app

    prompts = ["def f(x):", "Once upon", "abcabcabc", "1, 2, 3,"]
    plain = SpecDecoder.from_models(model, tok, draft="none")
    want = [plain.generate(p, max_new_tokens=20, chat=False).text for p in prompts]
    sd = SpecDecoder.from_models(model, tok, draft=draft, tau=3)
    srv = LiveServer(create_app(sd, model_name="tiny"))
    try:
        srv.price_rows_cheap()

        def ask(p):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": p, "max_tokens": 20, "temperature": 0})
            return r.json()["choices"][0]["text"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == want
        assert srv.metrics()[("specdec_draft_tokens_total", ())] > 0
    finally:
        srv.stop()
        model.feature_layers = None


def test_batched_requests_with_an_eagle3_head_get_what_target_only_gives(rt, head_dir):
    batched_http_is_target_only(*rt, str(head_dir))


def test_a_malformed_head_is_one_clear_error(rt, tmp_path):
    model, tok = rt
    target = registry.Target(model, tok)
    bad = [({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, IncompatibleDraft, "target layers"),
           ({"hidden_size": 32}, (IncompatibleDraft, ModelLoadError), "hidden size|size mismatch"),
           ({"num_hidden_layers": 2}, IncompatibleDraft, "of 2 layers")]
    for i, (config, error, why) in enumerate(bad):
        path, _ = head_files(tmp_path / str(i), model, **config)
        with pytest.raises(error, match=why):
            registry.build(str(path), target)
    path, _ = head_files(tmp_path / "missing", model)
    from safetensors.torch import load_file
    w = load_file(path / "model.safetensors")
    del w["midlayer.hidden_norm.weight"]
    save_file(w, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no hidden_norm.weight"):
        registry.build(str(path), target)
    path, _ = head_files(tmp_path / "far", model)
    w = load_file(path / "model.safetensors")
    w["d2t"] = w["d2t"] + VOCAB
    save_file(w, path / "model.safetensors")
    with pytest.raises(IncompatibleDraft, match="outside the target"):
        registry.build(str(path), target)
    model.feature_layers = None
