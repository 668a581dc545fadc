"""Continuous batching: every running request shares each target pass (the runtime's KV slots, runtime/model.py).

One `step()` is one cycle for every request in it:
1. rows the pass carries anyway: each decoding request's newest token, then prompt chunks of joining requests
   (at most `prefill_chunk` rows each, so a long prompt never stalls the others);
2. the verification budget (scheduler.py) splits the rows left under `max_batch_rows` into draft rows τ_i;
3. each request's own drafter proposes up to τ_i tokens, all requests' drafts in one batched call (the feature
   draft runs its layer once per step for all of them). A model-free drafter (n-gram, datastore) proposes before
   step 2 instead, as far as the request may draft: its proposal costs next to nothing, so the scheduler sees what
   there is to verify and acceptance is estimated over the cycles that had a proposal. So does a model draft that
   grows valued trees (the feature draft) for greedy requests while at most EARLY_MODEL_BATCH decode: the
   scheduler then sizes each tree on the draft's own node values;
4. ONE target pass over all rows, each at its own position in its own slot;
5. each request verifies its block with its own rule and randomness, emits, and rolls its slot back.

A drafter that proposes token trees (recycle) gets them verified here too: a tree's nodes, best first, are rows
like a chain's, and the scheduler sees them as draft positions whose chance of acceptance is each node's value
(drafters/tree.py), so a tree is cut to what the budget pays for. The accepted path is compacted in the slot.

Prefix caching (as vLLM's and SGLang's): the K/V of recent prompts are kept in slots of their own, and a joining
request copies the longest cached prefix of its prompt (a chat template's system prompt, an earlier turn) instead of
computing it: bitwise the same keys and values, fewer prefill rows.

The runtime computes every row on its own, so a request's logits, and hence its greedy tokens, are bitwise those it
gets alone; seeded sampling draws from per-position noise (sampling.PositionNoise), so its tokens do not depend
on τ or on the other requests either. Requests join and leave at cycle boundaries.

The package, in the order a request meets it: requests.py (a request and its state), runtime/prefix_cache.py (prompts'
K/V shared by block), admission.py (membership, memory and predicted work), engine.py (the cycle), calibration.py (the
measured pass curve and row cost the scheduler and admission start from).
"""
from .admission import Admission
from .calibration import (
           default_budget,
           lower_envelope,
           measure_pass_curve,
           measure_row_cost,
)
from .engine import EARLY_MODEL_BATCH, PROBE_EVERY, BatchEngine
from ..runtime.prefix_cache import PrefixCache
from .requests import Sequence

__all__ = ["EARLY_MODEL_BATCH", "PROBE_EVERY", "Admission", "BatchEngine", "PrefixCache", "Sequence", "default_budget", "lower_envelope",
           "measure_pass_curve", "measure_row_cost"]
