"""A compact Llama-family decoder (SmolLM, Llama, Mistral, Qwen2): RMSNorm, rotary embedding (default, linear,
llama3 and yarn scaling), grouped-query attention, SwiGLU, tied or untied head, optional q/k/v bias.

Weights stay in their file's form (weights.QTensor) and run on specdec's kernels: one C++ call per pass
(kernels/, `decoder_layers`: rows.cpp and its headers), which computes every row on its own, so a row of a verify pass gets bitwise the
logits a one-token pass gives it. Without the kernels the same layer runs in torch below (torch_layer.py), on the
same dequantized values.

KV slots: each sequence owns a slot, a preallocated pair of tensors, keys [layers, kv_heads, max_len/16, head_dim, 16]
(blocks of 16 positions stored transposed: the kernel scores 16 keys per vector) and values [layers, kv_heads,
max_len, head_dim]; pages are touched only as positions fill. A pass takes rows from any slots, each at its own position: the row's key and
value are written at (slot, position), then it attends to positions 0..position of its slot. Rolling back is
forgetting positions (SlotCache.rollback sets a length); no tensor is copied.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..cachedir import file_sha256
from ..kernels import abi
from . import torch_layer
from .blocks import BLOCK, BlockPool, default_kv_memory, drop_pages
from .rope import rope_tables
from .slot_cache import SlotCache
from .weights import QTensor, qlinear

_Seg, _Lin, _Layer, _Dims = abi.Seg, abi.Lin, abi.Layer, abi.Dims  # the kernels' structs (kernels/abi.py)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor | None  # None: no norm before attention (a feature draft's layer)
    q: QTensor
    k: QTensor
    v: QTensor
    o: QTensor
    ffn_norm: torch.Tensor
    gate: QTensor
    up: QTensor
    down: QTensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim]: per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [hidden]: norms of the attention and MLP outputs (Gemma)
    post_ffn_norm: torch.Tensor | None = None
    window: int = 0  # sliding-window attention over the last `window` positions; 0: full
    rope_theta: float | None = None  # this layer's rotary base (Gemma 3's local layers), None: the model's

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the MLP gate's activation -> kernels/abi.h Dims.act


def _lin(parts, q8: bool) -> _Lin:
    """A fused linear's segments; in the q8 mode each integer-format weight also names its repacked blocks."""
    lin = _Lin()
    for j, (w, b) in enumerate(parts):
        packed = w.packed() if q8 else None
        lin.seg[j] = _Seg(w.data.data_ptr(), None if packed is None else packed.data_ptr(),
                          None if b is None else b.data_ptr(), w.fmt, w.n)
    lin.count = len(parts)
    return lin


class Llama:
    """The decoder. `forward(tokens, slots, positions)` runs one pass over rows from any KV slots."""

    backend = "runtime"

    def __init__(self, config, embed: QTensor, layers: list[LayerWeights], norm: torch.Tensor, head: QTensor,
                 generation_config=None, max_len: int | None = None, source: str = "", numerics: str = "exact"):
        self.config, self.generation_config, self.source = config, generation_config, source
        self.numerics = numerics
        self.embed, self.layers, self.norm, self.head = embed, layers, norm, head
        self._heads: dict[int, QTensor] = {}  # head_rows -> the head's first rows (_head)
        self.head_ids: torch.Tensor | None = None  # a trimmed head's token ids, row by row (keep_head_rows)
        # layers whose input (the residual stream before them) forward(hidden=True) returns, side by side, in place of
        # the final hidden states: an EAGLE-3 head's target features (drafters/eagle3.py); None: the final ones
        self.feature_layers: tuple[int, ...] | None = None
        self.hd, self.heads, self.kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.eps = float(config.rms_norm_eps)
        self.interleaved = bool(getattr(config, "rope_interleaved", False))  # llama.cpp's Q/K row order
        self.max_len = -(-int(max_len or config.max_position_embeddings) // 16) * 16  # whole key blocks
        self.cos, self.sin = rope_tables(config, self.max_len)
        self._layer_rope = {th: rope_tables(config, self.max_len, th) for th in {w.rope_theta for w in layers} - {None}}
        self.act = getattr(config, "hidden_act", "silu")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} is not one the runtime runs ({sorted(ACTIVATIONS)})")
        self.embed_scale = getattr(config, "embed_scale", None)  # Gemma: embeddings times sqrt(hidden), in fp32
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.attn_scale = float(np.float32(scalar ** -0.5)) if scalar else 0.0  # 0: 1/sqrt(head_dim) (attention.h)
        self._tables: list[np.ndarray] = []  # per slot: block id of positions 16i..16i+15, -1 none (blocks.py)
        self._held: list[list[int]] = []  # per slot: its blocks in order (the table's filled entries)
        self._free: list[int] = []
        self._pool, self._kv_memory, self._kv_fp32 = None, None, False
        self._lib = kernels.library()
        if numerics not in kernels.NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(kernels.NUMERICS)}, got {numerics!r}")
        if numerics == "q8" and self._lib is None:
            import sys
            print("specdec: the q8 mode needs the CPU kernels; running exact", file=sys.stderr)
            self.numerics = "exact"
        self._structs = None  # the kernels' description of the layers, made at the first pass
        if self._lib is not None:
            self._tptr = (ctypes.c_void_p * 1)()
            self._dims = None  # made with the pool

    # ---- KV slots: tables of blocks from one pool (blocks.py) --------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        """How K/V are stored: fp16 in the q8 mode (half the bytes attention reads per position; every row reads the
        same rounded values, so passes stay row-invariant), fp32 in exact (bitwise transformers' fp32). q8 may keep
        fp32 too (set_kv_dtype: to measure what fp16 saves)."""
        if self.q8 and self._kv_fp32:
            return torch.float32
        return torch.float16 if self.q8 else torch.float32

    def set_kv_dtype(self, dtype: torch.dtype | None) -> None:
        """K/V storage for the q8 mode: torch.float16 (its default) or torch.float32; exact always keeps fp32.
        Slots keep their ids and lose what they held."""
        if dtype not in (None, torch.float16, torch.float32):
            raise ValueError("K/V are stored as float16 or float32")
        before = self.kv_dtype
        self._kv_fp32 = dtype == torch.float32
        if self.kv_dtype != before:
            self._remake_pool()
            self._pointers()

    @property
    def kv_bytes_per_position(self) -> int:
        """What one position of one slot holds: keys and values of every layer and KV head."""
        size = torch.empty(0, dtype=self.kv_dtype).element_size()
        return 2 * self.config.num_hidden_layers * self.kv_heads * self.hd * size

    @property
    def kv_budget(self) -> int:
        """Bytes the K/V of every slot may take together (set_kv_memory; by default a share of available memory)."""
        if self._kv_memory is not None:
            return self._kv_memory
        return default_kv_memory(self.kv_bytes_per_position * self.max_len)

    def set_kv_memory(self, nbytes: int | None) -> None:
        """Size the KV pool to `nbytes` (None: the default). It must hold the model's whole context (one sequence
        of max_len positions); held slots keep their ids and lose what they held."""
        per_context = self.kv_bytes_per_position * self.max_len
        if nbytes is not None and nbytes < per_context:
            raise ValueError(f"a KV memory budget of {nbytes / 2**30:.3g} GiB holds "
                             f"{max(0, nbytes // (self.kv_bytes_per_position * BLOCK)) * BLOCK} positions; this model's "
                             f"context of {self.max_len} needs {per_context / 2**30:.3g} GiB")
        self._kv_memory = None if nbytes is None else int(nbytes)
        self._remake_pool()

    def _remake_pool(self) -> None:
        self._pool = None
        self._tables = [np.full(self.max_len // BLOCK, -1, np.int32) for _ in self._tables]
        self._held = [[] for _ in self._tables]

    def _ensure_pool(self) -> BlockPool:
        if self._pool is None:
            c, G, dtype = self.config, self.kv_heads, self.kv_dtype
            blocks = self.kv_budget // (self.kv_bytes_per_position * BLOCK)
            self._pool = BlockPool(blocks)
            # untouched pages cost no memory: resident K/V grow with the blocks used, up to the budget
            self._kpool = torch.empty((blocks, c.num_hidden_layers, G, self.hd, BLOCK), dtype=dtype)
            self._vpool = torch.empty((blocks, c.num_hidden_layers, G, BLOCK, self.hd), dtype=dtype)
            self._pointers()
        return self._pool

    @property
    def pool(self) -> BlockPool:
        return self._ensure_pool()

    def acquire_slot(self) -> int:
        self._ensure_pool()
        if self._free:
            return self._free.pop()
        self._tables.append(np.full(self.max_len // BLOCK, -1, np.int32))
        self._held.append([])
        self._pointers()
        return len(self._tables) - 1

    def release_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._tables) or slot in self._free:
            raise ValueError(f"KV slot {slot} is not held (released twice, or never acquired)")
        self.truncate(slot, 0)
        self._free.append(slot)

    @property
    def held_slots(self) -> int:
        return len(self._tables) - len(self._free)

    def _pointers(self) -> None:
        if self._lib is not None and self._pool is not None:
            self._tptr = (ctypes.c_void_p * max(1, len(self._tables)))(*[t.ctypes.data for t in self._tables])
            self._dims = self._make_dims()

    def blocks_of(self, slot: int) -> list[int]:
        """The pool blocks slot `slot` holds, in position order."""
        return list(self._held[slot])

    def reserve(self, slot: int, positions: int) -> None:
        """Back positions 0..positions-1 of `slot` with blocks (raises blocks.OutOfBlocks when the budget is full;
        the blocks taken before stay with the slot)."""
        pool, held, table = self._ensure_pool(), self._held[slot], self._tables[slot]
        while len(held) * BLOCK < positions:
            table[len(held)] = block = pool.allocate()
            held.append(block)

    def blocks_needed(self, slot: int, positions: int) -> int:
        return max(0, -(-positions // BLOCK) - len(self._held[slot]))

    def truncate(self, slot: int, positions: int) -> None:
        """Keep positions 0..positions-1 of `slot`: the blocks past them go back to the pool."""
        held, table, keep = self._held[slot], self._tables[slot], -(-positions // BLOCK)
        while len(held) > keep:
            table[len(held) - 1] = -1
            self._pool.release(held.pop())

    def own(self, slot: int, index: int) -> None:
        """Before writing into block `index` of `slot`: a block others may read is copied first (copy on write)."""
        pool, block = self._pool, self._held[slot][index]
        if pool.shared(block):
            mine = pool.allocate()
            self._kpool[mine], self._vpool[mine] = self._kpool[block], self._vpool[block]
            pool.release(block)
            self._held[slot][index] = self._tables[slot][index] = mine

    def share(self, slot: int, blocks: list[int]) -> None:
        """Start an empty slot with `blocks` (a cached prefix; positions 0..16·len(blocks)-1), held by reference."""
        if self._held[slot]:
            raise ValueError("blocks are shared into an empty slot only")
        for i, block in enumerate(blocks):
            self._pool.hold(block)
            self._held[slot].append(block)
            self._tables[slot][i] = block

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int, index: int) -> None:
        """Block `index` of slot `src` into `dst`'s own block there: bitwise the K/V running the same tokens in dst
        writes (a position's K/V depend only on the tokens up to it); dst's positions past the ones it shares are
        rewritten by the pass that reaches them before anything reads them."""
        self.own(dst, index)
        a, b = self._held[src][index], self._held[dst][index]
        self._kpool[b], self._vpool[b] = self._kpool[a], self._vpool[a]

    def trim(self) -> None:
        """Hand the pages of free blocks back to the system (they are zero-filled when next touched)."""
        if self._pool is not None:
            for t in (self._kpool, self._vpool):
                for first, last in _runs(sorted(self._pool.free)):
                    drop_pages(t[first:last + 1])

    def kv_bytes(self) -> int:
        """K/V bytes in use: the blocks held by slots or kept by the prefix cache."""
        return 0 if self._pool is None else self._pool.used * self.kv_bytes_per_position * BLOCK

    def kv_pool_bytes(self) -> int:
        """The KV pool's size in bytes, as it was made (kv_budget may since read other free memory)."""
        return self.pool.blocks * self.kv_bytes_per_position * BLOCK

    def slot_kv(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..n-1 of `slot` as stored, [layers, kv_heads, n, head_dim] each."""
        at = torch.arange(n)
        blocks = torch.from_numpy(self._tables[slot]).long()[at // BLOCK]
        keys, values = self._kpool[blocks, :, :, :, at % BLOCK], self._vpool[blocks, :, :, at % BLOCK]  # [n, L, G, hd]
        return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)

    def _back(self, slots: list[int], positions: list[int], paths) -> None:
        """Before a pass: blocks behind every position a row reads or writes, and private copies of the blocks
        rows write into."""
        last, written = {}, {}
        for r, (slot, pos) in enumerate(zip(slots, positions)):
            path = paths[r] if paths is not None and paths[r] is not None else None
            st = path[-1] if path is not None else pos
            far = max(pos, max(path)) if path is not None else pos
            last[slot] = max(last.get(slot, -1), far)
            written.setdefault(slot, set()).add(st // BLOCK)
        for slot, far in last.items():
            self.reserve(slot, far + 1)
            for index in written[slot]:
                self.own(slot, index)

    def new_cache(self, vocab_size: int | None = None) -> SlotCache:
        return SlotCache(self, vocab_size or self.config.vocab_size)

    # ---- the pass ---------------------------------------------------------------------------------------------
    def forward(self, tokens: list[int], slots: list[int], positions: list[int], logit_rows=None,
                hidden: bool = False, paths: list | None = None, head_rows: int | None = None):
        """Rows `tokens` at `positions` of `slots` -> logits [len(logit_rows), V] for the rows asked (default: all),
        and with hidden=True also the final (normed) hidden states of all rows [R, hidden].

        `paths` makes a tree pass (rows of token trees): for row r, None (a plain row) or the storage positions of
        its last len(paths[r]) logical positions, ending with its own. A tree row is stored at paths[r][-1] and
        attends to its slot's positions before those, then to its path (its ancestors and itself): bitwise a
        one-token step of that path. The rotary position is positions[r], the row's depth in the sequence.
        `head_rows`: logits for the first head_rows token ids only (a draft's: each is what the whole head gives)."""
        if len(tokens) == 0:
            raise ValueError("a pass needs at least one row")
        x = self.embed.rows(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32)
        return self.forward_rows(x, slots, positions, logit_rows, hidden, paths, head_rows)

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, slots: list[int], positions: list[int], logit_rows=None,
                     hidden: bool = False, paths: list | None = None, head_rows: int | None = None):
        """forward() from input rows x [R, hidden] instead of token ids (logit_rows=[] skips the head)."""
        R = len(x)
        if not (len(slots) == len(positions) == R) or R == 0:
            raise ValueError("rows, slots and positions must have the same non-zero length")
        if max(positions) >= self.max_len or min(positions) < 0:
            raise ValueError(f"position outside the KV slots' {self.max_len} positions")
        if max(slots) >= len(self._tables) or min(slots) < 0:
            raise ValueError("a row names a KV slot that was never acquired")
        tree = self._tree_rows(positions, paths) if paths is not None else None
        self._back(slots, positions, paths)
        x = x.float().contiguous().clone()  # the residual stream, updated in place
        taps = sorted(set(self.feature_layers)) if hidden and self.feature_layers else []
        seen: dict[int, torch.Tensor] = {}  # layer -> the residual stream before it
        if self._lib is not None:
            if self._structs is None:
                self._structs = (_Layer * len(self.layers))(*[self._layer_struct(w) for w in self.layers])
            if not taps:
                kernels.decoder_layers(self._lib, self._dims, self._structs, x, slots, positions, tree)
            for a, b in zip([0] + taps, taps + [len(self.layers)]) if taps else ():  # in pieces, read between
                if b > a:
                    kernels.decoder_layers(self._lib, self._dims, self._structs, x, slots, positions, tree, a, b - a)
                if b < len(self.layers):
                    seen[b] = x.clone()
            h = kernels.rmsnorm(x, self.norm, self.eps, self._lib)
        else:  # torch, one row at a time through every layer: each row is exactly a one-token step (row-invariant)
            h = torch.empty_like(x)
            seen = {t: torch.empty_like(x) for t in taps}
            for r in range(R):
                xr = x[r:r + 1].clone()  # a fresh, aligned [1, hidden]: the same BLAS call a one-token pass makes
                path = None if paths is None else paths[r]
                for i, w in enumerate(self.layers):
                    if i in seen:
                        seen[i][r] = xr[0]
                    xr = torch_layer.layer(self, i, w, xr, slots[r], positions[r], path)
                h[r] = torch_layer.rmsnorm(xr, self.norm, self.eps)[0]
        rows = h if logit_rows is None else h[list(logit_rows)]
        logits = qlinear(rows.contiguous(), self._head(head_rows), q8=self.q8) if len(rows) else None
        if taps:  # a tap at len(layers) is the final normed state itself
            h = torch.cat([h if t == len(self.layers) else seen[t] for t in self.feature_layers], -1)
        return (logits, h) if hidden else logits

    def keep_head_rows(self, ids: torch.Tensor) -> None:
        """Keep only these token ids' rows of the head (a copy; the embedding stays whole): logits come out over
        `head_ids` in this order (slot_cache.fit_vocab scatters them back to token ids). A draft's trimmed head."""
        if self.head_ids is not None:
            raise ValueError("the head is trimmed already")
        ids = torch.as_tensor(ids, dtype=torch.long)
        self.head, self.head_ids, self._heads = self.head.take(ids), ids, {}

    def _head(self, rows: int | None) -> QTensor:
        """The head, or its first `rows` rows (views of its bytes and q8 layout, made once per size); a trimmed head
        whole (its rows are the kept ids already)."""
        if rows is None or rows >= self.head.n or self.head_ids is not None:
            return self.head
        if rows not in self._heads:
            self._heads[rows] = self.head.first(rows)
        return self._heads[rows]

    def _tree_rows(self, positions: list[int], paths: list) -> list[int]:
        """The kernel's tree description [store R | kbase R | map offset R | maps], checked."""
        R = len(positions)
        if len(paths) != R:
            raise ValueError("paths must name one entry per row")
        store, kbase, moff, maps = [], [], [], []
        for pos, path in zip(positions, paths):
            path = [pos] if path is None else [int(q) for q in path]
            if not 1 <= len(path) <= pos + 1 or min(path) < 0 or max(path) >= self.max_len:
                raise ValueError("a tree row's path must hold 1..position+1 storage positions inside the KV slots")
            store.append(path[-1])
            base = pos + 1 - len(path)
            plain = 0  # leading positions stored where they stand are plain keys (read a block at a time)
            while plain < len(path) and path[plain] == base + plain:
                plain += 1
            kbase.append(base + plain)
            moff.append(len(maps))
            maps.extend(path[plain:])
        return store + kbase + moff + maps

    @torch.inference_mode()
    def move_positions(self, slot: int, moves: list[tuple[int, int]]) -> None:
        """Copy the keys and values at storage position src to dst for each (src, dst), in order: how a tree pass's
        accepted path is compacted to the positions its tokens hold in the sequence."""
        table = self._tables[slot]
        for src, dst in moves:
            if src != dst:
                self.own(slot, dst // BLOCK)
                (bs, ls), (bd, ld) = divmod(src, BLOCK), divmod(dst, BLOCK)
                bs, bd = int(table[bs]), int(table[bd])
                self._kpool[bd, :, :, :, ld] = self._kpool[bs, :, :, :, ls]
                self._vpool[bd, :, :, ld] = self._vpool[bs, :, :, ls]

    # ---- the same layer in torch (no kernels on this machine) --------------------------------------------------
    # ---- ctypes descriptions -----------------------------------------------------------------------------------
    def _layer_struct(self, w: LayerWeights) -> _Layer:
        q8 = self.q8
        cos, sin = self._layer_rope.get(w.rope_theta, (None, None))
        return _Layer(_ptr(w.attn_norm), _lin([(w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)], q8),
                      _lin([(w.o, None)], q8), w.ffn_norm.data_ptr(), _lin([(w.gate, None), (w.up, None)], q8),
                      _lin([(w.down, None)], q8), _ptr(w.q_norm), _ptr(w.k_norm), _ptr(w.post_attn_norm),
                      _ptr(w.post_ffn_norm), _ptr(cos), _ptr(sin), int(w.window))

    @property
    def fingerprint(self) -> str | None:
        """The sha256 of the model's file (what its cached q8 layout and measured pass costs are keyed by), or
        None where the model is not one file."""
        if not hasattr(self, "_fingerprint"):
            from pathlib import Path
            self._fingerprint = file_sha256(self.source) if self.source and Path(self.source).is_file() else None
        return self._fingerprint

    @property
    def q8(self) -> bool:
        """The numerics mode: exact (fp32 on dequantized weights, bitwise transformers' fp32) or q8 (int8
        activations against integer weight blocks; kernels/q8_linear.h). Both row-invariant."""
        return self.numerics == "q8"

    def set_numerics(self, numerics: str) -> None:
        if numerics not in kernels.NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(kernels.NUMERICS)}, got {numerics!r}")
        before, mode = self.kv_dtype, self.numerics
        self.numerics = numerics if self._lib is not None else "exact"
        self._heads.clear()  # a draft's head rows are views of the head's layout, which q8 may attach below
        if self.kv_dtype != before:  # slots keep their ids; what they held was computed in the other mode
            self._remake_pool()
        elif self.numerics != mode and self._pool is not None:
            self._pool.clear_hashes()  # cached prompts' K/V were computed in the other mode: never restored now
        if self._lib is not None:
            if self.q8 and not getattr(self, "_q8_attached", False):
                from .q8cache import attach
                self.q8_layout = attach(self)  # mapped from the cache file (or built there once), else in memory
                self._q8_attached = True
            self._pointers()
            self._structs = None  # rebuilt at the next pass, naming the repacked blocks in q8

    def _make_dims(self) -> _Dims:
        c = self.config
        return _Dims(c.hidden_size, self.heads, self.kv_heads, self.hd, c.intermediate_size, c.num_hidden_layers,
                     self.max_len, int(self.interleaved), self.eps, self.cos.data_ptr(), self.sin.data_ptr(),
                     self._kpool.data_ptr(), self._vpool.data_ptr(), ctypes.cast(self._tptr, ctypes.c_void_p),
                     self._pool.blocks, int(self.q8), int(self.kv_dtype == torch.float16), ACTIVATIONS[self.act],
                     self.attn_scale)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _runs(ids: list[int]):
    """Sorted ids -> (first, last) of each run of consecutive ones."""
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            yield start, prev
        start = prev = i
    if start is not None:
        yield start, prev


