"""`specdec distill`'s training (phase 3): the draft layer against the target's next hidden state and argmax, on the
target's features and, unrolled, on its own; resumable from a checkpoint."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch
from torch.nn import functional as F

from ..drafters.feature_files import check_target, read_draft
from ..errors import InvalidRequest
from .progress import Budget, _progress, console


# ---- 3. training -----------------------------------------------------------------------------------------------
def _batch(items, embed, to_reduced, device):
    """-> embeddings, the features each position reads (the previous position's final state, or its tapped states
    side by side where the data holds taps before the final state), the final states, labels."""
    T = max(len(d["ids"]) for d in items)
    d_model = embed.shape[1]
    width = items[0]["h"].shape[1]
    B = len(items)
    emb = torch.zeros(B, T, d_model)
    feat_in = torch.zeros(B, T, max(d_model, width - d_model))
    target_h = torch.zeros(B, T, d_model)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, d in enumerate(items):
        n = len(d["ids"])
        emb[b, :n] = embed[d["ids"]]
        h = d["h"].float()
        feat_in[b, 1:n] = h[:-1, :-d_model] if width > d_model else h[:-1]
        target_h[b, :n] = h[:, -d_model:]
        labels[b, :n] = torch.where(d["argmax"] >= 0, to_reduced[d["argmax"].clamp(min=0)], -100)
        labels[b, :max(0, d.get("start", 0) - 1)] = -100  # position j predicts token j + 1
    return [t.to(device) for t in (emb, feat_in, target_h, labels)]


def _loss(net, head_r, emb, feat_in, target_h, labels, noise: float = 0.0):
    """-> predicted features, regression loss, token loss, argmax agreement. The token loss is cross-entropy with
    the target's argmax, or, for a fused-feature draft (EAGLE-3), with the target's whole distribution over the
    reduced vocabulary (softmax of its final state through the same head rows). `noise`: EAGLE's uniform feature
    noise, this half-width in the features' RMS."""
    fused = feat_in.shape[-1] != net.cfg["hidden"]
    feat = net.fused(feat_in) * (feat_in.abs().sum(-1, keepdim=True) > 0) if fused else feat_in
    if noise:
        feat = feat + (torch.rand_like(feat) * 2 - 1) * noise * feat.pow(2).mean().sqrt().detach()
    pred, _ = net(emb, feat, 0)
    mask = target_h.abs().sum(-1, keepdim=True) > 0  # real positions (padding is all zeros)
    reg = (F.smooth_l1_loss(pred, target_h, reduction="none") * mask).sum() / mask.sum() / pred.shape[-1]
    logits = pred @ head_r.T
    if "taps" in net.cfg:
        with torch.no_grad():
            p = torch.softmax((target_h @ head_r.T).float(), -1)
        keep = labels != -100
        ce = -(p[keep] * torch.log_softmax(logits[keep].float(), -1)).sum(-1).mean()
    else:
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    acc = (logits.argmax(-1) == labels)[labels != -100].float().mean()
    return pred, reg, ce, acc


@torch.no_grad()
def evaluate(net, head_r, data, embed, to_reduced, batch: int, device: str) -> dict:
    """Teacher-forced argmax agreement with the target on `data`: from target features (draft position 1) and
    from the draft's own features (positions 2 and 3)."""
    net.eval()
    hits = {"acc": 0.0, "acc2": 0.0, "acc3": 0.0}
    n = 0
    for i in range(0, len(data), batch):
        emb, feat_in, target_h, labels = _batch(data[i:i + batch], embed, to_reduced, device)
        m = int((labels != -100).sum())
        for key in hits:  # acc: from the target's features; acc2, acc3: from the draft's own, one and two steps on
            pred, _, _, acc = _loss(net, head_r, emb, feat_in, target_h, labels)
            hits[key] += float(acc) * m
            feat_in = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
        n += m
    net.train()
    return {k: round(v / max(1, n), 4) for k, v in hits.items()}


def mixed_precision(device: str):
    """bf16 autocast for training where the hardware does bf16 matmuls (weights and optimizer stay fp32):
    1.45x the fp32 training throughput on this project's CPU (Zen 4, AVX512-BF16), same loss to 1e-3."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    ok = torch.cuda.is_bf16_supported() if kind == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=ok)


def default_lr(hidden: int) -> float:
    """AdamW's peak rate for a draft layer `hidden` wide: 2e-3 at SmolLM2-135M's 576 (the shipped draft), and
    width^-1.5 above it, which puts Qwen2.5-Coder-1.5B's 1,536 at 4.6e-4. On that target, 150 steps reached
    7.7% held-out agreement at 2e-3, 21.8% at 1e-3, 24.8% at 5e-4 and 18.0% at 2e-4 (CHANGELOG.md, "A feature draft
    for Qwen2.5-Coder-1.5B")."""
    return 2e-3 * min(1.0, 576 / hidden) ** 1.5


def embedding_gain(embed: torch.Tensor, data: list[dict]) -> float:
    """How much larger the target's hidden states are than its embeddings (RMS over all entries). The draft's
    input is [embedding; hidden state]: Qwen2.5's embeddings are 250x smaller than its final hidden states, so
    the token just chosen is all but invisible to a freshly initialised fc. Training feeds embeddings times this
    gain, and fold_embedding_gain moves it into fc's weights, so the saved draft takes the raw embedding."""
    return hidden_rms(data, embed.shape[1]) / float(embed.float().pow(2).mean().sqrt())


def hidden_rms(data: list[dict], width: int) -> float:
    """RMS of the final hidden states (the last `width` columns of each item's states)."""
    return float(torch.cat([d["h"][:256, -width:].float() for d in data[:64]]).pow(2).mean().sqrt())


@torch.no_grad()
def fold_embedding_gain(net, gain: float) -> None:
    net.fc.weight[:, : net.cfg["hidden"]] *= gain  # fc([g·e; h]) == fc'([e; h])


def start_from(net, path: str, target_fingerprint: str, target_sha256: str | None) -> dict:
    """Load the draft at `path` (a directory or its safetensors file) into `net`, which training then goes on
    from: it must serve this target and have `net`'s shape. -> its file's sha256 (what a checkpoint is keyed on)
    and its recipe. Its fc still takes raw embeddings: `train(..., warm=True)` scales them back."""
    try:
        meta, weights = read_draft(path)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidRequest(f"--init-from {path}: not a draft ({getattr(e, 'strerror', None) or e})") from None
    check_target(meta, path, target_fingerprint, "--init-from draft", target_sha256)
    if meta.get("net") != net.cfg:
        raise InvalidRequest(f"--init-from {path}: its layer is {meta.get('net')}, this run's is {net.cfg} "
                             "(the same --draft-ffn and --features are needed)")
    weights.pop("vocab_map", None)  # the head rows are the target's, chosen again from this run's data
    net.load_state_dict({k: v.float() for k, v in weights.items()})
    file = Path(path) if Path(path).is_file() else Path(path) / "model.safetensors"
    return {"sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "recipe": {"path": str(path), **{k: meta[k] for k in ("recipe", "sequences", "tokens") if k in meta}}}


CHECKPOINT_STEPS = 200  # a checkpoint inside an epoch this often (a run killed loses at most this many steps)


def train(net, data, embed, head_r, vocab_map, epochs: int, batch: int, lr: float, seed: int, ckpt: Path,
          device: str, val: list[dict] | None = None, noise: float = 0.0, budget: Budget = Budget(),
          unroll: int = 2, warm: bool = False) -> dict:
    """AdamW + one-cycle schedule over `head_r` (the target's head rows for `vocab_map`); after each epoch the
    validation split (sequences never trained on) is scored and the best epoch's weights are kept (early
    stopping). Trains on embeddings scaled by embedding_gain and returns a net that takes raw ones. `noise`: EAGLE's
    feature noise, uniform with this half-width in units of the features' RMS, added to the target features the
    draft reads (a regulariser, and what the draft's own inexact features look like from position 2 on).
    Checkpointed every CHECKPOINT_STEPS steps and each epoch; resumes mid-epoch; raises BudgetSpent (checkpointed)
    when `budget` runs out. The result's `curve` is the training loss and agreement every 50 steps. `unroll`: the
    draft positions trained (EAGLE-3's training-time test): position 1 reads the target's features, position k the
    draft's own prediction from position k - 1 (detached), each at half the first's weight. `warm`: `net` is a
    trained draft (start_from), its fused norm kept and its fc brought back to the scaled embeddings."""
    torch.manual_seed(seed)
    net.to(device).train()
    fused = "taps" in net.cfg
    gain = embedding_gain(embed, data)
    if warm:  # a saved draft takes raw embeddings (fold_embedding_gain): undone, with this data's gain
        fold_embedding_gain(net, 1 / gain)
    elif fused:  # the fused feature starts at the final state's scale: what the draft's own features will have
        with torch.no_grad():
            net.fuse_norm.weight.fill_(hidden_rms(data, embed.shape[1]))
    half_width = 0.0 if fused else noise * hidden_rms(data, embed.shape[1])
    embed, head_r = embed.float() * gain, head_r.float().to(device)
    to_reduced = torch.full((embed.shape[0],), -100, dtype=torch.long)
    to_reduced[vocab_map] = torch.arange(len(vocab_map))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    order = sorted(range(len(data)), key=lambda i: len(data[i]["ids"]))  # similar lengths batch together
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)
    at = {"epoch": 0, "step": 0, "history": [], "best": None, "sums": None, "curve": []}
    if ckpt.exists():
        state = torch.load(ckpt)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        at = {**at, **{k: state[k] for k in at if k in state}}
        console.print(f"resuming training from epoch {at['epoch'] + 1}, step {at['step']}")

    def save():
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), **at}, ckpt)

    with _progress() as bar:
        task = bar.add_task("training", total=total, completed=at["epoch"] * len(batches) + at["step"])
        for epoch in range(at["epoch"], epochs):
            rng_epoch = random.Random(seed * 1_000_003 + epoch)  # same order whether resumed or not
            sums = at["sums"] or {"reg": 0.0, "ce": 0.0, "acc": 0.0, "acc2": 0.0}
            for step, idx in enumerate(rng_epoch.sample(batches, len(batches))):
                if step < at["step"]:
                    continue
                if budget.spent():
                    at.update(step=step, sums=sums)
                    save()
                    budget.check("training")
                emb, feat_in, target_h, labels = _batch([data[i] for i in idx], embed, to_reduced, device)
                if half_width:
                    feat_in = feat_in + (torch.rand_like(feat_in) * 2 - 1) * half_width
                with mixed_precision(device):
                    pred, reg, ce, acc = _loss(net, head_r, emb, feat_in, target_h, labels, noise if fused else 0)
                    loss, acc2 = ce + reg, acc
                    for k in range(2, unroll + 1):  # draft position k reads what the draft predicted at k - 1
                        own = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1].detach()], 1)
                        pred, reg_k, ce_k, acc_k = _loss(net, head_r, emb, own, target_h, labels)
                        loss = loss + 0.5 * (ce_k + reg_k)
                        acc2 = acc_k if k == 2 else acc2
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                for k, v in (("reg", reg), ("ce", ce), ("acc", acc), ("acc2", acc2)):
                    sums[k] += float(v.detach())
                done = epoch * len(batches) + step + 1
                if done % 50 == 0:
                    at["curve"].append({"step": done, "loss": round(float(loss.detach()), 4),
                                        "acc": round(float(acc), 4), "acc2": round(float(acc2), 4)})
                if done % CHECKPOINT_STEPS == 0:
                    at.update(step=step + 1, sums=sums)
                    save()
                bar.update(task, advance=1, description=f"training e{epoch + 1} acc {float(acc):.2f}")
            row = {k: round(v / len(batches), 4) for k, v in sums.items()}
            if val:
                row["val"] = evaluate(net, head_r, val, embed, to_reduced, batch, device)
                score = sum(row["val"].get(k, 0.0) for k in ("acc", "acc2", "acc3"))
                if at["best"] is None or score > at["best"]["score"]:
                    at["best"] = {"score": score, "epoch": epoch + 1,
                                  "net": {k: v.detach().clone() for k, v in net.state_dict().items()}}
            at["history"].append(row)
            console.print(f"epoch {epoch + 1}: {row}")
            at.update(epoch=epoch + 1, step=0, sums=None)
            save()
    if at["best"] is not None:
        net.load_state_dict(at["best"]["net"])
    net.cpu().eval()
    fold_embedding_gain(net, gain)
    return {"epochs": at["history"], "best_epoch": at["best"]["epoch"] if at["best"] else epochs,
            "embedding_gain": round(gain, 3), "curve": at["curve"]}
