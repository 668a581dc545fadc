"""Isolation as a rule (drafters/tenants.py): every drafter the registry builds serves tenant A, then tenant B probes
it with a prompt made of A's prompt and the start of A's answer. B's drafts (tokens, tree shapes) and the prompt
positions it found cached must be exactly those of a server that never saw A. A store that is not kept per tenant
(an output store, a successor table, a chain's acceptance, the prefix cache) makes B's run differ, and fails here."""
from __future__ import annotations

import pytest

from specdec import SpecDecoder, models
from specdec.api import build_drafter
from specdec.batch import BatchEngine, Sequence
from specdec.drafters.datastore import DatastoreDrafter
from specdec.drafters.registry import BUILDERS
from specdec.sampling import SamplingParams

# registry names built here by another name's spec: the same drafter class, the same stores
SAME_CLASS = {"distilled": "shipped", "keep": "draft model", "none": "none"}
A, B = b"tenant-a", b"tenant-b"


class FrozenCurve:
    """The pass curve, not refined by measured times: drafts sized by it are the same run to run."""

    def __call__(self, rows: int) -> float:
        return 10.0 + 0.5 * rows

    def values(self) -> dict[int, float]:  # (what the engine reads once a step: interpolated, the same line)
        return {1: self(1), 64: self(64)}

    def observe(self, rows: int, ms: float) -> None:
        pass

    def refined(self) -> dict:
        return {1: 10.5}


def serve(engine: BatchEngine, prompt: list[int], salt: bytes, n: int = 24) -> tuple[list, list]:
    """One greedy request of fixed τ -> (its tokens, what each cycle drafted and found cached)."""
    seq = engine.add(Sequence(prompt, n, SamplingParams(), max_tau=3, fixed_tau=True, cache_salt=salt))
    seen = []
    while engine.running:
        for s, rec in engine.step():
            seen.append((rec.proposed, rec.parents, rec.cached_tokens))
        assert not engine.failed
    return seq.generated, seen


def engine_for(model, template) -> BatchEngine:
    engine = BatchEngine(model, template, model.config.vocab_size, set(), 512, max_batch_rows=32, prefill_chunk=64,
                         pass_curve={1: 10.5, 64: 42.0})
    engine._pass = FrozenCurve()
    return engine


def probe(model, template_of, prompt: list[int], first: bytes | None, salt: bytes = B) -> list:
    """The probe's run (tenant `salt`) on a fresh drafter and engine, after tenant `first`'s request or alone. Its
    prompt is that request's prompt and the first 12 tokens of its answer (the target's greedy answer: the same
    whatever drafts it)."""
    answer, _ = serve(engine_for(model, build_drafter("none", model, None)), prompt, A)
    engine = engine_for(model, template_of())
    try:
        if first is not None:
            serve(engine, prompt, first)
        _, seen = serve(engine, prompt + answer[:12], salt)
    finally:
        engine.close()
    return seen


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tmp_path_factory):
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    root = tmp_path_factory.mktemp("isolation")
    store = root / "datastore"
    store.mkdir()
    DatastoreDrafter.save([tok("The quick brown fox jumps over the lazy dog. " * 3).input_ids], store)
    return model, tok, tiny_dirs, root, store


SPECS = ["ngram", "suffix", "recycle", "datastore", "target", "draft model", "ngram+recycle", "suffix+target"]
STORES = {"suffix", "recycle", "ngram+recycle", "suffix+target"}  # what these learn from a request shapes drafts


@pytest.mark.parametrize("name", SPECS)
def test_a_tenant_drafts_as_if_no_other_tenant_had_run(tiny, name):
    model, tok, dirs, root, store = tiny
    spec = {"recycle": f"recycle:{root / 'recycle.safetensors'}", "datastore": f"datastore:{store}",
            "draft model": dirs["draft"], "ngram+recycle": f"ngram+recycle:{root / 'chain.safetensors'}"}.get(name, name)

    def template():
        return build_drafter(spec, model, tok)
    prompt = tok("Tell me about the quick brown fox and the lazy dog, and then about cats.").input_ids
    alone = probe(model, template, prompt, None)
    assert probe(model, template, prompt, A) == alone
    # the probe can tell: the same tenant finds the first request's prompt cached, and what its stores learned
    same = probe(model, template, prompt, A, salt=A)
    assert [c for _, _, c in same] != [c for _, _, c in alone]
    if name in STORES:
        assert [(p, t) for p, t, _ in same] != [(p, t) for p, t, _ in alone]


def test_the_default_models_feature_draft_too():
    """The shipped feature draft (on the default model, the one it was trained for)."""
    sd = SpecDecoder(draft="shipped")
    prompt = sd.tokenizer("Write a short poem about the sea and the sky, the gulls above the harbour, the boats that "
                          "come home at dusk, and the light on the water.").input_ids

    def template():
        return build_drafter("shipped", sd.model, sd.tokenizer)
    alone = probe(sd.model, template, prompt, None)
    assert probe(sd.model, template, prompt, A) == alone and any(p for p, _, _ in alone)
    assert probe(sd.model, template, prompt, A, salt=A) != alone


def test_every_registered_drafter_is_probed():
    """A drafter registered later must be added to SPECS (or name the class it shares), or this fails."""
    probed = {s.split(":")[0] for spec in SPECS for s in spec.split("+")} | {"draft model", "shipped"}
    assert set(BUILDERS) - probed - set(SAME_CLASS) == set()


def test_two_keys_on_suffix_decoding_over_http(tiny):
    """The issue's probe, over real HTTP with two API keys on `--draft suffix`: key B's `specdec.proposed` is the
    same whether or not key A's answer exists (before: 0, then 7 once A's answer was stored); key A's own follow-up
    does draw on it."""
    import httpx

    from specdec.server import create_app
    from test_server import LiveServer
    model, tok, *_ = tiny
    alone_sd = SpecDecoder.from_models(model, tok, draft="none")
    prompt = "Tell me about the quick brown fox and the lazy dog, and then about cats."
    answer = alone_sd.generate(prompt, max_new_tokens=24, chat=False).text
    probe_prompt = prompt + answer[:12]

    def proposed(url, key, text):
        r = httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                       json={"prompt": text, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["specdec"]["proposed"]

    def server():
        sd = SpecDecoder.from_models(model, tok, draft="suffix", tau=3)
        return LiveServer(create_app(sd, model_name="tiny", api_key=["key-a", "key-b"]))
    fresh = server()
    try:
        before = proposed(fresh.url, "key-b", probe_prompt)
    finally:
        fresh.stop()
    srv = server()
    try:
        proposed(srv.url, "key-a", prompt)  # A's answer, stored in A's output store only
        after = proposed(srv.url, "key-b", probe_prompt)
        own = proposed(srv.url, "key-a", probe_prompt)
    finally:
        srv.stop()
    assert after == before and own > before
