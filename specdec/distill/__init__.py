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
              accepted length, draft ms per drafted token as a share of a target-only step (as
              `bench`'s draft_share_of_pass), predicted and measured speedup.
Every phase resumes from what an interrupted run left in OUT/work.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from time import perf_counter

import torch

from .. import models
from ..cli import threads_arg
from ..drafters.datastore import DatastoreDrafter
from ..drafters.feature import FeatureDrafter, target_identity
from ..drafters.feature_net import last_layer, net_for_target, save_draft
from ..errors import InvalidRequest, SpecDecError
from ..fim import fim_tokens
from ..prompts import load_prompts, prompt_ids
from ..prompts.stdlib import corpus as stdlib_corpus
from .data import (
    _keyed,
    _keyed_per_item,
    after_last,
    assistant_header,
    generate_responses,
    pre_query,
    reduced_vocab,
    self_chat_data,
    teacher_labels,
    text_sequences,
)
from .progress import DEFAULT_PROMPTS, Budget, BudgetSpent, Ledger
from .training import default_lr, start_from, train

__all__ = ["after_last", "assistant_header", "distill", "generate_responses", "pre_query", "reduced_vocab", "report",
           "self_chat_data", "teacher_labels", "text_sequences"]


# ---- 5. report -------------------------------------------------------------------------------------------------
def report(target_model, tok, drafter, prompts: list[dict], max_new_tokens: int, tau: int) -> dict:
    from ..api import SpecDecoder
    from ..costs import cost_model, verify_curve
    from ..trace import acceptance_by_position
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
    curve = verify_curve(recs) | {1: t_target}
    overhead = sum(r.cycle_ms - r.draft_ms - r.verify_ms for r in recs) / len(recs)
    accepted = sum(r.accepted for r in recs)
    # a draft too unsure to propose anything has no acceptance rate and no cost per drafted token
    c_ms = sum(r.draft_ms for r in recs) / proposed if proposed else None
    step_ms = 1e3 * t_base / n_base  # a target-only step, everything included: bench's draft_share_of_pass
    per_token = None if c_ms is None else {
        "draft_ms_per_token": round(c_ms, 3), "draft_cost_ratio": round(c_ms / step_ms, 4),
        "predicted_speedup": round(cost_model(alphas, tau, c_ms, curve, overhead, t_target), 3)}
    return {"prompts": len(prompts), "tau": tau, "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "acceptance_by_position": alphas, "mean_accepted_len": round(accepted / len(recs), 4),
            "target_pass_ms": round(t_target, 3),
            **(per_token or dict.fromkeys(("draft_ms_per_token", "draft_cost_ratio", "predicted_speedup"))),
            "measured_speedup": round((n_spec / t_spec) / (n_base / t_base), 3), "identical_to_target": identical}


# ---- the command -----------------------------------------------------------------------------------------------
def fused_taps(layers: int) -> tuple[int, int, int]:
    """The layers whose input an EAGLE-3-style draft reads: low, middle and high (EAGLE-3's trainers' 2, L/2, L-3)."""
    return (min(2, layers - 1), layers // 2, max(0, layers - 3))



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
            gen_batch: int = 64, reduced: int = 8192, epochs: int = 6, batch: int = 8, lr: float | None = None,
            seed: int = 0, limit: int = 0, eval_limit: int = 0, eval_tau: int = 4, device: str = "auto",
            self_chat: int = 1536, val_every: int = 50, loss_on: str = "response", loaded=None,
            ffn: int | None = None, noise: float = 0.0, stdlib_text: int = 0, features: str = "final",
            budget_minutes: float | None = None, unroll: int = 2, init_from: str | None = None) -> dict:
    """-> the report (distill_report.json); raises BudgetSpent where `budget_minutes` ran out first (what was done
    is kept in OUT/work: the same call goes on from there). `features`: "final" (EAGLE: the target's final hidden
    state) or "fused" (EAGLE-3: its low, middle and high layers fused, trained on its distributions; a target on
    specdec's runtime). `unroll`: the draft positions trained (training.train). `init_from`: a draft of this
    target and shape (its directory or file) to train on from, instead of the target's last layer: more data or
    epochs for a draft without training it again from the start."""
    if max_new_tokens < 1 or gen_batch < 1 or epochs < 1 or batch < 1 or (lr is not None and lr <= 0) \
            or eval_tau < 1:
        raise InvalidRequest("--max-new-tokens, --gen-batch, --epochs, --batch and --eval-tau must be >= 1, "
                             "--lr > 0")
    if isinstance(unroll, bool) or not isinstance(unroll, int) or not 1 <= unroll <= 8:
        raise InvalidRequest(f"--unroll must be an integer from 1 to 8, got {unroll!r}")
    if self_chat < 0 or val_every < 0 or stdlib_text < 0:
        raise InvalidRequest("--self-chat, --val-every and --stdlib-text must be >= 0")
    if not 0 <= noise < 1:
        raise InvalidRequest(f"--feature-noise must be in [0, 1), got {noise}")
    if reduced < 2:
        raise InvalidRequest("--reduced-vocab must be >= 2")
    if ffn is not None and (isinstance(ffn, bool) or not isinstance(ffn, int) or ffn < 32 or ffn % 32):
        raise InvalidRequest(f"--draft-ffn must be a positive multiple of 32 (the kernels' block), got {ffn!r}")
    if features not in ("final", "fused"):
        raise InvalidRequest(f"--features must be 'final' or 'fused', got {features!r}")
    if budget_minutes is not None and not budget_minutes > 0:
        raise InvalidRequest(f"--budget-minutes must be > 0, got {budget_minutes}")
    if loss_on not in ("response", "all"):
        raise InvalidRequest(f"--loss-on must be 'response' or 'all', got {loss_on!r}")
    out_dir, work = Path(out), Path(out) / "work"
    try:
        work.mkdir(parents=True, exist_ok=True)
        (work / ".write-test").write_text("ok")
    except OSError as e:
        raise SpecDecError(f"cannot write to {out}: {e.strerror}")
    prompts = [p for f in (prompt_files or DEFAULT_PROMPTS) for p in load_prompts(f, fim=True)]
    if limit:
        prompts = prompts[:limit]
    budget, fused = Budget(budget_minutes), features == "fused"
    if fused:  # everything on the runtime: its layers are tapped, its embedding and head dequantized for training
        model, tok = loaded[:2] if loaded else models.load(target, backend="runtime")
        if not models.is_runtime(model):
            raise InvalidRequest("--features fused taps the target's inner layers: give a target specdec's runtime "
                                 "runs (a GGUF file, or a Llama-family checkpoint)")
        device = "cpu"
    else:
        model, tok = loaded[:2] if loaded else models.load(target, backend="transformers")  # training: transformers
    if any("suffix" in p for p in prompts) and fim_tokens(tok) is None:
        raise InvalidRequest("the prompts include fill-in-the-middle ones (mode fim), and this target has no FIM "
                             "tokens: leave that file out")
    if reduced > model.config.vocab_size:
        raise InvalidRequest(f"--reduced-vocab {reduced} exceeds the target's vocabulary ({model.config.vocab_size})")
    # read before hours of generation, so a bad path fails fast
    texts = text_sequences(tok, text_files or [], texts=stdlib_corpus(tok, stdlib_text) if stdlib_text else [])
    if fused:
        gen, taps = model, fused_taps(model.config.num_hidden_layers)
        gen.feature_layers = (*taps, model.config.num_hidden_layers)  # ... and the final state, for the labels
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        model.to(device)
        # the data (generation with hidden states, labels) on specdec's runtime where it runs the target on this CPU
        gen = loaded[2] if loaded and len(loaded) > 2 else None if loaded else _runtime_twin(target, device)
        gen = gen or model
    torch.manual_seed(seed)  # the draft, and the one it goes on from, before hours of data: a bad one fails fast
    if ffn is not None and ffn > model.config.intermediate_size:
        raise InvalidRequest(f"--draft-ffn {ffn} is wider than the target's own {model.config.intermediate_size}")
    net = net_for_target(model.config, init_from=last_layer(model), ffn=ffn, taps=taps if fused else None)
    origin = start_from(net, init_from, models.tokenizer_fingerprint(tok),
                        target_identity(model) if models.is_runtime(model) else None) if init_from else None
    t0 = perf_counter()
    # resumable data is keyed on what made it: other prompts, limits, lengths or taps start that file again
    tapped = {"taps": list(gen.feature_layers)} if fused else {}
    _keyed_per_item(work / "sequences.jsonl", {"max_new_tokens": max_new_tokens, **tapped}, prompts)
    _keyed(work / "self_chat.jsonl", {"max_new_tokens": max_new_tokens, "gen_batch": gen_batch, "seed": seed,
                                      **tapped})
    ledger = Ledger(work / "seconds.json")
    with ledger.phase("data"):
        seqs = generate_responses(gen, tok, prompts, work / "sequences.jsonl", max_new_tokens, gen_batch, device,
                                  budget)
        chats = self_chat_data(gen, tok, self_chat, work / "self_chat.jsonl", max_new_tokens, gen_batch, seed,
                               device, budget)
    t_data = perf_counter() - t0
    if fused:  # greedy answers: the target's argmax at a position is the next token (no labelling pass)
        for it in seqs + chats:
            it["argmax"] = torch.tensor([*it["ids"][1:], -100])
    # where each response starts: drafts are only ever asked to continue responses (as EAGLE's loss mask)
    starts = [len(prompt_ids(tok, p)) for p in prompts]
    header = assistant_header(tok)
    starts += [after_last(it["ids"], header) for it in chats] + [0] * len(texts)
    answered = sum(len(it["ids"]) - s for it, s in zip(seqs + chats, starts))  # tokens the target generated as answers
    seqs += chats + texts
    with ledger.phase("labels"):
        data = teacher_labels(gen, seqs, work / ("labels_fused.pt" if fused else "labels.pt"), device, budget)
    for d, start in zip(data, starts):
        d["start"] = start if loss_on == "response" else 0
    vocab_map = reduced_vocab(data, reduced, models.eos_ids(model, tok), model.config.vocab_size)
    if fused:
        embed, head = model.embed.dequantize(), model.head.take(vocab_map).dequantize()
    else:
        embed = model.get_input_embeddings().weight.detach().cpu()
        head = model.get_output_embeddings().weight.detach().cpu()[vocab_map]
    t1 = perf_counter()
    # every val_every-th sequence is held out of training to pick the epoch (early stopping)
    val = [d for i, d in enumerate(data) if val_every and i % val_every == val_every - 1]
    train_data = [d for i, d in enumerate(data) if not (val_every and i % val_every == val_every - 1)] or data
    lr = lr or default_lr(model.config.hidden_size)
    # a resumed run with another shape, schedule or data starts training again
    _keyed(work / "checkpoint.pt", {"net": net.cfg, "lr": lr, "epochs": epochs, "batch": batch, "seed": seed,
                                    **({"noise": noise} if noise else {}),
                                    **({"unroll": unroll} if unroll != 2 else {}),
                                    **({"init_from": origin["sha256"]} if origin else {}),
                                    "data": [len(d["ids"]) for d in train_data]})
    with ledger.phase("train"):
        hist = train(net, train_data, embed, head, vocab_map, epochs, batch, lr, seed, work / "checkpoint.pt",
                     device, val, noise, budget, unroll, warm=origin is not None)
    t_train = perf_counter() - t1
    if not fused:
        model.cpu()
    gen.feature_layers = None
    fp = models.tokenizer_fingerprint(tok)
    meta = {"recipe": {"prompts": len(prompts), "self_chat": self_chat, "text_files": text_files or [],
                       "stdlib_text": stdlib_text,
                       "max_new_tokens": max_new_tokens, "reduced_vocab": reduced, "loss_on": loss_on,
                       "epochs": epochs, "batch": batch, "lr": lr, "seed": seed, "feature_noise": noise,
                       "unroll": unroll, **({"init_from": origin["recipe"]} if origin else {}),
                       "embedding_gain": hist["embedding_gain"]},
            "sequences": len(data), "tokens": int(sum(len(d["ids"]) for d in data)), "answer_tokens": answered,
            "train_history": hist["epochs"], "best_epoch": hist["best_epoch"], "train_curve": hist["curve"],
            **({"features": "fused", "taps": list(taps), "target_sha256": target_identity(model)} if fused else {})}
    save_draft(net, vocab_map, out_dir, fp, target_name=str(target), extra=meta)
    DatastoreDrafter.save([d["ids"].tolist() for d in data], out_dir)  # for `--draft datastore:DIR` (retrieval)
    drafter = FeatureDrafter.load(out_dir, gen, fp)  # measured as it will run: on the runtime where it can
    held_out = load_prompts()[: eval_limit or None]
    rep = {**meta, "seconds": {"data": round(t_data, 1), "labels": round(t1 - t0 - t_data, 1),
                               "train": round(t_train, 1)},
           "seconds_all_runs": ledger.totals,
           "held_out": report(gen, tok, drafter, held_out, 64, eval_tau)}
    (out_dir / "distill_report.json").write_text(json.dumps(rep, indent=2))
    from ..charts import training
    training(hist["curve"], hist["epochs"], str(out_dir / "training.png"),
             f"specdec distill {Path(str(target)).name} ({features} features)")
    return rep


BUDGET_SPENT = 75  # the exit status of a run whose --budget-minutes ran out (sysexits' EX_TEMPFAIL: run it again)


def cmd_distill(args) -> int:
    from ..drafters.feature_files import installed_draft
    args.out = args.out or str(installed_draft(args.target))
    try:
        rep = distill(args.target, args.out, args.prompts or [], args.text or [], args.max_new_tokens, args.gen_batch,
                      args.reduced_vocab, args.epochs, args.batch, args.lr, args.seed, args.limit, args.eval_limit,
                      args.eval_tau, args.device, args.self_chat, args.val_every, args.loss_on, ffn=args.draft_ffn,
                      noise=args.feature_noise, stdlib_text=args.stdlib_text, features=args.features,
                      budget_minutes=args.budget_minutes, unroll=args.unroll, init_from=args.init_from)
    except BudgetSpent as e:
        print(f"distill: the {args.budget_minutes}-minute budget ran out during {e}; what was done is kept in "
              f"{args.out}/work: run the same command again to go on", file=sys.stderr)
        return BUDGET_SPENT
    h = rep["held_out"]
    print(json.dumps(h, indent=2))
    if h["acceptance_rate"] is None:
        drafted = "it proposed nothing (too unsure: train it on more data)"
    else:
        drafted = f"acceptance {h['acceptance_rate']}, draft/target cost {h['draft_cost_ratio']}"
    print(f"draft saved to {args.out}: {drafted}, measured speedup {h['measured_speedup']}x on {h['prompts']} "
          "held-out prompts")
    return 0


def register(sub, model_args, sampling_args):
    d = sub.add_parser("distill", help="train a fast draft for a target on its own outputs")
    d.add_argument("--target", default="default")
    d.add_argument("--out", default=None,
                   help="directory for the draft (and work/ for resumable state); default: the target's own draft "
                        "directory in the cache, which `--draft distilled` runs")
    d.add_argument("--prompts", action="append", help="JSONL prompt files (default: the shipped distill set)")
    d.add_argument("--text", action="append", help="plain text files to add as training sequences")
    d.add_argument("--stdlib-text", type=int, default=0, metavar="N",
                   help="add N tokens of the standard library's modules and a third as many of the language "
                        "reference as teacher-forced text (0 = none)")
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
    d.add_argument("--draft-ffn", type=int, default=None,
                   help="the draft layer's feed-forward width (default: the target's; narrower is a cheaper step)")
    d.add_argument("--feature-noise", type=float, default=0.0,
                   help="EAGLE's training noise on the target features: uniform, this half-width in units of their "
                        "RMS (a regulariser; 0 = none)")
    d.add_argument("--features", choices=("final", "fused"), default="final",
                   help="what the draft reads: the target's final hidden state (EAGLE), or its low, middle and high "
                        "layers fused and trained on its distributions (EAGLE-3; a target on specdec's runtime)")
    d.add_argument("--budget-minutes", type=float, default=None, metavar="M",
                   help="stop after M minutes, keeping what was done (exit status 75); the same command goes on")
    d.add_argument("--epochs", type=int, default=6)
    d.add_argument("--unroll", type=int, default=2,
                   help="draft positions trained: 1 on the target's features, each further one on the draft's own "
                        "prediction from the one before (EAGLE-3's training-time test)")
    d.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="train on from this draft of the same target and shape (a directory or its safetensors "
                        "file) instead of from the target's last layer: new data or epochs without starting again")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 2e-3 for a 576-wide target, scaled as 1/width above that)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eval-limit", type=int, default=0, help="held-out prompts for the report (0 = all)")
    d.add_argument("--eval-tau", type=int, default=4)
    d.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    threads_arg(d)
    d.set_defaults(func=cmd_distill)
