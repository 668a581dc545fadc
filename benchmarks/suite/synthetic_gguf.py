"""A synthetic 1B-class Llama GGUF in llama.cpp's Q4_K_M layout (random weights, the real tensor types), and the
runtime against llama.cpp on it: decode tokens/s, the verify curve (1..16 rows per pass) and peak resident memory.

    python benchmarks/runtime.py synthetic-gguf --out /tmp/synth-1b.gguf           # write the file (Llama 3.2 1B's shapes)
    python benchmarks/runtime.py synthetic-gguf --bench /tmp/synth-1b.gguf --json docs/synthetic_1b.json

Q4_K_M as llama.cpp's llama-quant.cpp lays it out: Q4_K for the linears; Q6_K for the head (here the tied
embedding) and for attn_v / ffn_down in the first and last eighth of the layers and every third layer between;
the rotary factors of Llama 3.x as rope_freqs.weight. Quantized by our own K-quant quantizer
(specdec/runtime/quantize.py), which gguf's reference dequantization reads back (tests/test_runtime.py).
Each measurement runs in its own process, one engine at a time, interleaved over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(layers=16, hidden=2048, inter=8192, heads=32, kv_heads=8, vocab=128256, ctx=8192)  # Llama 3.2 1B


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write(out: Path, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int, ctx: int,
          seed: int = 0) -> None:
    import gguf
    from specdec.runtime.quantize import quantize
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    wr = gguf.GGUFWriter(str(out), "llama")
    wr.add_name("synthetic-1b-q4_k_m"), wr.add_file_type(15)  # MOSTLY_Q4_K_M
    wr.add_block_count(layers), wr.add_context_length(ctx), wr.add_embedding_length(hidden)
    wr.add_feed_forward_length(inter), wr.add_head_count(heads), wr.add_head_count_kv(kv_heads)
    wr.add_layer_norm_rms_eps(1e-5), wr.add_rope_freq_base(500000.0), wr.add_rope_dimension_count(hd)
    wr.add_vocab_size(vocab)
    # a tokenizer llama.cpp accepts (the benchmark feeds token ids; nothing is ever tokenized)
    wr.add_tokenizer_model("llama")
    wr.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
                      + [f"t{i}".encode() for i in range(vocab - 259)])
    wr.add_token_scores([0.0] * vocab)
    wr.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    wr.add_bos_token_id(1), wr.add_eos_token_id(2)

    def matrix(rows, cols, scale):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float32)

    def put(name, rows, cols, qtype, scale=0.02):
        wr.add_tensor(name, quantize(matrix(rows, cols, scale), int(qtype)), raw_dtype=qtype)

    put("token_embd.weight", vocab, hidden, T.Q6_K, 1.0)  # tied: the head reads it too
    wr.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    # Llama 3's rotary scaling (factor 32, low 1, high 4, original 8192) as per-frequency factors
    inv = 1.0 / 500000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    wavelen = 2 * np.pi / inv
    lo, hi = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(wavelen < hi, 1.0, np.where(wavelen > lo, 32.0, 1 / ((1 - smooth) / 32 + smooth)))
    wr.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        big = T.Q6_K if more_bits(i, layers) else T.Q4_K
        wr.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        wr.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        put(b + "attn_q.weight", heads * hd, hidden, T.Q4_K)
        put(b + "attn_k.weight", kv_heads * hd, hidden, T.Q4_K)
        put(b + "attn_v.weight", kv_heads * hd, hidden, big)
        put(b + "attn_output.weight", hidden, heads * hd, T.Q4_K)
        put(b + "ffn_gate.weight", inter, hidden, T.Q4_K)
        put(b + "ffn_up.weight", inter, hidden, T.Q4_K)
        put(b + "ffn_down.weight", hidden, inter, big)
        print(f"layer {i + 1}/{layers}", file=sys.stderr, flush=True)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()


# ---- one engine per process --------------------------------------------------------------------------------------
PROMPT = [1] + [300 + 17 * i for i in range(31)]


def run_engine(engine: str, path: str, steps: int, rows: list[int]) -> dict:
    """Decode `steps` tokens after a 32-token prompt, then time a verify pass of each row count (median of 3)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    out = {"engine": engine}
    if engine == "llama.cpp":
        from specdec import llamacpp
        llm = llamacpp.load(Path(path), n_ctx=1024)
        llm.eval(PROMPT)
        t = time.perf_counter()
        for i in range(steps):
            llm.eval([400 + i])
        out["decode_tok_s"] = steps / (time.perf_counter() - t)
        curve = {}
        for r in rows:
            times = []
            for _ in range(3):
                llm.n_tokens = len(PROMPT)  # roll back to the prompt, then r rows in one batch
                t = time.perf_counter()
                llm.eval([500 + j for j in range(r)])
                times.append(time.perf_counter() - t)
            curve[r] = 1000 * sorted(times)[1]
    else:
        from specdec.runtime.load import load_gguf
        rt = load_gguf(Path(path), max_len=1024)
        rt.set_numerics(engine)
        s = rt.acquire_slot()
        rt.forward(PROMPT, [s] * len(PROMPT), list(range(len(PROMPT))))
        t = time.perf_counter()
        for i in range(steps):
            rt.forward([400 + i], [s], [len(PROMPT) + i])
        out["decode_tok_s"] = steps / (time.perf_counter() - t)
        curve = {}
        n = len(PROMPT)
        for r in rows:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                rt.forward([500 + j for j in range(r)], [s] * r, list(range(n, n + r)))
                times.append(time.perf_counter() - t)
            curve[r] = 1000 * sorted(times)[1]
        del torch
    out["verify_ms"] = curve
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def bench(path: str, engines: list[str], rounds: int, steps: int, rows: list[int]) -> dict:
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(rounds):
        for e in engines:
            got = subprocess.run([sys.executable, __file__, "--engine", e, path, "--steps", str(steps),
                                  "--rows", *map(str, rows)], capture_output=True, text=True, check=True)
            res = json.loads(got.stdout.strip().splitlines()[-1])
            results[e].append(res)
            print(f"round {r + 1} {e}: {res['decode_tok_s']:.2f} tok/s, peak RSS {res['peak_rss_mb']:.0f} MB",
                  file=sys.stderr, flush=True)
    summary = {"file": path, "file_mb": round(os.path.getsize(path) / 2**20, 1), "rounds": rounds, "steps": steps}
    for e, runs in results.items():
        summary[e] = {
            "decode_tok_s": round(float(np.median([x["decode_tok_s"] for x in runs])), 2),
            "verify_ms": {r: round(float(np.median([x["verify_ms"][str(r)] for x in runs])), 1) for r in rows},
            "peak_rss_mb": round(max(x["peak_rss_mb"] for x in runs), 1)}
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the synthetic file here")
    p.add_argument("--bench", help="time the runtime (q8, exact) and llama.cpp on this file")
    p.add_argument("--engine", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    p.add_argument("--engines", nargs="+", default=["q8", "exact", "llama.cpp"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--layers", type=int, default=SHAPE["layers"])
    p.add_argument("--json")
    a = p.parse_args()
    if a.engine:
        print(json.dumps(run_engine(a.engine[0], a.engine[1], a.steps, a.rows)))
        return
    if a.out:
        t = time.time()
        write(Path(a.out), **{**SHAPE, "layers": a.layers})
        print(f"wrote {a.out}: {os.path.getsize(a.out) / 2**20:.0f} MB in {time.time() - t:.0f} s", file=sys.stderr)
    if a.bench:
        summary = bench(a.bench, a.engines, a.rounds, a.steps, a.rows)
        print(json.dumps(summary, indent=2))
        if a.json:
            Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
