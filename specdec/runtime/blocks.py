"""The KV cache's memory: one pool of blocks of BLOCK positions for every slot, sized once (paged, as vLLM's).

A slot is a table of block ids: positions 16i..16i+15 live in block table[i]. Rolling back returns the blocks past
the new length. The prefix cache shares blocks by reference: a full block of a prompt is named by a hash of every
token up to its end (a chain, so equal hashes mean equal prefixes, and the block's K/V, which depend only on those
tokens, are equal too). A hashed block nobody holds stays cached until a new block is needed, least recently used
first. A block that is shared or hashed is never written: a slot about to write one gets a private copy first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK = 16  # positions per block: one transposed key block of the kernel (kernels/attention.h, Pages)


class OutOfBlocks(RuntimeError):
    """The KV memory budget is full: no free block and no cached one to evict."""


class BlockPool:
    """Block ids, their reference counts and the prefix hashes (the tensors live in the model)."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.refs = [0] * blocks
        self.free = list(range(blocks - 1, -1, -1))  # unhashed, held by none; a stack, so warm pages come back first
        self.evictable: OrderedDict[int, bytes] = OrderedDict()  # hashed, held by none: block -> hash, LRU first
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.kept: dict[bytes, object] = {}  # what is kept beside a named block's K/V (hidden states), gone with its name
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks a new allocation can take: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Blocks that hold K/V someone may read: held by a slot or kept by the prefix cache."""
        return self.blocks - len(self.free)

    def allocate(self) -> int:
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, digest = self.evictable.popitem(last=False)
            del self.by_hash[digest], self.hash_of[block]
            self.kept.pop(digest, None)
            self.evictions += 1
        else:
            raise OutOfBlocks("the KV memory budget is full")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = self.hash_of[block]
            else:
                self.free.append(block)

    def shared(self, block: int) -> bool:
        """Readers other than one slot may depend on it: write a copy instead."""
        return self.refs[block] > 1 or block in self.hash_of

    def register(self, block: int, digest: bytes) -> None:
        """Name a full, held block by its prefix hash (unless that prefix is cached already)."""
        if digest not in self.by_hash and block not in self.hash_of:
            self.by_hash[digest], self.hash_of[block] = block, digest

    def forget_cached(self, keep: int) -> None:
        """Drop the names of the least recently used cached blocks nobody holds until at most `keep` remain (a
        cache bounded below the pool, as a draft model's is): they become free blocks."""
        while len(self.evictable) > keep:
            block, digest = self.evictable.popitem(last=False)
            del self.by_hash[digest], self.hash_of[block]
            self.kept.pop(digest, None)
            self.free.append(block)

    def clear_hashes(self) -> None:
        for block in list(self.evictable):
            self.free.append(block)
        self.evictable.clear()
        self.by_hash.clear()
        self.hash_of.clear()
        self.kept.clear()


def prefix_hashes(tokens: list[int], blocks: int, salt: bytes = b"") -> list[bytes]:
    """The chain hash of each of the first `blocks` full blocks of `tokens`: blake2b over the previous hash and the
    block's token ids (a collision would hand one prompt another's K/V, so not Python's hash())."""
    ids = np.asarray(tokens[: blocks * BLOCK], dtype=np.int64)
    out, prev = [], salt
    for i in range(blocks):
        prev = hashlib.blake2b(prev + ids[i * BLOCK: (i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


DEFAULT_SHARE = 0.5  # of the memory available when the pool is made
DEFAULT_CONTEXTS = 64  # nor more than this many whole contexts (the batch's default row budget)


def available_memory() -> int:
    """Bytes the system can give without swapping (MemAvailable), or total memory where /proc is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_memory(per_context: int) -> int:
    """The KV budget when none is given: half the available memory, at most 64 whole contexts, at least one."""
    return max(per_context, min(int(DEFAULT_SHARE * available_memory()), DEFAULT_CONTEXTS * per_context))


def drop_pages(t) -> None:
    """Return the whole pages inside tensor `t`'s bytes to the system (anonymous memory: they read as zeros when
    touched again). Pages shared with neighbouring data are kept."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    start = t.data_ptr()
    first, last = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)
