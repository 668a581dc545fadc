// q8_linear.h: the q8 linear: exact integer dot products per block (VNNI or AVX2), one fp32 chain per output.
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

// Q4_K's super-block header (repack_q4k) -> each sub-block b's D[b] = d·sc_b and M[b] = -(dmin·m_b) for the 16 rows,
// in fp32: products of an fp16 and a 6-bit integer, so exact (the exact kernels' D and M). The 6-bit fields as
// ggml's get_scale_min_k4, on the three dwords of each row's 12 scale bytes.
#if defined(__AVX512F__)
template <int B>  // sub-block B: its 6-bit scale and min in each lane (the shifts are immediates), times d and -dmin
static inline void q4k_scale(__m512i w0, __m512i w1, __m512i w2, __m512 d, __m512 neg_dmin, float (*D)[16],
                             float (*M)[16]) {
    constexpr int sh = 8 * (B % 4);
    const __m512i k63 = _mm512_set1_epi32(63), k15 = _mm512_set1_epi32(15), k48 = _mm512_set1_epi32(48);
    __m512i s, m;
    if constexpr (B < 4) {
        s = _mm512_and_si512(_mm512_srli_epi32(w0, sh), k63);
        m = _mm512_and_si512(_mm512_srli_epi32(w1, sh), k63);
    } else {  // low 4 bits from the third dword, top 2 from the top bits of the first (scale) or second (min)
        s = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, sh), k15), _mm512_and_si512(_mm512_srli_epi32(w0, sh + 2), k48));
        m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, sh + 4), k15), _mm512_and_si512(_mm512_srli_epi32(w1, sh + 2), k48));
    }
    _mm512_store_ps(D[B], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
    _mm512_store_ps(M[B], _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(m)));
}
static inline void q4k_scales(const uint8_t* h, float (*D)[16], float (*M)[16]) {
    const __m512i w0 = _mm512_loadu_si512(h + 64), w1 = _mm512_loadu_si512(h + 128), w2 = _mm512_loadu_si512(h + 192);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
    const __m512 nd = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + 32))), _mm512_set1_ps(-1.0f));
    q4k_scale<0>(w0, w1, w2, d, nd, D, M), q4k_scale<1>(w0, w1, w2, d, nd, D, M);
    q4k_scale<2>(w0, w1, w2, d, nd, D, M), q4k_scale<3>(w0, w1, w2, d, nd, D, M);
    q4k_scale<4>(w0, w1, w2, d, nd, D, M), q4k_scale<5>(w0, w1, w2, d, nd, D, M);
    q4k_scale<6>(w0, w1, w2, d, nd, D, M), q4k_scale<7>(w0, w1, w2, d, nd, D, M);
}
#else
static inline void q4k_scales(const uint8_t* h, float (*D)[16], float (*M)[16]) {
    alignas(64) uint32_t w[3][16];
    memcpy(w, h + 64, sizeof w);
    const V16 d = f16_to_f((const uint16_t*)h), neg_dmin = vmul(f16_to_f((const uint16_t*)(h + 32)), vset1(-1.0f));
    for (int b = 0; b < 8; b++) {
        alignas(64) float sc[16], mn[16];
        const int sh = 8 * (b % 4);
        for (int j = 0; j < 16; j++) {
            const uint32_t s = b < 4 ? (w[0][j] >> sh) & 63 : ((w[2][j] >> sh) & 15) | ((w[0][j] >> (sh + 2)) & 48);
            const uint32_t m = b < 4 ? (w[1][j] >> sh) & 63 : ((w[2][j] >> (sh + 4)) & 15) | ((w[1][j] >> (sh + 2)) & 48);
            sc[j] = (float)s, mn[j] = (float)m;
        }
        vstore(D[b], vmul(d, vload(sc)));
        vstore(M[b], vmul(neg_dmin, vload(mn)));
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
    alignas(64) float kd[FMT == Q4_K ? 8 : 1][16], km[FMT == Q4_K ? 8 : 1][16];  // Q4_K: a super-block's scales
    for (int bl = 0; bl < nb; bl++) {
        const uint8_t* blk;  // the block's quants (Q4_K: after its super-block's header), less F::SCALES
        V16 d, second;       // Q4_1 / Q5_K / Q4_K: d and m; Q6_K, Q3_K, Q2_K: the two halves' d
        if constexpr (FMT == Q4_K) {
            const uint8_t* super = G + (long)(bl / 8) * Q4K_SUPER;
            if (bl % 8 == 0) q4k_scales(super, kd, km);
            blk = super + 256 + 256 * (bl % 8);
            d = vload(kd[bl % 8]), second = vload(km[bl % 8]);
        } else if constexpr (FMT == Q6_K) {  // d·sc of the two halves: an fp16 times an int8, exact in fp32
            const uint8_t* super = G + (long)(bl / 8) * Q6K_SUPER;
            const int8_t* sc = (const int8_t*)super + 32 + 32 * (bl % 8);
            const V16 dsup = f16_to_f((const uint16_t*)super);
            blk = super + 288 + 384 * (bl % 8);
            d = vmul(dsup, i8_to_f(sc)), second = vmul(dsup, i8_to_f(sc + 16));
        } else {
            blk = G + bl * bb;
            d = f16_to_f((const uint16_t*)blk);
            second = FMT == Q4_0 || FMT == Q8_0 ? d : f16_to_f((const uint16_t*)blk + 16);
        }
        for (int o = 0; o < (int)bb; o += 64) _mm_prefetch((const char*)blk + Q8_AHEAD + o, _MM_HINT_T0);
        I16 ia[M], ib[M];
        q8_block_sums<FMT == Q4_K ? Q4_1 : FMT, M>(Q, m0, bl, blk + F::SCALES, ia, ib);  // Q4_K's quants are Q4_1's
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
                if (FMT == Q4_1 || FMT == Q5_K || FMT == Q4_K) acc[m] = vfma(second, vset1(Q.sq[at]), acc[m]);
            }
        }
    }
    if constexpr (q8_scaled_up(FMT))  // the scales were stored times Q8_SCALE_UP (q8_repack.h): exact
        for (int m = 0; m < M; m++) acc[m] = vmul(acc[m], vset1(1.0f / Q8_SCALE_UP));
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
    const uint8_t* G = Wq + g * q8_group_bytes<FMT>(Q.nb);
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
