"""`specdec distill`'s data (phases 1 and 2): the target's own responses, self-chat and text, then its teacher
labels (final hidden state and argmax at every position), each resumable; the states memory-mapped from disk."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from .. import models
from ..errors import SpecDecError
from ..generate import generate_batch
from ..prompts import encode_prompt, prompt_ids
from ..runtime.weights import qlinear
from ..sampling import SamplingParams
from .progress import Budget, _progress, console


# ---- 1. data ---------------------------------------------------------------------------------------------------
# A data item is {"ids": [...], "h": final hidden states [len(ids), d] or None}. Generation records the target's
# hidden states as it goes (the same computation teacher forcing would repeat), so generated data needs no
# separate labelling pass; plain text gets one in phase 2.
def _key(inputs) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _keyed(path: Path, inputs: dict) -> None:
    """Keep a stored data file (and its hidden-state shards) only if it was made from these inputs: a resumed run
    with another length would otherwise pair old items with new settings. The self-chat data may grow or shrink
    with --self-chat (it is seeded per batch), so that count is not part of its key."""
    key = _key(inputs)
    stamp = path.with_suffix(".key")
    if path.exists() and (not stamp.exists() or stamp.read_text() != key):
        console.print(f"{path.name} was made from other inputs: generating it again")
        path.unlink()
        shutil.rmtree(path.parent / f"{path.stem}_hidden", ignore_errors=True)
    stamp.write_text(key)


def _keyed_per_item(path: Path, inputs: dict, items: list) -> None:
    """As _keyed, for data made item by item in order (one response per prompt): items made from the same
    settings and the same leading prompts are kept, so a run with a larger --limit or more prompt files only
    generates what is new; a changed prompt drops it and everything after it."""
    stamp = path.with_suffix(".key")
    new = {"settings": _key(inputs), "items": [_key(x) for x in items]}
    try:
        old = json.loads(stamp.read_text()) if path.exists() else None
    except (OSError, ValueError):
        old = None
    if path.exists() and (not isinstance(old, dict) or old.get("settings") != new["settings"]):
        _keyed(path, {"settings": new["settings"]})  # other settings: all of it again
    elif path.exists():
        same = next((i for i, (a, b) in enumerate(zip(old["items"], new["items"])) if a != b),
                    min(len(old["items"]), len(new["items"])))
        if same < len(old["items"]):  # (loading the store reads every hidden state: only when some must go)
            _Store(path).truncate(same)
    stamp.write_text(json.dumps(new))


def save_mapped(obj, path: Path):
    """torch.save to `path` (through a new file: a mapping of the old one stays valid), then the saved object read
    back memory-mapped: its tensors are the file's pages, read when touched and dropped by the OS under pressure.
    Tapped states are 12 KB a position for Qwen2.5-1.5B (4 x 1,536 fp16): held in memory, 377k positions took 15 GB
    of the machine's 24 and capped the data; mapped, the data is bounded by the disk."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
    return torch.load(path, mmap=True)


class _Store:
    """Generated sequences, appended batch by batch (resumable): ids in a JSONL file, hidden states in one
    fp16 shard per batch next to it (written first, so a line never lacks its shard), memory-mapped."""

    def __init__(self, path: Path):
        self.path, self.shards = path, path.parent / f"{path.stem}_hidden"
        self.items = []
        for i, line in enumerate(path.read_text().splitlines() if path.exists() else []):
            self.items.append({"ids": json.loads(line)["ids"], "h": None})
        for shard in sorted(self.shards.glob("*.pt")) if self.shards.exists() else []:
            first = int(shard.stem)
            for j, h in enumerate(torch.load(shard, mmap=True)):
                if first + j < len(self.items):  # the item keeps the positions that have a hidden state
                    item = self.items[first + j]
                    item["ids"], item["h"] = item["ids"][:len(h)], h

    def truncate(self, n: int) -> None:
        """Keep the first n items (one shard for them), dropping the rest."""
        if n >= len(self.items):
            return
        self.items = self.items[:n]
        shutil.rmtree(self.shards, ignore_errors=True)
        if n:
            self.shards.mkdir()
            for it, h in zip(self.items, save_mapped([it["h"] for it in self.items], self.shards / f"{0:07d}.pt")):
                it["h"] = h
        self.path.write_text("".join(line + "\n" for line in self.path.read_text().splitlines()[:n]))

    def add(self, batch: list[tuple[list[int], torch.Tensor]]) -> None:
        self.shards.mkdir(exist_ok=True)
        mapped = save_mapped([h for _, h in batch], self.shards / f"{len(self.items):07d}.pt")
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({"ids": seq}) + "\n" for seq, _ in batch))
        self.items += [{"ids": seq[:len(h)], "h": h} for (seq, _), h in zip(batch, mapped)]


@torch.inference_mode()
def generate_responses(model, tok, prompts: list[dict], path: Path, max_new_tokens: int, batch: int,
                       device: str, budget: Budget = Budget()) -> list[dict]:
    """Greedy responses, batched with left padding (resumable). A prompt's own "max_new_tokens" (its file's line)
    replaces `max_new_tokens`; a batch holds consecutive prompts with the same limit."""
    store = _Store(path)
    eos = sorted(models.eos_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    todo = prompts[len(store.items):]
    limit = [p.get("max_new_tokens") or max_new_tokens for p in todo]
    with _progress() as bar:
        task = bar.add_task("target responses", total=len(prompts), completed=len(store.items))
        i = 0
        while i < len(todo):
            budget.check("target responses")
            n = next((k for k in range(1, min(batch, len(todo) - i)) if limit[i + k] != limit[i]),
                     min(batch, len(todo) - i))
            chunk = [prompt_ids(tok, p) for p in todo[i:i + n]]
            store.add(_greedy_batch(model, chunk, limit[i], pad, eos, device))
            bar.advance(task, len(chunk))
            i += n
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
                   device: str, budget: Budget = Budget()) -> list[dict]:
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
            budget.check("self-chat data")
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


def text_sequences(tok, files: list[str], length: int = 256, texts: list[str] = ()) -> list[dict]:
    """Plain text (the files', then `texts`) cut into sequences of `length` tokens for teacher forcing."""
    read = []
    for name in files:
        try:
            read.append(Path(name).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise SpecDecError(f"cannot read text file {name}: {getattr(e, 'strerror', None) or e}")
    seqs = []
    for text in [*read, *texts]:
        ids = tok(text).input_ids
        seqs += [{"ids": ids[i:i + length], "h": None} for i in range(0, len(ids) - 8, length)]
    return seqs


# ---- 2. teacher labels -----------------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_labels(model, items: list[dict], path: Path, device: str, budget: Budget = Budget()) -> list[dict]:
    """Per sequence: final hidden states (fp16; one teacher-forcing pass where generation did not record them)
    and the target's argmax at every position; sequences labelled before (in `path`) are not labelled again."""
    done = {}  # labels already made for a sequence (an interrupted or smaller run) are reused
    if path.exists():
        done = {tuple(d["ids"].tolist()): d for d in torch.load(path, mmap=True)}
    if models.is_runtime(model):
        def features(ids):  # -> the states, and the argmax of the pass's own logits (the head as the target serves)
            cache = model.new_cache()
            try:
                logits, h = cache.forward(ids, len(ids), hidden=True)
                return h.half(), logits.argmax(-1)
            finally:
                cache.close()

        def argmax_of(h):  # from the final state (the last of the taps where the model returns several)
            return qlinear(h[:, -model.config.hidden_size:].float().contiguous(), model.head).argmax(-1)
    else:
        decoder, head = model.get_decoder(), model.get_output_embeddings()

        def features(ids):
            return decoder(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0].half(), None

        def argmax_of(h):
            return head(h.to(device, head.weight.dtype)).argmax(-1)
    out = []
    with _progress() as bar:
        task = bar.add_task("teacher labels", total=len(items))
        for it in items:
            if (old := done.get(tuple(it["ids"]))) is not None:
                out.append(old)
                bar.advance(task)
                continue
            h, argmax = it["h"], it.get("argmax")
            if h is None:
                if budget.spent():  # what is labelled so far is kept for the next run
                    save_mapped(out, path)
                    budget.check("teacher labels")
                h, passed = features(list(it["ids"]))
                argmax = passed if argmax is None else argmax
            argmax = argmax_of(h) if argmax is None else argmax
            out.append({"ids": torch.tensor(it["ids"]), "h": h.cpu(), "argmax": argmax.cpu()})
            bar.advance(task)
    return save_mapped(out, path)


def reduced_vocab(data: list[dict], size: int, must: set[int], vocab: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often (plus EOS), sorted: draft index -> target id."""
    counts = torch.zeros(vocab)
    for d in data:
        known = d["argmax"][d["argmax"] >= 0]  # (-100: a position whose next token nobody computed)
        counts.index_add_(0, known, torch.ones(len(known)))
    top = torch.argsort(counts, descending=True)[:size].tolist()
    keep = list(dict.fromkeys(sorted(must) + top))[:size]
    return torch.tensor(sorted(keep))
