"""One bad request never hurts the others: the batching server under bad input and planted failures (over real
HTTP), bounds at the edge, the loader's shape checks, the kernels' argument checks and the torch fallback's
row-invariance. Each test names the failure it guards against."""
import asyncio
import copy
import json
import os
import stat

import gguf
import httpx
import numpy as np
import pytest
import torch

from specdec import SpecDecoder, kernels, models
from specdec.drafters import NgramDrafter
from specdec.errors import InvalidRequest, PromptTooLong
from specdec.runtime.load import load_hf_dir
from specdec.runtime.weights import QTensor, Unsupported
from specdec.sampling import SamplingParams, warp
from specdec.server import create_app
from test_server import LiveServer, queue_depth, wait_for
from test_serving import stream

GOOD = [dict(prompt=p, max_tokens=24, temperature=0) for p in
        ["Hello there", "The cat sat", "abcabcabc", "Once upon", "qqq", "xyz xyz", "Well, well", "zebra"]]
STRICT_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles must "
                   "alternate user/assistant/user/assistant/...') }}{% endif %}"
                   "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")


class Exploding(NgramDrafter):
    """Raises for contexts holding the marker text's tokens (a bug one request's content reaches)."""
    name = "exploding"

    def __init__(self, marker: list[int]):
        super().__init__()
        self.marker = marker

    def propose(self, context, k, params, generator):
        n = len(self.marker)
        if any(context[i:i + n] == self.marker for i in range(len(context) - n + 1)):
            raise RuntimeError("drafter bug reached by this request")
        return super().propose(context, k, params, generator)


@pytest.fixture(scope="module")
def rt_parts(tiny_dirs):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    tok = copy.deepcopy(tok)
    tok.chat_template = STRICT_TEMPLATE
    return model, tok


@pytest.fixture(scope="module")
def chaos_server(rt_parts):
    model, tok = rt_parts
    marker = tok("BOOM", add_special_tokens=False).input_ids
    sd = SpecDecoder.from_models(model, tok, draft=Exploding(marker), tau=3)
    srv = LiveServer(create_app(sd, model_name="tiny", max_queue=64, max_batch_rows=24, prefill_chunk=8))
    yield srv, sd
    srv.stop()


async def post(url, path, body):
    """As JSON with ASCII escapes: a lone surrogate travels as the valid JSON text \\ud800."""
    async with httpx.AsyncClient(timeout=60) as hc:
        return await hc.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_chaos_good_streams_finish_as_alone_while_bad_requests_fail_alone(chaos_server, rt_parts):
    """8 greedy streams in flight while each kind of bad request arrives: a seed past 64 bits (item 1), a temperature
    of 1e-308 (item 2: valid, must not poison the batch), a prompt of a million characters (item 7), a chat template
    that raises (item 8), a lone surrogate, and a request whose own drafting raises. Every good stream equals the
    target alone; each bad one gets a JSON error naming itself; /health stays truthful; the server serves after."""
    srv, sd = chaos_server
    bad = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                     "temperature": 0, "seed": 18446744073709551616}, 400),
           ("/v1/completions", {"prompt": "x" * 1_000_000, "max_tokens": 4}, 400),
           ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 4}, 400),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}, 400),
           ("/v1/completions", {"prompt": "say BOOM now", "max_tokens": 8, "temperature": 0}, 500),
           ("/v1/completions", {"prompt": "tiny temperature", "max_tokens": 6, "temperature": 1e-308}, 200),
           ("/v1/completions", {"prompt": "too hot", "max_tokens": 6, "temperature": 2.5}, 400)]
    health = []

    async def scenario():
        goods = [asyncio.create_task(stream(srv.url, body)) for body in GOOD]
        await asyncio.sleep(0)
        bads = [asyncio.create_task(post(srv.url, path, body)) for path, body, _ in bad]
        async with httpx.AsyncClient(timeout=30) as hc:
            while not all(t.done() for t in goods + bads):
                health.append((await hc.get(srv.url + "/health")).status_code)
                await asyncio.sleep(0.05)
        return [t.result() for t in goods], [t.result() for t in bads]
    texts, answers = asyncio.run(scenario())
    model, tok = rt_parts
    alone = SpecDecoder.from_models(model, tok, draft="none")
    for body, text in zip(GOOD, texts):
        assert text == alone.generate(body["prompt"], max_new_tokens=body["max_tokens"], chat=False).text, body
    for (path, body, status), r in zip(bad, answers):
        assert r.status_code == status, (body.get("prompt", "")[:20], r.text[:200])
        if status != 200:
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in err["message"]
    assert "in this request" in answers[4].json()["error"]["message"]  # a 500 that names itself alone
    tiny = answers[5].json()["choices"][0]["text"]  # the argmax at every step: greedy's text
    assert tiny == alone.generate("tiny temperature", max_new_tokens=6, chat=False).text
    assert set(health) == {200}
    after = httpx.post(srv.url + "/v1/completions", json={"prompt": "after", "max_tokens": 5, "temperature": 0})
    assert after.status_code == 200 and httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_a_crashed_worker_loop_is_restarted_and_health_tells(chaos_server, monkeypatch):
    srv, _ = chaos_server
    worker = srv.app.state.worker
    original, calls = worker._admit, []

    def crash_once():
        if not calls:
            calls.append(1)
            raise SystemError("the loop itself broke")
        return original()
    monkeypatch.setattr(worker, "_admit", crash_once)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_down"
    wait_for(lambda: worker.alive, "the supervisor restarts the loop")
    assert worker.restarts >= 1 and httpx.get(srv.url + "/health").status_code == 200
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200
    wait_for(lambda: queue_depth(srv) == 0, "nothing left in the queue")


def test_health_is_503_when_the_worker_cannot_serve(chaos_server, monkeypatch):
    srv, _ = chaos_server
    monkeypatch.setattr(type(srv.app.state.worker), "alive", property(lambda self: False))
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 503 and h.json()["status"] == "unavailable"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_down"


def test_batch_refuses_a_policy_it_cannot_honour_and_counts_each_pass_once(chaos_server):
    srv, _ = chaos_server
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "policy": "heuristic"})
    assert r.status_code == 400 and "continuous batching" in r.json()["error"]["message"]

    async def four():
        return await asyncio.gather(*(stream(srv.url, body) for body in GOOD[:4]))
    before = srv.metrics()
    asyncio.run(four())
    m = srv.metrics()
    passes = m[("specdec_batch_rows_count", ())] - before[("specdec_batch_rows_count", ())]
    assert m[("specdec_cycles_total", ())] - before[("specdec_cycles_total", ())] == passes
    assert m[("specdec_verify_seconds_count", ())] - before[("specdec_verify_seconds_count", ())] == passes


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", 2.01),
                                         ("temperature", -1), ("top_k", 2**31), ("top_p", 0), ("max_tokens", 2**40)])
def test_bounds_at_the_edge(chaos_server, field, value):
    srv, _ = chaos_server
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_sampling_bounds_and_extreme_seeds():
    for bad in [dict(temperature=2.5), dict(temperature=float("nan")), dict(seed=2**64), dict(top_k=2**31),
                dict(top_p=float("nan"))]:
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)
    for seed in [2**64 - 1, -(2**63), 0]:  # the whole range works, greedy and sampled
        SamplingParams(temperature=0, seed=seed).generator()
        SamplingParams(temperature=1, seed=seed).generator()
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    p = warp(logits, SamplingParams(temperature=1e-308))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=torch.float64))


def test_long_prompt_refused_before_tokenizing(rt_parts, monkeypatch):
    model, tok = rt_parts
    sd = SpecDecoder.from_models(model, tok, draft="none")
    sd.encode("warm")  # measures the longest token
    calls = []
    monkeypatch.setattr(type(sd._encoder), "__call__", lambda *a, **k: calls.append(1))
    with pytest.raises(PromptTooLong, match="characters"):
        sd.encode("x" * (sd.context_window * sd.max_token_chars))
    assert not calls


def test_template_errors_and_bad_text_are_invalid_requests(rt_parts):
    model, tok = rt_parts
    sd = SpecDecoder.from_models(model, tok, draft="none")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        sd.encode([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequest, match="surrogate"):
        sd.encode("\ud800")


# ---- the loader and the kernels ------------------------------------------------------------------------------------
def test_shapes_that_disagree_with_the_config_are_refused(tiny_dirs, tmp_path, capsys):
    """intermediate_size 16 against 128-wide tensors ended in `double free or corruption` (SIGABRT)."""
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dirs["target"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 16
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Unsupported, match=r"layer 0 gate is \(128, 64\), the config says \(16, 64\)"):
        load_hf_dir(bad)
    from specdec.cli import main
    assert main(["generate", "hi", "--target", str(bad), "--backend", "runtime", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config says" in err


@pytest.mark.parametrize("factors", [5, 8])
def test_bad_rope_freqs_and_missing_tensors_are_one_line(tmp_path, factors):
    """rope_freqs.weight is applied (tests/test_architectures.py); one of the wrong length is refused, and a file
    missing a layer's tensors is refused by name, never a KeyError."""
    from specdec.runtime.load import load_gguf
    path = tmp_path / "llama31.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(1), wr.add_embedding_length(64), wr.add_head_count(4), wr.add_feed_forward_length(128)
    wr.add_tensor("rope_freqs.weight", np.ones(factors, dtype=np.float32))
    wr.add_tensor("token_embd.weight", np.zeros((99, 64), dtype=np.float32))
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    with pytest.raises(Unsupported, match="rope_freqs.weight has 5 factors" if factors == 5 else "has no tensor"):
        load_gguf(path)


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernels here")
def test_kernel_linear_checks_its_arguments():
    w = QTensor.from_float(torch.randn(8, 32))
    x = torch.randn(3, 32)
    assert torch.equal(kernels.linear(w.fmt, x, w.data, w.n), kernels.linear(w.fmt, x, w.data, w.n))
    for bad_x in [x.double(), torch.randn(3, 16)]:
        with pytest.raises(ValueError):
            kernels.linear(w.fmt, bad_x, w.data, w.n)
    with pytest.raises(ValueError):
        kernels.linear(w.fmt, x, w.data, 9)  # more rows than the weight holds
    with pytest.raises(ValueError):
        kernels.linear(w.fmt, x, w.data, w.n, torch.zeros(7))


def test_kernel_cache_is_readable_by_other_users(tmp_path, monkeypatch):
    """mkstemp made the cached library 0600: another user's dlopen got Permission denied."""
    def fake_compile(cmd, **kw):
        open(cmd[cmd.index("-o") + 1], "wb").close()
    monkeypatch.setattr(kernels.subprocess, "run", fake_compile)
    lib = kernels._build("g++", "avx2", str(tmp_path))
    assert stat.S_IMODE(os.stat(lib).st_mode) == 0o755


def test_slot_double_release_is_refused(rt_parts):
    model, _ = rt_parts
    s = model.acquire_slot()
    model.release_slot(s)
    with pytest.raises(ValueError, match="not held"):
        model.release_slot(s)
    with pytest.raises(ValueError, match="not held"):
        model.release_slot(10_000)


def test_torch_fallback_is_row_invariant_bitwise(tiny_dirs, monkeypatch):
    """Without the kernels (no AVX2, no compiler, SPECDEC_CPU_KERNEL=0) a 40-row pass equals 40 one-token steps
    bitwise, and a row batched beside another slot's rows equals the same row alone."""
    monkeypatch.setattr(kernels, "library", lambda isa=None: None)
    model = load_hf_dir(__import__("pathlib").Path(tiny_dirs["target"]))
    assert model._lib is None
    ids = torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = model.acquire_slot(), model.acquire_slot()
    whole = model.forward(ids, [a] * 40, list(range(40)))
    steps = torch.cat([model.forward([t], [b], [i]) for i, t in enumerate(ids)])
    assert torch.equal(whole, steps)
    c = model.acquire_slot()
    model.forward(ids[:10], [c] * 10, list(range(10)))
    mixed = model.forward([ids[10], ids[20], ids[21]], [c, a, a], [10, 20, 21])  # slots a and b hold ids already
    assert torch.equal(mixed[0], model.forward([ids[10]], [c], [10])[0])
    assert torch.equal(mixed[1:], whole[20:22])


def test_numerics_is_validated_in_the_api(tiny_dirs):
    from specdec.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="unknown numerics 'int4'"):
        SpecDecoder(target=tiny_dirs["target"], draft="none", numerics="int4")
    with pytest.raises(ModelLoadError, match="runtime only"):
        SpecDecoder(target=tiny_dirs["target"], draft="none", numerics="q8", backend="transformers")
    assert SpecDecoder(target=tiny_dirs["target"], draft="none", numerics="q8").numerics == "q8"


def test_a_pass_that_fails_on_one_requests_rows_fails_that_request_alone(rt_parts, monkeypatch):
    """The target pass raises whenever a poisoned token is among its rows: the engine re-runs the pass request by
    request, the poisoned request leaves with the error, and the others finish exactly as alone (greedy)."""
    from specdec.batch import BatchEngine, Sequence
    model, tok = rt_parts
    alone = SpecDecoder.from_models(model, tok, draft="none")
    prompts = [tok(p).input_ids for p in ("Hello there", "The cat sat", "poison: ~")]
    poison = tok("~", add_special_tokens=False).input_ids[-1]
    engine = BatchEngine(model, NgramDrafter(), model.config.vocab_size, {2}, 128, max_batch_rows=16,
                         prefill_chunk=4, prefix_cache=0)
    original = model.forward

    def forward(tokens, *a, **kw):
        if poison in tokens:
            raise RuntimeError("a kernel fault on this row")
        return original(tokens, *a, **kw)
    monkeypatch.setattr(model, "forward", forward)
    seqs = [engine.add(Sequence(p, 12, SamplingParams())) for p in prompts]
    failed = []
    while engine.running:
        engine.step()
        failed += engine.failed
    assert [(s.id, type(e)) for s, e in failed] == [(seqs[2].id, RuntimeError)]
    monkeypatch.setattr(model, "forward", original)
    for s, p in zip(seqs[:2], ("Hello there", "The cat sat")):
        assert s.generated == alone.generate(p, max_new_tokens=12, chat=False).token_ids


def _bad_gguf(path, **meta):
    """A one-layer llama GGUF whose metadata says `meta` (a key of None: left out)."""
    wr = gguf.GGUFWriter(str(path), "llama")
    fields = dict(block_count=1, embedding_length=64, head_count=4, feed_forward_length=128, context_length=128)
    fields.update(meta)
    for key, value in fields.items():
        if key == "alignment":
            wr.add_uint32("general.alignment", value)
        elif key == "nested":
            wr.add_array("tokenizer.ggml.nested", value)
        elif value is not None:
            wr.add_uint32(f"llama.{'attention.' if key == 'head_count' else ''}{key}", value)
    wr.add_tensor("token_embd.weight", np.zeros((99, 64), dtype=np.float32))
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()
    return path


@pytest.mark.parametrize("meta,message", [(dict(alignment=0), "general.alignment"),
                                          (dict(head_count=0), "head_count"),
                                          (dict(context_length=2**31), "context_length"),
                                          (dict(nested=[[1, 2], [3]]), "nested metadata arrays")])
def test_absurd_gguf_metadata_is_one_line(tmp_path, meta, message):
    """Metadata no model has is refused by name (it was a ZeroDivisionError, a RecursionError, or rotary tables
    for two billion positions allocated at load)."""
    from specdec.runtime.load import load_gguf
    with pytest.raises(Unsupported, match=message):
        load_gguf(_bad_gguf(tmp_path / "bad.gguf", **meta))


def test_tools_nested_past_the_limit_are_a_400(chaos_server):
    srv, _ = chaos_server
    params = '{"type": "object", "properties": {"x": ' * 200 + "{}" + "}}" * 200
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": "function", '
            '"function": {"name": "deep", "parameters": ' + params + "}}]}")
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nest deeper" in r.json()["error"]["message"]


@pytest.mark.skipif(not kernels.available(), reason="no CPU kernels here")
def test_switching_numerics_forgets_cached_prompts(tiny_dirs):
    """K/V cached in one numerics mode are never restored in the other, even where both keep fp32 K/V."""
    model, _ = models.load(tiny_dirs["target"], backend="runtime", numerics="q8")
    model.set_kv_dtype(torch.float32)
    slot = model.acquire_slot()
    model.forward(list(range(3, 40)), [slot] * 37, list(range(37)), [])
    model.pool.register(model.blocks_of(slot)[0], b"k" * 16)
    model.release_slot(slot)
    assert model.pool.by_hash
    model.set_numerics("exact")
    assert not model.pool.by_hash and not model.pool.evictable
