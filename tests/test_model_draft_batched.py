"""A model draft proposes for several requests in one pass a step (ModelDrafter.propose_many): each chain is bitwise
its fork's own (greedy tokens, sampled q), whatever the other requests, their contexts and their k."""
import pytest
import torch

from specdec import models
from specdec.drafters.base import propose_many
from specdec.drafters.model import ModelDrafter
from specdec.runtime.blocks import BLOCK
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def draft_model(tiny_dirs):
    return models.load(tiny_dirs["draft"], backend="runtime")[0]


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("cached", [True, False])
def test_batched_chains_are_each_forks_own(draft_model, cached, monkeypatch):
    draft_model.pool.clear_hashes()
    template = ModelDrafter(draft_model, draft_model.config.vocab_size)
    if not cached:
        template.draft_cache = None
    shared = ids(0, 2 * BLOCK + 3)
    contexts = [shared + ids(1, 5), ids(2, 9), shared + ids(3, 40), ids(4, 1), shared + ids(5, 5)]
    ks = [4, 2, 0, 5, 3]
    params = [SamplingParams(), SamplingParams(0.8, 0.9, 0, 1), SamplingParams(), SamplingParams(1.0, 1.0, 5, 2),
              SamplingParams()]
    forks = [template.fork() for _ in contexts]
    passes = []
    real = draft_model.forward
    monkeypatch.setattr(draft_model, "forward", lambda tokens, *a, **k: passes.append(len(tokens)) or real(tokens, *a,
                                                                                                             **k))
    got = propose_many(forks, contexts, ks, params, [gen(i) for i in range(len(contexts))])
    assert len(passes) == max(ks) and passes[1:] == [4, 3, 2, 1]  # a pass a step for the requests still drafting
    monkeypatch.undo()
    for round_ in range(2):  # a second round: each fork continues from its own slot (the accepted part kept)
        for i, (context, k, p) in enumerate(zip(contexts, ks, params)):
            alone = ModelDrafter(draft_model, draft_model.config.vocab_size)
            alone.draft_cache = None
            want = alone.propose(context, k, p, gen(i + 10 * round_))
            assert got[i].tokens == want.tokens, (round_, i)
            assert (got[i].q is None) == (want.q is None) and (want.q is None or torch.equal(got[i].q, want.q))
            alone.close()
        assert not got[2].tokens  # k = 0: nothing run
        contexts = [c + d.tokens[:2] + [7] for c, d in zip(contexts, got)]
        got = propose_many(forks, contexts, ks, params, [gen(i + 10) for i in range(len(contexts))])
    assert got[0].prefill_ms == 0.0  # a step after the first: no catch-up
    for f in forks:
        f.close()
