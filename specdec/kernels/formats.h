// formats.h: the weight block formats, one table row each (FORMAT_TABLE), and how each yields its weights 16
// columns at a time for the exact kernels: non-K formats (Fmt*), then the K-quants (FmtK).
#pragma once

// ---- weight formats: each yields its weights 16 columns at a time, in column order ------------------------------
// ggml type ids (ggml.h): F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10 .. Q6_K 14, BF16 30.
// A format with scales (SPR > 0) writes SPR fp32 scales per 32 columns of a row into `S` once per tile (`scales`);
// `chunk` then yields CH chunks of 16 columns from its bytes and those scales.
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };

// The formats, one row each: columns per block, bytes per block, and the layout the q8 mode repacks it into
// (q8_repack.h; 0: the exact kernels only): Q5_0 as its own bytes (nibbles and a plane of fifth bits), Q4_K as its own bytes
// (16 rows' super-blocks interleaved), Q5_1 as Q5_K's bytes. kernels/formats.py holds the same table and checks it against this one at load
// (rows_formats): everything else (row bytes, the q8 layout, which formats a linear serves) is read from here.
struct Format { int id, block, bytes, q8; };
static constexpr Format FORMAT_TABLE[] = {
    {F32, 1, 4, 0},         {F16, 1, 2, 0},          {BF16, 1, 2, 0},         {Q4_0, 32, 18, Q4_0},
    {Q4_1, 32, 20, Q4_1},   {Q5_0, 32, 22, Q5_0},    {Q5_1, 32, 24, Q5_K},    {Q8_0, 32, 34, Q8_0},
    {Q2_K, 256, 84, Q2_K},  {Q3_K, 256, 110, Q3_K},  {Q4_K, 256, 144, Q4_K},  {Q5_K, 256, 176, Q5_K},
    {Q6_K, 256, 210, Q6_K}};
struct FormatIndex {  // type id -> its row of FORMAT_TABLE, or -1 (built at compile time: an O(1) lookup)
    signed char at[32];
    constexpr FormatIndex() : at() {
        for (auto& a : at) a = -1;
        for (int i = 0; i < (int)(sizeof(FORMAT_TABLE) / sizeof(FORMAT_TABLE[0])); i++) at[FORMAT_TABLE[i].id] = (signed char)i;
    }
};
static constexpr FormatIndex FORMAT_INDEX{};
static inline const Format* format_of(int fmt) {  // null: not a format the kernels serve
    return fmt >= 0 && fmt < 32 && FORMAT_INDEX.at[fmt] >= 0 ? &FORMAT_TABLE[FORMAT_INDEX.at[fmt]] : nullptr;
}
static inline long row_bytes_of(int fmt, int K) {  // bytes of a row of K columns, -1: unknown format or K
    const Format* f = format_of(fmt);
    return !f || K < 0 || K % f->block ? -1 : (long)f->bytes * (K / f->block);
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
struct FmtQ4_1 {  // block: d, m (fp16), 16 bytes: weight j < 16 is the low nibble of byte j, j >= 16 the high one
    static const int CH = 2, BLOCK = 20;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 2;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        q4_affine(row + 20 * (c / 2) + 4, sc[c], sc[c + 1], &w[0], &w[1]);  // d, m of block c/2
    }
};
struct FmtQ4_0 {  // block: d (fp16), 16 bytes; w = d * (q - 8)
    static const int CH = 2, BLOCK = 18;
    static const bool TAIL = false;
    static inline void tail(const uint8_t*, int, V16*) {}
    static const int SPR = 1;
    static inline void scales(const uint8_t* row, int K, float* out) { block_scales<SPR>(row, K / 32, BLOCK, out); }
    static inline void chunk(const uint8_t* row, const float* sc, int c, int, V16* w) {
        q4_centered(row + 18 * (c / 2) + 2, sc[c / 2], &w[0], &w[1]);
    }
};

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
