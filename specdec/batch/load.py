"""What other threads may know of the batch: a snapshot the engine's owner (the worker thread) publishes after each of
its steps (runtime/owner.py). A request's predicted work, the 429 made before it queues, is computed from it, never
from the engine, its prefix cache or its pool, which only the worker touches."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequest
from ..runtime.blocks import BLOCK, prefix_hashes


def prefill_ms(row_ms: float, key_ms: float, scale: float, start: int, end: int) -> float:
    """Predicted ms of computing positions start..end-1 of one sequence: row_ms a row plus key_ms for each key a
    row's attention reads (sum over p in start..end-1 of p), scaled by what passes measured."""
    n = max(0, end - start)
    return scale * (n * row_ms + key_ms * (start + end - 1) * n / 2)


def check_fits(prompt: list[int], blocks: int) -> None:
    """A prompt the whole KV budget of `blocks` cannot hold (with its first generated token) is refused."""
    need = -(-(len(prompt) + 1) // BLOCK)
    if need > blocks:
        raise InvalidRequest(f"the prompt's {len(prompt)} tokens need {need * BLOCK} KV positions; this server's "
                             f"KV memory holds {blocks * BLOCK}")


Work = tuple[float, float]  # one request's predicted (prefill ms, decode ms)


def finish_ms(ahead: list[Work], own: Work, backlog_ms: float, running: int, slots: int) -> float:
    """Predicted ms until a request finishes, queued behind the requests `ahead`. Prompts are computed one after
    another (a pass's prompt rows are its work): the running requests' prefill left (`backlog_ms`) and every prompt
    ahead delay it whole. Decode passes are shared: the requests ahead delay its decode only where they hold the
    batch's `slots`, and then, on average, by their decode spread over the slots (summed as if each ran alone, 8
    requests arriving together were predicted to finish 8 times later than they did, and were refused)."""
    wait = sum(d for _, d in ahead) / max(1, slots) if running + len(ahead) + 1 > slots else 0.0
    return backlog_ms + sum(p for p, _ in ahead) + own[0] + own[1] + wait


@dataclass(frozen=True)
class Load:
    row_ms: float
    key_ms: float
    scale: float  # measured / predicted pass time
    step_ms: float  # a pass with one more request in it, or the passes lately if longer
    backlog_ms: float  # prefill the running requests still need
    waiting: tuple[Work, ...]  # the predicted work of the requests waiting to join
    running: int  # requests in the batch
    slots: int  # requests the batch can hold (one row each)
    blocks: int  # the KV pool's size
    cached: frozenset  # the prefix hashes a request can find (runtime/prefix_cache.py), every tenant's

    def work(self, start: int, end: int, max_new_tokens: int) -> Work:
        """Predicted ms one request adds: its prefill, then one pass per token."""
        return prefill_ms(self.row_ms, self.key_ms, self.scale, start, end), max_new_tokens * self.step_ms

    def uncached(self, prompt: list[int], salt: bytes = b"") -> int:
        """Where the prefill of `prompt` would start: after the blocks cached for it (its tenant's: the salt is in
        the hash chain)."""
        n = 0
        for digest in prefix_hashes(prompt, len(prompt) // BLOCK, salt):
            if digest not in self.cached:
                break
            n += 1
        return min(n * BLOCK, max(0, len(prompt) - 1))

    def check_fits(self, prompt: list[int]) -> None:
        check_fits(prompt, self.blocks)
