"""The speculative cycle: draft -> verify in one target pass -> accept -> emit -> roll back."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from time import perf_counter

from .costs import PassCosts, best_tree_size
from .drafters.base import Draft, Drafter, makes_trees
from .drafters.prediction import PRIOR, PredictionDrafter
from .drafters.tree import best_chain, chain_parents, prune
from .kv import cached_model
from .policy import FixedPolicy
from .sampling import PositionNoise, SamplingParams, token_logprobs
from .trace import CycleRecord, shortfall
from .verification import choice_rows, committed_rows, verify_block, verify_constrained, verify_tree

# A curve timed in a busy moment can price every draft row above its worth, and then only one-row passes run, so
# the multi-row price is never taken again: speculation off for good. One cycle in PROBE_EVERY whose tree was cut to
# nothing verifies its best node anyway, at most (T(2) - T(1)) / T(1) / PROBE_EVERY of the time (~2%: 0.35 / 16).
PROBE_EVERY = 16

StopCheck = Callable[[list[int]], "int | None"]  # generated ids -> how many to keep, if a stop string completed


class Engine:
    def __init__(self, target_model, drafter: Drafter, vocab_size: int, eos_ids: set[int], context_window: int):
        self.target = cached_model(target_model, vocab_size)
        self.drafter, self.eos_ids, self.context_window = drafter, set(eos_ids), context_window
        self.wants_hidden = getattr(drafter, "wants_target_hidden", False)
        self.trees = hasattr(self.target, "forward_tree")  # token trees need the runtime's tree passes
        self.costs = PassCosts()  # the verify curve trees are sized by, measured here
        self.unpriced = 0  # cycles in a row whose tree the curve cut to nothing (see PROBE_EVERY)

    def run(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, policy,
            stop: StopCheck | None = None, constraint=None, logprobs: int | None = None,
            prompt_logprobs: int | None = None, prediction: list[int] | None = None,
            prediction_prior: float = PRIOR) -> Iterator[CycleRecord]:
        """Yields one record per cycle; the last one carries finish_reason. `policy` picks τ each cycle
        (an int means a fixed τ). `constraint` (constraints.Constraint): a grammar the output follows. `logprobs`
        (0..20): each record carries the emitted tokens' logprobs and that many alternatives (sampling.token_logprobs).
        `prompt_logprobs`: the first record also carries the prompt's (tokens 2.., unwarped), from the prefill pass;
        max_new_tokens may then be 0 (scoring only). `prediction`: the tokens the client expects most of the output to
        be (drafters/prediction.py): drafted first, as deep as the pass curve pays for; the drafter when it has
        nothing to offer; `prediction_prior` its acceptance assumed before any verification."""
        policy = FixedPolicy(policy) if isinstance(policy, int) else policy
        policy.start()
        self.target.reset()
        self.drafter.reset()
        gen = params.generator()
        predicted = PredictionDrafter(prediction, len(prompt), prediction_prior) \
            if prediction and constraint is None else None
        if not params.greedy and not isinstance(gen, PositionNoise) and (
                constraint is not None or self.trees and makes_trees(self.drafter)):
            gen = PositionNoise.fresh()  # trees and grammars verify by the race rule; unseeded requests draw a seed
        seq, n_prompt = list(prompt), len(prompt)
        scored = None
        if prompt_logprobs is not None:  # the prefill with every row's logits; the loop then finds it cached
            rows = self.target.forward(seq, len(seq))
            scored = token_logprobs(rows[:-1], seq[1:], SamplingParams(), prompt_logprobs)
            self.target.rollback(len(seq) - 1)
            if max_new_tokens == 0:
                yield CycleRecord(0, 0, [], 0, [], 0.0, 0.0, 0.0, finish_reason="length", prompt_logprobs=scored)
                return
        for cycle in range(max_new_tokens):  # >= 1 token per cycle
            t0 = perf_counter()
            tau = policy.next_tau() if self.drafter.name != "none" else 0  # target-only: nothing to ask for
            room = min(max_new_tokens - (len(seq) - n_prompt), self.context_window - len(seq))
            k = max(0, min(tau, room - 1))  # never draft more than can be emitted
            forced, by, source, prefill_ms = 0, None, None, 0.0
            if constraint is not None:  # what the grammar forces, then the drafter's guess after it: one chain
                # within τ: a pass's rows cost the same whoever drafted them (`none` drafts nothing: target-only)
                free = constraint.forced(k) if self.drafter.name != "none" else []
                rest = k - len(free)
                more = self.drafter.propose(seq + free, rest, params, gen) if rest > 0 else None
                prefill_ms = more.prefill_ms if more is not None else 0.0
                source = (more.by or self.drafter.name) if more is not None and more.tokens else None
                tokens = free + (best_chain(more)[:rest] if more is not None else [])
                drafted = len(tokens)
                draft = Draft(tokens[: constraint.valid_prefix(tokens)]) if tokens else None
                forced = min(len(free), len(draft.tokens)) if draft else 0
            else:
                draft = None
                if predicted is not None:  # the prediction first, as deep as the pass curve pays for
                    depth = max(0, min(predicted.depth(self.costs), room - 1))
                    draft = predicted.propose(seq, depth, params, gen) if depth else None
                    if draft is not None and draft.tokens:
                        tau = k = depth
                        by = "prediction"
                    else:
                        draft = None
                if draft is None and k and getattr(self.drafter, "sizes_own_depth", False):
                    tau = k = max(1, min(self.drafter.depth(self.costs), room - 1))  # as deep as the curve pays for
                if draft is None:
                    draft = self.drafter.propose(seq, k, params, gen) if k else None
                    source = (draft.by or self.drafter.name) if draft is not None and draft.tokens else None
                drafted = len(draft.tokens) if draft is not None else 0
                prefill_ms = draft.prefill_ms if draft is not None else 0.0
                draft = self._shape(draft, k, self.context_window - len(seq) - 1)
            proposed = draft.tokens if draft else []
            t1 = perf_counter()

            masked = [] if constraint is not None and logprobs is not None else None
            if constraint is not None:
                logits = self.target.forward(seq + proposed, len(proposed) + 1)
                n, token = verify_constrained(proposed, logits, params, gen, len(seq), constraint, masked)
                nodes, accepted = list(range(n)), proposed[:n]
            elif draft is not None and draft.is_tree:
                out = self.target.forward_tree(seq, proposed, draft.parents, hidden=self.wants_hidden)
                logits = out[0] if self.wants_hidden else out
                nodes, token = verify_tree(proposed, draft.parents, logits, params, gen, len(seq))
                self.target.keep_path(nodes)
                if self.wants_hidden:  # features of the rows the slot lacked, then of the accepted path's nodes
                    start = self.target.last_start
                    self.drafter.observe_target(start, out[1][committed_rows(len(seq) - start, nodes)])
                n, accepted = len(nodes), [proposed[i] for i in nodes]
            else:
                if self.wants_hidden:
                    logits, hidden = self.target.forward(seq + proposed, len(proposed) + 1, hidden=True)
                    start = self.target.last_start
                else:
                    logits = self.target.forward(seq + proposed, len(proposed) + 1)
                n, token = verify_block(proposed, draft.q if draft is not None else None, logits, params, gen,
                                        len(seq))
                nodes, accepted = list(range(n)), proposed[:n]
                if self.wants_hidden:  # target features of the committed positions (all but the newest token)
                    self.drafter.observe_target(start, hidden[: len(seq) + n - start])
            t2 = perf_counter()  # stop strings and detokenizing are not the target's cost (the policy reads verify_ms)
            if hasattr(self.drafter, "observe_verify"):  # e.g. recycle: the target's top-k after every row
                self.drafter.observe_verify(seq, draft, logits, nodes)
            if by == "prediction":
                predicted.observe_verify(seq, draft, logits, nodes)
            emitted, finish = cut(accepted + [token], seq, n_prompt, stop, max_new_tokens, self.eos_ids,
                                  self.context_window)
            seq.extend(emitted)
            self.target.rollback(len(seq) - 1)  # keep the committed prefix; the newest token is fed next cycle

            record = CycleRecord(cycle, tau, proposed, n, emitted, draft_ms=round((t1 - t0) * 1e3, 3),
                                 verify_ms=round((t2 - t1) * 1e3, 3), cycle_ms=round((perf_counter() - t0) * 1e3, 3),
                                 finish_reason=finish, parents=draft.parents if draft is not None else None,
                                 path=nodes if draft is not None and draft.is_tree else None, forced=forced,
                                 asked=k, drafted=drafted, by=by or (source if proposed else None),
                                 draft_prefill_ms=round(prefill_ms, 3),
                                 short=shortfall(tau, k, drafted, len(proposed),
                                                 later_cut="grammar" if constraint is not None else "budget"))
            if cycle == 0:
                record.prompt_logprobs = scored
            if logprobs is not None:
                tree = draft is not None and draft.is_tree and constraint is None
                record.logprobs = token_logprobs(choice_rows(logits, nodes, tree, masked), emitted, params, logprobs)
            if cycle:  # cycle 0 carries the prompt's prefill
                self.costs.observe(len(proposed) + 1, record.verify_ms)
            if by is None:  # the policy estimates its drafter, not the prediction
                policy.observe(record)
            yield record
            if finish:
                return


    def _shape(self, draft: Draft | None, depth: int, max_nodes: int) -> Draft | None:
        """A chain cut to `depth`; a tree sized by the cost model (costs.best_tree_size on this engine's measured
        verify curve), or, where trees cannot be verified, its best branch as a chain."""
        if draft is None or not draft.is_tree:
            return Draft(draft.tokens[:depth], draft.q) if draft is not None and len(draft.tokens) > depth else draft
        if not self.trees:
            chain = best_chain(draft)[:depth]
            return Draft(chain) if chain else None
        n = best_tree_size(draft.values or [1.0] * len(draft.tokens), self.costs)
        self.unpriced = self.unpriced + 1 if n == 0 else 0
        if self.unpriced >= PROBE_EVERY:  # the curve is only measured on passes that run: price a row afresh
            n, self.unpriced = 1, 0
        tree = prune(draft, min(n, max_nodes))
        if tree.parents == chain_parents(len(tree.tokens)):
            return Draft(tree.tokens)  # a one-branch tree is a chain: the plain pass
        return tree if tree.tokens else None


def cut(emitted, seq, n_prompt, stop, max_new_tokens, eos_ids, context_window):
    """Truncate a cycle's tokens at a stop string, EOS, the token budget or the context window -> (tokens kept,
    finish reason or None). A stop string completed before an EOS in the same cycle wins, so token_ids and usage
    end where the text does."""
    eos_at = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
    body = emitted if eos_at is None else emitted[:eos_at]  # an EOS adds no text
    if stop is not None:
        keep = stop(seq[n_prompt:] + body)
        if keep is not None:
            return body[: max(0, keep - (len(seq) - n_prompt))], "stop"
    if eos_at is not None:
        return emitted[: eos_at + 1], "stop"
    room = min(max_new_tokens - (len(seq) - n_prompt), context_window - len(seq))
    if len(emitted) >= room:
        return emitted[:room], "length"
    return emitted, None
