"""A compact Llama-family decoder (SmolLM, Llama, Mistral, Qwen2): RMSNorm, rotary embedding (default, linear,
llama3 and yarn scaling), grouped-query attention, SwiGLU, tied or untied head, optional q/k/v bias.

Weights stay in their file's form (weights.QTensor) and run on specdec's kernels: one C++ call per pass
(kernels/rows.cpp, `decoder_layers`), which computes every row on its own, so a row of a verify pass gets bitwise the
logits a one-token pass gives it. Without the kernels the same layer runs in torch below (`_layer_torch`), on the
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

import torch
from torch.nn import functional as F

from .. import kernels
from .weights import QTensor, qlinear

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Seg(ctypes.Structure):
    _fields_ = [("w", _p), ("wq", _p), ("bias", _p), ("fmt", _i), ("n", _i)]


class _Lin(ctypes.Structure):
    _fields_ = [("seg", _Seg * 3), ("count", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("qkv", _Lin), ("o", _Lin), ("ffn_norm", _p), ("gate_up", _Lin), ("down", _Lin)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("inter", _i), ("layers", _i),
                ("max_len", _i), ("interleaved", _i), ("eps", _f), ("cos", _p), ("sin", _p), ("kslot", _p),
                ("vslot", _p), ("q8", _i), ("kv16", _i)]


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


def _lin(parts, q8: bool) -> _Lin:
    """A fused linear's segments; in the q8 mode each integer-format weight also names its repacked blocks."""
    lin = _Lin()
    for j, (w, b) in enumerate(parts):
        packed = w.packed() if q8 else None
        lin.seg[j] = _Seg(w.data.data_ptr(), None if packed is None else packed.data_ptr(),
                          None if b is None else b.data_ptr(), w.fmt, w.n)
    lin.count = len(parts)
    return lin


def rope_tables(config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] as transformers' Llama computes them (fp32 inv_freq x position, scaled)."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    hd = config.head_dim
    if kind == "default":
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        scale = 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if not hasattr(config, "to_dict"):  # the GGUF loader's plain namespace
            config = AutoConfig.for_model(config.model_type, **{k: v for k, v in vars(config).items()
                                                                if k != "model_type"})
        inv, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    ang = torch.arange(max_len).float()[:, None] * inv.float()[None]
    emb = torch.cat([ang, ang], -1)
    return (emb.cos() * scale).contiguous(), (emb.sin() * scale).contiguous()


class Llama:
    """The decoder. `forward(tokens, slots, positions)` runs one pass over rows from any KV slots."""

    backend = "runtime"

    def __init__(self, config, embed: QTensor, layers: list[LayerWeights], norm: torch.Tensor, head: QTensor,
                 generation_config=None, max_len: int | None = None, source: str = "", numerics: str = "exact"):
        self.config, self.generation_config, self.source = config, generation_config, source
        self.numerics = numerics
        self.embed, self.layers, self.norm, self.head = embed, layers, norm, head
        self.hd, self.heads, self.kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.eps = float(config.rms_norm_eps)
        self.interleaved = bool(getattr(config, "rope_interleaved", False))  # llama.cpp's Q/K row order
        self.max_len = -(-int(max_len or config.max_position_embeddings) // 16) * 16  # whole key blocks
        self.cos, self.sin = rope_tables(config, self.max_len)
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._free: list[int] = []
        self._lib = kernels.library()
        if numerics not in kernels.NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(kernels.NUMERICS)}, got {numerics!r}")
        if numerics == "q8" and self._lib is None:
            import sys
            print("specdec: the q8 mode needs the CPU kernels; running exact", file=sys.stderr)
            self.numerics = "exact"
        self._structs = None  # the kernels' description of the layers, made at the first pass
        if self._lib is not None:
            self._kptr, self._vptr = (ctypes.c_void_p * 0)(), (ctypes.c_void_p * 0)()
            self._dims = self._make_dims()

    # ---- KV slots -------------------------------------------------------------------------------------------
    def acquire_slot(self) -> int:
        if self._free:
            return self._free.pop()
        self._slots.append(self._empty_slot())
        self._pointers()
        return len(self._slots) - 1

    @property
    def kv_dtype(self) -> torch.dtype:
        """How K/V are stored: fp16 in the q8 mode (half the bytes attention reads per position; every row reads the
        same rounded values, so passes stay row-invariant), fp32 in exact (bitwise transformers' fp32)."""
        return torch.float16 if self.q8 else torch.float32

    def _empty_slot(self) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.config.num_hidden_layers
        keys = (layers, self.kv_heads, self.max_len // 16, self.hd, 16)
        values = (layers, self.kv_heads, self.max_len, self.hd)
        dtype = self.kv_dtype
        return torch.empty(keys, dtype=dtype), torch.empty(values, dtype=dtype)  # untouched pages cost no memory

    def _pointers(self) -> None:
        if self._lib is not None:
            n = len(self._slots)
            self._kptr = (ctypes.c_void_p * n)(*[k.data_ptr() for k, _ in self._slots])
            self._vptr = (ctypes.c_void_p * n)(*[v.data_ptr() for _, v in self._slots])
            self._dims = self._make_dims()

    def trim(self, slots: list[int] | None = None) -> None:
        """Hand the memory of free slots back (fresh, untouched tensors in their place): all, or those named."""
        for i in self._free if slots is None else [i for i in slots if i in self._free]:
            self._slots[i] = self._empty_slot()
        self._pointers()

    @property
    def kv_bytes_per_position(self) -> int:
        """What one position of one slot holds: keys and values of every layer and KV head."""
        size = torch.empty(0, dtype=self.kv_dtype).element_size()
        return 2 * self.config.num_hidden_layers * self.kv_heads * self.hd * size

    def release_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._slots) or slot in self._free:
            raise ValueError(f"KV slot {slot} is not held (released twice, or never acquired)")
        self._free.append(slot)

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions 0..n-1 of slot `src` into slot `dst`, keys and values: bitwise what running those tokens in dst
        would write (a position's key and value depend only on the tokens up to it). Whole key blocks are copied;
        positions past n in dst are rewritten by the pass that reaches them before anything reads them."""
        (ks, vs), (kd, vd) = self._slots[src], self._slots[dst]
        blocks = -(-n // 16)
        kd[:, :, :blocks].copy_(ks[:, :, :blocks])
        vd[:, :, :n].copy_(vs[:, :, :n])

    def new_cache(self, vocab_size: int | None = None) -> SlotCache:
        return SlotCache(self, vocab_size or self.config.vocab_size)

    # ---- the pass ---------------------------------------------------------------------------------------------
    def forward(self, tokens: list[int], slots: list[int], positions: list[int], logit_rows=None,
                hidden: bool = False, paths: list | None = None):
        """Rows `tokens` at `positions` of `slots` -> logits [len(logit_rows), V] for the rows asked (default: all),
        and with hidden=True also the final (normed) hidden states of all rows [R, hidden].

        `paths` makes a tree pass (rows of token trees): for row r, None (a plain row) or the storage positions of
        its last len(paths[r]) logical positions, ending with its own. A tree row is stored at paths[r][-1] and
        attends to its slot's positions before those, then to its path (its ancestors and itself): bitwise a
        one-token step of that path. The rotary position is positions[r], the row's depth in the sequence."""
        if len(tokens) == 0:
            raise ValueError("a pass needs at least one row")
        return self.forward_rows(self.embed.rows(tokens), slots, positions, logit_rows, hidden, paths)

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, slots: list[int], positions: list[int], logit_rows=None,
                     hidden: bool = False, paths: list | None = None):
        """forward() from input rows x [R, hidden] instead of token ids (logit_rows=[] skips the head)."""
        R = len(x)
        if not (len(slots) == len(positions) == R) or R == 0:
            raise ValueError("rows, slots and positions must have the same non-zero length")
        if max(positions) >= self.max_len or min(positions) < 0:
            raise ValueError(f"position outside the KV slots' {self.max_len} positions")
        if max(slots) >= len(self._slots) or min(slots) < 0:
            raise ValueError("a row names a KV slot that was never acquired")
        tree = self._tree_rows(positions, paths) if paths is not None else None
        x = x.float().contiguous().clone()  # the residual stream, updated in place
        if self._lib is not None:
            if self._structs is None:
                self._structs = (_Layer * len(self.layers))(*[self._layer_struct(w) for w in self.layers])
            s, p = (ctypes.c_int * R)(*slots), (ctypes.c_int * R)(*positions)
            t = None if tree is None else (ctypes.c_int * len(tree))(*tree)
            threads = torch.get_num_threads()
            if self._lib.decoder_layers(ctypes.byref(self._dims), self._structs, len(self.layers), x.data_ptr(), R, s,
                                        p, t, threads):
                raise RuntimeError("the decoder kernel refused its shapes")
            h = torch.empty_like(x)
            self._lib.rows_rmsnorm(x.data_ptr(), R, x.shape[1], self.norm.data_ptr(), self.eps, h.data_ptr(), threads)
        else:  # torch, one row at a time through every layer: each row is exactly a one-token step (row-invariant)
            h = torch.empty_like(x)
            for r in range(R):
                xr = x[r:r + 1].clone()  # a fresh, aligned [1, hidden]: the same BLAS call a one-token pass makes
                path = None if paths is None else paths[r]
                for i, w in enumerate(self.layers):
                    xr = self._layer_torch(i, w, xr, slots[r], positions[r], path)
                h[r] = _rmsnorm(xr, self.norm, self.eps)[0]
        rows = h if logit_rows is None else h[list(logit_rows)]
        logits = qlinear(rows.contiguous(), self.head, q8=self.q8) if len(rows) else None
        return (logits, h) if hidden else logits

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
            kbase.append(pos + 1 - len(path))
            moff.append(len(maps))
            maps.extend(path)
        return store + kbase + moff + maps

    @torch.inference_mode()
    def move_positions(self, slot: int, moves: list[tuple[int, int]]) -> None:
        """Copy the keys and values at storage position src to dst for each (src, dst), in order: how a tree pass's
        accepted path is compacted to the positions its tokens hold in the sequence."""
        kc, vc = self._slots[slot]
        for src, dst in moves:
            if src != dst:
                kc[:, :, dst // 16, :, dst % 16] = kc[:, :, src // 16, :, src % 16]
                vc[:, :, dst] = vc[:, :, src]

    # ---- the same layer in torch (no kernels on this machine) --------------------------------------------------
    def _layer_torch(self, i, w: LayerWeights, x, slot: int, pos: int, path: list[int] | None = None):
        """One layer for ONE row x [1, hidden] at position `pos` of `slot` (rows go one by one: torch's matrix
        products change their summation order with the number of rows, a single row's never does). A tree row's
        `path` maps its last logical positions to where they are stored (forward())."""
        hd = self.hd
        h = x if w.attn_norm is None else _rmsnorm(x, w.attn_norm, self.eps)
        q = F.linear(h, w.q.dequantize(), w.q_bias).view(self.heads, hd)
        k = F.linear(h, w.k.dequantize(), w.k_bias).view(self.kv_heads, hd)
        v = F.linear(h, w.v.dequantize(), w.v_bias).view(self.kv_heads, hd)
        cos, sin = _pairs(self.cos[pos], self.interleaved), _pairs(self.sin[pos], self.interleaved)
        rot = _rotate_pairs if self.interleaved else _rotate_half
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        kc, vc = self._slots[slot]
        st = pos if path is None else path[-1]
        kc[i, :, st // 16, :, st % 16], vc[i, :, st] = k, v
        rep, blocks = self.heads // self.kv_heads, pos // 16 + 1
        # only this row's key blocks, untransposed: [kv_heads, blocks * 16, hd] cut to the pos + 1 keys it attends to
        keys = kc[i, :, :blocks].transpose(2, 3).reshape(self.kv_heads, blocks * 16, hd)[:, : pos + 1]
        vals = vc[i, :, : pos + 1]
        if path is not None:  # the logical key sequence: stored prefix, then the path (same shapes, same products)
            at = torch.tensor(list(range(pos + 1 - len(path))) + list(path))
            keys = kc[i][:, at // 16, :, at % 16].transpose(0, 1)  # [kv_heads, L, hd]
            vals = vc[i, :, at]
        keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
        p = torch.softmax((keys @ q[:, :, None])[..., 0] / hd ** 0.5, -1)  # [heads, L]
        att = (p[:, None] @ vals)[:, 0].reshape(1, -1)
        x = x + F.linear(att, w.o.dequantize())
        h = _rmsnorm(x, w.ffn_norm, self.eps)
        return x + F.linear(F.silu(F.linear(h, w.gate.dequantize())) * F.linear(h, w.up.dequantize()),
                            w.down.dequantize())

    # ---- ctypes descriptions -----------------------------------------------------------------------------------
    def _layer_struct(self, w: LayerWeights) -> _Layer:
        q8 = self.q8
        return _Layer(None if w.attn_norm is None else w.attn_norm.data_ptr(),
                      _lin([(w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)], q8), _lin([(w.o, None)], q8),
                      w.ffn_norm.data_ptr(), _lin([(w.gate, None), (w.up, None)], q8), _lin([(w.down, None)], q8))

    @property
    def q8(self) -> bool:
        """The numerics mode: exact (fp32 on dequantized weights, bitwise transformers' fp32) or q8 (int8
        activations against integer weight blocks; rows.cpp). Both row-invariant."""
        return self.numerics == "q8"

    def set_numerics(self, numerics: str) -> None:
        if numerics not in kernels.NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(kernels.NUMERICS)}, got {numerics!r}")
        before = self.kv_dtype
        self.numerics = numerics if self._lib is not None else "exact"
        if self.kv_dtype != before:  # slots keep their ids; what they held was computed in the other mode
            self._slots = [self._empty_slot() for _ in self._slots]
            self._pointers()
        if self._lib is not None:
            self._dims = self._make_dims()
            self._structs = None  # rebuilt at the next pass, naming the repacked blocks in q8

    def _make_dims(self) -> _Dims:
        c = self.config
        return _Dims(c.hidden_size, self.heads, self.kv_heads, self.hd, c.intermediate_size, c.num_hidden_layers,
                     self.max_len, int(self.interleaved), self.eps, self.cos.data_ptr(), self.sin.data_ptr(),
                     ctypes.cast(self._kptr, ctypes.c_void_p), ctypes.cast(self._vptr, ctypes.c_void_p),
                     int(self.q8), int(self.kv_dtype == torch.float16))


def _rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _rotate_pairs(x):
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): rotate-half for llama.cpp's interleaved row order."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)


def _pairs(table, interleaved):
    """cos/sin laid out for the row order: (c0..c_{h-1}, c0..c_{h-1}) or (c0, c0, c1, c1, ...)."""
    return table[..., : table.shape[-1] // 2].repeat_interleave(2, -1) if interleaved else table


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class SlotCache:
    """One sequence in one KV slot, with kv.CachedModel's interface (what the engine and drafters use):
    `forward(tokens, n_logits)` runs only the tokens the slot lacks, rolling back past any divergence first."""

    def __init__(self, model: Llama, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self.slot = model.acquire_slot()
        self.tokens: list[int] = []
        self.last_start = 0

    def reset(self) -> None:
        self.tokens = []

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the slot's length; the positions beyond are overwritten by the next pass

    def forward(self, tokens: list[int], n_logits: int = 1, hidden: bool = False):
        self.rollback(min(common_prefix_len(self.tokens, tokens), len(tokens) - n_logits))
        start = self.last_start = len(self.tokens)
        new = tokens[start:]
        out = self.model.forward(new, [self.slot] * len(new), list(range(start, len(tokens))),
                                 range(len(new) - n_logits, len(new)), hidden)
        self.tokens.extend(new)
        logits = out[0] if hidden else out
        logits = fit_vocab(logits, self.vocab_size)
        return (logits, out[1]) if hidden else logits

    def forward_tree(self, tokens: list[int], tree: list[int], parents: list[int]):
        """One pass over the tokens the slot lacks and a token tree after them -> logits [1 + len(tree), V]: the
        row of tokens[-1] (which the tree hangs from, parent -1), then one per node (parents[i] < i is node i's
        parent). Nodes are stored after the sequence in their order, and each attends to its own path only.
        Only `tokens` count as cached afterwards; keep_path() then moves an accepted path into place."""
        self.rollback(min(common_prefix_len(self.tokens, tokens), len(tokens) - 1))
        start = self.last_start = len(self.tokens)
        new, base = tokens[start:], len(tokens)
        paths, depth = [None] * len(new), []
        for i, parent in enumerate(parents):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            paths.append((paths[len(new) + parent] if parent >= 0 else []) + [base + i])
        out = self.model.forward(new + list(tree), [self.slot] * (len(new) + len(tree)),
                                 list(range(start, base)) + [base - 1 + d for d in depth],
                                 range(len(new) - 1, len(new) + len(tree)), paths=paths)
        self.tokens.extend(new)
        self._tree = (base, tree, paths[len(new):])
        return fit_vocab(out, self.vocab_size)

    def keep_path(self, nodes: list[int]) -> None:
        """After forward_tree: the accepted nodes (a root-to-node path, in order) join the cached sequence, their
        keys and values moved to the positions they hold in it."""
        base, tree, paths = self._tree
        if nodes:
            self.model.move_positions(self.slot, list(zip(paths[nodes[-1]], range(base, base + len(nodes)))))
        self.rollback(base)
        self.tokens.extend(tree[i] for i in nodes)

    def close(self) -> None:
        if self.slot is not None:
            self.model.release_slot(self.slot)
            self.slot = None

    def __del__(self):
        self.close()


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Models may pad their output head; align every model to the target's vocabulary size."""
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    if logits.shape[-1] < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)
    return logits
