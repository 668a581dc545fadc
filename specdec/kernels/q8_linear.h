// q8_linear.h: the q8 linear: a block's integer sums (q8_sums.h, or q8_amx.h's tiles) scaled into one fp32 chain
// per output.
#pragma once

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
// AMX: the sums of AMX_CHUNK blocks at a time come from tile multiplies (q8_amx.h), the same integers.
template <int FMT, int M, bool AMX = false>
static inline void q8_tile(const QX& Q, int m0, const uint8_t* G, float* y, long ldy, const float* b, int cols,
                           bool acc_out) {
    typedef Q8W<FMT> F;
    constexpr bool HALVES = FMT == Q6_K || FMT == Q3_K || FMT == Q2_K;
    const int nb = Q.nb;
    const long bb = 16L * F::BLOCK;
    V16 acc[M];
    for (int m = 0; m < M; m++) acc[m] = vzero();
    alignas(64) float kd[FMT == Q4_K ? 8 : 1][16], km[FMT == Q4_K ? 8 : 1][16];  // Q4_K: a super-block's scales
#ifdef Q8_HAS_AMX
    alignas(64) int32_t tsa[AMX ? AMX_CHUNK : 1][16][16], tsb[AMX && HALVES ? AMX_CHUNK : 1][16][16];
    if constexpr (AMX) amx_configure(M, HALVES ? 16 : 32);
#endif
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
            second = FMT == Q4_0 || FMT == Q5_0 || FMT == Q8_0 ? d : f16_to_f((const uint16_t*)blk + 16);
        }
        const int ahead = M == 1 ? q8_ahead_one : q8_ahead;
        if (ahead)
            for (int o = 0; o < (int)bb; o += 64) _mm_prefetch((const char*)blk + ahead + o, _MM_HINT_T0);
        if (M > 1 && q8_ahead_l2)
            for (int o = 0; o < (int)bb; o += 64) _mm_prefetch((const char*)blk + q8_ahead_l2 + o, _MM_HINT_T1);
        auto scale = [&](int m, I16 ia, I16 ib) {  // row m's block sums into its fp32 chain
            const long at = (long)(m0 + m) * nb + bl;
            const V16 sv = vset1(Q.s[at]);
            if constexpr (HALVES) {  // Σ q·x per half, each scaled by its d
                acc[m] = vfma(i16_to_f(ia), vmul(d, sv), acc[m]);
                acc[m] = vfma(i16_to_f(ib), vmul(second, sv), acc[m]);
                if constexpr (FMT == Q2_K) {  // and each half's min times its Σx
                    const int32_t h0 = Q.h0[at], total = -Q.o4[at] / 8;
                    acc[m] = vfma(f16_to_f((const uint16_t*)blk + 32), vset1(Q.s[at] * (float)h0), acc[m]);
                    acc[m] = vfma(f16_to_f((const uint16_t*)blk + 48), vset1(Q.s[at] * (float)(total - h0)), acc[m]);
                }
            } else {
                acc[m] = vfma(i16_to_f(ia), vmul(d, sv), acc[m]);
                if (FMT == Q4_1 || FMT == Q5_K || FMT == Q4_K) acc[m] = vfma(second, vset1(Q.sq[at]), acc[m]);
            }
        };
        constexpr int SUMS = FMT == Q4_K ? Q4_1 : FMT;  // Q4_K's quants are Q4_1's
#if Q8_M >= 8
        if constexpr (!AMX && M > Q8_M) {  // a wide tile: each row scaled as soon as summed, so that the registers
                                           // hold the weights and M chains only
            WB w;
            q8_unpack<SUMS>(blk + F::SCALES, &w);
#pragma GCC unroll 16
            for (int m = 0; m < M; m++) {
                I16 ia, ib;
                q8_row_sums<SUMS>(Q, m0 + m, bl, w, &ia, &ib);
                scale(m, ia, ib);
            }
            continue;
        }
#endif
        I16 ia[M], ib[M];
#ifdef Q8_HAS_AMX
        if constexpr (AMX) {
            if (bl % AMX_CHUNK == 0)
                amx_sums<FMT, M>(Q, m0, G, bl, nb - bl < AMX_CHUNK ? nb - bl : AMX_CHUNK, tsa, HALVES ? tsb : nullptr);
            amx_block_sums<FMT, M>(Q, m0, bl, tsa[bl % AMX_CHUNK], tsb[HALVES ? bl % AMX_CHUNK : 0], ia, ib);
        } else
#endif
        q8_block_sums<SUMS, M>(Q, m0, bl, blk + F::SCALES, ia, ib);
        for (int m = 0; m < M; m++) scale(m, ia[m], ib[m]);
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

#if Q8_M >= 8
// Passes of 9+ rows in wide tiles of 9..16 rows, even ones (24: 12 + 12; 17: 9 + 8): each block unpacked once per
// tile, each row's sums scaled as soon as made, so the registers hold the block's weights and one chain a row. A
// second 8-row tile would unpack the weights again: on the 2-core Xeon a 9-row pass of the 1.5B costs 73.7 ms that
// way, 64.8 in one wide tile, against 60.4 for 8 rows (docs/numerics.md). 0: off (rows_wide); the same bits.
static int q8_wide = 1;
#else
static const int q8_wide = 0;  // AVX2: 16 registers hold no wide tile
#endif

template <int FMT, bool AMX>
static inline void q8_wide_tile(int rows, const QX& Q, int m0, const uint8_t* G, float* y, long ldy, const float* b,
                                int cols, bool acc_out) {
#if Q8_M >= 8
    switch (rows) {  // 9..16
        case 9: q8_tile<FMT, 9, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 10: q8_tile<FMT, 10, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 11: q8_tile<FMT, 11, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 12: q8_tile<FMT, 12, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 13: q8_tile<FMT, 13, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 14: q8_tile<FMT, 14, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        case 15: q8_tile<FMT, 15, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
        default: q8_tile<FMT, 16, AMX>(Q, m0, G, y, ldy, b, cols, acc_out); break;
    }
#else
    (void)rows, (void)Q, (void)m0, (void)G, (void)y, (void)ldy, (void)b, (void)cols, (void)acc_out;
#endif
}

// Group g (16 weight rows of a repacked matrix) against all R rows of x: wide tiles (or AMX ones) while 9+ rows are
// left, then Q8_M rows at a time.
template <int FMT>
static void q8_group(const QX& Q, int R, const uint8_t* Wq, int g, int N, float* y, long ldy, const float* b,
                     bool acc_out) {
    const uint8_t* G = Wq + g * q8_group_bytes<FMT>(Q.nb);
    const int n0 = 16 * g, cols = N - n0 < 16 ? N - n0 : 16;
    float* yn = y + n0;
    const float* bn = b ? b + n0 : nullptr;
    for (int m0 = 0; m0 < R;) {
        const int left = R - m0, rows = (left + (left + 15) / 16 - 1) / ((left + 15) / 16);  // even tiles of <= 16
#ifdef Q8_HAS_AMX
        if (q8_amx_rows && left > Q8_M && rows >= q8_amx_rows) {  // AMX tile multiplies: the same integer sums
            q8_wide_tile<FMT, true>(rows, Q, m0, G, yn, ldy, bn, cols, acc_out);
            m0 += rows;
            continue;
        }
#endif
        if (q8_wide && left > Q8_M) {
            q8_wide_tile<FMT, false>(rows, Q, m0, G, yn, ldy, bn, cols, acc_out);
            m0 += rows;
            continue;
        }
        switch (left < Q8_M ? left : Q8_M) {
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
        m0 += left < Q8_M ? left : Q8_M;
    }
}
