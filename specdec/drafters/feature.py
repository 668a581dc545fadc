"""A feature-conditioned draft (EAGLE, Li et al. 2024): one small transformer layer that predicts the target's
next final hidden state from (embedding of token j, target hidden state at j-1), read out through the target's
own output head restricted to a reduced vocabulary. It reuses the target's embeddings and head (nothing of them
is shipped) and is cheap: one layer plus a head over the most frequent tokens.

Positions j whose input feature came from the target are cached; positions drafted from the draft's own
predicted features are discarded after each proposal and recomputed once the target has verified them.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.nn import functional as F

from .. import kernels
from ..errors import IncompatibleDraft, ModelLoadError
from ..kv import common_prefix_len, few_row_linears, rows_linear
from ..models import is_runtime
from ..runtime.weights import QTensor, qlinear
from ..sampling import PositionNoise, draw, warp
from .base import Draft
from .feature_files import check_target, read_draft
from .feature_net import FeatureDraftNet, quantized, runtime_layer, tap_norm

# Stop a block once the draft's own probability that all of it is accepted falls below this. The shipped draft is
# calibrated (bench prompts: draft confidence 0.2-0.4 -> 21% accepted, 0.8-0.9 -> 77%); at fixed tau=3 this
# threshold took ngram+shipped from 1.06x to 1.18x and adaptive from 1.19x to 1.21x (one bench run).
MIN_CONFIDENCE = 0.5
# The draft's matrices and its reduced head run as Q4_0 blocks in the q8 mode: a draft step reads ~4 MB instead of
# ~13 (bf16 layer, Q8_0 head), and the target's passes evict them from cache every cycle. Its proposals are
# verified, so its numerics cost acceptance only: 0.48 accepted drafts per pass against 0.49 in bf16 (17 chat and
# code prompts, τ=3), at 0.68 ms a step against 1.05 (docs/trees.md).
DRAFT_FORMAT = kernels.Q4_0
FUSE_AFTER = 64  # a fused draft's tapped states wait for one fusing call until it reads them or this many wait
# EAGLE-2 trees (grow_trees): children read per expanded node, nodes expanded per depth, the least value worth a
# draft pass to expand, and the most nodes offered (the cost model verifies those that pay their rows).
TREE_TOP, TREE_WIDTH, TREE_EXPAND, TREE_NODES = 4, 2, 0.4, 16
# A sampled request's draft samples from q = warp(draft logits / SHARPEN): the draft, trained on the target's argmax,
# is flatter than the target at its temperature. On the 1.5B's distilled draft at T = 0.7 (546 chat and completion
# positions), the first draft's acceptance Σ min(p, q) was 0.373 with 1.0, 0.391 with 0.6 and 0.393 with 0.4; in
# process, 16 sampled requests made 1.50 / 1.54 / 1.57 tokens a pass (CHANGELOG.md, "Sampled requests: a sharper
# draft"). Any q keeps the output exact.
SHARPEN = 0.4
RACE_SPREAD = 4.0  # (race_children)


def race_children(logits: torch.Tensor, vocab_map: torch.Tensor, params, noise: PositionNoise, position: int):
    """A sampled request's children of a tree node whose token sits at `position`: the target's token there is the
    race winner argmax p/E on the request's noise E (sampling.PositionNoise), so the draft bets on its own race's
    leaders, argmax q/E with q = warp(draft logits / SHARPEN), best first -> (values, reduced-vocabulary ids).
    A child's value is its share of exp((log q - log E) / RACE_SPREAD) among the node's candidates: the chance,
    calibrated on the 1.5B's draft, that it is the target's winner (CHANGELOG.md, "Sampled requests draft trees on
    their race")."""
    q = warp(logits / SHARPEN, params)
    score = q.log() - noise.exponentials(position, vocab_map).log()
    top = score.topk(min(TREE_TOP, len(score)))
    value = torch.softmax(score / RACE_SPREAD, -1)[top.indices]
    keep = top.values > float("-inf")  # outside the request's top-k / top-p: never the winner
    return value[keep].tolist(), top.indices[keep].tolist()


def target_identity(model) -> str:
    """What a draft reading a runtime target's inner layers is keyed by: its file's sha256, or for a target that is
    not one file, a sha256 of its norm weights (every layer's and the final: a fine-tune moves them)."""
    if model.fingerprint:
        return model.fingerprint
    import hashlib
    h = hashlib.sha256()
    for t in [w.ffn_norm for w in model.layers] + [model.norm]:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class _CachedRows:
    """Embedding rows of a quantized table, dequantized once per token (a lookup is then a dict hit, not ~10
    torch operations)."""
    LIMIT = 16384

    def __init__(self, table: QTensor):
        self.table, self.rows = table, {}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        missing = [t for t in dict.fromkeys(ids) if t not in self.rows]
        if missing:
            if len(self.rows) + len(missing) > self.LIMIT:
                self.rows.clear()
            self.rows.update(zip(missing, self.table.rows(missing)))
        return torch.stack([self.rows[t] for t in ids])


class FeatureDrafter:
    """Drafter protocol + `observe_target(start, hidden)`: the engine hands it the target's final hidden states."""
    wants_target_hidden = True
    _fuse = None  # EAGLE-3's fused features: taps [R, n x d] -> features [R, d] (a draft with "taps")

    def __init__(self, net: FeatureDraftNet, embed, head, vocab_map: torch.Tensor, vocab_size: int,
                 name: str = "feature", min_confidence: float = MIN_CONFIDENCE, max_len: int = 8192,
                 fmt: int | None = DRAFT_FORMAT):
        """`embed` and `head` are the target's: tensors (transformers backend, tests) or the runtime's QTensors
        (GGUF blocks: embedding rows dequantized on lookup, the head's reduced-vocabulary rows kept quantized).
        With QTensors and specdec's kernels the draft layer itself runs on the runtime too (one C++ call per step,
        its own KV slot of `max_len` positions) instead of ~20 torch operations."""
        self.net, self.vocab_map, self.vocab_size, self.name = net.eval(), vocab_map, vocab_size, name
        self.min_confidence = min_confidence
        self.dtype = next(net.parameters()).dtype
        if isinstance(embed, QTensor):
            self._embed = _CachedRows(embed)
        else:
            table = embed.to(self.dtype)
            self._embed = lambda ids: F.embedding(torch.tensor(ids), table)
        self._rt, self._q8 = None, False
        if isinstance(head, QTensor):
            reduced = head.take(vocab_map)
            if fmt is not None and kernels.available():
                reduced = quantized(reduced.dequantize(), fmt)
            self._logits = lambda feat: qlinear(feat.contiguous(), reduced)
            if kernels.available() and self.dtype == torch.float32:
                self._rt, self._fc = runtime_layer(net, max_len, fmt), quantized(net.fc.weight, fmt)
                self._slot = self._rt.acquire_slot()
                self._q8 = self._rt.q8
                self._logits = lambda feat: qlinear(feat.contiguous(), reduced, q8=self._q8)
        else:
            self.head = head[vocab_map].to(self.dtype).contiguous()  # the target's head rows for the reduced vocab
            self._logits = lambda feat: rows_linear(feat, self.head)
        if "taps" in net.cfg:  # EAGLE-3's fused features: one linear over the tapped states, per committed row
            fuse_w, norm_w, eps = quantized(net.fuse.weight, fmt), net.fuse_norm.weight.detach().float(), net.cfg["eps"]
            n = len(net.cfg["taps"])
            self._fuse = lambda taps: kernels.rmsnorm(qlinear(tap_norm(taps, n).contiguous(), fuse_w, q8=self._q8),
                                                      norm_w, eps, self._rt._lib) if self._rt is not None else \
                net.fused(taps).to(self.dtype)
        few_row_linears(self.net)  # drafting runs one row at a time
        self.reset()

    def fork(self) -> FeatureDrafter:
        """Shares the net, the head rows and the runtime layer; owns its features, cache and KV slot."""
        other = copy.copy(self)
        if self._rt is not None:
            other._slot = self._rt.acquire_slot()
        other.reset()
        return other

    def close(self) -> None:
        if self._rt is not None and self._slot is not None:
            self._rt.release_slot(self._slot)
            self._slot = None

    def reset(self) -> None:
        d = self.net.cfg["hidden"]
        self._fbuf, self._flen = torch.zeros(64, d, dtype=self.dtype), 0  # target features of committed positions
        self._taps: list[tuple[int, torch.Tensor]] = []  # tapped states not fused yet: (start, rows), contiguous
        self.tokens: list[int] = []  # positions in the cache, all computed from target features
        self.cache = None

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        """The target's states of positions start.. (rows past them are dropped: a rollback). Tapped states (a fused
        draft's) wait to be fused in one call when the draft reads them or FUSE_AFTER rows are waiting: a call per
        request per pass cost 1 ms of every 30 ms pass at 8 streams, where the draft seldom runs."""
        if self._fuse is None:
            self._write(start, hidden)
            return
        self._flen = min(self._flen, start)
        if self._taps and self._taps[-1][0] + len(self._taps[-1][1]) != start:  # a rollback (or a gap: fused first)
            self._taps = [(a, rows[:start - a]) for a, rows in self._taps if a < start]
            if self._taps and self._taps[-1][0] + len(self._taps[-1][1]) != start:
                self._fuse_waiting()
        self._taps.append((start, hidden))
        if start + len(hidden) - self._taps[0][0] >= FUSE_AFTER:  # (contiguous: the rows waiting)
            self._fuse_waiting()

    def _fuse_waiting(self) -> None:
        if self._taps:  # (row-invariant kernels: the features are those of a call per cycle, bit for bit)
            start, taps = self._taps[0][0], torch.cat([rows for _, rows in self._taps])
            self._taps = []
            self._write(start, self._fuse(taps))

    def _write(self, start: int, hidden: torch.Tensor) -> None:
        end = start + len(hidden)
        if end > len(self._fbuf):  # grown by doubling: a cycle writes its rows only, never the whole history
            grown = self._fbuf.new_zeros(max(end, 2 * len(self._fbuf)), self._fbuf.shape[1])
            grown[:start] = self._fbuf[:start]
            self._fbuf = grown
        self._fbuf[start:end] = hidden
        self._flen = end

    @staticmethod
    def fuse_together(drafters) -> None:
        """Every fork's waiting tapped states fused in one call (forks share the fusion): a call per request cost
        ~0.5 ms of Python and a small q8 linear each, at 4 streams 2 ms of every pass. Row-invariant: each fork's
        features are those of its own call, bit for bit."""
        waiting = [d for d in drafters if d._taps and d._fuse is drafters[0]._fuse]
        if len(waiting) < 2:
            return
        runs = [(d._taps[0][0], torch.cat([rows for _, rows in d._taps])) for d in waiting]
        fused, at = waiting[0]._fuse(torch.cat([rows for _, rows in runs])), 0
        for d, (start, rows) in zip(waiting, runs):
            d._taps = []
            d._write(start, fused[at:at + len(rows)])
            at += len(rows)

    @property
    def feats(self) -> torch.Tensor:
        self._fuse_waiting()
        return self._fbuf[: self._flen]

    def _truncate(self, n: int) -> None:
        if self.cache is not None and self.cache[0].shape[2] > n:
            self.cache = (self.cache[0][:, :, :n], self.cache[1][:, :, :n])
        del self.tokens[n:]

    def _step(self, tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
        if self._rt is not None:  # positions past `start` in the slot are simply overwritten
            x = qlinear(torch.cat([self._embed(tokens), feats], -1).contiguous(), self._fc, q8=self._q8)
            return self._rt.forward_rows(x, [self._slot] * len(tokens), list(range(start, start + len(tokens))),
                                         logit_rows=[], hidden=True)[1]
        emb = self._embed(tokens).to(self.dtype)[None]
        out, self.cache = self.net(emb, feats[None], start, self.cache)
        return out[0]

    @property
    def makes_trees(self) -> bool:
        """On the runtime's kernels a greedy proposal is a token tree (EAGLE-2, grow_trees)."""
        return self._rt is not None

    def propose(self, context, k, params, generator) -> Draft:
        return FeatureDrafter.propose_many([self], [context], [k], [params], [generator])[0]

    @staticmethod
    @torch.inference_mode()
    def grow_trees(drafters, contexts, depths: list[int], params=None, generators=None) -> list[Draft]:
        """Dynamic token trees (EAGLE-2, Li et al. 2024), one per fork, grown together: the draft's top TREE_TOP
        children of each context, then, depth by depth, each tree's TREE_WIDTH likeliest nodes expanded (one draft
        pass for every tree's, each row attending to its context and its own path), while a node is worth at least
        TREE_EXPAND. A node's value is the product of the draft's probabilities along its path (its own estimate
        that the path is the target's); nodes come best-first, and the engine's cost model verifies as many as pay
        (costs.best_tree_size; the batch engine's budget). Every row is computed as alone (row-invariant kernels),
        so each tree equals that fork's tree grown alone. A seeded sampled request (race_children) ranks children by
        the draft's own race on the request's noise, as the target's token is that noise's race winner."""
        out = [Draft() for _ in drafters]
        noise = {i: g for i, g in enumerate(generators or []) if isinstance(g, PositionNoise)}
        live = FeatureDrafter._catch_up(drafters, contexts, depths)
        if not live:
            return out
        rt = drafters[live[0]]._rt
        feats = FeatureDrafter._advance([drafters[i] for i in live], [drafters[i]._rows for i in live])
        grown = {i: ([], [], [], {}) for i in live}  # tokens, parents, values, storage (an expanded node's position)
        frontier = {i: [(-1, f)] for i, f in zip(live, feats)}  # expanded nodes whose children are to be read
        for d in range(1, max(depths[i] for i in live) + 1):
            rows = [(i, node, f) for i in frontier for node, f in frontier[i]]
            logits = drafters[live[0]]._logits(torch.stack([f for _, _, f in rows]))
            top = logits.softmax(-1).topk(min(TREE_TOP, logits.shape[-1]), -1)
            tops = [race_children(lg, drafters[i].vocab_map, params[i], noise[i], len(contexts[i]) - 1 + d)
                    if i in noise else (ps, ids)
                    for (i, _, _), lg, ps, ids in zip(rows, logits, top.values.tolist(), top.indices.tolist())]
            born = {i: [] for i in frontier}
            for (i, node, f), (ps, ids) in zip(rows, tops):
                tokens, parents, values, _ = grown[i]
                base = values[node] if node >= 0 else 1.0
                for p, j in zip(ps, ids):
                    tokens.append(int(drafters[i].vocab_map[j])), parents.append(node), values.append(base * p)
                    born[i].append((len(tokens) - 1, f))
            expand = []  # (fork, node, its predicted feature, its path's storage positions, its rotary position)
            for i, nodes in born.items():
                tokens, parents, values, storage = grown[i]
                L = len(contexts[i])
                grow = sorted((b for b in nodes if values[b[0]] >= TREE_EXPAND), key=lambda b: -values[b[0]])
                grow = grow[:TREE_WIDTH]
                if d == depths[i] or not grow or L + len(storage) + len(grow) >= rt.max_len:
                    continue
                for node, f in grow:
                    storage[node] = L + len(storage)
                    up, chain = parents[node], [storage[node]]
                    while up >= 0:
                        chain.append(storage[up])
                        up = parents[up]
                    expand.append((i, node, f, chain[::-1], L - 1 + d))
            if not expand:
                break
            x = torch.cat([torch.cat([drafters[i]._embed([grown[i][0][n]]) for i, n, _, _, _ in expand]),
                           torch.stack([f for _, _, f, _, _ in expand])], -1)
            h = rt.forward_rows(qlinear(x.contiguous(), drafters[live[0]]._fc, q8=drafters[live[0]]._q8),
                                [drafters[i]._slot for i, _, _, _, _ in expand], [pos for *_, pos in expand],
                                logit_rows=[], hidden=True, paths=[path for _, _, _, path, _ in expand])[1]
            frontier = {}
            for (i, node, _, _, _), hf in zip(expand, h):
                frontier.setdefault(i, []).append((node, hf))
        for i in live:
            tokens, parents, values, _ = grown[i]
            drafters[i]._truncate(len(contexts[i]))
            order = sorted(range(len(tokens)), key=lambda n: (-values[n], n))[:TREE_NODES]  # parents before children
            where = {old: new for new, old in enumerate(order)}
            out[i] = Draft([tokens[n] for n in order], values=[values[n] for n in order],
                           parents=[-1 if parents[n] < 0 else where[parents[n]] for n in order])
        return out

    @staticmethod
    def _catch_up(drafters, contexts, ks) -> list[int]:
        """Each drafter's rows the draft has not run yet, as `d._rows` (tokens, input features, first position) ->
        the indices that can draft (the target has scored their context)."""
        live = []
        FeatureDrafter.fuse_together([d for d, k in zip(drafters, ks) if k >= 1])
        for i, (d, ctx) in enumerate(zip(drafters, contexts)):
            L = len(ctx)
            if len(d.feats) < L - 1 or L < 2 or ks[i] < 1:
                continue  # the target has not scored this context yet (first cycle)
            keep = min(common_prefix_len(d.tokens, ctx), L - 1)
            d._truncate(keep)
            prev = d.feats[max(0, keep - 1): L - 1]  # position j is fed the target's feature at j - 1
            if keep == 0:
                prev = torch.cat([prev.new_zeros(1, prev.shape[1]), prev])
            d._rows = (ctx[keep:L], prev, keep)
            d.tokens = list(ctx)
            live.append(i)
        return live

    @staticmethod
    def propose_many(drafters, contexts, ks, params, generators) -> list[Draft]:
        """Drafts for several sequences at once (continuous batching), each with its own drafter fork: greedy and
        seeded sampled ones on the runtime as trees (grow_trees), the others as chains (chains), each kind in one
        batched call."""
        out = [Draft() for _ in drafters]
        tree = [d._rt is not None and (p.greedy or isinstance(g, PositionNoise))
                for d, p, g in zip(drafters, params, generators)]
        for kind, grow in ((True, FeatureDrafter.grow_trees), (False, FeatureDrafter.chains)):
            group = [i for i, t in enumerate(tree) if t == kind]
            if group:
                pick = lambda xs: [xs[i] for i in group]  # noqa: E731
                for i, draft in zip(group, grow(pick(drafters), pick(contexts), pick(ks), pick(params),
                                                pick(generators))):
                    out[i] = draft
        return out

    @staticmethod
    @torch.inference_mode()
    def chains(drafters, contexts, ks, params, generators) -> list[Draft]:
        """The draft as a chain for several sequences at once, each with its own drafter fork. On the runtime the
        forks share one draft layer, so each step runs the layer and the head once for all of them; every row is
        computed as alone (row-invariant kernels), so each draft equals that fork's chain."""
        out = [Draft() for _ in drafters]
        live = FeatureDrafter._catch_up(drafters, contexts, ks)
        if not live:
            return out
        feats = FeatureDrafter._advance([drafters[i] for i in live], [drafters[i]._rows for i in live])
        state = {i: ([], [], 1.0) for i in live}  # drafted, qs, reach
        for step in range(max(ks[i] for i in live)):
            logits = FeatureDrafter._head([drafters[i] for i in live], feats)
            nxt, rows = [], []
            for i, feat, lg in zip(live, feats, logits):
                d, L = drafters[i], len(contexts[i])
                drafted, qs, reach = state[i]
                if params[i].greedy:
                    best = int(lg.argmax())
                    token, p = int(d.vocab_map[best]), float(lg.softmax(-1)[best])
                else:
                    full = lg.new_full((d.vocab_size,), float("-inf"))
                    full[d.vocab_map] = lg
                    q = warp(full / SHARPEN, params[i])
                    token = draw(q, generators[i], L + step)
                    qs.append(q)
                    p = float(q[token])
                drafted.append(token)
                reach *= p  # the draft's own estimate that the whole block so far is accepted
                state[i] = (drafted, qs, reach)
                # dynamic block length (EAGLE-2): below the threshold the rest would rarely be accepted
                if reach >= d.min_confidence and step + 1 < ks[i]:
                    nxt.append(i)
                    rows.append(([token], feat[None], L + step))
            if not nxt:
                break
            live, feats = nxt, FeatureDrafter._advance([drafters[i] for i in nxt], rows)
        for i, (drafted, qs, _) in state.items():
            drafters[i]._truncate(len(contexts[i]))  # drop positions drafted from predicted features
            out[i] = Draft(drafted, torch.stack(qs) if qs else None)
        return out

    @staticmethod
    def _advance(drafters, rows) -> list[torch.Tensor]:
        """Run each drafter's rows (tokens, input features, first position) -> each one's last predicted feature.
        Forks on one runtime layer share a single pass; otherwise one torch step each."""
        rt = drafters[0]._rt
        if rt is None or any(d._rt is not rt for d in drafters):
            return [d._step(t, f, s)[-1] for d, (t, f, s) in zip(drafters, rows)]
        x = torch.cat([torch.cat([d._embed(t), f], -1) for d, (t, f, _) in zip(drafters, rows)]).contiguous()
        slots = [d._slot for d, (t, _, _) in zip(drafters, rows) for _ in t]
        positions = [s + j for t, _, s in rows for j in range(len(t))]
        h = rt.forward_rows(qlinear(x, drafters[0]._fc, q8=drafters[0]._q8), slots, positions, logit_rows=[], hidden=True)[1]
        ends = torch.tensor([len(t) for t, _, _ in rows]).cumsum(0) - 1
        return list(h[ends])

    @staticmethod
    def _head(drafters, feats) -> list[torch.Tensor]:
        """Reduced-vocabulary logits per feature: one call for forks on the runtime (row-invariant), else each
        alone (the transformers path's linear is not row-invariant across row counts)."""
        if drafters[0]._rt is not None:
            return list(drafters[0]._logits(torch.stack(feats)))
        return [d._logits(f) for d, f in zip(drafters, feats)]

    # ---- persistence ---------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, target_model, target_fingerprint: str, name: str | None = None) -> FeatureDrafter:
        path = Path(path)
        try:
            meta, weights = read_draft(path)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot load draft {path}: {e}")
        check_target(meta, path, target_fingerprint,
                     target_sha256=target_identity(target_model) if is_runtime(target_model) else None)
        net = FeatureDraftNet(**meta["net"])
        vocab_map = weights.pop("vocab_map").long()
        net.load_state_dict({k: v.float() for k, v in weights.items()})
        if is_runtime(target_model):
            embed, head = target_model.embed, target_model.head
        else:
            embed = target_model.get_input_embeddings().weight.detach()
            head = target_model.get_output_embeddings().weight.detach()
        drafter = cls(net.float(), embed, head, vocab_map, target_model.config.vocab_size, name or str(path),
                      max_len=getattr(target_model, "max_len", 8192))
        if "taps" in net.cfg:
            if not is_runtime(target_model):
                raise IncompatibleDraft(f"draft {path} reads the target's inner layers: run the target on specdec's "
                                        "runtime (a GGUF file, or --backend runtime)")
            target_model.feature_layers = tuple(net.cfg["taps"])
        if drafter._rt is not None:  # the runtime layer holds the weights now: the fp32 copy goes (75 MB on the 1.5B)
            drafter.net.to("meta")
        return drafter
