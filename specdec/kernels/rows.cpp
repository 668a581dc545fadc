// specdec's CPU kernels for decode and verify passes: linears on GGUF blocks (the formats of FORMAT_TABLE in
// formats.h: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K) and float weights (F32, F16, BF16), RMSNorm, rotary
// embedding, attention over KV slots, the gated MLP, and whole decoder layers; then top-k, argmax and the race.
//
// Row-invariance: every output row is computed by the same instructions in the same order whatever the number of
// rows in the call, so a verify pass gives each token bitwise what a one-token pass gives it.
// Exactness: quantized weights are dequantized in registers exactly as gguf's reference does (w = d*q + m for Q4_1,
// d*(q-8) for Q4_0, d*q for Q8_0; d, m fp16 widened to fp32; a multiply then an add, never fused: built with
// -ffp-contract=off), then accumulated like the fp32 weights: 16 lanes, one FMA per 16 columns in column order, the
// lanes summed in one fixed tree. So a quantized linear equals the F32 linear on the dequantized weights, bitwise.
// Built twice from these sources: AVX-512 (one __m512 per 16 lanes) and AVX2 (two __m256); both give the same bits.
//
// The only compiled file: the headers below, in the order a pass uses them, then every C entry point. Each header
// has its reference twin of the same name under kernels/reference/ (docs/runtime.md: the map).
#include "simd.h"         // 16 fp32 lanes, their sum tree, exp
#include "formats.h"      // the block formats: FORMAT_TABLE, and 16 dequantized columns at a time
#include "linear.h"       // the exact linear
#include "q8_repack.h"    // q8: int8 activations, weights repacked in groups of 16 rows
#include "q8_sums.h"      // q8: a block's exact integer sums (vpdpbusd, or AVX2's maddubs)
#include "q8_amx.h"       // q8: the same sums for all rows of x in one AMX tile multiply, where the CPU has AMX
#include "q8_linear.h"    // q8: the blocks' sums scaled into one fp32 chain per output
#include "abi.h"          // Seg, Lin, Dims, Layer: the structs Python passes (kernels/abi.py)
#include "dispatch.h"     // one linear over fused segments of any format
#include "norms.h"        // RMSNorm, rotary
#include "attention.h"    // paged attention: plain, windowed, tree rows
#include "layer.h"        // one decoder layer
#include "selection.h"    // top-k, argmax, the race

// ---- the C entry points (kernels/__init__.py declares their signatures) ------------------------------------------
// Bytes of one weight row of K columns, or -1 for an unsupported format/shape.
extern "C" long row_bytes(int fmt, int K) { return row_bytes_of(fmt, K); }

// q8 tiles of at least min_rows rows of x take AMX tile multiplies (0: none), where the build, the CPU and the OS
// allow; returns the threshold now in force (0 where AMX cannot serve). The bits are the same either way.
// q8 passes of 9+ rows in wide VNNI tiles (1) or in 8-row ones (0; -1 keeps it): the threshold in force, the same
// bits either way (q8_linear.h). AVX2 builds have none: 0.
extern "C" int rows_wide(int on) {
#if Q8_M >= 8
    if (on >= 0) q8_wide = on ? 1 : 0;
#endif
    (void)on;
    return q8_wide;
}

extern "C" int rows_amx(int min_rows) {
#ifdef Q8_HAS_AMX
    static const bool granted = amx_granted();
    q8_amx_rows = granted && min_rows > 0 ? (min_rows < 9 ? 9 : min_rows) : 0;  // tiles of 9..16 rows
#endif
    (void)min_rows;
    return q8_amx_rows;
}

// How far ahead q8 tiles prefetch weights, in bytes: `one` for one-row tiles, `many` for the others, `l2` for the
// others' second prefetch into L2 (0: none) (each a multiple of 64 in [0, 65536]; -1 keeps the current one).
// out: the three distances now in force. Prefetching changes no bit. (Builds before the L2 distance exported
// rows_prefetch(one, many, out): a new name, so that no caller passes three distances to it.)
extern "C" void rows_prefetch3(int one, int many, int l2, int* out) {
    auto fit = [](int d, int now) { return d < 0 ? now : (d > 65536 ? 65536 : d) / 64 * 64; };
    q8_ahead_one = fit(one, q8_ahead_one), q8_ahead = fit(many, q8_ahead), q8_ahead_l2 = fit(l2, q8_ahead_l2);
    out[0] = q8_ahead_one, out[1] = q8_ahead, out[2] = q8_ahead_l2;
}

// FORMAT_TABLE as [id, block, bytes, q8 layout] rows, for kernels/formats.py's check at load; returns the count.
extern "C" int rows_formats(long* out, int cap) {
    const int n = (int)(sizeof(FORMAT_TABLE) / sizeof(FORMAT_TABLE[0]));
    for (int i = 0; i < n && 4 * i + 3 < cap; i++) {
        const Format& f = FORMAT_TABLE[i];
        out[4 * i] = f.id, out[4 * i + 1] = f.block, out[4 * i + 2] = f.bytes, out[4 * i + 3] = f.q8;
    }
    return 4 * n;
}

extern "C" long rows_repacked_bytes(int fmt, int N, int K) {
    const int lay = q8_layout(fmt);
    if (!lay || row_bytes_of(fmt, K) < 0 || K % 32 || N < 0) return -1;
    if (lay == Q6_K) return (N + 15) / 16 * q8_group_bytes<Q6_K>(K / 32);  // whole super-blocks (repack_q6k)
    const long block = lay == Q4_0 ? Q8W<Q4_0>::BLOCK : lay == Q4_1 ? Q8W<Q4_1>::BLOCK : lay == Q5_0 ? Q8W<Q5_0>::BLOCK
                       : lay == Q4_K ? Q8W<Q4_K>::BLOCK
                       : lay == Q5_K ? Q8W<Q5_K>::BLOCK : lay == Q3_K ? Q8W<Q3_K>::BLOCK : lay == Q2_K ? Q8W<Q2_K>::BLOCK
                       : Q8W<Q8_0>::BLOCK;
    return (N + 15) / 16 * 16L * block * (K / 32);
}

// 0, -1 (format or shape not repackable), -2 (a K-quant tensor whose scales fp16 cannot hold: it runs exact)
extern "C" int rows_repack(int fmt, const uint8_t* W, int N, int K, uint8_t* out, int threads) {
    if (rows_repacked_bytes(fmt, N, K) < 0) return -1;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        bool ok;
        switch (q8_layout(fmt)) {
            case Q4_0: ok = repack<Q4_0>(fmt, W, N, K, out); break;
            case Q4_1: ok = repack<Q4_1>(fmt, W, N, K, out); break;
            case Q5_0: ok = repack<Q5_0>(fmt, W, N, K, out); break;
            case Q4_K: ok = repack_q4k(W, N, K, out); break;
            case Q6_K: ok = repack_q6k(W, N, K, out); break;
            case Q5_K: ok = repack<Q5_K>(fmt, W, N, K, out); break;
            case Q3_K: ok = repack<Q3_K>(fmt, W, N, K, out); break;
            case Q2_K: ok = repack<Q2_K>(fmt, W, N, K, out); break;
            case Q8_0: ok = repack<Q8_0>(fmt, W, N, K, out); break;
            default: ok = false; break;  // unreachable: rows_repacked_bytes refused it
        }
        bad |= !ok;
    }
    return bad ? -2 : 0;
}

// x: [R, K] row-major fp32; W: N rows of `fmt`; y: [R, N]; b: [N] or null. Wq: W repacked (rows_repack) for the q8
// mode (int8 activations against the integer formats of FORMAT_TABLE), or null: exact (fp32 on the dequantized weights).
// Returns 0, or -1 if fmt/K unsupported.
extern "C" int rows_linear(int fmt, const float* x, int R, int K, const uint8_t* W, const uint8_t* Wq, int N, float* y,
                           const float* b, int threads) {
    Lin L = {{{W, Wq, b, fmt, N}}, 1};
    if (!servable(&L, K) || R < 0) return -1;
    const bool quant = Wq && q8_format(fmt) && R > 0;
    QXBuf buf(quant ? R : 0, quant ? K : 32);
    const QX Q = buf.view(K);
    amx_new_call();
#pragma omp parallel num_threads(threads)
    {
        if (quant) q8_quantize(x, R, Q);
        linear(&L, x, R, K, y, false, quant ? &Q : nullptr);
    }
    return 0;
}

// Rows idx[0..R-1] of W (N rows of `fmt`, K columns) dequantized to fp32 into out [R, K]: the weights each linear
// multiplies by (its L1 buffer's values), which are gguf's reference dequantization. An embedding lookup: gguf's
// numpy reference took 0.1-0.6 ms a call on the 1.5B's Q4_K rows. Returns 0, or -1 (format, K or an index).
template <class F>
static void dequantize_row(const uint8_t* row, int K, float* out, float* S) {
    if constexpr (F::SPR > 0) F::scales(row, K, S);
    int c = 0;
    for (; c + F::CH <= K / 16; c += F::CH) {
        V16 w[F::CH];
        F::chunk(row, S, c, K, w);
        for (int h = 0; h < F::CH; h++) vstore(out + 16 * (c + h), w[h]);
    }
    if (F::TAIL && K % 16) {
        alignas(64) float t[16];
        V16 w;
        F::tail(row, K, &w);
        vstore(t, w);
        memcpy(out + K / 16 * 16, t, 4L * (K % 16));
    }
}

extern "C" int rows_dequantize(int fmt, const uint8_t* W, int N, int K, const long* idx, int R, float* out) {
    const long rb = row_bytes_of(fmt, K);
    if (rb < 0 || R < 0) return -1;
    for (int r = 0; r < R; r++)
        if (idx[r] < 0 || idx[r] >= N) return -1;
    std::vector<float> S((size_t)K / 8 + 16);  // the most scales a row has: Q2_K's, 4 per 32 columns
    for (int r = 0; r < R; r++) {
        const uint8_t* row = W + idx[r] * rb;
        float* o = out + (long)r * K;
        switch (fmt) {
            case F32: dequantize_row<FmtF32>(row, K, o, S.data()); break;
            case F16: dequantize_row<FmtF16>(row, K, o, S.data()); break;
            case BF16: dequantize_row<FmtBF16>(row, K, o, S.data()); break;
            case Q4_0: dequantize_row<FmtQ4_0>(row, K, o, S.data()); break;
            case Q4_1: dequantize_row<FmtQ4_1>(row, K, o, S.data()); break;
            case Q5_0: dequantize_row<FmtQ5_0>(row, K, o, S.data()); break;
            case Q5_1: dequantize_row<FmtQ5_1>(row, K, o, S.data()); break;
            case Q8_0: dequantize_row<FmtQ8_0>(row, K, o, S.data()); break;
            case Q2_K: dequantize_row<FmtQ2_K>(row, K, o, S.data()); break;
            case Q3_K: dequantize_row<FmtQ3_K>(row, K, o, S.data()); break;
            case Q4_K: dequantize_row<FmtQ4_K>(row, K, o, S.data()); break;
            case Q5_K: dequantize_row<FmtQ5_K>(row, K, o, S.data()); break;
            case Q6_K: dequantize_row<FmtQ6_K>(row, K, o, S.data()); break;
            default: return -1;
        }
    }
    return 0;
}

extern "C" void rows_rmsnorm(const float* x, int R, int D, const float* w, float eps, float* out, int threads) {
#pragma omp parallel num_threads(threads)
    rmsnorm(x, R, D, w, eps, out);
}

extern "C" void rows_topk(const float* x, int R, int V, int k, int* idx, float* val, float* lse, int threads) {
    topk_rows(x, R, V, k, idx, val, lse, threads);
}

extern "C" void rows_argmax(const float* x, int R, int V, long* out, int threads) { argmax_rows(x, R, V, out, threads); }

extern "C" void rows_race(const double* p, int R, int V, const uint64_t* keys, long* out, int threads) {
    race_rows(p, R, V, keys, out, threads);
}

// All decoder layers of one pass in one parallel region (thread start-up costs more than a whole small linear).
// `tree` is null for a plain pass, else [store R | kbase R | moff R | map...] (Tree above; model.py checks it).
// Layers first .. first + n_layers - 1 of one pass (`layers` points at layer `first`'s struct; K/V go to those layers'
// places): a pass run in pieces, the residual stream read between them (an EAGLE-3 head's target features).
extern "C" int decoder_layers_from(const Dims* d, const Layer* layers, int first, int n_layers, float* x, int R,
                                   const int* slot, const int* pos, const int* tree_rows, int threads) {
    if (first < 0 || n_layers < 1 || first + n_layers > d->layers) return -1;
    const int D = d->hidden, hd = d->head_dim, H = d->heads, G = d->kv_heads, I = d->inter;
    if (hd % 16 || hd > 256 || H % G || R < 1) return -1;
    const Tree tree = tree_rows ? Tree{tree_rows, tree_rows + R, tree_rows + 2 * R, tree_rows + 3 * R}
                                : Tree{nullptr, nullptr, nullptr, nullptr};
    int maxpos = 0;
    for (int r = 0; r < R; r++) {
        if (pos[r] < 0 || pos[r] >= d->max_len) return -1;
        const int st = tree.stored(pos, r);
        if (st < 0 || st >= d->max_len) return -1;
        maxpos = pos[r] > maxpos ? pos[r] : maxpos;
        int last = st > pos[r] ? st : pos[r];  // the furthest position the row writes or reads
        if (tree.store)
            for (int j = 0; j <= pos[r] - tree.kbase[r]; j++) last = tree.map[tree.moff[r] + j] > last ? tree.map[tree.moff[r] + j] : last;
        const int* table = d->tables[slot[r]];  // every block it touches is one of the pool's
        for (int b = 0; b <= last >> 4; b++)
            if (table[b] < 0 || table[b] >= d->blocks) return -1;
    }
    for (int l = 0; l < n_layers; l++) {
        const Layer* L = layers + l;
        if (!servable(&L->qkv, D) || !servable(&L->o, H * hd) || !servable(&L->gate_up, D) || !servable(&L->down, I))
            return -1;
    }
    std::vector<float> h((size_t)R * D), qkv((size_t)R * (H + 2 * G) * hd), att((size_t)R * H * hd),
        gu((size_t)R * 2 * I), act((size_t)R * I), p((size_t)threads * 4 * (maxpos + 16));
    const int kmax = D > H * hd ? (D > I ? D : I) : (H * hd > I ? H * hd : I);
    QXBuf xq(d->q8 ? R : 0, d->q8 ? kmax : 32);
    const Scratch s = {h.data(), qkv.data(), att.data(), gu.data(), act.data(), p.data(), 4 * (maxpos + 16), &xq};
    amx_new_call();
#pragma omp parallel num_threads(threads)
    for (int l = 0; l < n_layers; l++) layer_body(d, layers + l, first + l, x, R, slot, pos, tree, s);
    return 0;
}

extern "C" int decoder_layers(const Dims* d, const Layer* layers, int n_layers, float* x, int R, const int* slot,
                              const int* pos, const int* tree_rows, int threads) {
    return decoder_layers_from(d, layers, 0, n_layers, x, R, slot, pos, tree_rows, threads);
}

// The ABI the ctypes mirrors (kernels/abi.py) are checked against when the library loads: for Seg, Lin, Layer and
// Dims in turn, the struct's size, then each field's offset in declaration order. Writes up to `cap` values and
// returns how many there are.
extern "C" int rows_abi(long* out, int cap) {
    const long v[] = {
        (long)sizeof(Seg), (long)offsetof(Seg, w), (long)offsetof(Seg, wq), (long)offsetof(Seg, bias),
        (long)offsetof(Seg, fmt), (long)offsetof(Seg, n),
        (long)sizeof(Lin), (long)offsetof(Lin, seg), (long)offsetof(Lin, count),
        (long)sizeof(Layer), (long)offsetof(Layer, attn_norm), (long)offsetof(Layer, qkv), (long)offsetof(Layer, o),
        (long)offsetof(Layer, ffn_norm), (long)offsetof(Layer, gate_up), (long)offsetof(Layer, down),
        (long)offsetof(Layer, q_norm), (long)offsetof(Layer, k_norm), (long)offsetof(Layer, post_attn_norm),
        (long)offsetof(Layer, post_ffn_norm), (long)offsetof(Layer, cos), (long)offsetof(Layer, sin),
        (long)offsetof(Layer, window),
        (long)sizeof(Dims), (long)offsetof(Dims, hidden), (long)offsetof(Dims, heads), (long)offsetof(Dims, kv_heads),
        (long)offsetof(Dims, head_dim), (long)offsetof(Dims, inter), (long)offsetof(Dims, layers),
        (long)offsetof(Dims, max_len), (long)offsetof(Dims, interleaved), (long)offsetof(Dims, eps),
        (long)offsetof(Dims, cos), (long)offsetof(Dims, sin), (long)offsetof(Dims, kpool), (long)offsetof(Dims, vpool),
        (long)offsetof(Dims, tables), (long)offsetof(Dims, blocks), (long)offsetof(Dims, q8), (long)offsetof(Dims, kv16),
        (long)offsetof(Dims, act), (long)offsetof(Dims, attn_scale)};
    const int n = (int)(sizeof(v) / sizeof(v[0]));
    for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}
