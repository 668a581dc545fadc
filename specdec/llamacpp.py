"""llama.cpp (through llama-cpp-python, optional) as a peer in `specdec bench --compare-llamacpp`: autoregressive
greedy decoding of the same GGUF file, on the same prompt token ids."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import InvalidRequest

INSTALL = ('pip install llama-cpp-python  (on CPUs where its native build crashes: CMAKE_ARGS="-DGGML_NATIVE=OFF '
           '-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python)')


def load(path: Path, n_ctx: int = 4096, logits_all: bool = False):
    if Path(path).suffix != ".gguf":
        raise InvalidRequest("--compare-llamacpp needs a .gguf target")
    try:
        import llama_cpp
    except ImportError:
        raise InvalidRequest(f"--compare-llamacpp needs llama-cpp-python: {INSTALL}")
    os.environ.setdefault("LLAMA_LOG_LEVEL", "error")
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), verbose=False,
                           logits_all=logits_all)


def decode(llm, ids: list[int], max_new_tokens: int, eos: set[int], params=None) -> list[int]:
    """Up to max_new_tokens tokens after `ids` (llama.cpp evaluates the prompt, then one token per step): greedy, or
    sampled with `params` (temperature, top-k, top-p, min-p; seeded)."""
    if params is not None and not params.greedy:
        llm.set_seed(params.seed if params.seed is not None else 0)
        kw = dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    else:
        kw = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
    out = []
    for token in llm.generate(ids, repeat_penalty=1.0, reset=True, **kw):
        out.append(int(token))
        if token in eos or len(out) >= max_new_tokens:
            break
    return out
