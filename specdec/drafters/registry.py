"""Drafters by name. `build(spec, target)` reads a spec the CLI, API and server accept:

- `none`, `ngram`, `suffix` / `suffix:FILE` (suffix decoding: long drafts from the longest earlier match, this
  request's or an earlier output's; FILE keeps the outputs between runs), `recycle` / `recycle:FILE` (token
  recycling; FILE keeps its table between runs), `datastore` / `datastore:DIR` (retrieval), `target`, `shipped`
  (the distilled draft shipped for the default target), `distilled` (the draft `specdec distill` installed for
  this target);
- anything else names a `specdec distill` directory (a feature draft) or a draft model (directory, .gguf, name);
  a GGUF draft model runs as its 4-bit copy (runtime/four_bit.py), `keep:FILE` as its file is;
- `A+B`: A first, B when A proposes nothing.

A new drafter registers a builder under its name (`@register("name")`); nothing outside this package changes."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .. import models
from ..cachedir import cache_root
from ..errors import IncompatibleDraft, InvalidRequest
from .base import NoDrafter
from .chain import ChainDrafter
from .datastore import FILE as DATASTORE_FILE
from .datastore import DatastoreDrafter
from .eagle3 import Eagle3Drafter, is_eagle3
from .feature import FeatureDrafter
from .feature_files import MARKER, check_target, is_feature_draft
from .model import ModelDrafter
from .ngram import NgramDrafter
from .recycle import RecycleDrafter, load_tables
from .suffix import SuffixDrafter, load_stores
from .vocab import kept_ids, load_counts, split_trim

SHIPPED_DRAFT = Path(__file__).parent.parent / "drafts" / "smollm2-135m-instruct"  # trained by `specdec distill`


@dataclass
class Target:
    """What a drafter may need of its target: the model, its tokenizer, the spec it was loaded from, the backend
    for draft models, and draft models already loaded (by name)."""
    model: object
    tokenizer: object
    spec: str | None = None
    backend: str = "auto"
    loaded: dict = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    @cached_property
    def fingerprint(self) -> str:
        return models.tokenizer_fingerprint(self.tokenizer)


BUILDERS: dict[str, Callable[[str, Target], object]] = {}


def register(name: str):
    def add(builder):
        BUILDERS[name] = builder
        return builder
    return add


def build(spec: str, target: Target):
    if "+" in spec and not Path(spec).exists():
        members = [build(part, target) for part in spec.split("+")]
        readers = [m for m in members if getattr(m, "wants_target_hidden", False)]
        if len(readers) > 1 and any(isinstance(m, Eagle3Drafter) for m in readers):
            raise InvalidRequest(f"--draft {spec!r}: an EAGLE-3 head and another feature draft read different "
                                 "states of the target; chain one of them")
        return ChainDrafter(members)
    if ":vocab=" in spec and not Path(spec).exists():
        return _trimmed(spec, target)
    head = spec.split(":", 1)[0]
    if head in BUILDERS and not Path(spec).exists():
        return BUILDERS[head](spec, target)
    return _draft_model(spec, target)


@register("distilled")
def _distilled(spec, target):
    from .feature_files import installed_draft
    path = installed_draft(target.spec) if target.spec else None
    if path is None or not is_feature_draft(path):
        raise InvalidRequest(f"no distilled draft for this target: `specdec distill --target {target.spec or 'T'}` "
                             "(without --out) installs one")
    return _draft_model(str(path), target)


@register("none")
def _none(spec, target):
    return NoDrafter()


@register("ngram")
def _ngram(spec, target):
    return NgramDrafter()


@register("suffix")
def _suffix(spec, target):
    """`suffix`: earlier outputs kept while the process runs; `suffix:FILE` keeps them in FILE between runs."""
    if ":" not in spec:
        return SuffixDrafter()
    name = spec.split(":", 1)[1]
    if not name or Path(name).is_dir():
        raise InvalidRequest(f"--draft {spec!r}: suffix:FILE needs a file name (the store is kept there)")
    path, meta = Path(name), {"fingerprint": target.fingerprint, "vocab": target.vocab}
    return SuffixDrafter(load_stores(path, meta, target.vocab), path, meta)


@register("recycle")
def _recycle(spec, target):
    """`recycle`: a table in the cache directory, one per target vocabulary; `recycle:FILE` names the file."""
    path = Path(spec.split(":", 1)[1]) if ":" in spec else recycle_file(target.fingerprint)
    return RecycleDrafter(load_tables(path, target.vocab, target.fingerprint), path)


def recycle_file(fingerprint: str) -> Path:
    return cache_root() / "recycle" / f"{fingerprint}.safetensors"


@register("datastore")
def _datastore(spec, target):
    """'datastore' = the one `specdec datastore build` made for this target, else the shipped draft's;
    'datastore:DIR' = a `specdec distill` or `specdec datastore build --out` directory's (or a .safetensors)."""
    from .datastore import check_datastore, datastore_dir
    if spec == "datastore":
        built = datastore_dir(target.spec) if target.spec else None
        src = built if built is not None and (built / DATASTORE_FILE).exists() else SHIPPED_DRAFT
    else:
        src = models.resolve(spec.split(":", 1)[1])
    if Path(src).is_dir() and is_feature_draft(src):
        try:
            check_target(json.loads((src / MARKER).read_text()), src, target.fingerprint, "datastore")
        except IncompatibleDraft as e:
            raise IncompatibleDraft(f"{e}; `specdec datastore build --target TARGET` builds one for this target") \
                from None
    elif Path(src).is_dir():
        check_datastore(src, target.fingerprint)
    return DatastoreDrafter.load(src, target.vocab, name=spec)


@register("target")
def _target(spec, target):
    drafter = ModelDrafter(target.model, target.vocab, name="target")
    drafter.draft_cache = None  # its slots are in the target's own pool, which the target's prefix cache bounds
    return drafter


@register("shipped")
def _shipped(spec, target):
    return _draft_model(spec, target)


@register("keep")
def _keep(spec, target):
    """`keep:FILE`: a GGUF draft model run as its file is, not as its 4-bit copy."""
    if not spec.split(":", 1)[1]:
        raise InvalidRequest("--draft keep:FILE needs a draft model file")
    return _draft_model(spec.split(":", 1)[1], target, name=spec, four_bit=False)


def _trimmed(spec: str, target: Target):
    """`FILE:vocab=N` (or `keep:FILE:vocab=N`): a draft model whose head keeps N token ids (drafters/vocab.py)."""
    try:
        base, n = split_trim(spec)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    keep = base.startswith("keep:")
    file = base.split(":", 1)[1] if keep else base
    if file in BUILDERS or file == target.spec:
        raise InvalidRequest(f"--draft {spec!r}: vocab=N trims a draft model file's head, not {file!r}'s")
    drafter = _draft_model(file, target, name=spec, four_bit=not keep)
    model = getattr(drafter.lm, "model", None) if isinstance(drafter, ModelDrafter) else None
    if not hasattr(model, "keep_head_rows"):
        raise InvalidRequest(f"--draft {spec!r}: vocab=N needs a draft model on specdec's runtime (a GGUF file, or "
                             "--backend runtime)")
    if model.head_ids is None:  # (loaded once per spec: target.loaded)
        counts = load_counts(target.spec)
        model.keep_head_rows(kept_ids(target.vocab, n, models.eos_ids(target.model, target.tokenizer), counts))
        source = ("the most frequent in the target's counted text" if counts else
                  f"the lowest ids; `specdec vocab --target {target.spec}` counts the target's own text")
        print(f"specdec: draft head trimmed to {len(model.head_ids):,} of {target.vocab:,} token ids ({source})",
              file=sys.stderr)
    return drafter


def _draft_model(spec: str, target: Target, name: str | None = None, four_bit: bool = True):
    name = name or str(spec)
    if spec == target.spec:
        return _target(spec, target)
    if name in target.loaded:
        return ModelDrafter(target.loaded[name], target.vocab, name=name)
    path = SHIPPED_DRAFT if spec == "shipped" else models.resolve(spec)
    if is_eagle3(path):
        return Eagle3Drafter.load(path, target.model, name=name)
    if is_feature_draft(path):
        name = f"shipped:{SHIPPED_DRAFT.name}" if Path(path) == SHIPPED_DRAFT else name
        return FeatureDrafter.load(path, target.model, target.fingerprint, name=name)
    if four_bit and target.backend != "transformers" and path.is_file() and path.suffix == ".gguf":
        path = _four_bit(path)
    draft_model, draft_tok = models.load(str(path), backend=target.backend)
    models.check_compatible(target.tokenizer, draft_tok, spec)
    target.loaded[name] = draft_model
    return ModelDrafter(draft_model, target.vocab, name=name)


def _four_bit(path: Path) -> Path:
    """A GGUF draft's 4-bit copy (runtime/four_bit.py: its step reads fewer bytes; the output cannot change), or the
    file itself where the copy cannot be made (one stderr line)."""
    from ..runtime.four_bit import four_bit_copy
    try:
        return four_bit_copy(path)
    except (OSError, ValueError) as e:
        print(f"specdec: no 4-bit copy of the draft {path.name} ({e}); it runs as its file is", file=sys.stderr)
        return path
