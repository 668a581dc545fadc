// specdec's CPU kernels for decode and verify passes: linears on GGUF blocks (Q4_0, Q4_1, Q8_0) and float weights
// (F32, F16, BF16), RMSNorm, rotary embedding, attention over KV slots, SwiGLU, and a whole Llama decoder layer.
//
// Row-invariance: every output row is computed by the same instructions in the same order whatever the number of
// rows in the call, so a verify pass gives each token bitwise what a one-token pass gives it.
// Exactness: quantized weights are dequantized in registers exactly as gguf's reference does (w = d*q + m for Q4_1,
// d*(q-8) for Q4_0, d*q for Q8_0; d, m fp16 widened to fp32; a multiply then an add, never fused: built with
// -ffp-contract=off), then accumulated like the fp32 weights: 16 lanes, one FMA per 16 columns in column order, the
// lanes summed in one fixed tree. So a quantized linear equals the F32 linear on the dequantized weights, bitwise.
// Built twice from this source: AVX-512 (one __m512 per 16 lanes) and AVX2 (two __m256); both give the same bits.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#include <omp.h>

#include <vector>

// ---- 16 fp32 lanes ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct V16 { __m512 v; };
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vset1(float f) { return {_mm512_set1_ps(f)}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline V16 vfloor(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
static inline V16 vzero_where_less(V16 a, V16 x, V16 t) {  // lanes with x < t become 0
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, t.v, _CMP_LT_OQ), a.v, _mm512_setzero_ps())};
}
static inline V16 vpow2i(V16 n) {  // 2^n for integral n in [-126, 127]
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(e)};
}
static inline __m256 vlo(V16 a) { return _mm512_castps512_ps256(a.v); }
static inline __m256 vhi(V16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)); }
static inline V16 vfrom_i32(__m512i i) { return {_mm512_cvtepi32_ps(i)}; }
static inline V16 u8_to_f(const uint8_t* p) { return vfrom_i32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline V16 i8_to_f(const int8_t* p) { return vfrom_i32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline V16 f16_to_f(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
static inline V16 bf16_to_f(const uint16_t* p) {
    __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(i, 16))};
}
// Q4_1 / Q4_0: the 16 weights a nibble can name, looked up by the packed bytes (vpermps reads the low 4 bits)
static inline void q4_pair(const uint8_t* qs, V16 table, V16* lo, V16* hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    lo->v = _mm512_permutexvar_ps(b, table.v);
    hi->v = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table.v);
}
#else
struct V16 { __m256 lo, hi; };
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline V16 vfloor(V16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
static inline V16 vzero_where_less(V16 a, V16 x, V16 t) {
    return {_mm256_blendv_ps(a.lo, _mm256_setzero_ps(), _mm256_cmp_ps(x.lo, t.lo, _CMP_LT_OQ)),
            _mm256_blendv_ps(a.hi, _mm256_setzero_ps(), _mm256_cmp_ps(x.hi, t.hi, _CMP_LT_OQ))};
}
static inline __m256 pow2i8(__m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline V16 vpow2i(V16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
static inline __m256 vlo(V16 a) { return a.lo; }
static inline __m256 vhi(V16 a) { return a.hi; }
static inline V16 u8_to_f(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
static inline V16 i8_to_f(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
static inline V16 f16_to_f(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static inline V16 bf16_to_f(const uint16_t* p) {
    __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
// the same values as the AVX-512 table lookup: each weight is fl(fl(d*q) + m) either way
static inline void q4_nibbles(const uint8_t* qs, V16* lo, V16* hi) {
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
    const __m256i f = _mm256_set1_epi32(15);
    *lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, f)), _mm256_cvtepi32_ps(_mm256_and_si256(b, f))};
    *hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
#endif

// The lanes summed in one fixed tree (the same on both instruction sets): 8+8, 4+4, 2+2, 1+1.
static inline float vsum(V16 a) {
    __m256 s8 = _mm256_add_ps(vhi(a), vlo(a));
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128 s1 = _mm_add_ps(s2, _mm_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(s1);
}


// exp on 16 lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n; ~1 ulp), the same
// operations lane by lane on both instruction sets. exp(x) for x < -87.3 is exactly 0, never a subnormal (a softmax
// over far-apart scores would otherwise feed subnormal weights to the value sums: slow microcode assists).
static inline V16 vexp(V16 x0) {
    V16 x = vmax(vmin(x0, vset1(88.3762626647949f)), vset1(-87.3365447504f));
    V16 n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    V16 r = vsub(vsub(x, vmul(n, vset1(0.693359375f))), vmul(n, vset1(-2.12194440e-4f)));
    V16 y = vset1(1.9875691500e-4f);
    y = vfma(y, r, vset1(1.3981999507e-3f));
    y = vfma(y, r, vset1(8.3334519073e-3f));
    y = vfma(y, r, vset1(4.1665795894e-2f));
    y = vfma(y, r, vset1(1.6666665459e-1f));
    y = vfma(y, r, vset1(5.0000001201e-1f));
    y = vadd(vfma(y, vmul(r, r), r), vset1(1.0f));
    return vzero_where_less(vmul(y, vpow2i(n)), x0, vset1(-87.3365447504f));
}

// The fp16 scales of one weight row's blocks (d, or d and m for Q4_1) widened to fp32 into `out` (d_b, m_b at
// out[SPR*b], out[SPR*b + 1]) once per tile, so the inner loop broadcasts them from L1 instead of converting one per
// block per chunk. `stride`: bytes per block; the scales are the block's first 2 (or 4) bytes.
template <int SPR>
static inline void block_scales(const uint8_t* row, int nb, int stride, float* out) {
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const __mmask16 mask = nb - b0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b0)) - 1);
        const __m512i offs = _mm512_mullo_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(b0)), _mm512_set1_epi32(stride));
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offs, row, 1);  // d | m << 16
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
        if (SPR == 1) {
            _mm512_mask_storeu_ps(out + b0, mask, d);
        } else {
            const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
            const __m512 lo = _mm512_permutex2var_ps(d, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), m);
            const __m512 hi = _mm512_permutex2var_ps(d, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), m);
            const int n = nb - b0 >= 16 ? 16 : nb - b0;  // blocks in this step: 2n floats out
            _mm512_mask_storeu_ps(out + 2 * b0, n >= 8 ? (__mmask16)0xFFFF : (__mmask16)((1u << (2 * n)) - 1), lo);
            if (n > 8)
                _mm512_mask_storeu_ps(out + 2 * b0 + 16,
                                      n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (2 * (n - 8))) - 1), hi);
        }
    }
#else
    for (int b = 0; b < nb; b++) {
        uint16_t h[2];
        memcpy(h, row + (long)b * stride, 2 * SPR);
        for (int j = 0; j < SPR; j++) out[SPR * b + j] = _cvtsh_ss(h[j]);
    }
#endif
}

// ---- weight formats: each yields its weights 16 columns at a time, in column order ------------------------------
// ggml type ids (ggml.h): F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10 .. Q6_K 14, BF16 30.
// A format with scales (SPR > 0) writes SPR fp32 scales per 32 columns of a row into `S` once per tile (`scales`);
// `chunk` then yields CH chunks of 16 columns from its bytes and those scales.
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };

// Float rows may have a tail (K % 16): `chunk` is only asked for whole chunks, `tail` zero-pads the last one as
// masked lanes would.
struct FmtF32 {
    static const int CH = 1, BLOCK = 0;
    static const bool TAIL = true;
    static const int SPR = 0;
    static inline void chunk(const uint8_t* row, const float*, int c, int, V16* w) { *w = vload((const float*)row + 16 * c); }
    static inline void tail(const uint8_t* row, int K, V16* w) {
        float t[16] = {0}; memcpy(t, (const float*)row + K / 16 * 16, 4 * (K % 16)); *w = vload(t);
    }
};
template <V16 (*WIDEN)(const uint16_t*)>  // fp16 or bf16 rows, widened exactly
struct FmtHalf {
    static const int CH = 1, BLOCK = 0;
    static const bool TAIL = true;
    static const int SPR = 0;
    static inline void chunk(const uint8_t* row, const float*, int c, int, V16* w) { *w = WIDEN((const uint16_t*)row + 16 * c); }
    static inline void tail(const uint8_t* row, int K, V16* w) {
        uint16_t t[16] = {0}; memcpy(t, (const uint16_t*)row + K / 16 * 16, 2 * (K % 16)); *w = WIDEN(t);
    }
};
using FmtF16 = FmtHalf<f16_to_f>;
using FmtBF16 = FmtHalf<bf16_to_f>;
struct FmtQ8_0 {  // block: d (fp16), 32 x int8
    static const int CH = 2, BLOCK = 34;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 1;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        const uint8_t* b = row + 34 * (c / 2);
        const V16 d = vset1(sc[c / 2]);
        w[0] = vmul(i8_to_f((const int8_t*)b + 2), d);
        w[1] = vmul(i8_to_f((const int8_t*)b + 18), d);
    }
};
#if defined(__AVX512F__)
static const float IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const float IOTA_8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
struct FmtQ4_1 {  // block: d, m (fp16), 16 bytes: weight j < 16 is the low nibble of byte j, j >= 16 the high one
    static const int CH = 2, BLOCK = 20;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 2;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        const uint8_t* b = row + 20 * (c / 2);
        V16 table = vadd(vmul(vset1(sc[c]), vload(IOTA)), vset1(sc[c + 1]));  // d, m of block c/2
        q4_pair(b + 4, table, &w[0], &w[1]);
    }
};
struct FmtQ4_0 {  // block: d (fp16), 16 bytes; w = d * (q - 8)
    static const int CH = 2, BLOCK = 18;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 1;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        const uint8_t* b = row + 18 * (c / 2);
        q4_pair(b + 2, vmul(vset1(sc[c / 2]), vload(IOTA_8)), &w[0], &w[1]);
    }
};
#else
struct FmtQ4_1 {
    static const int CH = 2, BLOCK = 20;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 2;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        const uint8_t* b = row + 20 * (c / 2);
        const V16 d = vset1(sc[c]), m = vset1(sc[c + 1]);
        q4_nibbles(b + 4, &w[0], &w[1]);
        w[0] = vadd(vmul(d, w[0]), m);
        w[1] = vadd(vmul(d, w[1]), m);
    }
};
struct FmtQ4_0 {
    static const int CH = 2, BLOCK = 18;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 1;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        const uint8_t* b = row + 18 * (c / 2);
        const V16 d = vset1(sc[c / 2]), minus8 = vset1(-8.f);
        q4_nibbles(b + 2, &w[0], &w[1]);
        w[0] = vmul(d, vadd(w[0], minus8));  // q - 8 is exact in fp32
        w[1] = vmul(d, vadd(w[1], minus8));
    }
};
#endif

// K-quants (256-column super-blocks) and the 5-bit blocks: integer quants widened exactly, then w = D*q - M (or
// D*q + m, or D*q), a multiply then an add as gguf's reference computes it, with D = d*sc and M = dmin*m per
// sub-block in fp32 (`scales`, once per row and tile). Layouts as ggml-common.h's block_q*_K / block_q5_*.
static inline __m128i bytes16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
static inline __m128i field8(__m128i v, int shift, int mask) {  // (byte >> shift) & mask: bits past the byte are masked
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8((char)mask));
}
static inline V16 s8v_to_f(__m128i q) {  // 16 signed bytes, exactly
#if defined(__AVX512F__)
    return vfrom_i32(_mm512_cvtepi8_epi32(q));
#else
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
#endif
}
static inline float h2f(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
// Q4_K/Q5_K's 8 six-bit scales and mins from 12 bytes (ggml's get_scale_min_k4)
static inline void scale_min_k4(const uint8_t* q, int j, int* sc, int* m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}
template <int BYTES, int SUB, bool MIN>  // S per 32 columns: (D, M) for 32-column sub-blocks, (D_a, [M_a,] D_b[, M_b]) for 16
struct FmtK {
    static const int CH = 2, BLOCK = BYTES;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = (MIN ? 2 : 1) * (32 / SUB);
};
// Q4_K's and Q5_K's (D_j, M_j) = (d·sc_j, dmin·m_j) per 32 columns; super-blocks of BYTES bytes open with d, dmin
template <int BYTES>
static inline void k4_scales(const uint8_t* row, int K, float* out) {
    for (int s = 0; s < K / 256; s++, out += 16) {
        const uint8_t* b = row + (long)BYTES * s;
        const float d = h2f(b), dmin = h2f(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min_k4(b + 4, j, &sc, &m);
            out[2 * j] = d * (float)sc, out[2 * j + 1] = dmin * (float)m;
        }
    }
}
struct FmtQ4_K : FmtK<144, 32, true> {  // d, dmin, scales[12], qs[128]: sub-block j in byte group j/2, nibble j%2
    static inline void scales(const uint8_t* row, int K, float* out) { k4_scales<144>(row, K, out); }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const int j = (c / 2) % 8;
        const uint8_t* q = row + 144L * (c / 16) + 16 + 32 * (j / 2);
        const V16 D = vset1(S[c]), M = vset1(S[c + 1]);
        for (int h = 0; h < 2; h++) w[h] = vsub(vmul(D, s8v_to_f(field8(bytes16(q + 16 * h), 4 * (j % 2), 15))), M);
    }
};
struct FmtQ5_K : FmtK<176, 32, true> {  // d, dmin, scales[12], qh[32] (bit j: sub-block j), qs[128] as Q4_K
    static inline void scales(const uint8_t* row, int K, float* out) { k4_scales<176>(row, K, out); }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const int j = (c / 2) % 8;
        const uint8_t* b = row + 176L * (c / 16);
        const V16 D = vset1(S[c]), M = vset1(S[c + 1]);
        for (int h = 0; h < 2; h++) {
            const __m128i lo = field8(bytes16(b + 48 + 32 * (j / 2) + 16 * h), 4 * (j % 2), 15);
            const __m128i hi = _mm_slli_epi16(field8(bytes16(b + 16 + 16 * h), j, 1), 4);
            w[h] = vsub(vmul(D, s8v_to_f(_mm_or_si128(lo, hi))), M);
        }
    }
};
struct FmtQ6_K : FmtK<210, 16, false> {  // ql[128], qh[64], scales[16] (int8), d; q = (ql | qh << 4) - 32
    static inline void scales(const uint8_t* row, int K, float* out) {
        for (int s = 0; s < K / 256; s++, out += 16) {
            const uint8_t* b = row + 210L * s;
            const float d = h2f(b + 208);
            for (int j = 0; j < 16; j++) out[j] = d * (float)(int8_t)b[192 + j];
        }
    }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const int o = 16 * (c % 16), h = o / 128, r0 = o % 128;  // columns o..o+31 of the super-block
        const uint8_t* b = row + 210L * (c / 16);
        for (int k = 0; k < 2; k++) {
            const __m128i lo = field8(bytes16(b + 64 * h + r0 % 64 + 16 * k), 4 * (r0 / 64), 15);
            const __m128i hi = _mm_slli_epi16(field8(bytes16(b + 128 + 32 * h + 16 * k), 2 * (r0 / 32), 3), 4);
            w[k] = vmul(vset1(S[c + k]), s8v_to_f(_mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32))));
        }
    }
};
struct FmtQ3_K : FmtK<110, 16, false> {  // hmask[32], qs[64], scales[12] (6-bit, -32), d; q = ql - 4 (hmask bit 0)
    static inline void scales(const uint8_t* row, int K, float* out) {
        for (int s = 0; s < K / 256; s++, out += 16) {
            const uint8_t* b = row + 110L * s;
            const float d = h2f(b + 108);
            for (int j = 0; j < 16; j++) {
                const int lo = (b[96 + j % 8] >> (4 * (j / 8))) & 15, hi = (b[104 + j % 4] >> (2 * (j / 4))) & 3;
                out[j] = d * (float)((lo | hi << 4) - 32);
            }
        }
    }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const int o = 16 * (c % 16), h = o / 128, t = (o % 128) / 32;
        const uint8_t* b = row + 110L * (c / 16);
        for (int k = 0; k < 2; k++) {
            const __m128i ql = field8(bytes16(b + 32 + 32 * h + 16 * k), 2 * t, 3);
            const __m128i hb = _mm_slli_epi16(field8(bytes16(b + 16 * k), o / 32, 1), 2);  // 4 where the bit is set
            w[k] = vmul(vset1(S[c + k]), s8v_to_f(_mm_sub_epi8(_mm_add_epi8(ql, hb), _mm_set1_epi8(4))));
        }
    }
};
struct FmtQ2_K : FmtK<84, 16, true> {  // scales[16] (sc | m << 4), qs[64], d, dmin; w = d*sc*q - dmin*m
    static inline void scales(const uint8_t* row, int K, float* out) {
        for (int s = 0; s < K / 256; s++, out += 32) {
            const uint8_t* b = row + 84L * s;
            const float d = h2f(b + 80), dmin = h2f(b + 82);
            for (int j = 0; j < 16; j++) out[2 * j] = d * (float)(b[j] & 15), out[2 * j + 1] = dmin * (float)(b[j] >> 4);
        }
    }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const int o = 16 * (c % 16), h = o / 128, t = (o % 128) / 32;
        const uint8_t* b = row + 84L * (c / 16);
        for (int k = 0; k < 2; k++) {
            const __m128i q = field8(bytes16(b + 16 + 32 * h + 16 * k), 2 * t, 3);
            w[k] = vsub(vmul(vset1(S[2 * c + 2 * k]), s8v_to_f(q)), vset1(S[2 * c + 2 * k + 1]));
        }
    }
};
// Q5_0: d, qh (32 bits), qs[16]; w = d * (q - 16). Q5_1: d, m, qh, qs; w = d * q + m. Column i's fifth bit is bit i.
template <bool ONE>
struct FmtQ5 {
    static const int CH = 2, BLOCK = ONE ? 24 : 22;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = ONE ? 2 : 1;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* S, int c, int, V16* w) {
        const uint8_t* b = row + (long)BLOCK * (c / 2);
        uint32_t qh;
        memcpy(&qh, b + (ONE ? 4 : 2), 4);
        const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
        const __m128i qs = bytes16(b + (ONE ? 8 : 6));
        for (int k = 0; k < 2; k++) {
            const uint16_t hk = (uint16_t)(qh >> (16 * k));  // bytes of hk spread to lanes 0-7 and 8-15, one bit each
            const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(hk), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
            const __m128i hi = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
            const __m128i q = _mm_or_si128(field8(qs, 4 * k, 15), hi);
            if (ONE) w[k] = vadd(vmul(vset1(S[c]), s8v_to_f(q)), vset1(S[c + 1]));
            else w[k] = vmul(vset1(S[c / 2]), s8v_to_f(_mm_sub_epi8(q, _mm_set1_epi8(16))));
        }
    }
};
using FmtQ5_0 = FmtQ5<false>;
using FmtQ5_1 = FmtQ5<true>;

// Weight rows are prefetched this many rows ahead: the hardware prefetcher alone left the small matrices of a pass
// at half the bandwidth of one big one.
#ifndef PREFETCH
#define PREFETCH 8
#endif
// ---- linear: y[m, n] (+)= x[m, :] . W[n, :] (+ b[n]) -------------------------------------------------------------
// NR weight rows at a time (independent FMA chains), each dequantized once for up to 8 rows of x; more rows of x are
// taken 8 at a time. A (row m, weight row n) result depends on neither NR nor how the rows of x are grouped.
// W, y and b point at weight row n0 (its output column, its bias).
template <class F, int M, int NR, bool PF = true>  // PF: prefetch weight rows ahead (not for an L1 buffer)
static inline void tile(const float* x, long ldx, int K, const uint8_t* W, long rb, float* y, long ldy,
                        const float* b, bool acc_out) {
    const int ns = F::SPR * (K / 32);  // scales per weight row
    alignas(64) float S[NR * ns + 16];
    if constexpr (F::SPR > 0)
        for (int r = 0; r < NR; r++) F::scales(W + r * rb, K, S + r * ns);
    V16 acc[NR][M];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[r][m] = vzero();
    const int full = K / 16;  // whole chunks of 16 columns
    for (int c = 0; c + F::CH <= full; c += F::CH) {
        V16 w[NR][F::CH];
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const uint8_t* row = W + r * rb;
            if (PF && PREFETCH) _mm_prefetch((const char*)row + PREFETCH * rb + c * (rb / ((K + 15) / 16)), _MM_HINT_T0);
            F::chunk(row, S + r * ns, c, K, w[r]);
        }
#pragma GCC unroll 2
        for (int h = 0; h < F::CH; h++) {
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const V16 xv = vload(x + m * ldx + 16 * (c + h));
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) acc[r][m] = vfma(xv, w[r][h], acc[r][m]);
            }
        }
    }
    if (F::TAIL && K % 16) {  // float rows only: the zero-padded last chunk, as masked lanes would be
        const int col = K / 16 * 16;
        for (int r = 0; r < NR; r++) {
            V16 w;
            F::tail(W + r * rb, K, &w);
            for (int m = 0; m < M; m++) {
                float t[16] = {0};
                memcpy(t, x + m * ldx + col, 4 * (K - col));
                acc[r][m] = vfma(vload(t), w, acc[r][m]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            float s = vsum(acc[r][m]);
            if (b) s = s + b[r];
            float* out = y + m * ldy + r;
            *out = acc_out ? *out + s : s;
        }
}

// Rows of x 4 at a time against NR weight rows (more accumulators no longer fit in registers beside them).
template <class F, int NR, bool PF = true>
static inline void row_tiles(const float* x, long ldx, int R, int K, const uint8_t* W, long rb, float* y, long ldy,
                             const float* b, bool acc_out) {
    for (int m0 = 0; m0 < R; m0 += 4) {
        const float* xm = x + m0 * ldx;
        float* ym = y + m0 * ldy;
        switch (R - m0 < 4 ? R - m0 : 4) {
            case 1: tile<F, 1, NR, PF>(xm, ldx, K, W, rb, ym, ldy, b, acc_out); break;
            case 2: tile<F, 2, NR, PF>(xm, ldx, K, W, rb, ym, ldy, b, acc_out); break;
            case 3: tile<F, 3, NR, PF>(xm, ldx, K, W, rb, ym, ldy, b, acc_out); break;
            default: tile<F, 4, NR, PF>(xm, ldx, K, W, rb, ym, ldy, b, acc_out); break;
        }
    }
}

// Many rows against NR weight rows already dequantized to fp32 (an L1 buffer): rows of x WIDE at a time, the most
// accumulators the registers hold beside the weights (AVX-512: 6 x 4 + 4 + 1 of 32). Same products, same order.
#ifndef WIDE
#define WIDE 6
#endif
template <int NR>
static inline void wide_tiles(const float* x, long ldx, int R, int K, const float* buf, float* y, long ldy,
                              const float* b, bool acc_out) {
    const uint8_t* W = (const uint8_t*)buf;
    const long rb = 4L * K;
    int m0 = 0;
    for (; m0 + WIDE <= R; m0 += WIDE)
        tile<FmtF32, WIDE, NR, false>(x + m0 * ldx, ldx, K, W, rb, y + m0 * ldy, ldy, b, acc_out);
    if (m0 < R) row_tiles<FmtF32, NR, false>(x + m0 * ldx, ldx, R - m0, K, W, rb, y + m0 * ldy, ldy, b, acc_out);
}

// Weight rows n0..n0+NR-1 against all R rows of x. Up to BUFFER_ROWS - 1 rows, each weight is dequantized in
// registers once per 4-row tile. From BUFFER_ROWS rows (prompts, batched generation) the NR weight rows are
// dequantized once into an L1 buffer (exactly the values the registers would hold) and every 4-row tile runs on them
// as fp32 weights: the same products in the same order, so the same bits. (For verify passes of 5-8 rows that
// measured slower: a 5-token pass of SmolLM2-135M took 17.2 ms against 13.9 ms.)
#ifndef BUFFER_ROWS
#define BUFFER_ROWS 12
#endif
template <class F, int NR>
static inline void weight_rows(const float* x, long ldx, int R, int K, const uint8_t* W, long rb, int n0, float* y,
                               long ldy, const float* b, bool acc_out) {
    const uint8_t* Wn = W + (long)n0 * rb;
    const float* bn = b ? b + n0 : nullptr;
    if (F::TAIL || R < BUFFER_ROWS) {
        row_tiles<F, NR>(x, ldx, R, K, Wn, rb, y + n0, ldy, bn, acc_out);
        return;
    }
    static thread_local std::vector<float> buf, S;  // per thread, grown once: no allocation per call
    const int ns = F::SPR * (K / 32);
    if (buf.size() < (size_t)NR * K) buf.resize((size_t)NR * K);
    if (S.size() < (size_t)ns + 16) S.resize((size_t)ns + 16);
    for (int r = 0; r < NR; r++) {
        if constexpr (F::SPR > 0) F::scales(Wn + r * rb, K, S.data());
        for (int c = 0; c + F::CH <= K / 16; c += F::CH) {
            V16 w[F::CH];
            F::chunk(Wn + r * rb, S.data(), c, K, w);
            for (int h = 0; h < F::CH; h++) vstore(buf.data() + (long)r * K + 16 * (c + h), w[h]);
        }
    }
    wide_tiles<NR>(x, ldx, R, K, buf.data(), y + n0, ldy, bn, acc_out);
}

// Bytes of one weight row of K columns, or -1 for an unsupported format/shape.
extern "C" long row_bytes(int fmt, int K) {
    switch (fmt) {
        case F32: return 4L * K;
        case F16: case BF16: return 2L * K;
        case Q4_0: return K % 32 ? -1 : 18L * (K / 32);
        case Q4_1: return K % 32 ? -1 : 20L * (K / 32);
        case Q8_0: return K % 32 ? -1 : 34L * (K / 32);
        case Q5_0: return K % 32 ? -1 : 22L * (K / 32);
        case Q5_1: return K % 32 ? -1 : 24L * (K / 32);
        case Q2_K: return K % 256 ? -1 : 84L * (K / 256);
        case Q3_K: return K % 256 ? -1 : 110L * (K / 256);
        case Q4_K: return K % 256 ? -1 : 144L * (K / 256);
        case Q5_K: return K % 256 ? -1 : 176L * (K / 256);
        case Q6_K: return K % 256 ? -1 : 210L * (K / 256);
        default: return -1;
    }
}

// ---- q8: int8 activations x integer weights (the `q8` numerics mode) ---------------------------------------------
// Activations: each row quantized by itself in 32-element blocks (as ggml's Q8_0): s = max|x| / 127,
// q = round-half-even(x * (127 / max|x|)); an all-zero block has s = 0 and q = 0.
// Weights: Q4_0, Q4_1 and Q8_0 repacked once (rows_repack) into groups of 16 rows: per block of 32 columns, the 16
// rows' fp16 d (and m), then their quants interleaved 4 columns at a time, so one 64-byte load holds 4 columns of
// all 16 rows and one dot-product instruction gives each row's lane its 4 products (Q4 bytes hold columns c and
// c + 16 in their low and high nibbles, as in the file). Same bytes as the file.
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

// The layout a file format runs as in q8: Q4_0, Q4_1 and Q8_0 as themselves; Q5_0 as Q8_0 (d, q - 16 as int8: the
// same weights); Q4_K as Q4_1 (sub-block j: d = d·sc_j, m = -dmin·m_j, rounded to fp16 once at repack; refused, so
// the tensor runs exact, where that rounding would lose more than fp16's 11 bits); Q6_K as its own layout: per 32
// columns the two 16-column sub-blocks' d·sc in fp16 (the same rounding rule) and q + 32 in [0, 63] as Q4
// nibbles plus a 2-bit plane (Q8W<Q6_K>);
// Q5_K and Q5_1 as a byte layout of Q4_1's: d and m (fp16: Q5_1's own, Q5_K's d·sc_j and -dmin·m_j by the rule) and
// 32 bytes q in [0, 31]; Q3_K and Q2_K as Q4 nibbles (Q3_K: q + 4 in [0, 7]; Q2_K: q in [0, 3]) with both
// 16-column sub-blocks' d·sc in fp16 (Q2_K: and -dmin·m). The halves of a nibble block are its low (columns 0-15)
// and high nibbles (16-31). 0: none (exact kernels).
static inline int q8_layout(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 || fmt == Q6_K || fmt == Q5_K || fmt == Q3_K || fmt == Q2_K ? fmt
           : fmt == Q5_0 ? Q8_0 : fmt == Q4_K ? Q4_1 : fmt == Q5_1 ? Q5_K : 0;
}
static inline bool q8_format(int fmt) { return q8_layout(fmt) != 0; }
template <int FMT> struct Q8W;  // a file block's bytes and where its quants start; a repacked block's scale bytes
template <> struct Q8W<Q4_0> { static const int BLOCK = 18, QS = 2, SCALES = 32, CHUNKS = 4; };
template <> struct Q8W<Q4_1> { static const int BLOCK = 20, QS = 4, SCALES = 64, CHUNKS = 4; };
template <> struct Q8W<Q8_0> { static const int BLOCK = 34, QS = 2, SCALES = 32, CHUNKS = 8; };
// Q6_K: d_a, d_b; then u = q + 32 split: its low 4 bits as Q4 nibbles (4 chunks), its top 2 bits as 8 planes of 16
// bytes, plane e for the 64 bytes of unpacked chunk e (byte p's bits at plane byte p % 16, bits 2·(p / 16)): 7 bits a
// weight, against the file's 6.56
template <> struct Q8W<Q6_K> { static const int BLOCK = 28, QS = 4, SCALES = 64, CHUNKS = 4; };
template <> struct Q8W<Q5_K> { static const int BLOCK = 36, QS = 4, SCALES = 64, CHUNKS = 8; };  // d, m, 32 u8
template <> struct Q8W<Q3_K> { static const int BLOCK = 20, QS = 4, SCALES = 64, CHUNKS = 4; };  // d_a, d_b, nibbles
template <> struct Q8W<Q2_K> { static const int BLOCK = 24, QS = 8, SCALES = 128, CHUNKS = 4; };  // + m_a, m_b

// Block b of a file row in the layout FMT's bytes: the row's own block, or a converted copy in `tmp` (Q5_0, Q4_K).
// Returns null where a Q4_K sub-block's scale or min is not an fp16 number within fp16's relative precision.
static inline bool fp16_exact_enough(float v, uint16_t* h) {
    *h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    const float back = _cvtsh_ss(*h);
    return v == 0.0f || (fabsf(v) >= 6.103515625e-05f && fabsf(back - v) <= fabsf(v) * 0x1p-11f);
}
// Q4_K / Q5_K sub-block j of super-block sb: d·sc_j and -dmin·m_j as fp16 into out[0..3], or false
static inline bool k4_scale_min_fp16(const uint8_t* sb, int j, uint8_t* out) {
    int sc, m;
    scale_min_k4(sb + 4, j, &sc, &m);
    uint16_t d16, m16;
    if (!fp16_exact_enough(h2f(sb) * (float)sc, &d16) || !fp16_exact_enough(-(h2f(sb + 2) * (float)m), &m16))
        return false;
    memcpy(out, &d16, 2);
    memcpy(out + 2, &m16, 2);
    return true;
}
static const uint8_t* layout_block(int src, const uint8_t* row, int b, uint8_t* tmp) {
    if (src == Q5_0) {  // -> Q8_0: d, then q - 16 as int8
        const uint8_t* blk = row + 22L * b;
        uint32_t qh;
        memcpy(tmp, blk, 2);
        memcpy(&qh, blk + 2, 4);
        for (int i = 0; i < 32; i++) {
            const int lo = i < 16 ? blk[6 + i] & 15 : blk[6 + i - 16] >> 4;
            tmp[2 + i] = (uint8_t)(int8_t)((lo | ((qh >> i) & 1) << 4) - 16);
        }
        return tmp;
    }
    if (src == Q4_K) {  // -> Q4_1: sub-block j's 32 nibbles with column i in byte i % 16 (low nibble for i < 16)
        const uint8_t* sb = row + 144L * (b / 8);
        const int j = b % 8;
        if (!k4_scale_min_fp16(sb, j, tmp)) return nullptr;
        const uint8_t* q = sb + 16 + 32 * (j / 2);
        const int sh = 4 * (j % 2);
        for (int i = 0; i < 16; i++) tmp[4 + i] = (uint8_t)(((q[i] >> sh) & 15) | (((q[16 + i] >> sh) & 15) << 4));
        return tmp;
    }
    if (src == Q6_K) {  // -> d_a, d_b (fp16), then u = q + 32 of the 32 columns, in column order
        const uint8_t* sb = row + 210L * (b / 8);
        const int o = 32 * (b % 8), h = o / 128, r0 = o % 128;
        const float d = h2f(sb + 208);
        for (int k = 0; k < 2; k++) {
            uint16_t dk;
            if (!fp16_exact_enough(d * (float)(int8_t)sb[192 + o / 16 + k], &dk)) return nullptr;
            memcpy(tmp + 2 * k, &dk, 2);
        }
        for (int i = 0; i < 32; i++)
            tmp[4 + i] = (uint8_t)(((sb[64 * h + r0 % 64 + i] >> (4 * (r0 / 64))) & 15) |
                                   (((sb[128 + 32 * h + i] >> (2 * (r0 / 32))) & 3) << 4));
        return tmp;
    }
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
            if (!fp16_exact_enough(D, &dk) || (src == Q2_K && !fp16_exact_enough(M, &mk))) return nullptr;
            memcpy(tmp + 2 * k, &dk, 2);
            if (src == Q2_K) memcpy(tmp + 4 + 2 * k, &mk, 2);
        }
        uint8_t* nib = tmp + (src == Q3_K ? 4 : 8);
        for (int i = 0; i < 16; i++) nib[i] = (uint8_t)(u[i] | u[16 + i] << 4);
        return tmp;
    }
    if (src == Q5_1) {  // d, m as they are, then q = low nibble | fifth bit << 4
        const uint8_t* blk = row + 24L * b;
        uint32_t qh;
        memcpy(tmp, blk, 4);
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
    return row + (long)(src == Q4_0 ? 18 : src == Q4_1 ? 20 : 34) * b;
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
    const long rb = row_bytes(src, K), bb = 16L * F::BLOCK;
    static const uint8_t ZERO[36] = {0};
    bool ok = true;
#pragma omp for schedule(static)
    for (int g = 0; g < G; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t* o = out + (long)g * nb * bb + b * bb;
            if (FMT == Q6_K) memset(o + F::SCALES + 256, 0, 128);  // the 2-bit planes are or-ed in row by row
            for (int j = 0; j < 16; j++) {
                const int n = 16 * g + j;
                uint8_t tmp[36];
                const uint8_t* blk = n < N ? layout_block(src, W + n * rb, b, tmp) : ZERO;
                if (!blk) { ok = false; blk = ZERO; }
                for (int f = 0; f < F::SCALES / 32; f++) memcpy(o + 32 * f + 2 * j, blk + 2 * f, 2);  // d (m, d_b, ...)
                if constexpr (FMT == Q6_K) {
                    q6_split(blk + F::QS, j, o + F::SCALES);
                    continue;
                }
                for (int c = 0; c < F::CHUNKS; c++) memcpy(o + F::SCALES + 64 * c + 4 * j, blk + F::QS + 4 * c, 4);
            }
        }
    return ok;
}

extern "C" long rows_repacked_bytes(int fmt, int N, int K) {
    const int lay = q8_layout(fmt);
    if (!lay || row_bytes(fmt, K) < 0 || K % 32 || N < 0) return -1;
    const long block = lay == Q4_0 ? Q8W<Q4_0>::BLOCK : lay == Q4_1 ? Q8W<Q4_1>::BLOCK : lay == Q6_K ? Q8W<Q6_K>::BLOCK
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
            case Q6_K: ok = repack<Q6_K>(fmt, W, N, K, out); break;
            case Q5_K: ok = repack<Q5_K>(fmt, W, N, K, out); break;
            case Q3_K: ok = repack<Q3_K>(fmt, W, N, K, out); break;
            case Q2_K: ok = repack<Q2_K>(fmt, W, N, K, out); break;
            default: ok = repack<Q8_0>(fmt, W, N, K, out); break;
        }
        bad |= !ok;
    }
    return bad ? -2 : 0;
}

// One block's isum for 16 weight rows (lanes) and one x row: the 8 groups of 4 columns (Q4: chunk c's low nibbles
// are columns 4c.., its high nibbles 16 + 4c..; Q8_0: chunk c is columns 4c..). Two integer chains, added: exact.
#if defined(__AVX512VNNI__)
struct I16 { __m512i v; };
static inline V16 i16_to_f(I16 a) { return vfrom_i32(a.v); }
struct WB { __m512i g[8]; };  // a block's 8 column groups as vpdpbusd's unsigned operand
template <int FMT>
static inline void q8_unpack(const uint8_t* qs, WB* w) {
    if (FMT == Q8_0) {  // s8 -> u8 by +128, taken back by the -128 Σq start
        for (int c = 0; c < 8; c++) w->g[c] = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * c), _mm512_set1_epi8((char)0x80));
        return;
    }
    if (FMT == Q5_K) {  // already u8
        for (int c = 0; c < 8; c++) w->g[c] = _mm512_loadu_si512(qs + 64 * c);
        return;
    }
    if (FMT == Q6_K) {  // nibbles | plane bits << 4: plane byte p % 16 shifted by 2·(p / 16), one 128-bit lane per shift
        const __m512i m = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
        const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
        for (int e = 0; e < 8; e++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * (e % 4));
            const __m512i nib = _mm512_and_si512(e < 4 ? v : _mm512_srli_epi16(v, 4), m);
            const __m512i plane = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(qs + 256 + 16 * e)));
            const __m512i top = _mm512_and_si512(_mm512_srlv_epi32(plane, shifts), three);
            w->g[e] = _mm512_or_si512(nib, _mm512_slli_epi16(top, 4));
        }
        return;
    }
    const __m512i m = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * c);
        w->g[c] = _mm512_and_si512(v, m);
        w->g[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    }
}
static inline __m512i xb4(const int8_t* x) { int32_t v; memcpy(&v, x, 4); return _mm512_set1_epi32(v); }
template <int FMT>
static inline I16 q8_dot(const WB& w, const int8_t* xq, int32_t start) {
    __m512i a = _mm512_set1_epi32(start), b = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) a = _mm512_dpbusd_epi32(a, w.g[c], xb4(xq + 4 * c));
    for (int c = 4; c < 8; c++) b = _mm512_dpbusd_epi32(b, w.g[c], xb4(xq + 4 * c));
    return {_mm512_add_epi32(a, b)};
}
template <int FMT> static inline int32_t q8_start(const QX& Q, long at) {
    return FMT == Q4_0 ? Q.o4[at] : FMT == Q8_0 ? Q.o8[at] : 0;
}
// The block's two 16-column halves apart (Q6_K: a scale each), u8 weights: two exact integer chains from sa, sb.
static inline void q8_dot_halves(const WB& w, const int8_t* xq, int32_t sa, int32_t sb, I16* a, I16* b) {
    __m512i A = _mm512_set1_epi32(sa), B = _mm512_set1_epi32(sb);
    for (int c = 0; c < 4; c++) A = _mm512_dpbusd_epi32(A, w.g[c], xb4(xq + 4 * c));
    for (int c = 4; c < 8; c++) B = _mm512_dpbusd_epi32(B, w.g[c], xb4(xq + 4 * c));
    a->v = A, b->v = B;
}
#else
struct I16 { __m256i lo, hi; };  // rows 0-7, 8-15
static inline V16 i16_to_f(I16 a) {
#if defined(__AVX512F__)
    return vfrom_i32(_mm512_inserti64x4(_mm512_castsi256_si512(a.lo), a.hi, 1));
#else
    return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)};
#endif
}
static inline __m256i xb4(const int8_t* x) { int32_t v; memcpy(&v, x, 4); return _mm256_set1_epi32(v); }
template <int FMT>
static inline __m256i q8_dot8(__m256i w, __m256i x) {  // 8 lanes, each the exact sum of 4 products
    const __m256i ones = _mm256_set1_epi16(1);
    if (FMT == Q8_0)  // the sign trick: |w| . (x signed like w); |w| <= 128, |x| <= 127: no 16-bit saturation
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}
template <int FMT> static inline int32_t q8_start(const QX& Q, long at) { return FMT == Q4_0 ? Q.o4[at] : 0; }
#endif

#ifndef Q8_AHEAD
#define Q8_AHEAD 4096
#endif
// Rows of x per tile: each block's weights are unpacked once for them (q8_block_sums keeps them in registers).
// AVX-512: 8 (8 weight registers, 8 or 16 integer accumulators of 32), so a verify pass of up to 8 rows unpacks
// each block once; AVX2: 4 (its 16 registers). The tile width changes no bit: each row's sums and their order are
// the same in any tile.
#ifndef Q8_M
#if defined(__AVX512VNNI__)
#define Q8_M 8
#else
#define Q8_M 4
#endif
#endif

// The exact integer sums of one block (16 weight rows) against M rows of x: a[m] over the block (from q8_start), or
// for Q6_K, Q3_K and Q2_K a[m] and b[m] over its two 16-column halves (from -32, -4 and 0 times Σx of each half). Integer sums are exact, so the
// grouping below changes no bit.
#if defined(__AVX512VNNI__)
template <int FMT, int M>
static inline void q8_block_sums(const QX& Q, int m0, int bl, const uint8_t* qs, I16* a, I16* b) {
    WB w;  // 8 of 32 registers: unpacked once for the M rows
    q8_unpack<FMT>(qs, &w);
    for (int m = 0; m < M; m++) {
        const long at = (long)(m0 + m) * Q.nb + bl;
        const int8_t* xq = Q.q + (long)(m0 + m) * Q.K + 32 * bl;
        if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K) {
            const int32_t h0 = Q.h0[at], total = -Q.o4[at] / 8, off = FMT == Q6_K ? 32 : FMT == Q3_K ? 4 : 0;
            q8_dot_halves(w, xq, -off * h0, -off * (total - h0), &a[m], &b[m]);
        } else {
            a[m] = q8_dot<FMT>(w, xq, q8_start<FMT>(Q, at));
        }
    }
}
#else
// AVX2 has 16 registers: a block's unpacked weights alone would fill them. Chunk by chunk instead: a chunk's weights
// (4 columns of the 16 rows, two registers) meet every row's 4 activations while in registers, beside M rows'
// accumulators (Q6_K's halves need twice as many: its rows go two at a time).
template <int FMT, int M>
static inline void q8_block_sums(const QX& Q, int m0, int bl, const uint8_t* qs, I16* a, I16* b) {
    constexpr bool HALVES = FMT == Q6_K || FMT == Q3_K || FMT == Q2_K;
    if constexpr (HALVES && M > 2) {
        q8_block_sums<FMT, 2>(Q, m0, bl, qs, a, b);
        q8_block_sums<FMT, M - 2>(Q, m0 + 2, bl, qs, a + 2, b + 2);
        return;
    }
    constexpr int DOT = FMT == Q8_0 ? Q8_0 : Q4_1;  // signed bytes (the sign trick), or unsigned ones
    const int8_t* xq[M];
    __m256i alo[M], ahi[M], blo[M], bhi[M];
    for (int m = 0; m < M; m++) {
        const long at = (long)(m0 + m) * Q.nb + bl;
        xq[m] = Q.q + (long)(m0 + m) * Q.K + 32 * bl;
        if (HALVES) {
            const int32_t h0 = Q.h0[at], total = -Q.o4[at] / 8, off = FMT == Q6_K ? 32 : FMT == Q3_K ? 4 : 0;
            alo[m] = ahi[m] = _mm256_set1_epi32(-off * h0);
            blo[m] = bhi[m] = _mm256_set1_epi32(-off * (total - h0));
        } else {
            alo[m] = ahi[m] = _mm256_set1_epi32(q8_start<FMT>(Q, at));
        }
    }
    auto step = [&](int c, __m256i wlo, __m256i whi) {  // chunk c: columns 4c..4c+3 (Q4: see q8_unpack)
        for (int m = 0; m < M; m++) {
            const __m256i x = xb4(xq[m] + 4 * c);
            if (HALVES && c >= 4) {
                blo[m] = _mm256_add_epi32(blo[m], q8_dot8<DOT>(wlo, x));
                bhi[m] = _mm256_add_epi32(bhi[m], q8_dot8<DOT>(whi, x));
            } else {
                alo[m] = _mm256_add_epi32(alo[m], q8_dot8<DOT>(wlo, x));
                ahi[m] = _mm256_add_epi32(ahi[m], q8_dot8<DOT>(whi, x));
            }
        }
    };
    if constexpr (FMT == Q4_0 || FMT == Q4_1 || FMT == Q3_K || FMT == Q2_K || FMT == Q6_K) {
        const __m256i mask = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
        // Q6_K's top bits: plane byte p % 16 shifted by 2·(p / 16); rows 0-7 are bytes 0-31, rows 8-15 bytes 32-63
        const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), shift_hi = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
        auto top = [&](int e, __m256i nib, __m256i shifts) {
            if constexpr (FMT != Q6_K) return nib;
            const __m256i plane = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(qs + 256 + 16 * e)));
            return _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(plane, shifts), three), 4));
        };
        for (int c = 0; c < 4; c++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i*)(qs + 64 * c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i*)(qs + 64 * c + 32));
            step(c, top(c, _mm256_and_si256(v0, mask), shift_lo), top(c, _mm256_and_si256(v1, mask), shift_hi));
            step(c + 4, top(c + 4, _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask), shift_lo),
                 top(c + 4, _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask), shift_hi));
        }
    } else {
        for (int c = 0; c < 8; c++)
            step(c, _mm256_loadu_si256((const __m256i*)(qs + 64 * c)), _mm256_loadu_si256((const __m256i*)(qs + 64 * c + 32)));
    }
    for (int m = 0; m < M; m++) {
        a[m] = {alo[m], ahi[m]};
        if (HALVES) b[m] = {blo[m], bhi[m]};
    }
}
#endif

// One group of 16 weight rows (cols of them real, the rest padding) against M rows of x from m0: each block is
// unpacked once for the M rows. y, b: at the group's first output column.
template <int FMT, int M>
static inline void q8_tile(const QX& Q, int m0, const uint8_t* G, float* y, long ldy, const float* b, int cols,
                           bool acc_out) {
    typedef Q8W<FMT> F;
    const int nb = Q.nb;
    const long bb = 16L * F::BLOCK;
    V16 acc[M];
    for (int m = 0; m < M; m++) acc[m] = vzero();
    for (int bl = 0; bl < nb; bl++) {
        const uint8_t* blk = G + bl * bb;
        for (int o = 0; o < (int)bb; o += 64) _mm_prefetch((const char*)blk + Q8_AHEAD + o, _MM_HINT_T0);
        const V16 d = f16_to_f((const uint16_t*)blk);
        I16 ia[M], ib[M];
        q8_block_sums<FMT, M>(Q, m0, bl, blk + F::SCALES, ia, ib);
        // Q4_1 / Q5_K: m; Q6_K: d of the second half
        const V16 second = FMT == Q4_0 || FMT == Q8_0 ? d : f16_to_f((const uint16_t*)blk + 16);
        for (int m = 0; m < M; m++) {
            const long at = (long)(m0 + m) * nb + bl;
            const V16 sv = vset1(Q.s[at]);
            if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K) {  // Σ q·x per half, each scaled by its d
                acc[m] = vfma(i16_to_f(ia[m]), vmul(d, sv), acc[m]);
                acc[m] = vfma(i16_to_f(ib[m]), vmul(second, sv), acc[m]);
                if constexpr (FMT == Q2_K) {  // and each half's min times its Σx
                    const int32_t h0 = Q.h0[at], total = -Q.o4[at] / 8;
                    acc[m] = vfma(f16_to_f((const uint16_t*)blk + 32), vset1(Q.s[at] * (float)h0), acc[m]);
                    acc[m] = vfma(f16_to_f((const uint16_t*)blk + 48), vset1(Q.s[at] * (float)(total - h0)), acc[m]);
                }
            } else {
                acc[m] = vfma(i16_to_f(ia[m]), vmul(d, sv), acc[m]);
                if (FMT == Q4_1 || FMT == Q5_K) acc[m] = vfma(second, vset1(Q.sq[at]), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float* out = y + (long)(m0 + m) * ldy;
        if (cols == 16) {
            V16 v = acc[m];
            if (b) v = vadd(v, vload(b));
            vstore(out, acc_out ? vadd(vload(out), v) : v);
        } else {
            alignas(64) float t[16];
            vstore(t, acc[m]);
            for (int j = 0; j < cols; j++) {
                float s = t[j];
                if (b) s = s + b[j];
                out[j] = acc_out ? out[j] + s : s;
            }
        }
    }
}

// Group g (16 weight rows of a repacked matrix) against all R rows of x, Q8_M rows at a time.
template <int FMT>
static void q8_group(const QX& Q, int R, const uint8_t* Wq, int g, int N, float* y, long ldy, const float* b,
                     bool acc_out) {
    const uint8_t* G = Wq + (long)g * Q.nb * 16 * Q8W<FMT>::BLOCK;
    const int n0 = 16 * g, cols = N - n0 < 16 ? N - n0 : 16;
    float* yn = y + n0;
    const float* bn = b ? b + n0 : nullptr;
    for (int m0 = 0; m0 < R; m0 += Q8_M) {
        switch (R - m0 < Q8_M ? R - m0 : Q8_M) {
            case 1: q8_tile<FMT, 1>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
#if Q8_M >= 3
            case 2: q8_tile<FMT, 2>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
            case 3: q8_tile<FMT, 3>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
#endif
#if Q8_M >= 8
            case 4: q8_tile<FMT, 4>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
            case 5: q8_tile<FMT, 5>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
            case 6: q8_tile<FMT, 6>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
            case 7: q8_tile<FMT, 7>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
#endif
            default: q8_tile<FMT, Q8_M>(Q, m0, G, yn, ldy, bn, cols, acc_out); break;
        }
    }
}

// A linear whose output columns come from up to 3 weight matrices (fused q/k/v, gate/up), each in its own format;
// wq: the matrix repacked for q8 (rows_repack), or null.
struct Seg { const uint8_t* w; const uint8_t* wq; const float* bias; int fmt, n; };
struct Lin { Seg seg[3]; int count; };

template <int NR>
static inline void rows_of(const Seg& s, const float* x, int R, int K, int n0, float* y, long ldy, bool acc_out) {
    const long rb = row_bytes(s.fmt, K);
    switch (s.fmt) {
        case F32: weight_rows<FmtF32, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case F16: weight_rows<FmtF16, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case BF16: weight_rows<FmtBF16, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q4_0: weight_rows<FmtQ4_0, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q4_1: weight_rows<FmtQ4_1, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q5_0: weight_rows<FmtQ5_0, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q5_1: weight_rows<FmtQ5_1, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q2_K: weight_rows<FmtQ2_K, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q3_K: weight_rows<FmtQ3_K, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q4_K: weight_rows<FmtQ4_K, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q5_K: weight_rows<FmtQ5_K, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        case Q6_K: weight_rows<FmtQ6_K, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        default: weight_rows<FmtQ8_0, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
    }
}

static bool servable(const Lin* L, int K) {
    for (int i = 0; i < L->count; i++) {
        const int fmt = L->seg[i].fmt;
        if (row_bytes(fmt, K) < 0) return false;
    }
    return true;
}

// y[R, Σn] (+)= x[R, K]·[W_0; W_1; ...]ᵀ (+ biases). Work-shares over the calling parallel region (an orphaned
// `omp for`: called outside one, the calling thread does it all); ends with the for's barrier. With Q (x quantized,
// the q8 mode) a segment with a repacked matrix runs the q8 kernel, 16 weight rows per work item; float weights
// always take x itself, 4 rows per item.
static void linear(const Lin* L, const float* x, int R, int K, float* y, bool acc_out, const QX* Q = nullptr) {
    const int NR = 4;
    int groups = 0, ldy = 0, starts[4] = {0}, cols[4] = {0}, per[3];
    for (int i = 0; i < L->count; i++) {
        cols[i] = ldy;
        ldy += L->seg[i].n;
        per[i] = Q && L->seg[i].wq && q8_format(L->seg[i].fmt) ? 16 : NR;
        starts[i + 1] = groups += (L->seg[i].n + per[i] - 1) / per[i];
    }
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        int i = 0;
        while (g >= starts[i + 1]) i++;
        const Seg& s = L->seg[i];
        float* ys = y + cols[i];  // weight row n of this segment is output column cols[i] + n
        if (per[i] == 16) {
            switch (q8_layout(s.fmt)) {
                case Q4_0: q8_group<Q4_0>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q4_1: q8_group<Q4_1>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q6_K: q8_group<Q6_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q5_K: q8_group<Q5_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q3_K: q8_group<Q3_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q2_K: q8_group<Q2_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                default: q8_group<Q8_0>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
            }
            continue;
        }
        const int n0 = (g - starts[i]) * NR;
        if (n0 + NR <= s.n) rows_of<NR>(s, x, R, K, n0, ys, ldy, acc_out);
        else for (int n = n0; n < s.n; n++) rows_of<1>(s, x, R, K, n, ys, ldy, acc_out);
    }
}

// QX buffers for R rows of up to K columns, owned by the caller's vectors.
struct QXBuf {
    std::vector<int8_t> q; std::vector<float> s, sq; std::vector<int32_t> o4, o8, h0;
    QXBuf(int R, int K)
        : q((size_t)R * K), s((size_t)R * (K / 32)), sq(s.size()), o4(s.size()), o8(s.size()), h0(s.size()) {}
    QX view(int K) {  // the layout for rows of K columns (K <= the size it was made for)
        return {q.data(), s.data(), sq.data(), o4.data(), o8.data(), h0.data(), K, K / 32};
    }
};

// x: [R, K] row-major fp32; W: N rows of `fmt`; y: [R, N]; b: [N] or null. Wq: W repacked (rows_repack) for the q8
// mode (int8 activations against Q4_0/Q4_1/Q8_0 weights), or null: exact (fp32 on the dequantized weights).
// Returns 0, or -1 if fmt/K unsupported.
extern "C" int rows_linear(int fmt, const float* x, int R, int K, const uint8_t* W, const uint8_t* Wq, int N, float* y,
                           const float* b, int threads) {
    Lin L = {{{W, Wq, b, fmt, N}}, 1};
    if (!servable(&L, K) || R < 0) return -1;
    const bool quant = Wq && q8_format(fmt) && R > 0;
    QXBuf buf(quant ? R : 0, quant ? K : 32);
    const QX Q = buf.view(K);
#pragma omp parallel num_threads(threads)
    {
        if (quant) q8_quantize(x, R, Q);
        linear(&L, x, R, K, y, false, quant ? &Q : nullptr);
    }
    return 0;
}

// ---- the non-linear work, each row on its own ---------------------------------------------------------------------
static void rmsnorm_row(const float* x, int D, const float* w, float eps, float* out) {
    V16 acc = vzero();
    int k = 0;
    for (; k + 16 <= D; k += 16) { V16 v = vload(x + k); acc = vfma(v, v, acc); }
    float ss = vsum(acc);
    for (; k < D; k++) ss += x[k] * x[k];
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int i = 0; i < D; i++) out[i] = w[i] * (x[i] * r);
}

// w == null: no norm (a draft layer whose input is already scaled, as EAGLE's first layer), the rows are copied
static void rmsnorm(const float* x, int R, int D, const float* w, float eps, float* out) {
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        if (w) rmsnorm_row(x + (long)r * D, D, w, eps, out + (long)r * D);
        else memcpy(out + (long)r * D, x + (long)r * D, 4L * D);
    }
}

extern "C" void rows_rmsnorm(const float* x, int R, int D, const float* w, float eps, float* out, int threads) {
#pragma omp parallel num_threads(threads)
    rmsnorm(x, R, D, w, eps, out);
}

// Rotary embedding of `heads` heads of size hd at x (one row): pair i is (v[i], v[i + hd/2]) as transformers' Llama
// rotates halves, or (v[2i], v[2i+1]) in llama.cpp's row order. Either way each pair gets the same two products and
// one add/sub, so the rotated values are the same numbers, stored in another order.
static void rope_row(float* x, int heads, int hd, const float* cs, const float* sn, bool interleaved) {
    const int h2 = hd / 2;
    for (int h = 0; h < heads; h++) {
        float* v = x + h * hd;
        for (int i = 0; i < h2; i++) {
            float* pa = interleaved ? v + 2 * i : v + i;
            float* pb = interleaved ? v + 2 * i + 1 : v + i + h2;
            const float a = *pa, b = *pb;
            *pa = a * cs[i] - b * sn[i];
            *pb = b * cs[i] + a * sn[i];  // the tables hold one angle per pair (both halves of a row are equal)
        }
    }
}

// silu(g) = g / (1 + exp(-g)); gelu(g) = g/2 (1 + tanh(√(2/π) (g + 0.044715 g³))), tanh(u) = 1 - 2 / (1 + exp(2u))
// (exp saturates: tanh is ±1 there), as torch's gelu(approximate="tanh") defines it.
static inline V16 vsilu(V16 g) { return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))); }
static inline V16 vgelu(V16 g) {
    const V16 u = vmul(vset1(0.7978845608028654f), vadd(g, vmul(vset1(0.044715f), vmul(g, vmul(g, g)))));
    const V16 t = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(vset1(1.0f), vexp(vadd(u, u)))));
    return vmul(vmul(vset1(0.5f), g), vadd(vset1(1.0f), t));
}
static inline float lane0(V16 (*f)(V16), float g) {  // the tail of a row whose width is not a multiple of 16
    float t[16] = {g}, e[16];
    vstore(e, f(vload(t)));
    return e[0];
}
static inline float silu(float g) { return lane0(vsilu, g); }
static inline float gelu(float g) { return lane0(vgelu, g); }

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

// Where one slot's K/V of one layer and KV head live: the element offset of position p's block (its 16 keys at
// + 16 * column + p % 16, its value row at + (p % 16) * head_dim). Rows of any pass read blocks only through this, so a
// position's keys and values are the same numbers whichever block holds them.
template <typename T>
struct Pages {
    T* base;
    const int* table;
    long bstride, lg;  // elements per block; offset of (layer, group) inside a block
    Pages(const Dims* d, void* pool, int slot, int layer, int g)
        : base((T*)pool), table(d->tables[slot]), bstride(16L * d->head_dim * d->kv_heads * d->layers),
          lg(16L * d->head_dim * ((long)layer * d->kv_heads + g)) {}
    inline T* block(int p) const { return base + table[p >> 4] * bstride + lg; }
    inline T* key(int p) const { return block(p) + (p & 15); }  // column c at + 16 * c
    inline T* value(int p, int hd) const { return block(p) + (long)(p & 15) * hd; }
};

// K/V elements as stored: fp32, or fp16 (F16C: both builds)
static inline V16 kv_load(const float* p) { return vload(p); }
static inline V16 kv_load(const uint16_t* p) { return f16_to_f(p); }
static inline float kv_get(const float* p) { return *p; }
static inline float kv_get(const uint16_t* p) { return _cvtsh_ss(*p); }
static inline void kv_put(float* p, float v) { *p = v; }
static inline void kv_put(uint16_t* p, float v) { *p = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
static inline void kv_put_row(float* p, const float* x, int n) { memcpy(p, x, 4L * n); }
static inline void kv_put_row(uint16_t* p, const float* x, int n) {  // n a multiple of 16; the same rounding
    for (int i = 0; i < n; i += 16) {
#if defined(__AVX512F__)
        _mm256_storeu_si256((__m256i*)(p + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#else
        _mm_storeu_si128((__m128i*)(p + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i*)(p + i + 8), _mm256_cvtps_ph(_mm256_loadu_ps(x + i + 8), _MM_FROUND_TO_NEAREST_INT));
#endif
    }
}

// NH query heads of one row that share KV head g, over keys 0..pos of its slot: per head softmax(q.k / sqrt(hd)) . v,
// keys in order. The heads go together so each key and value is read once for all of them (grouped-query attention
// is memory-bound: a batch of sequences reads every slot's whole cache each pass). Keys are stored in transposed
// blocks of 16 positions: 16 keys' scores come from hd broadcast multiply-adds, no horizontal sums. Each score is
// one multiply-add chain over the dimensions in order (a tree row's mapped keys by fmaf, as a lane does it);
// each output is one chain over the keys in order. Nothing depends on other rows or heads.
//
// A tree row (Keys.map) sees logical positions 0..kbase-1 where they are stored and kbase..pos at the storage
// positions map[0..pos-kbase] (its ancestors, then itself). Every step below is a function of the logical key
// sequence alone (a score is the same chain from a lane or from fmaf), so a tree node gets bitwise the output a
// one-token step of its path gets.
struct Keys {
    int kbase;        // logical positions >= kbase are mapped (pos + 1 for a plain row)
    const int* map;   // their storage positions
    inline int at(int j) const { return j < kbase ? j : map[j - kbase]; }
};

#ifndef V_AHEAD
#define V_AHEAD 8
#endif
// Output columns 16·c0 .. 16·(c0 + CN) of NH heads: Σ_j p_j v_j over the keys in order, then / Σ p. CN is a constant
// so the NH × CN chains stay in registers.
template <int NH, int CN, typename T>
static inline void attend_values(const Pages<const T>& V, const Keys& keys, int j0, int L, int hd, int c0,
                                 const float* p, int L16, const float* sum, float* out) {
    V16 o[NH][CN];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < CN; c++) o[h][c] = vzero();
    auto add = [&](int j, const T* vj, const T* ahead) {  // key j's value row (columns from c0) into the sums
        V16 v[CN];
        for (int c = 0; c < CN; c++) {
            _mm_prefetch((const char*)(ahead + 16 * c), _MM_HINT_T0);
            v[c] = kv_load(vj + 16 * c);
        }
        for (int h = 0; h < NH; h++) {
            const V16 pj = vset1(p[h * L16 + j]);
            for (int c = 0; c < CN; c++) o[h][c] = vfma(pj, v[c], o[h][c]);
        }
    };
    int j = j0;
    const int whole = (L < keys.kbase ? L : keys.kbase) / 16 * 16;  // full blocks of plain keys: rows hd apart
    for (; j < whole; j += 16) {
        const T* vb = V.block(j) + 16 * c0;
        const bool more = j + 16 < whole;  // prefetch 16 keys ahead: the next block's rows, else the next key's
        const T* next = more ? V.block(j + 16) + 16 * c0 : j + 16 < L ? V.value(keys.at(j + 16), hd) + 16 * c0 : vb;
        for (int i = 0; i < 16; i++) add(j + i, vb + (long)i * hd, more ? next + (long)i * hd : next);
    }
    for (; j < L; j++) {
        const T* vj = V.value(keys.at(j), hd) + 16 * c0;
        add(j, vj, j + V_AHEAD < L ? V.value(keys.at(j + V_AHEAD), hd) + 16 * c0 : vj);  // the same columns
    }
    for (int h = 0; h < NH; h++) {
        const V16 inv = vset1(1.0f / sum[h]);
        for (int c = 0; c < CN; c++) vstore(out + h * hd + 16 * (c0 + c), vmul(o[h][c], inv));
    }
}

// A sliding window (window > 0) hides logical keys before lo = L - window: scoring starts at lo's block j0, and the
// keys j0..lo-1 get -inf, so they weigh exactly 0.
template <int NH, typename T>
static void attend(const Dims* d, int layer, int slot, int pos, const Keys& keys, int g, const float* q, float* out,
                   float* p, int window) {
    const int hd = d->head_dim, L = pos + 1, L16 = (L + 15) / 16 * 16;
    const int lo = window > 0 && L > window ? L - window : 0, j0 = lo / 16 * 16;
    const int Lplain = L < keys.kbase ? L : keys.kbase;  // keys stored at their own position
    const float scale = d->attn_scale > 0.0f ? d->attn_scale : 1.0f / sqrtf((float)hd);
    const Pages<const T> K(d, d->kpool, slot, layer, g), V(d, d->vpool, slot, layer, g);
    int j = j0;
    // whole blocks, and the partial block of plain keys as lanes too (a lane's chain is the scalar fmaf chain; lanes
    // past L are padding, set to -inf below)
    for (; j < Lplain && (j + 16 <= Lplain || Lplain == L); j += 16) {
        V16 acc[NH];
        for (int h = 0; h < NH; h++) acc[h] = vzero();
        const T* blk = K.block(j);
        const T* next = j + 16 < Lplain ? K.block(j + 16) : blk;  // blocks are apart: no hardware prefetch across
        for (int c = 0; c < hd; c++) {
            _mm_prefetch((const char*)(next + 16 * c), _MM_HINT_T0);
            const V16 k = kv_load(blk + 16 * c);
            for (int h = 0; h < NH; h++) acc[h] = vfma(vset1(q[h * hd + c]), k, acc[h]);
        }
        for (int h = 0; h < NH; h++) vstore(p + h * L16 + j, vmul(acc[h], vset1(scale)));
    }
    for (; j < L; j++) {
        const int sj = keys.at(j);
        const T* blk = K.key(sj);
        for (int h = 0; h < NH; h++) {
            float acc = 0.0f;
            for (int c = 0; c < hd; c++) acc = fmaf(q[h * hd + c], kv_get(blk + 16 * c), acc);
            p[h * L16 + j] = acc * scale;
        }
    }
    float sum[NH];
    for (int h = 0; h < NH; h++) {
        float* ph = p + h * L16;
        float mx = -INFINITY;
        for (j = j0; j < lo; j++) ph[j] = -INFINITY;  // outside the window
        for (j = lo; j < L; j++) mx = ph[j] > mx ? ph[j] : mx;
        for (j = L; j < L16; j++) ph[j] = -INFINITY;  // padding lanes: exp gives ~0 and they are not summed
        V16 sums = vzero();
        for (j = j0; j < L16; j += 16) {
            V16 e = vexp(vsub(vload(ph + j), vset1(mx)));
            vstore(ph + j, e);
            if (j + 16 <= L) sums = vadd(sums, e);
        }
        sum[h] = vsum(sums);
        for (j = L / 16 * 16; j < L; j++) sum[h] += ph[j];
    }
    const int nc = hd / 16;
    int c0 = 0;
    for (; c0 + 4 <= nc; c0 += 4) attend_values<NH, 4, T>(V, keys, j0, L, hd, c0, p, L16, sum, out);
    switch (nc - c0) {
        case 3: attend_values<NH, 3, T>(V, keys, j0, L, hd, c0, p, L16, sum, out); break;
        case 2: attend_values<NH, 2, T>(V, keys, j0, L, hd, c0, p, L16, sum, out); break;
        case 1: attend_values<NH, 1, T>(V, keys, j0, L, hd, c0, p, L16, sum, out); break;
    }
}

// Heads of group g, up to 4 at a time (registers), on K/V stored as T.
template <typename T>
static void attend_heads(const Dims* d, int layer, int slot, int pos, const Keys& keys, int g, const float* q,
                         float* out, float* p, int window) {
    const int rep = d->heads / d->kv_heads, hd = d->head_dim;
    for (int h = 0; h < rep; h += 4) {
        const float* qh = q + (long)h * hd;
        float* oh = out + (long)h * hd;
        switch (rep - h < 4 ? rep - h : 4) {
            case 1: attend<1, T>(d, layer, slot, pos, keys, g, qh, oh, p, window); break;
            case 2: attend<2, T>(d, layer, slot, pos, keys, g, qh, oh, p, window); break;
            case 3: attend<3, T>(d, layer, slot, pos, keys, g, qh, oh, p, window); break;
            default: attend<4, T>(d, layer, slot, pos, keys, g, qh, oh, p, window); break;
        }
    }
}

static void attend_group(const Dims* d, int layer, int slot, int pos, const Keys& keys, int g, const float* q,
                         float* out, float* p, int window) {
    if (d->kv16) attend_heads<uint16_t>(d, layer, slot, pos, keys, g, q, out, p, window);
    else attend_heads<float>(d, layer, slot, pos, keys, g, q, out, p, window);
}

// A row's key and value at storage position st of its slot, in the slot's block for st.
template <typename T>
static inline void store_kv(const Dims* d, int slot, int layer, int g, int st, const float* k, const float* v) {
    const int hd = d->head_dim;
    T* kb = Pages<T>(d, d->kpool, slot, layer, g).key(st);
    for (int c = 0; c < hd; c++) kv_put(kb + 16 * c, k[c]);
    kv_put_row(Pages<T>(d, d->vpool, slot, layer, g).value(st, hd), v, hd);
}

struct Scratch { float *h, *qkv, *att, *gu, *act, *p; int plen; QXBuf* xq; };

static const QX* q8_input(const Dims* d, const Scratch& s, const float* x, int R, int K, QX* view);
// x += W·in, or with a post-norm (Gemma) x += norm(W·in): the product lands in s.h, is normed in place, then added.
static void residual_add(const Lin& W, const float* post_norm, const Dims* d, const Scratch& s, const float* in, int R,
                         int K, float* x, QX* view) {
    if (!post_norm) {
        linear(&W, in, R, K, x, true, q8_input(d, s, in, R, K, view));
        return;
    }
    const int D = d->hidden;
    linear(&W, in, R, K, s.h, false, q8_input(d, s, in, R, K, view));
    rmsnorm(s.h, R, D, post_norm, d->eps, s.h);
#pragma omp for schedule(static)
    for (long i = 0; i < (long)R * D; i++) x[i] = x[i] + s.h[i];
}

// x quantized for the next linear (q8 mode), or null (exact)
static const QX* q8_input(const Dims* d, const Scratch& s, const float* x, int R, int K, QX* view) {
    if (!d->q8) return nullptr;
    *view = s.xq->view(K);
    q8_quantize(x, R, *view);
    return view;
}

// One decoder layer over R rows, in place on the residual stream x [R, hidden], inside the pass's parallel region.
// Row r is at position pos[r] of KV slot slot[r]; its key and value are written there first, so a row sees the
// earlier rows of its own slot in this pass (causal) and nothing of other slots. With a tree (Tree, below) a row's
// key and value go to its storage position and it attends through its ancestors' map.
struct Tree {
    const int* store;  // [R] storage position of each row
    const int* kbase;  // [R] first mapped logical position (pos + 1: none)
    const int* moff;   // [R] offset of the row's map in `map`
    const int* map;
    inline int stored(const int* pos, int r) const { return store ? store[r] : pos[r]; }
    inline Keys keys(const int* pos, int r) const {
        return store ? Keys{kbase[r], map + moff[r]} : Keys{pos[r] + 1, nullptr};
    }
};

static void layer_body(const Dims* d, const Layer* L, int layer, float* x, int R, const int* slot, const int* pos,
                       const Tree& tree, const Scratch& s) {
    const int D = d->hidden, hd = d->head_dim, H = d->heads, G = d->kv_heads, I = d->inter;
    const int nq = H * hd, nkv = G * hd, nqkv = nq + 2 * nkv;
    QX view;
    rmsnorm(x, R, D, L->attn_norm, d->eps, s.h);
    linear(&L->qkv, s.h, R, D, s.qkv, false, q8_input(d, s, s.h, R, D, &view));
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        float* row = s.qkv + (long)r * nqkv;
        const float* cs = (L->cos ? L->cos : d->cos) + (long)pos[r] * (hd / 2);
        const float* sn = (L->sin ? L->sin : d->sin) + (long)pos[r] * (hd / 2);
        for (int h = 0; L->q_norm && h < H; h++) rmsnorm_row(row + h * hd, hd, L->q_norm, d->eps, row + h * hd);
        for (int h = 0; L->k_norm && h < G; h++) rmsnorm_row(row + nq + h * hd, hd, L->k_norm, d->eps, row + nq + h * hd);
        rope_row(row, H, hd, cs, sn, d->interleaved);
        rope_row(row + nq, G, hd, cs, sn, d->interleaved);
        const int st = tree.stored(pos, r);
        for (int g = 0; g < G; g++) {
            const float *k = row + nq + g * hd, *v = row + nq + nkv + g * hd;
            if (d->kv16) store_kv<uint16_t>(d, slot[r], layer, g, st, k, v);
            else store_kv<float>(d, slot[r], layer, g, st, k, v);
        }
    }
    float* p = s.p + (long)omp_get_thread_num() * s.plen;
#pragma omp for schedule(static)
    for (int rg = 0; rg < R * G; rg++) {  // query heads g*rep .. g*rep+rep-1 share KV head g
        const int r = rg / G, g = rg % G, h0 = g * (H / G);
        attend_group(d, layer, slot[r], pos[r], tree.keys(pos, r), g, s.qkv + (long)r * nqkv + h0 * hd,
                     s.att + (long)r * nq + h0 * hd, p, L->window);
    }
    residual_add(L->o, L->post_attn_norm, d, s, s.att, R, nq, x, &view);  // x += o(att)
    rmsnorm(x, R, D, L->ffn_norm, d->eps, s.h);
    linear(&L->gate_up, s.h, R, D, s.gu, false, q8_input(d, s, s.h, R, D, &view));
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {  // act = f(gate) * up, 16 lanes at a time
        const float* gate = s.gu + (long)r * 2 * I;
        float* a = s.act + (long)r * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) vstore(a + i, vmul(d->act ? vgelu(vload(gate + i)) : vsilu(vload(gate + i)), vload(gate + I + i)));
        for (; i < I; i++) a[i] = (d->act ? gelu : silu)(gate[i]) * gate[I + i];
    }
    residual_add(L->down, L->post_ffn_norm, d, s, s.act, R, I, x, &view);  // x += down(act)
}

// The k largest logits of each row (descending; ties keep the lower index) and each row's log-sum-exp: what
// the recycle drafter keeps of every verify pass (drafters/recycle.py). Blocks of 64 whose maximum cannot enter the
// current top k are skipped after 3 vector maxima, so a row costs about one read plus one exp pass.
extern "C" void rows_topk(const float* x, int R, int V, int k, int* idx, float* val, float* lse, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < R; r++) {
        const float* row = x + (long)r * V;
        int* ti = idx + (long)r * k;
        float* tv = val + (long)r * k;
        for (int j = 0; j < k; j++) ti[j] = -1, tv[j] = -INFINITY;
        auto offer = [&](int i) {
            const float v = row[i];
            if (!(v > tv[k - 1])) return;
            int j = k - 1;
            for (; j > 0 && v > tv[j - 1]; j--) tv[j] = tv[j - 1], ti[j] = ti[j - 1];
            tv[j] = v, ti[j] = i;
        };
        int i = 0;
        float lanes[16];
        for (; i + 64 <= V; i += 64) {
            vstore(lanes, vmax(vmax(vload(row + i), vload(row + i + 16)), vmax(vload(row + i + 32), vload(row + i + 48))));
            float m = lanes[0];
            for (int l = 1; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
            if (m > tv[k - 1])
                for (int j = i; j < i + 64; j++) offer(j);
        }
        for (; i < V; i++) offer(i);
        const float mx = tv[0];
        V16 sums = vzero();
        for (i = 0; i + 16 <= V; i += 16) sums = vadd(sums, vexp(vsub(vload(row + i), vset1(mx))));
        float sum = vsum(sums);
        for (; i < V; i++) sum += expf(row[i] - mx);
        lse[r] = mx + logf(sum);
    }
}

static inline bool vany_eq(V16 a, float m) {  // some lane equals m
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(m), _CMP_EQ_OQ) != 0;
#else
    const __m256 mm = _mm256_set1_ps(m);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a.lo, mm, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, mm, _CMP_EQ_OQ)));
#endif
}

// Each row's argmax, the first index of its maximum as torch.argmax gives it: one vector pass for the maximum,
// then a scan for its first occurrence. -1 for a row holding a NaN or an infinity (the caller asks torch).
// torch's argmax takes ~45 µs a row of a 49k vocabulary here.
extern "C" void rows_argmax(const float* x, int R, int V, long* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < R; r++) {
        const float* row = x + (long)r * V;
        float m = -INFINITY, lanes[16];
        bool finite = true;
        int i = 0;
        if (V >= 16) {
            V16 mv = vload(row), bad = vmul(mv, vzero());  // 0·x: NaN exactly where x is NaN or ±inf
            for (i = 16; i + 16 <= V; i += 16) {
                const V16 v = vload(row + i);
                mv = vmax(mv, v), bad = vadd(bad, vmul(v, vzero()));
            }
            finite = vsum(bad) == 0.0f;
            vstore(lanes, mv);
            for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
        }
        for (; i < V; i++) finite &= std::isfinite(row[i]), m = row[i] > m ? row[i] : m;
        if (!finite) { out[r] = -1; continue; }
        long at = 0;
        while (at + 16 <= V && !vany_eq(vload(row + at), m)) at += 16;
        while (row[at] != m) at++;
        out[r] = at;
    }
}

// Seeded sampling's noise (sampling.PositionNoise): u = splitmix64(key + (token + 1)·golden) as ((z >> 11) + 1/2)/2^53.
static inline double noise_uniform(uint64_t key, long token) {
    uint64_t z = key + (uint64_t)(token + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((double)(int64_t)(z >> 11) + 0.5) * 0x1p-53;
}

// Each row's race winner argmax_v p_v / E_v, E_v = -log u_v (the first on ties), with few logarithms:
// 1 - u <= -log u <= (1 - u) / u, so L = max_v p_v u_v / (1 - u_v) is at most the best score, and only a token whose
// bound p_v / (1 - u_v) reaches L (less a margin for rounding) can win; those get their exact score. Both passes over
// the vocabulary are branch-free loops the compiler vectorizes. -1: no p_v > 0.
extern "C" void rows_race(const double* p, int R, int V, const uint64_t* keys, long* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < R; r++) {
        const double* pr = p + (long)r * V;
        const uint64_t key = keys[r];
        std::vector<double> slack(V);  // 1 - u_v
        double L = 0.0;
        for (long v = 0; v < V; v++) {
            const double u = noise_uniform(key, v), lb = pr[v] * u / (1.0 - u);
            slack[v] = 1.0 - u;
            L = lb > L ? lb : L;
        }
        const double cut = L * (1.0 - 1e-9);
        long best = -1;
        double top = 0.0;
        for (long v0 = 0; v0 < V; v0 += 64) {
            const long v1 = v0 + 64 < V ? v0 + 64 : V;
            bool any = false;
            for (long v = v0; v < v1; v++) any |= pr[v] > 0.0 && pr[v] >= cut * slack[v];
            if (!any) continue;
            for (long v = v0; v < v1; v++) {
                if (!(pr[v] > 0.0 && pr[v] >= cut * slack[v])) continue;
                const double score = pr[v] / -log(noise_uniform(key, v));
                if (score > top) top = score, best = v;
            }
        }
        out[r] = best;
    }
}

// All decoder layers of one pass in one parallel region (thread start-up costs more than a whole small linear).
// `tree` is null for a plain pass, else [store R | kbase R | moff R | map...] (Tree above; model.py checks it).
extern "C" int decoder_layers(const Dims* d, const Layer* layers, int n_layers, float* x, int R, const int* slot,
                              const int* pos, const int* tree_rows, int threads) {
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
#pragma omp parallel num_threads(threads)
    for (int l = 0; l < n_layers; l++) layer_body(d, layers + l, l, x, R, slot, pos, tree, s);
    return 0;
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
