// linear.h: the exact linear y[m, n] (+)= x[m, :] . W[n, :] (+ b[n]) on any format's dequantized weights.
#pragma once

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
