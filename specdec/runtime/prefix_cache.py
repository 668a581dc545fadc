"""Prompts' K/V shared by block, within one tenant (vLLM's prefix caching with its cache_salt)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from .blocks import BLOCK, prefix_hashes
from .model import Llama
from .owner import Owner

MEMO = 256  # prompts whose block hashes are kept: admission, the 429 prediction, restore and store hash each once


class PrefixCache:
    """Prompts' K/V shared by block (runtime/blocks.py, as vLLM's prefix caching): once a prompt is in its slot, its
    full blocks are named by their prefix hashes; a joining request whose prompt starts with named blocks holds them
    instead of computing them (bitwise the same keys and values). Blocks nobody holds stay named until the pool needs
    them, least recently used first: the cache lives within the KV budget.

    With `features` (a drafter that reads the target's final hidden states, drafters/feature.py) each named block
    also keeps its positions' hidden states, and a block is found only with them: a request that shares the K/V
    hands its drafter the features its prefill would have computed (bitwise: the runtime is row-invariant). They
    live beside the block's name (BlockPool.kept) and go with it; in fp32 beside q8's fp16 K/V they add
    hidden/(layers·kv_width) of its bytes (6 KB a position beside 28 KB on Qwen2.5-1.5B)."""

    def __init__(self, model: Llama, features: bool = False, max_blocks: int | None = None):
        """`max_blocks`: the most cached blocks nobody holds that its owner keeps (BlockPool.forget_cached; None:
        the pool's whole budget, as the target's)."""
        self.model, self.max_blocks = model, max_blocks
        self.features = features  # named blocks keep their positions' hidden states (pool.kept: digest -> tensor)
        self.hits = self.reused = 0  # requests served from the cache, positions shared instead of computed
        self.queried = 0  # positions looked up (all of a prompt but its last token)
        self._hashes: OrderedDict = OrderedDict()  # (salt, full blocks' tokens) -> their chain hashes
        self.owner = Owner("the prefix cache")  # its LRU memo and the pool change on every lookup

    def hashes(self, tokens: list[int], salt: bytes = b"") -> list[bytes]:
        """The prefix hashes of `tokens`' full blocks for this tenant, computed once per prompt (recently used)."""
        self.owner.check()
        key = (salt, tuple(tokens[: len(tokens) // BLOCK * BLOCK]))
        found = self._hashes.get(key)
        if found is None:
            found = self._hashes[key] = prefix_hashes(tokens, len(tokens) // BLOCK, salt)
            if len(self._hashes) > MEMO:
                self._hashes.popitem(last=False)
        else:
            self._hashes.move_to_end(key)
        return found

    def lookup(self, tokens: list[int], salt: bytes = b"") -> list[int]:
        """The cached blocks `tokens` starts with, for this tenant (`salt`: a tenant's prompts hash apart from every
        other's, so nothing of one can be found, shared or timed by another): the one walk of a prompt's hashes
        that admission, the 429 prediction and restore all use."""
        pool, found = self.model.pool, []
        for digest in self.hashes(tokens, salt):
            block = pool.by_hash.get(digest)
            if block is None or (self.features and digest not in pool.kept):
                break
            found.append(block)
        return found

    def restore(self, tokens: list[int], slot: int, salt: bytes = b"") -> int:
        """Share the longest cached prefix of `tokens` into the empty `slot` -> the positions it covers (all but the
        last token at most: that row's logits are needed; writing it copies its block first)."""
        self.queried += max(0, len(tokens) - 1)
        found = self.lookup(tokens, salt)
        if not found:
            return 0
        self.model.share(slot, found)
        n = min(len(found) * BLOCK, len(tokens) - 1)
        self.hits, self.reused = self.hits + 1, self.reused + n
        return n

    def features_of(self, tokens: list[int], n: int, salt: bytes = b"") -> torch.Tensor:
        """The hidden states of positions 0..n-1 of `tokens`, from the blocks restore() just shared."""
        kept = self.model.pool.kept
        return torch.cat([kept[d] for d in self.hashes(tokens, salt)[: -(-n // BLOCK)]])[:n]

    def store(self, tokens: list[int], slot: int, salt: bytes = b"", hidden: torch.Tensor | None = None) -> None:
        """Name the full blocks of a prompt just computed in `slot`, for this tenant; with features, `hidden` holds
        the target's hidden states of its positions (at least its full blocks')."""
        pool = self.model.pool
        for i, (digest, block) in enumerate(zip(self.hashes(tokens, salt), self.model.blocks_of(slot))):
            pool.register(block, digest)
            if self.features and digest in pool.by_hash and digest not in pool.kept and hidden is not None \
                    and len(hidden) >= (i + 1) * BLOCK:
                pool.kept[digest] = hidden[i * BLOCK: (i + 1) * BLOCK].clone()
