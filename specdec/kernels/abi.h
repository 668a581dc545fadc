// abi.h: the structs the entry points take from Python, mirrored in kernels/abi.py and checked at load
// (rows_abi).
#pragma once

// A linear whose output columns come from up to 3 weight matrices (fused q/k/v, gate/up), each in its own format;
// wq: the matrix repacked for q8 (rows_repack), or null.
struct Seg { const uint8_t* w; const uint8_t* wq; const float* bias; int fmt, n; };
struct Lin { Seg seg[3]; int count; };

struct Dims {
    int hidden, heads, kv_heads, head_dim, inter, layers, max_len;
    int interleaved;  // rotary pairs (2i, 2i+1) as llama.cpp stores Q/K rows, else (i, i + head_dim/2)
    float eps;
    const float* cos;  // [max_len, head_dim / 2]: pair i's cos at each position
    const float* sin;
    // The KV cache is one pool of blocks of 16 positions (runtime/blocks.py). Block b holds, for every layer and KV
    // head, 16 keys transposed [head_dim, 16] (the kernel scores 16 keys per vector) and 16 values [16, head_dim].
    void* kpool;  // [blocks, layers, kv_heads, head_dim, 16]
    void* vpool;  // [blocks, layers, kv_heads, 16, head_dim]
    const int* const* tables;  // per KV slot: the block holding its positions 16i..16i+15 (max_len / 16 entries)
    int blocks;
    int q8;  // the numerics mode: 0 exact, 1 int8 activations for integer weight formats
    int kv16;  // K/V stored as fp16 (rounded to nearest even when written; the q8 mode), else fp32
    int act;  // the MLP's gate activation: 0 silu (SwiGLU), 1 gelu with the tanh approximation (GeGLU: Gemma)
    float attn_scale;  // scores are q.k times this; 0: 1/sqrt(head_dim)
};

struct Layer {
    const float* attn_norm;
    Lin qkv, o;
    const float* ffn_norm;
    Lin gate_up, down;
    const float* q_norm;          // [head_dim]: each query head RMS-normed before the rotation (Qwen3, Gemma 3), or null
    const float* k_norm;          // the same for key heads
    const float* post_attn_norm;  // [hidden]: the attention output RMS-normed before the residual add (Gemma), or null
    const float* post_ffn_norm;   // the same for the MLP output
    const float* cos;             // this layer's rotary tables [max_len, head_dim / 2] (Gemma 3's local layers), or null:
    const float* sin;             // the model's
    int window;                   // sliding-window attention: a row sees its last `window` positions; 0: all of them
};
