"""The speculative cycle: draft -> verify in one target pass -> accept -> emit -> roll back."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from time import perf_counter

from .drafters.base import Drafter
from .kv import cached_model
from .policy import FixedPolicy
from .sampling import SamplingParams
from .trace import CycleRecord
from .verification import verify_block

StopCheck = Callable[[list[int]], "int | None"]  # generated ids -> how many to keep, if a stop string completed


class Engine:
    def __init__(self, target_model, drafter: Drafter, vocab_size: int, eos_ids: set[int], context_window: int):
        self.target = cached_model(target_model, vocab_size)
        self.drafter, self.eos_ids, self.context_window = drafter, set(eos_ids), context_window
        self.wants_hidden = getattr(drafter, "wants_target_hidden", False)

    def run(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, policy,
            stop: StopCheck | None = None) -> Iterator[CycleRecord]:
        """Yields one record per cycle; the last one carries finish_reason. `policy` picks τ each cycle
        (an int means a fixed τ)."""
        policy = FixedPolicy(policy) if isinstance(policy, int) else policy
        policy.start()
        self.target.reset()
        self.drafter.reset()
        gen = params.generator()
        seq, n_prompt = list(prompt), len(prompt)
        for cycle in range(max_new_tokens):  # >= 1 token per cycle
            t0 = perf_counter()
            tau = policy.next_tau()
            room = min(max_new_tokens - (len(seq) - n_prompt), self.context_window - len(seq))
            k = max(0, min(tau, room - 1))  # never draft more than can be emitted
            draft = self.drafter.propose(seq, k, params, gen) if k else None
            proposed = draft.tokens[:k] if draft else []
            t1 = perf_counter()

            if self.wants_hidden:
                logits, hidden = self.target.forward(seq + proposed, len(proposed) + 1, hidden=True)
                start = self.target.last_start
            else:
                logits = self.target.forward(seq + proposed, len(proposed) + 1)
            n, token = verify_block(proposed, draft.q if draft is not None else None, logits, params, gen, len(seq))
            if self.wants_hidden:  # target features of the committed positions (all but the newest token)
                self.drafter.observe_target(start, hidden[: len(seq) + n - start])
            t2 = perf_counter()  # stop strings and detokenizing are not the target's cost (the policy reads verify_ms)
            emitted, finish = cut(proposed[:n] + [token], seq, n_prompt, stop, max_new_tokens, self.eos_ids,
                                  self.context_window)
            seq.extend(emitted)
            self.target.rollback(len(seq) - 1)  # keep the committed prefix; the newest token is fed next cycle

            record = CycleRecord(cycle, tau, proposed, n, emitted, draft_ms=round((t1 - t0) * 1e3, 3),
                                 verify_ms=round((t2 - t1) * 1e3, 3), cycle_ms=round((perf_counter() - t0) * 1e3, 3),
                                 finish_reason=finish)
            policy.observe(record)
            yield record
            if finish:
                return


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
