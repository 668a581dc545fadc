"""A draft model's trimmed head (`--draft FILE:vocab=N`, drafters/vocab.py): the kept ids, their logits bitwise the
whole head's (q8, the production path), drafts only among them, and the output still the target's own, greedy and
seeded; bad specs are one clear error."""
from collections import Counter

import pytest
import torch

from specdec import models
from specdec.api import SpecDecoder
from specdec.drafters import registry
from specdec.drafters.vocab import count_tokens, kept_ids, split_trim
from specdec.errors import InvalidRequest
from specdec.runtime.slot_cache import fit_vocab


def test_the_kept_ids_are_the_most_frequent_with_the_end_of_turn_ids_always():
    counts = Counter({5: 9, 40: 9, 7: 3, 90: 1})
    # 99 always; then by count (5 and 40, 7, 90); then the uncounted by id
    assert kept_ids(100, 16, {99}, counts).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 90, 99]
    assert kept_ids(100, 17, set(), None).tolist() == list(range(32))  # whole 16-row groups; the lowest ids
    assert kept_ids(20, 64, {3}, None).tolist() == list(range(20))  # never more than the vocabulary
    assert count_tokens([[1, 2, 2], [2]]) == Counter({2: 3, 1: 1})


def test_a_trim_spec_parses_and_a_bad_one_says_why():
    assert split_trim("a/b.gguf:vocab=32768") == ("a/b.gguf", 32768)
    assert split_trim("keep:a.gguf:vocab=16") == ("keep:a.gguf", 16)
    assert split_trim("a.gguf") is None
    for bad in ("a.gguf:vocab=", "a.gguf:vocab=8", "a.gguf:vocab=lots"):
        with pytest.raises(ValueError, match="vocab=N needs a whole number"):
            split_trim(bad)


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory):
    """The default model (Q4_1 GGUF, q8) as a draft file of its own: it drafts for itself, so every proposal whose
    token the trimmed head keeps is the target's."""
    path = tmp_path_factory.mktemp("trim") / "draft.gguf"
    path.symlink_to(models.default_model_path())
    return path


@pytest.fixture(scope="module")
def plain():
    return SpecDecoder(draft="none")


def test_a_trimmed_heads_logits_are_the_whole_heads_bitwise(plain, draft_file):
    sd = SpecDecoder.from_models(plain.model, plain.tokenizer, draft=f"keep:{draft_file}:vocab=4096")
    trimmed = sd.engine.drafter.lm.model
    ids = trimmed.head_ids
    assert len(ids) == 4096 and trimmed.head.n == 4096 and trimmed.q8
    whole, _ = models.load(str(draft_file), backend="runtime")
    tokens = plain.tokenizer("def quicksort(xs):").input_ids
    got, full = (m.forward(tokens, [m.acquire_slot()] * len(tokens), list(range(len(tokens)))) for m in (trimmed, whole))
    assert torch.equal(got, full[:, ids])
    fitted = fit_vocab(got, full.shape[-1], ids)
    assert torch.equal(fitted[:, ids], got) and torch.isinf(fitted).sum() == got.shape[0] * (full.shape[-1] - 4096)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
def test_the_output_is_the_targets_and_drafts_stay_in_the_kept_ids(plain, draft_file, sampling, capsys):
    prompt = "Write a haiku about the sea."
    want = plain.generate(prompt, max_new_tokens=32, **sampling).token_ids
    sd = SpecDecoder.from_models(plain.model, plain.tokenizer, draft=f"keep:{draft_file}:vocab=2048", tau=3)
    assert "draft head trimmed to 2,048 of 49,152 token ids (the lowest ids" in capsys.readouterr().err
    out = sd.generate(prompt, max_new_tokens=32, **sampling)
    assert out.token_ids == want
    kept = set(sd.engine.drafter.lm.model.head_ids.tolist())
    proposed = [t for r in out.records for t in r.proposed]
    assert proposed and set(proposed) <= kept
    assert sum(r.accepted for r in out.records) > 0
    if not sampling:  # drafting for itself, greedy: a draft is rejected only where the target's token is not kept
        emitted = [t for r in out.records for t in r.emitted]
        assert all(r.accepted == len(r.proposed) or emitted[sum(len(x.emitted) for x in out.records[:k])
                                                             + r.accepted] not in kept
                   for k, r in enumerate(out.records))


def test_a_trim_needs_a_draft_model_file_on_the_runtime(plain, draft_file):
    target = registry.Target(plain.model, plain.tokenizer)
    for spec, why in [("ngram:vocab=32", "trims a draft model file's head"),
                      ("target:vocab=32", "trims a draft model file's head"),
                      (f"{draft_file}:vocab=12", "at least 16")]:
        with pytest.raises(InvalidRequest, match=why):
            registry.build(spec, target)


def test_batched_requests_with_a_trimmed_draft_get_what_target_only_gives(plain, draft_file):
    """The server's batch engine drafts every request's chain in one pass of the trimmed draft (forward_slots)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import LiveServer

    from specdec.server import create_app

    prompts = ["def fib(n):", "The capital of France is", "Once upon a time", "import numpy as np\n"]
    want = [plain.generate(p, max_new_tokens=24, chat=False).text for p in prompts]
    sd = SpecDecoder.from_models(plain.model, plain.tokenizer, draft=f"keep:{draft_file}:vocab=4096", tau=3)
    srv = LiveServer(create_app(sd, model_name="tiny"))
    try:
        srv.price_rows_cheap()

        def ask(p):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                           timeout=120)
            return r.json()["choices"][0]["text"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == want
        drafted = srv.metrics()[("specdec_draft_tokens_by_draft_total", (("draft", "draft"),))]
        assert drafted > 0
    finally:
        srv.stop()
