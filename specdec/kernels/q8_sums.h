// q8_sums.h: the q8 mode's exact integer sums of one 32-column block of 16 weight rows against M rows of x
// (VNNI's vpdpbusd, or AVX2's maddubs); q8_linear.h scales them.
#pragma once

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
    if (FMT == Q5_0) {  // + 16 where the fifth bit is set: chunk e's plane is its byte mask (Q8W<Q5_0>)
        for (int e = 0; e < 8; e++) {
            uint64_t k;
            memcpy(&k, qs + 256 + 8 * e, 8);
            w->g[e] = _mm512_mask_add_epi8(w->g[e], (__mmask64)k, w->g[e], _mm512_set1_epi8(16));
        }
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
    return FMT == Q4_0 ? Q.o4[at] : FMT == Q5_0 ? 2 * Q.o4[at] : FMT == Q8_0 ? Q.o8[at] : 0;
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
template <int FMT> static inline int32_t q8_start(const QX& Q, long at) {
    return FMT == Q4_0 ? Q.o4[at] : FMT == Q5_0 ? 2 * Q.o4[at] : 0;
}
#endif

// Where row m's integer sums of block `at` start: q8_start (Q4_0's -8·Σx, Q5_0's -16·Σx; Q8_0's -128·Σx on VNNI,
// whose weights are offset to u8); for Q6_K, Q3_K and Q2_K each 16-column half's -off·Σx (their quants stored + 32, + 4, + 0).
template <int FMT>
static inline void q8_starts(const QX& Q, long at, int32_t* sa, int32_t* sb) {
    if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K) {
        const int32_t h0 = Q.h0[at], total = -Q.o4[at] / 8, off = FMT == Q6_K ? 32 : FMT == Q3_K ? 4 : 0;
        *sa = -off * h0, *sb = -off * (total - h0);
    } else {
        *sa = q8_start<FMT>(Q, at), *sb = 0;
    }
}

// How far ahead of the block being summed q8_tile prefetches its weights, in bytes: in a one-row tile (a decode
// step) and in tiles of more rows (0: none). The best distances differ by CPU (a Xeon's one-row pass is fastest at
// 2 KB, an EPYC's with none: its own prefetchers keep up with one row), so rows_prefetch3 sets them at load
// (kernels/__init__.py chooses; docs/runtime.md, "Prefetch").
// Tiles of more rows also prefetch into L2 q8_ahead_l2 bytes ahead (0: not): their longer compute per byte let the
// EPYC's reads fall to ~20 GB/s with L1 prefetches alone (a 4-row pass of the 1.5B at 1.46x a one-row one; 1.13x
// with both).
// A prefetch changes no bit.
static int q8_ahead_one = 2048, q8_ahead = 4096, q8_ahead_l2 = 0;
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
// Row `row` of x against a block's unpacked weights w: its sums a (and b: the halves).
template <int FMT>
static inline void q8_row_sums(const QX& Q, int row, int bl, const WB& w, I16* a, I16* b) {
    const long at = (long)row * Q.nb + bl;
    const int8_t* xq = Q.q + (long)row * Q.K + 32 * bl;
    int32_t sa, sb;
    q8_starts<FMT>(Q, at, &sa, &sb);
    if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K) q8_dot_halves(w, xq, sa, sb, a, b);
    else *a = q8_dot<FMT>(w, xq, sa);
}
template <int FMT, int M>
static inline void q8_block_sums(const QX& Q, int m0, int bl, const uint8_t* qs, I16* a, I16* b) {
    WB w;  // 8 of 32 registers: unpacked once for the M rows
    q8_unpack<FMT>(qs, &w);
    for (int m = 0; m < M; m++) q8_row_sums<FMT>(Q, m0 + m, bl, w, &a[m], &b[m]);
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
        int32_t sa, sb;
        q8_starts<FMT>(Q, at, &sa, &sb);
        alo[m] = ahi[m] = _mm256_set1_epi32(sa);
        if (HALVES) blo[m] = bhi[m] = _mm256_set1_epi32(sb);
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
    if constexpr (FMT == Q4_0 || FMT == Q4_1 || FMT == Q5_0 || FMT == Q3_K || FMT == Q2_K || FMT == Q6_K) {
        const __m256i mask = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
        // Q6_K's top bits: plane byte p % 16 shifted by 2·(p / 16); rows 0-7 are bytes 0-31, rows 8-15 bytes 32-63
        const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), shift_hi = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
        auto top = [&](int e, __m256i nib, __m256i shifts, bool hi) {  // hi: rows 8-15
            if constexpr (FMT == Q5_0) {  // the fifth bit: bit p of chunk e's 64-bit plane for its byte p
                uint32_t k;  // rows 8-15 (bytes 32-63): the mask's high half
                memcpy(&k, qs + 256 + 8 * e + (hi ? 4 : 0), 4);
                const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
                const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);  // byte p: mask byte p / 8, bit p % 8
                const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)k), spread), bit);
                return _mm256_or_si256(nib, _mm256_and_si256(_mm256_cmpeq_epi8(m, bit), _mm256_set1_epi8(16)));
            }
            if constexpr (FMT != Q6_K) return nib;
            const __m256i plane = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(qs + 256 + 16 * e)));
            return _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(plane, shifts), three), 4));
        };
        for (int c = 0; c < 4; c++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i*)(qs + 64 * c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i*)(qs + 64 * c + 32));
            step(c, top(c, _mm256_and_si256(v0, mask), shift_lo, false), top(c, _mm256_and_si256(v1, mask), shift_hi, true));
            step(c + 4, top(c + 4, _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask), shift_lo, false),
                 top(c + 4, _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask), shift_hi, true));
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
