"""`specdec distill`: train a feature-conditioned draft (drafters/feature.py) for a target.

1. data     — the target's own greedy responses to the shipped prompt sets (templated, and cut from Python's
              standard library: prompts/stdlib.py) or user prompts, plus self-chat (the target writes the query
              too) and optional plain-text files; generated in batches;
2. labels   — one teacher-forcing pass of the target per sequence: its final hidden state and argmax at every
              position;
3. train    — the draft layer learns to predict the next hidden state (smooth L1) and the target's argmax through
              the target's head over a reduced vocabulary (cross-entropy, at response positions by default: the
              prompt is context), on target features and, in a second unrolled pass, on its own predicted
              features (what it sees from draft position 2 on);
4. save     — a model directory (safetensors + specdec_draft.json) that `--draft DIR` loads;
5. report   — on held-out prompts (the bench sets, never used for training): acceptance by position, mean
              accepted length, draft cost per token vs one target pass, predicted and measured speedup.
Every phase resumes from what an interrupted run left in OUT/work.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from time import perf_counter

import torch
from rich.console import Console
from rich.progress import Progress
from torch.nn import functional as F

from . import models
from .api import encode_prompt
from .drafters.datastore import DatastoreDrafter
from .drafters.feature import FeatureDrafter
from .drafters.feature_net import net_for_target, save_draft
from .errors import InvalidRequest, SpecDecError
from .generate import generate_batch
from .prompts import HERE as PROMPT_DIR
from .prompts import load_prompts
from .runtime.weights import qlinear
from .sampling import SamplingParams

console = Console(stderr=True)


DEFAULT_PROMPTS = [PROMPT_DIR / "distill.jsonl", PROMPT_DIR / "distill_stdlib.jsonl"]  # templated + stdlib-cut


def _progress():
    return Progress(console=console, transient=False)


# ---- 1. data ---------------------------------------------------------------------------------------------------
# A data item is {"ids": [...], "h": final hidden states [len(ids), d] or None}. Generation records the target's
# hidden states as it goes (the same computation teacher forcing would repeat), so generated data needs no
# separate labelling pass; plain text gets one in phase 2.
def _keyed(path: Path, inputs: dict) -> None:
    """Keep a stored data file (and its hidden-state shards) only if it was made from these inputs: a resumed run
    with another --limit, prompt set or length would otherwise pair old items with new prompts. The self-chat data
    may grow or shrink with --self-chat (it is seeded per batch), so that count is not part of its key."""
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stamp = path.with_suffix(".key")
    if path.exists() and (not stamp.exists() or stamp.read_text() != key):
        console.print(f"{path.name} was made from other inputs: generating it again")
        path.unlink()
        shutil.rmtree(path.parent / f"{path.stem}_hidden", ignore_errors=True)
    stamp.write_text(key)


class _Store:
    """Generated sequences, appended batch by batch (resumable): ids in a JSONL file, hidden states in one
    fp16 shard per batch next to it (written first, so a line never lacks its shard)."""

    def __init__(self, path: Path):
        self.path, self.shards = path, path.parent / f"{path.stem}_hidden"
        self.items = []
        for i, line in enumerate(path.read_text().splitlines() if path.exists() else []):
            self.items.append({"ids": json.loads(line)["ids"], "h": None})
        for shard in sorted(self.shards.glob("*.pt")) if self.shards.exists() else []:
            first = int(shard.stem)
            for j, h in enumerate(torch.load(shard)):
                if first + j < len(self.items):  # the item keeps the positions that have a hidden state
                    item = self.items[first + j]
                    item["ids"], item["h"] = item["ids"][:len(h)], h

    def add(self, batch: list[tuple[list[int], torch.Tensor]]) -> None:
        self.shards.mkdir(exist_ok=True)
        torch.save([h for _, h in batch], self.shards / f"{len(self.items):07d}.pt")
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({"ids": seq}) + "\n" for seq, _ in batch))
        self.items += [{"ids": seq[:len(h)], "h": h} for seq, h in batch]


@torch.inference_mode()
def generate_responses(model, tok, prompts: list[dict], path: Path, max_new_tokens: int, batch: int,
                       device: str) -> list[dict]:
    """Greedy responses, batched with left padding (resumable)."""
    store = _Store(path)
    eos = sorted(models.eos_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    todo = prompts[len(store.items):]
    with _progress() as bar:
        task = bar.add_task("target responses", total=len(prompts), completed=len(store.items))
        for i in range(0, len(todo), batch):
            chunk = [encode_prompt(tok, p["prompt"], p["chat"]) for p in todo[i:i + batch]]
            store.add(_greedy_batch(model, chunk, max_new_tokens, pad, eos, device))
            bar.advance(task, len(chunk))
    return store.items


def _greedy_batch(model, chunk: list[list[int]], max_new_tokens: int, pad: int, eos: list[int],
                  device: str) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy continuations of a batch of prompts, each cut after its first EOS, with the target's final hidden
    states at every position but the last (its token was never fed back): on specdec's runtime (every sequence in
    its own KV slot, no padding) or transformers' generate (left padding)."""
    if models.is_runtime(model):
        return generate_batch(model, chunk, max_new_tokens, set(eos))
    return _greedy_batch_transformers(model, chunk, max_new_tokens, pad, eos, device)
def _greedy_batch_transformers(model, chunk, max_new_tokens, pad, eos, device):
    width = max(map(len, chunk))
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk], device=device)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=device)
    steps = []  # the decoder's output for the prefill, then for each decode step
    hook = model.get_decoder().register_forward_hook(lambda m, i, o: steps.append(o.last_hidden_state.half().cpu()))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)
    finally:
        hook.remove()
    hidden = torch.cat(steps, 1)
    result = []
    for b, (c, row) in enumerate(zip(chunk, out[:, width:].tolist())):
        cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
        seq = c + row[:cut]
        left = width - len(c)
        result.append((seq, hidden[b, left:left + len(seq) - 1].clone()))  # compact: not a view of the batch
    return result


def pre_query(tok) -> list[int]:
    """The chat template up to where the user's message begins (Magpie, Xu et al. 2024): sampling from here makes
    an instruction-tuned target write a user query itself. Without a chat template: just BOS (free text)."""
    if tok.chat_template:
        mark = "\x00QUERY\x00"
        text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
        return tok(text[: text.index(mark)], add_special_tokens=False).input_ids
    return [tok.bos_token_id if tok.bos_token_id is not None else 0]


def assistant_header(tok) -> list[int]:
    """The tokens the chat template puts between a user message and the response (e.g. `<|im_start|>assistant\n`);
    empty without a chat template."""
    if not tok.chat_template:
        return []
    msgs = [{"role": "user", "content": "\x00QUERY\x00"}]
    full = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    bare = tok.apply_chat_template(msgs, tokenize=False)
    return tok(full[len(bare):], add_special_tokens=False).input_ids if full.startswith(bare) else []


def after_last(ids: list[int], header: list[int]) -> int:
    """Index just past the last occurrence of `header` in `ids` (0 if absent or empty)."""
    for j in range(len(ids) - len(header), -1, -1) if header else ():
        if ids[j:j + len(header)] == header:
            return j + len(header)
    return 0


@torch.inference_mode()
def self_chat_data(model, tok, n: int, path: Path, max_new_tokens: int, batch: int, seed: int,
              device: str) -> list[dict]:
    """`n` synthetic conversations: a user query sampled from the target (T=1, top-p 0.95, from the pre-query
    template), then the target's greedy response to it, exactly as `generate` would prompt it. Diverse contexts
    in the target's own distribution, at batched-generation cost. Appended to `path` per batch (resumable);
    batch i is seeded with (seed, i) so a resumed run produces the same data."""
    store = _Store(path)
    eos = sorted(models.eos_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    start = pre_query(tok)
    with _progress() as bar:
        task = bar.add_task("self-chat data", total=n, completed=min(n, len(store.items)))
        while len(store.items) < n:
            torch.manual_seed(seed * 1_000_003 + len(store.items) // batch)
            b = min(batch, n - len(store.items))
            if models.is_runtime(model):
                rows = [s[len(start):] for s, _ in generate_batch(
                    model, [start] * b, 64, set(eos), SamplingParams(1.0, 0.95), torch.default_generator)]
            else:
                q = model.generate(torch.tensor([start] * b, device=device), max_new_tokens=64, do_sample=True,
                                   temperature=1.0, top_p=0.95, top_k=0, pad_token_id=pad, eos_token_id=eos)
                rows = q[:, len(start):].tolist()
            queries = [tok.decode([t for t in row if t not in eos and t != pad], skip_special_tokens=True).strip()
                       for row in rows]
            chunk = [encode_prompt(tok, x, chat=True) if x else start for x in queries]
            store.add(_greedy_batch(model, chunk, max_new_tokens, pad, eos, device))
            bar.advance(task, b)
    return store.items[:n]


def text_sequences(tok, files: list[str], length: int = 256) -> list[dict]:
    seqs = []
    for name in files:
        try:
            ids = tok(Path(name).read_text()).input_ids
        except (OSError, UnicodeDecodeError) as e:
            raise SpecDecError(f"cannot read text file {name}: {getattr(e, 'strerror', None) or e}")
        seqs += [{"ids": ids[i:i + length], "h": None} for i in range(0, len(ids) - 8, length)]
    return seqs


# ---- 2. teacher labels -----------------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_labels(model, items: list[dict], path: Path, device: str) -> list[dict]:
    """Per sequence: final hidden states (fp16; one teacher-forcing pass where generation did not record them)
    and the target's argmax at every position."""
    if path.exists():
        out = torch.load(path)
        if [d["ids"].tolist() for d in out] == [list(it["ids"]) for it in items]:
            return out  # labels of exactly this data (an interrupted run); more or other data is relabelled
    if models.is_runtime(model):
        def features(ids):
            cache = model.new_cache()
            try:
                return cache.forward(ids, 1, hidden=True)[1].half()
            finally:
                cache.close()

        def argmax_of(h):
            return qlinear(h.float().contiguous(), model.head).argmax(-1)
    else:
        decoder, head = model.get_decoder(), model.get_output_embeddings()

        def features(ids):
            return decoder(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0].half()

        def argmax_of(h):
            return head(h.to(device, head.weight.dtype)).argmax(-1)
    out = []
    with _progress() as bar:
        task = bar.add_task("teacher labels", total=len(items))
        for it in items:
            h = it["h"]
            if h is None:
                h = features(list(it["ids"]))
            argmax = argmax_of(h)
            out.append({"ids": torch.tensor(it["ids"]), "h": h.cpu(), "argmax": argmax.cpu()})
            bar.advance(task)
    torch.save(out, path)
    return out


def reduced_vocab(data: list[dict], size: int, must: set[int], vocab: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often (plus EOS), sorted: draft index -> target id."""
    counts = torch.zeros(vocab)
    for d in data:
        counts.index_add_(0, d["argmax"], torch.ones(len(d["argmax"])))
    top = torch.argsort(counts, descending=True)[:size].tolist()
    keep = list(dict.fromkeys(sorted(must) + top))[:size]
    return torch.tensor(sorted(keep))


# ---- 3. training -----------------------------------------------------------------------------------------------
def _batch(items, embed, to_reduced, device):
    T = max(len(d["ids"]) for d in items)
    d_model = embed.shape[1]
    B = len(items)
    emb = torch.zeros(B, T, d_model)
    feat_in = torch.zeros(B, T, d_model)
    target_h = torch.zeros(B, T, d_model)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, d in enumerate(items):
        n = len(d["ids"])
        emb[b, :n] = embed[d["ids"]]
        h = d["h"].float()
        feat_in[b, 1:n] = h[:-1]
        target_h[b, :n] = h
        labels[b, :n] = to_reduced[d["argmax"]]
        labels[b, :max(0, d.get("start", 0) - 1)] = -100  # position j predicts token j + 1
    return [t.to(device) for t in (emb, feat_in, target_h, labels)]


def _loss(net, head_r, emb, feat_in, target_h, labels):
    pred, _ = net(emb, feat_in, 0)
    mask = target_h.abs().sum(-1, keepdim=True) > 0  # real positions (padding is all zeros)
    reg = (F.smooth_l1_loss(pred, target_h, reduction="none") * mask).sum() / mask.sum() / pred.shape[-1]
    logits = pred @ head_r.T
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    acc = (logits.argmax(-1) == labels)[labels != -100].float().mean()
    return pred, reg, ce, acc


@torch.no_grad()
def evaluate(net, head_r, data, embed, to_reduced, batch: int, device: str) -> dict:
    """Teacher-forced argmax agreement with the target on `data`: from target features (draft position 1) and
    from the draft's own features (later positions)."""
    net.eval()
    hits = {"acc": 0.0, "acc2": 0.0}
    n = 0
    for i in range(0, len(data), batch):
        emb, feat_in, target_h, labels = _batch(data[i:i + batch], embed, to_reduced, device)
        pred, _, _, acc = _loss(net, head_r, emb, feat_in, target_h, labels)
        own = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
        _, _, _, acc2 = _loss(net, head_r, emb, own, target_h, labels)
        m = int((labels != -100).sum())
        hits["acc"], hits["acc2"], n = hits["acc"] + float(acc) * m, hits["acc2"] + float(acc2) * m, n + m
    net.train()
    return {k: round(v / max(1, n), 4) for k, v in hits.items()}


def mixed_precision(device: str):
    """bf16 autocast for training where the hardware does bf16 matmuls (weights and optimizer stay fp32):
    1.45x the fp32 training throughput on this project's CPU (Zen 4, AVX512-BF16), same loss to 1e-3."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    ok = torch.cuda.is_bf16_supported() if kind == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=ok)


def train(net, data, embed, head, vocab_map, epochs: int, batch: int, lr: float, seed: int, ckpt: Path,
          device: str, val: list[dict] | None = None) -> dict:
    """AdamW + one-cycle schedule; after each epoch the validation split (sequences never trained on) is scored
    and the best epoch's weights are kept (early stopping)."""
    torch.manual_seed(seed)
    net.to(device).train()
    embed, head_r = embed.float(), head[vocab_map].float().to(device)
    to_reduced = torch.full((head.shape[0],), -100, dtype=torch.long)
    to_reduced[vocab_map] = torch.arange(len(vocab_map))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    order = sorted(range(len(data)), key=lambda i: len(data[i]["ids"]))  # similar lengths batch together
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)
    start_epoch, history, best = 0, [], None
    if ckpt.exists():
        state = torch.load(ckpt)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, history, best = state["epoch"], state["history"], state.get("best")
        console.print(f"resuming training from epoch {start_epoch}")
    with _progress() as bar:
        task = bar.add_task("training", total=total, completed=start_epoch * len(batches))
        for epoch in range(start_epoch, epochs):
            rng_epoch = random.Random(seed * 1_000_003 + epoch)  # same order whether resumed or not
            sums = {"reg": 0.0, "ce": 0.0, "acc": 0.0, "acc2": 0.0}
            for idx in rng_epoch.sample(batches, len(batches)):
                emb, feat_in, target_h, labels = _batch([data[i] for i in idx], embed, to_reduced, device)
                with mixed_precision(device):
                    pred, reg, ce, acc = _loss(net, head_r, emb, feat_in, target_h, labels)
                    # unrolled pass: inputs are the draft's own predictions, as from draft position 2 on
                    own = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1].detach()], 1)
                    _, reg2, ce2, acc2 = _loss(net, head_r, emb, own, target_h, labels)
                    loss = ce + reg + 0.5 * (ce2 + reg2)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                for k, v in (("reg", reg), ("ce", ce), ("acc", acc), ("acc2", acc2)):
                    sums[k] += float(v.detach())
                bar.update(task, advance=1, description=f"training e{epoch + 1} acc {float(acc):.2f}")
            row = {k: round(v / len(batches), 4) for k, v in sums.items()}
            if val:
                row["val"] = evaluate(net, head_r, val, embed, to_reduced, batch, device)
                score = row["val"]["acc"] + row["val"]["acc2"]
                if best is None or score > best["score"]:
                    best = {"score": score, "epoch": epoch + 1,
                            "net": {k: v.detach().clone() for k, v in net.state_dict().items()}}
            history.append(row)
            console.print(f"epoch {epoch + 1}: {row}")
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch + 1, "history": history, "best": best}, ckpt)
    if best is not None:
        net.load_state_dict(best["net"])
    net.cpu().eval()
    return {"epochs": history, "best_epoch": best["epoch"] if best else epochs}


# ---- 5. report -------------------------------------------------------------------------------------------------
def report(target_model, tok, drafter, prompts: list[dict], max_new_tokens: int, tau: int) -> dict:
    from .api import SpecDecoder
    from .costs import cost_model, verify_curve
    from .trace import acceptance_by_position
    spec = SpecDecoder.from_models(target_model, tok, drafter, tau)
    base = SpecDecoder.from_models(target_model, tok, "none")
    spec.generate(prompts[0]["prompt"], max_new_tokens=4, chat=prompts[0]["chat"])  # warm-up
    base.generate(prompts[0]["prompt"], max_new_tokens=4, chat=prompts[0]["chat"])
    recs, base_recs, t_spec, t_base, n_spec, n_base, identical = [], [], 0.0, 0.0, 0, 0, True
    for p in prompts:
        a = spec.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p["chat"])
        b = base.generate(p["prompt"], max_new_tokens=max_new_tokens, chat=p["chat"])
        recs += a.records[1:]
        base_recs += b.records[1:]
        t_spec, t_base = t_spec + a.stats["wall_s"], t_base + b.stats["wall_s"]
        n_spec, n_base = n_spec + len(a.token_ids), n_base + len(b.token_ids)
        identical &= a.token_ids == b.token_ids
    proposed = sum(len(r.proposed) for r in recs)
    alphas = [a or 0.0 for a in acceptance_by_position(recs)]
    t_target = sum(r.verify_ms for r in base_recs) / len(base_recs)
    c_ms = sum(r.draft_ms for r in recs) / max(1, proposed)
    curve = verify_curve(recs) | {1: t_target}
    overhead = sum(r.cycle_ms - r.draft_ms - r.verify_ms for r in recs) / len(recs)
    return {"prompts": len(prompts), "tau": tau, "acceptance_rate": round(sum(r.accepted for r in recs) / proposed, 4),
            "acceptance_by_position": alphas, "mean_accepted_len": round(sum(r.accepted for r in recs) / len(recs), 4),
            "draft_ms_per_token": round(c_ms, 3), "target_pass_ms": round(t_target, 3),
            "draft_cost_ratio": round(c_ms / t_target, 4),
            "predicted_speedup": round(cost_model(alphas, tau, c_ms, curve, overhead, t_target), 3),
            "measured_speedup": round((n_spec / t_spec) / (n_base / t_base), 3), "identical_to_target": identical}


# ---- the command -----------------------------------------------------------------------------------------------
def _runtime_twin(target: str, device: str):
    """The target on specdec's runtime for data generation on CPU, or None to use the transformers model."""
    if device != "cpu":
        return None
    try:
        model = models.load(target, backend="runtime")[0]
    except SpecDecError:
        return None
    return model
def distill(target: str, out: str, prompt_files: list[str], text_files: list[str], max_new_tokens: int = 128,
            gen_batch: int = 64, reduced: int = 8192, epochs: int = 6, batch: int = 8, lr: float = 2e-3,
            seed: int = 0, limit: int = 0, eval_limit: int = 0, eval_tau: int = 4, device: str = "auto",
            self_chat: int = 1536, val_every: int = 50, loss_on: str = "response", loaded=None) -> dict:
    if max_new_tokens < 1 or gen_batch < 1 or epochs < 1 or batch < 1 or lr <= 0 or eval_tau < 1:
        raise InvalidRequest("--max-new-tokens, --gen-batch, --epochs, --batch and --eval-tau must be >= 1, "
                             "--lr > 0")
    if self_chat < 0 or val_every < 0:
        raise InvalidRequest("--self-chat and --val-every must be >= 0")
    if reduced < 2:
        raise InvalidRequest("--reduced-vocab must be >= 2")
    if loss_on not in ("response", "all"):
        raise InvalidRequest(f"--loss-on must be 'response' or 'all', got {loss_on!r}")
    out_dir, work = Path(out), Path(out) / "work"
    try:
        work.mkdir(parents=True, exist_ok=True)
        (work / ".write-test").write_text("ok")
    except OSError as e:
        raise SpecDecError(f"cannot write to {out}: {e.strerror}")
    prompts = [p for f in (prompt_files or DEFAULT_PROMPTS) for p in load_prompts(f)]
    if limit:
        prompts = prompts[:limit]
    model, tok = loaded[:2] if loaded else models.load(target, backend="transformers")  # training: transformers
    if reduced > model.config.vocab_size:
        raise InvalidRequest(f"--reduced-vocab {reduced} exceeds the target's vocabulary ({model.config.vocab_size})")
    texts = text_sequences(tok, text_files or [])  # read before hours of generation, so a bad path fails fast
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model.to(device)
    # the data (generation with hidden states, labels) on specdec's runtime where it runs the target on this CPU
    gen = loaded[2] if loaded and len(loaded) > 2 else None if loaded else _runtime_twin(target, device)
    gen = gen or model
    t0 = perf_counter()
    # resumable data is keyed on what made it: other prompts, limits or lengths start that file again
    _keyed(work / "sequences.jsonl", {"prompts": prompts, "max_new_tokens": max_new_tokens})
    _keyed(work / "self_chat.jsonl", {"max_new_tokens": max_new_tokens, "gen_batch": gen_batch, "seed": seed})
    seqs = generate_responses(gen, tok, prompts, work / "sequences.jsonl", max_new_tokens, gen_batch, device)
    chats = self_chat_data(gen, tok, self_chat, work / "self_chat.jsonl", max_new_tokens, gen_batch, seed, device)
    t_data = perf_counter() - t0
    # where each response starts: drafts are only ever asked to continue responses (as EAGLE's loss mask)
    starts = [len(encode_prompt(tok, p["prompt"], p["chat"])) for p in prompts]
    header = assistant_header(tok)
    starts += [after_last(it["ids"], header) for it in chats] + [0] * len(texts)
    seqs += chats + texts
    data = teacher_labels(gen, seqs, work / "labels.pt", device)
    for d, start in zip(data, starts):
        d["start"] = start if loss_on == "response" else 0
    vocab_map = reduced_vocab(data, reduced, models.eos_ids(model, tok), model.config.vocab_size)
    embed = model.get_input_embeddings().weight.detach().cpu()
    head = model.get_output_embeddings().weight.detach().cpu()
    decoder = model.get_decoder()
    torch.manual_seed(seed)
    net = net_for_target(model.config, init_from=(decoder.layers[-1], decoder.norm))
    t1 = perf_counter()
    # every val_every-th sequence is held out of training to pick the epoch (early stopping)
    val = [d for i, d in enumerate(data) if val_every and i % val_every == val_every - 1]
    train_data = [d for i, d in enumerate(data) if not (val_every and i % val_every == val_every - 1)] or data
    hist = train(net, train_data, embed, head, vocab_map, epochs, batch, lr, seed, work / "checkpoint.pt", device,
                 val)
    t_train = perf_counter() - t1
    model.cpu()
    fp = models.tokenizer_fingerprint(tok)
    meta = {"recipe": {"prompts": len(prompts), "self_chat": self_chat, "text_files": text_files or [],
                       "max_new_tokens": max_new_tokens, "reduced_vocab": reduced, "loss_on": loss_on,
                       "epochs": epochs, "batch": batch, "lr": lr, "seed": seed},
            "sequences": len(data), "tokens": int(sum(len(d["ids"]) for d in data)),
            "train_history": hist["epochs"], "best_epoch": hist["best_epoch"]}
    save_draft(net, vocab_map, out_dir, fp, target_name=str(target), extra=meta)
    DatastoreDrafter.save([d["ids"].tolist() for d in data], out_dir)  # for `--draft datastore:DIR` (retrieval)
    drafter = FeatureDrafter.load(out_dir, gen, fp)  # measured as it will run: on the runtime where it can
    held_out = load_prompts()[: eval_limit or None]
    rep = {**meta, "seconds": {"data": round(t_data, 1), "labels": round(t1 - t0 - t_data, 1),
                               "train": round(t_train, 1)},
           "held_out": report(gen, tok, drafter, held_out, 64, eval_tau)}
    (out_dir / "distill_report.json").write_text(json.dumps(rep, indent=2))
    return rep


def cmd_distill(args) -> int:
    rep = distill(args.target, args.out, args.prompts or [], args.text or [], args.max_new_tokens, args.gen_batch,
                  args.reduced_vocab, args.epochs, args.batch, args.lr, args.seed, args.limit, args.eval_limit,
                  args.eval_tau, args.device, args.self_chat, args.val_every, args.loss_on)
    h = rep["held_out"]
    print(json.dumps(h, indent=2))
    print(f"draft saved to {args.out}: acceptance {h['acceptance_rate']}, draft/target cost "
          f"{h['draft_cost_ratio']}, measured speedup {h['measured_speedup']}x on {h['prompts']} held-out prompts")
    return 0


def register(sub, model_args, sampling_args):
    d = sub.add_parser("distill", help="train a fast draft for a target on its own outputs")
    d.add_argument("--target", default="default")
    d.add_argument("--out", required=True, help="directory for the draft (and work/ for resumable state)")
    d.add_argument("--prompts", action="append", help="JSONL prompt files (default: the shipped distill set)")
    d.add_argument("--text", action="append", help="plain text files to add as training sequences")
    d.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    d.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's responses")
    d.add_argument("--gen-batch", type=int, default=64, help="sequences generated together")
    d.add_argument("--self-chat", type=int, default=1536,
                   help="extra synthetic conversations: the target writes a query, then answers it")
    d.add_argument("--val-every", type=int, default=50,
                   help="hold every Nth sequence out of training to pick the best epoch (0 = no split)")
    d.add_argument("--loss-on", choices=("response", "all"), default="response",
                   help="positions whose next token the draft is trained to predict: responses only (default; "
                        "prompts are context) or every position")
    d.add_argument("--reduced-vocab", type=int, default=8192, help="draft head size (most frequent target tokens)")
    d.add_argument("--epochs", type=int, default=6)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--lr", type=float, default=2e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eval-limit", type=int, default=0, help="held-out prompts for the report (0 = all)")
    d.add_argument("--eval-tau", type=int, default=4)
    d.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    d.set_defaults(func=cmd_distill)
