"""The peer reference for feature drafts: transformers' own assisted-generation loop (`generate`, its verification
and cache cropping) driven by our feature draft. transformers hands a candidate generator the target's outputs
when it sets `requires_model_outputs` (as its MTP and DFlash generators do), so the same draft runs in both loops
and a bench compares the loops, not the drafts. Greedy only (the bench is greedy)."""
from __future__ import annotations

from functools import lru_cache

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .errors import SpecDecError
from .sampling import SamplingParams

SUPPORTED = hasattr(CandidateGenerator, "requires_model_outputs")  # transformers 5: generators see the outputs


class FeatureCandidates(CandidateGenerator):
    requires_model_outputs = True
    model_kwargs_overrides = {"output_hidden_states": True}

    def __init__(self, drafter, tau: int, max_length: int, final_norm):
        self.drafter, self.tau, self.max_length, self.norm = drafter, tau, max_length, final_norm
        self.drafter.reset()

    @property
    def num_drafting_tokens(self) -> int:  # transformers >= 5.2x sizes its cache's past recording by this
        return self.tau

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if is_first_iteration:  # the target runs the prompt first; its features arrive with the next call
            return input_ids, None
        L = input_ids.shape[1]
        # the last pass fed [start, L - 1 + n_rejected); its first L - 1 - start positions are now committed
        fed = model_outputs.hidden_states[-1][0]
        start = 0 if len(self.drafter.feats) == 0 else L - 2 - n_last_matches
        hidden = self.norm(fed[: L - 1 - start]) if self.norm is not None else fed[: L - 1 - start]
        self.drafter.observe_target(start, hidden)
        k = min(self.tau, self.max_length - L - 1)
        if k < 1:
            return input_ids, None
        draft = self.drafter.propose(input_ids[0].tolist(), k, SamplingParams(), None)
        if not draft.tokens:
            return input_ids, None
        return torch.cat([input_ids, torch.tensor([draft.tokens], device=input_ids.device)], 1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


@lru_cache(maxsize=8)
def last_hidden_is_normed(model) -> bool:
    """Whether `output_hidden_states`' last entry is already the final-normed state (our features) or needs it."""
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        out = model(x, output_hidden_states=True)
        final = model.get_decoder()(x).last_hidden_state
    return torch.allclose(out.hidden_states[-1], final, atol=1e-5)


@torch.inference_mode()
def generate(model, ids: list[int], drafter, tau: int, max_new_tokens: int, pad: int) -> list[int]:
    """transformers `generate` (greedy, assisted) with `drafter` proposing `tau` tokens per step."""
    if not SUPPORTED:
        raise SpecDecError("this transformers version cannot hand the target's hidden states to a candidate "
                           "generator; upgrade transformers to compare feature drafts in its loop")
    x = torch.tensor([ids])
    norm = None if last_hidden_is_normed(model) else model.get_decoder().norm
    gen = FeatureCandidates(drafter, tau, len(ids) + max_new_tokens, norm)
    model._get_candidate_generator = lambda *a, **kw: gen  # instance attribute: shadows the method for this call
    try:  # prompt_lookup_num_tokens selects the assisted-generation loop; our generator replaces prompt lookup
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, prompt_lookup_num_tokens=tau)
    finally:
        del model._get_candidate_generator
    return out[0, len(ids):].tolist()
