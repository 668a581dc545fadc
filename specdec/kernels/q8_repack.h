// q8_repack.h: the q8 mode's inputs: activations quantized to int8 per 32-column block, and weights repacked
// once into groups of 16 rows (rows_repack).
#pragma once

// ---- q8: int8 activations x integer weights (the `q8` numerics mode) ---------------------------------------------
// Activations: each row quantized by itself in 32-element blocks (as ggml's Q8_0): s = max|x| / 127,
// q = round-half-even(x * (127 / max|x|)); an all-zero block has s = 0 and q = 0.
// Weights: every format with a q8 layout (FORMAT_TABLE) repacked once (rows_repack) into groups of 16 rows: per block of 32 columns, the 16
// rows' fp16 d (and m), then their quants interleaved 4 columns at a time, so one 64-byte load holds 4 columns of
// all 16 rows and one dot-product instruction gives each row's lane its 4 products (Q4 bytes hold columns c and
// c + 16 in their low and high nibbles, as in the file). Same bytes as the file, but for the scales: Q4_K and Q6_K
// keep their super-blocks' (repack_q4k, repack_q6k), the layouts whose scales are fp16 numbers hold them times
// Q8_SCALE_UP.
// Per (x row m, weight row n, block b): isum = Σ_i w_q[i] x_q[i], an exact integer (Q4_0's -8 and Q8_0's u8 offset
// taken back in integers) whatever the instructions (VNNI `vpdpbusd`, or AVX2 `maddubs` + `madd`). Then one float
// chain per output over the blocks in order: acc = fma(float(isum), d_b * s_b, acc), and for Q4_1 also
// acc = fma(m_b, s_b * Σq_b, acc); y = acc (+ bias). No lane tree: 16 weight rows are 16 lanes. Nothing depends on
// other rows, so every row is a one-token step's (row-invariant); tests rebuild it in numpy bit for bit.
struct QX {            // R rows of K columns, quantized
    int8_t* q;         // [R][K]
    float* s;          // [R][nb]: block scales
    float* sq;         // [R][nb]: s_b * Σq_b (Q4_1's offset term)
    int32_t* o4;       // [R][nb]: -8 Σq_b (Q4_0's offset)
    int32_t* o8;       // [R][nb]: -128 Σq_b (Q8_0 weights offset by +128 for vpdpbusd's unsigned operand)
    int32_t* h0;       // [R][nb]: Σq of the block's first 16 columns (Q6_K's, Q3_K's and Q2_K's two sub-blocks per block)
    int K, nb;
};

// One 32-column block: q[i] = round-half-even(x[i]·127/amax) (MXCSR's default, as _mm_cvtss_si32), and Σq. The
// maximum is exact in any order and the conversions are per element, so the vector forms equal the scalar one.
static inline int q8_block(const float* xb, float amax_out[1], int8_t* q) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(ia));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(ib));
    amax_out[0] = amax;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_ps(xb + 8 * c), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[c]));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    int32_t t[32];
    for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i*)(t + 8 * c), _mm256_cvtps_epi32(_mm256_mul_ps(v[c], id)));
    int total = 0;
    for (int i = 0; i < 32; i++) q[i] = (int8_t)t[i], total += t[i];
    amax_out[0] = amax;
    return total;
#endif
}

static void q8_quantize_row(const float* x, const QX& Q, int r) {
    const int nb = Q.nb;
    int8_t* q = Q.q + (long)r * Q.K;
    for (int b = 0; b < nb; b++) {
        float amax;
        const int total = q8_block(x + 32 * b, &amax, q + 32 * b);
        const float s = amax / 127.0f;
        const long at = (long)r * nb + b;
        Q.s[at] = s;
        Q.sq[at] = s * (float)total;
        Q.o4[at] = -8 * total;
        Q.o8[at] = -128 * total;
        int h = 0;
        for (int i = 0; i < 16; i++) h += q[32 * b + i];
        Q.h0[at] = h;
    }
}

static void q8_quantize(const float* x, int R, const QX& Q) {
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) q8_quantize_row(x + (long)r * Q.K, Q, r);
}

// The layout a file format runs as in q8: Q4_0, Q4_1 and Q8_0 as themselves; Q5_0 as Q4_0's layout of its nibbles
// plus a plane of fifth bits (Q8W<Q5_0>: u = q in [0, 31], summed from -16·Σx, so the sums are Σ (q - 16)·x); Q4_K as its own bytes (repack_q4k: sub-block j's d·sc_j and -dmin·m_j computed in fp32 in the
// tile, exact products, nothing rounded); Q6_K as its own bytes rearranged (repack_q6k: per super-block the 16 rows'
// d and int8 scales, d·sc computed in fp32 in the tile, exact; per block q + 32 in [0, 63] as Q4 nibbles plus a
// 2-bit plane, Q8W<Q6_K>). The layouts below hold scales rounded to fp16 once at repack (times Q8_SCALE_UP); where
// that rounding would lose more than fp16's 11 bits the repack is refused and the tensor runs exact.
// Q5_K and Q5_1 as a byte layout of Q4_1's: d and m (fp16: Q5_1's own, Q5_K's d·sc_j and -dmin·m_j by the rule) and
// 32 bytes q in [0, 31]; Q3_K and Q2_K as Q4 nibbles (Q3_K: q + 4 in [0, 7]; Q2_K: q in [0, 3]) with both
// 16-column sub-blocks' d·sc in fp16 (Q2_K: and -dmin·m). The halves of a nibble block are its low (columns 0-15)
// and high nibbles (16-31). 0: none (exact kernels).
static inline int q8_layout(int fmt) { const Format* f = format_of(fmt); return f ? f->q8 : 0; }  // FORMAT_TABLE
static inline bool q8_format(int fmt) { return q8_layout(fmt) != 0; }
template <int FMT> struct Q8W;  // a file block's bytes and where its quants start; a repacked block's scale bytes
template <> struct Q8W<Q4_0> { static const int BLOCK = 18, QS = 2, SCALES = 32, CHUNKS = 4; };
template <> struct Q8W<Q4_1> { static const int BLOCK = 20, QS = 4, SCALES = 64, CHUNKS = 4; };
// Q4_K: the file's own bytes, 18 a row per 32 columns (144 per super-block): see repack_q4k
template <> struct Q8W<Q4_K> { static const int BLOCK = 18, QS = 0, SCALES = 0, CHUNKS = 4; };
template <> struct Q8W<Q8_0> { static const int BLOCK = 34, QS = 2, SCALES = 32, CHUNKS = 8; };
// Q5_0: the file's d and nibbles as Q4_0's, then a 64-byte plane of the fifth bits: for unpacked chunk e (columns
// 4e..4e+3 of the 16 rows) a 64-bit mask, bit p for chunk byte p (a byte mask AVX-512 applies as it is); the
// file's 22 bytes a row
template <> struct Q8W<Q5_0> { static const int BLOCK = 22, QS = 6, SCALES = 32, CHUNKS = 4; };
// Q6_K: per block u = q + 32 split: its low 4 bits as Q4 nibbles (4 chunks), its top 2 bits as 8 planes of 16
// bytes, plane e for the 64 bytes of unpacked chunk e (byte p's bits at plane byte p % 16, bits 2·(p / 16)); the
// scales per super-block (repack_q6k): 210 bytes a row per 256 columns, as the file
template <> struct Q8W<Q6_K> { static const int BLOCK = 26, QS = 0, SCALES = 0, CHUNKS = 4; };  // ~210 / 8: see repack_q6k
template <> struct Q8W<Q5_K> { static const int BLOCK = 36, QS = 4, SCALES = 64, CHUNKS = 8; };  // d, m, 32 u8
template <> struct Q8W<Q3_K> { static const int BLOCK = 20, QS = 4, SCALES = 64, CHUNKS = 4; };  // d_a, d_b, nibbles
template <> struct Q8W<Q2_K> { static const int BLOCK = 24, QS = 8, SCALES = 128, CHUNKS = 4; };  // + m_a, m_b

// Scales stored 2^8 times larger: every layout but Q4_0's, Q8_0's, Q4_K's and Q6_K's (the file's own scales) keeps its
// scales (and mins) times Q8_SCALE_UP in fp16, and q8_tile multiplies its result by 1 / Q8_SCALE_UP. Powers of two
// scale fp32 exactly, so the bits are those of an fp16 with a wider exponent: K-quant products d·sc down to 2^-22
// (fp16's normal numbers start at 2^-14) run q8 instead of sending the whole tensor to the exact kernels, and up
// to 255.9.
#define Q8_SCALE_UP 256.0f
static constexpr bool q8_scaled_up(int lay) {
    return lay != Q4_0 && lay != Q5_0 && lay != Q8_0 && lay != Q4_K && lay != Q6_K;
}

// Block b of a file row in the layout FMT's bytes: the row's own block, or a converted copy in `tmp` (Q5_0, Q6_K, ...).
// Returns null where a computed scale or min times Q8_SCALE_UP is not an fp16 number within fp16's relative
// precision, or a copied one times Q8_SCALE_UP is not exactly one.
static inline bool fp16_exact_enough(float v, uint16_t* h) {
    *h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    const float back = _cvtsh_ss(*h);
    return v == 0.0f || (fabsf(v) >= 6.103515625e-05f && fabsf(back - v) <= fabsf(v) * 0x1p-11f);
}
static inline bool fp16_scaled_up(float v, uint16_t* h) { return fp16_exact_enough(v * Q8_SCALE_UP, h); }
// n fp16 fields copied from the file, each times Q8_SCALE_UP (exact, or false where fp16 cannot hold it)
static inline bool fp16_copy_scaled_up(const uint8_t* from, int n, uint8_t* to) {
    for (int i = 0; i < n; i++) {
        const float v = h2f(from + 2 * i) * Q8_SCALE_UP;
        const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        if (_cvtsh_ss(h) != v) return false;
        memcpy(to + 2 * i, &h, 2);
    }
    return true;
}
// Q5_K sub-block j of super-block sb: d·sc_j and -dmin·m_j (times Q8_SCALE_UP) as fp16 into out[0..3], or false
static inline bool k4_scale_min_fp16(const uint8_t* sb, int j, uint8_t* out) {
    int sc, m;
    scale_min_k4(sb + 4, j, &sc, &m);
    uint16_t d16, m16;
    if (!fp16_scaled_up(h2f(sb) * (float)sc, &d16) || !fp16_scaled_up(-(h2f(sb + 2) * (float)m), &m16))
        return false;
    memcpy(out, &d16, 2);
    memcpy(out + 2, &m16, 2);
    return true;
}
static const uint8_t* layout_block(int src, const uint8_t* row, int b, uint8_t* tmp) {
    if (src == Q3_K || src == Q2_K) {  // 16-column sub-blocks' scales (and mins), then u as Q4 nibbles
        const long sbytes = src == Q3_K ? 110 : 84;
        const uint8_t* sb = row + sbytes * (b / 8);
        const int o = 32 * (b % 8), h = o / 128, t = (o % 128) / 32;
        const uint8_t* qs = sb + (src == Q3_K ? 32 : 16) + 32 * h;
        uint8_t u[32];
        for (int i = 0; i < 32; i++) {
            const int crumb = (qs[i] >> (2 * t)) & 3;
            u[i] = (uint8_t)(src == Q3_K ? crumb + 4 * ((sb[i] >> (o / 32)) & 1) : crumb);  // Q3_K: q + 4
        }
        for (int k = 0; k < 2; k++) {
            const int j = o / 16 + k;
            float D, M = 0.0f;
            if (src == Q3_K) {
                const int lo = (sb[96 + j % 8] >> (4 * (j / 8))) & 15, hi = (sb[104 + j % 4] >> (2 * (j / 4))) & 3;
                D = h2f(sb + 108) * (float)((lo | hi << 4) - 32);
            } else {
                D = h2f(sb + 80) * (float)(sb[j] & 15), M = -(h2f(sb + 82) * (float)(sb[j] >> 4));
            }
            uint16_t dk, mk;
            if (!fp16_scaled_up(D, &dk) || (src == Q2_K && !fp16_scaled_up(M, &mk))) return nullptr;
            memcpy(tmp + 2 * k, &dk, 2);
            if (src == Q2_K) memcpy(tmp + 4 + 2 * k, &mk, 2);
        }
        uint8_t* nib = tmp + (src == Q3_K ? 4 : 8);
        for (int i = 0; i < 16; i++) nib[i] = (uint8_t)(u[i] | u[16 + i] << 4);
        return tmp;
    }
    if (src == Q5_1) {  // d, m (times Q8_SCALE_UP), then q = low nibble | fifth bit << 4
        const uint8_t* blk = row + 24L * b;
        uint32_t qh;
        if (!fp16_copy_scaled_up(blk, 2, tmp)) return nullptr;
        memcpy(&qh, blk + 4, 4);
        for (int i = 0; i < 32; i++) tmp[4 + i] = (uint8_t)((i < 16 ? blk[8 + i] & 15 : blk[8 + i - 16] >> 4) | ((qh >> i) & 1) << 4);
        return tmp;
    }
    if (src == Q5_K) {  // sub-block j: d·sc_j, -dmin·m_j (fp16), then its 32 five-bit quants
        const uint8_t* sb = row + 176L * (b / 8);
        const int j = b % 8;
        if (!k4_scale_min_fp16(sb, j, tmp)) return nullptr;
        for (int i = 0; i < 32; i++)
            tmp[4 + i] = (uint8_t)(((sb[48 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15) | ((sb[16 + i] >> j) & 1) << 4);
        return tmp;
    }
    if (src == Q4_1) {  // d, m times Q8_SCALE_UP, the nibbles as they are
        const uint8_t* blk = row + 20L * b;
        if (!fp16_copy_scaled_up(blk, 2, tmp)) return nullptr;
        memcpy(tmp + 4, blk + 4, 16);
        return tmp;
    }
    return row + (long)(src == Q4_0 ? 18 : src == Q5_0 ? 22 : 34) * b;
}

// Row j's 32 values u (0..63, column order) into Q6_K's layout at `q`: nibbles as Q4 (chunk c byte 4j+i: columns
// 4c+i low, 16+4c+i high), top bits into the planes (unpacked chunk e, byte p = 4j+i: column 4e+i for e < 4, else
// 16 + 4(e-4) + i).
static inline void q6_split(const uint8_t* u, int j, uint8_t* q) {
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) q[64 * c + 4 * j + i] = (uint8_t)((u[4 * c + i] & 15) | (u[16 + 4 * c + i] & 15) << 4);
    for (int e = 0; e < 8; e++)
        for (int i = 0; i < 4; i++) {
            const int p = 4 * j + i, col = e < 4 ? 4 * e + i : 16 + 4 * (e - 4) + i;
            q[256 + 16 * e + p % 16] |= (uint8_t)((u[col] >> 4) << (2 * (p / 16)));
        }
}

// Repack N rows of K columns (file blocks) into ceil(N / 16) groups of 16 rows (rows past N are zero). Per group and
// block: d[16] fp16, (Q4_1: m[16] fp16), then 64-byte chunks: chunk c, bytes 4j..4j+3 = row j's quant bytes 4c..4c+3.
// Returns false if a block cannot be laid out (layout_block).
template <int FMT>
static bool repack(int src, const uint8_t* W, int N, int K, uint8_t* out) {
    typedef Q8W<FMT> F;
    const int nb = K / 32, G = (N + 15) / 16;
    const long rb = row_bytes_of(src, K), bb = 16L * F::BLOCK;
    static const uint8_t ZERO[36] = {0};
    bool ok = true;
#pragma omp for schedule(static)
    for (int g = 0; g < G; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t* o = out + (long)g * nb * bb + b * bb;
            if constexpr (FMT == Q5_0) memset(o + F::SCALES + 256, 0, 64);  // the plane is or-ed in row by row
            for (int j = 0; j < 16; j++) {
                const int n = 16 * g + j;
                uint8_t tmp[36];
                const uint8_t* blk = n < N ? layout_block(src, W + n * rb, b, tmp) : ZERO;
                if (!blk) { ok = false; blk = ZERO; }
                for (int f = 0; f < F::SCALES / 32; f++) memcpy(o + 32 * f + 2 * j, blk + 2 * f, 2);  // d (m, d_b, ...)
                for (int c = 0; c < F::CHUNKS; c++) memcpy(o + F::SCALES + 64 * c + 4 * j, blk + F::QS + 4 * c, 4);
                if constexpr (FMT == Q5_0) {  // row j's fifth bits: column 4e + i -> chunk e, byte p = 4j + i
                    uint32_t qh;
                    memcpy(&qh, blk + 2, 4);
                    for (int e = 0; e < 8; e++)
                        for (int i = 0; i < 4; i++) {
                            const int p = 4 * j + i;
                            o[F::SCALES + 256 + 8 * e + p / 8] |= (uint8_t)(((qh >> (4 * e + i)) & 1) << (p % 8));
                        }
                }
            }
        }
    return ok;
}

// The super-block layouts (Q4_K, Q6_K): per group of 16 rows and super-block (256 columns), SB bytes of each row
// (SB: the file's bytes per super-block), so a layout is as large as the file. `prepare(o)` once per output
// super-block, then `row(o, j, sb)` for its 16 rows (sb: row j's super-block in the file; zeros past N).
template <int FMT, typename Prepare, typename Row>
static void each_super_row(const uint8_t* W, int N, int K, uint8_t* out, Prepare prepare, Row row) {
    constexpr int SB = FMT == Q4_K ? 144 : 210;
    const int ns = K / 256, G = (N + 15) / 16;
    const long rb = row_bytes_of(FMT, K);
    static const uint8_t ZERO[SB] = {0};
#pragma omp for schedule(static)
    for (int g = 0; g < G; g++)
        for (int t = 0; t < ns; t++) {
            uint8_t* o = out + ((long)g * ns + t) * 16 * SB;
            prepare(o);
            for (int j = 0; j < 16; j++) row(o, j, 16 * g + j < N ? W + (16 * g + j) * rb + (long)SB * t : ZERO);
        }
}

// Q4_K as its own bytes, in groups of 16 rows. Per group and super-block, Q4K_SUPER bytes:
//   d[16] fp16, dmin[16] fp16, then the 12 scale bytes of each row as three dword vectors (vector k, lane j: row j's
//   bytes 4k..4k+3), so the 16 rows' 6-bit scales and mins decode lane-parallel (q4k_scales);
//   then per 32-column sub-block 4 chunks of 64 bytes as Q4_1's (chunk c bytes 4j..4j+3: row j's nibble bytes
//   4c..4c+3; nibble byte i holds column i low, i + 16 high).
// 144 bytes a row per super-block, as the file: nothing is rounded, and a tensor is always servable.
#define Q4K_SUPER (16 * 144)
static bool repack_q4k(const uint8_t* W, int N, int K, uint8_t* out) {
    each_super_row<Q4_K>(W, N, K, out, [](uint8_t*) {}, [](uint8_t* o, int j, const uint8_t* sb) {
        memcpy(o + 2 * j, sb, 2);            // d
        memcpy(o + 32 + 2 * j, sb + 2, 2);   // dmin
        for (int k = 0; k < 3; k++) memcpy(o + 64 + 64 * k + 4 * j, sb + 4 + 4 * k, 4);
        for (int b = 0; b < 8; b++) {
            const uint8_t* q = sb + 16 + 32 * (b / 2);
            const int sh = 4 * (b % 2);
            uint8_t nib[16];
            for (int i = 0; i < 16; i++) nib[i] = (uint8_t)(((q[i] >> sh) & 15) | (((q[16 + i] >> sh) & 15) << 4));
            for (int c = 0; c < 4; c++) memcpy(o + 256 + 256 * b + 64 * c + 4 * j, nib + 4 * c, 4);
        }
    });
    return true;
}

// Q6_K as its own bytes rearranged, in groups of 16 rows. Per group and super-block, Q6K_SUPER bytes: d[16] fp16,
// then the 16 sub-blocks' int8 scales of the 16 rows (sub-block i, row j at 32 + 16i + j), then per 32-column block
// u = q + 32 as Q4 nibbles (256 bytes, q6_split) and 2-bit planes (128). 210 bytes a row, as the file.
#define Q6K_SUPER (16 * 210)
// Bytes of one group of 16 rows with nb blocks of 32 columns in layout FMT (Q6_K counts whole super-blocks)
template <int FMT> static constexpr long q8_group_bytes(int nb) {
    return FMT == Q6_K ? (long)(nb / 8) * Q6K_SUPER : (long)nb * 16 * Q8W<FMT>::BLOCK;
}
// Where block bl's quants start in a group (after the block's scale bytes; Q4_K's and Q6_K's inside their super-block)
template <int FMT> static inline const uint8_t* q8_quants(const uint8_t* G, int bl) {
    if constexpr (FMT == Q4_K) return G + (long)(bl / 8) * Q4K_SUPER + 256 + 256 * (bl % 8);
    else if constexpr (FMT == Q6_K) return G + (long)(bl / 8) * Q6K_SUPER + 288 + 384 * (bl % 8);
    else return G + (long)bl * 16 * Q8W<FMT>::BLOCK + Q8W<FMT>::SCALES;
}
static bool repack_q6k(const uint8_t* W, int N, int K, uint8_t* out) {
    auto planes_cleared = [](uint8_t* o) {  // the planes are or-ed in row by row
        for (int b = 0; b < 8; b++) memset(o + 288 + 384 * b + 256, 0, 128);
    };
    each_super_row<Q6_K>(W, N, K, out, planes_cleared, [](uint8_t* o, int j, const uint8_t* sb) {
        memcpy(o + 2 * j, sb + 208, 2);
        for (int i = 0; i < 16; i++) o[32 + 16 * i + j] = sb[192 + i];
        for (int b = 0; b < 8; b++) {  // u = q + 32 of block b's 32 columns, in column order
            const int c0 = 32 * b, h = c0 / 128, r0 = c0 % 128;
            uint8_t u[32];
            for (int i = 0; i < 32; i++)
                u[i] = (uint8_t)(((sb[64 * h + r0 % 64 + i] >> (4 * (r0 / 64))) & 15) |
                                 (((sb[128 + 32 * h + i] >> (2 * (r0 / 32))) & 3) << 4));
            q6_split(u, j, o + 288 + 384 * b);
        }
    });
    return true;
}

