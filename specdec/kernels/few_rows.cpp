// y = x·Wᵀ (+ b) for a few rows of x (decode and verify passes), fp32, AVX-512.
//
// Decoding is memory bound: every pass streams all weights once. Each thread takes a share of W's rows; each W row
// (K floats, read once from memory) is multiplied with all M rows of x, which stay in L1. M accumulators, one per x
// row; K is covered 16 lanes at a time (masked tail), then each accumulator is summed across lanes. The per-row
// arithmetic does not depend on M, so a row's result is the same whatever the number of rows around it.
#include <immintrin.h>

template <int M>
static inline void one_weight_row(const float* x, int K, const float* w, float* y, int N, float bias) {
    __m512 acc[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(w + k);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (long)m * K + k), wv, acc[m]);
    }
    if (k < K) {  // the last K % 16 columns
        const __mmask16 lanes = (__mmask16)((1u << (K - k)) - 1);
        const __m512 wv = _mm512_maskz_loadu_ps(lanes, w + k);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, x + (long)m * K + k), wv, acc[m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) y[(long)m * N] = _mm512_reduce_add_ps(acc[m]) + bias;
}

template <int M>
static void few_rows(const float* x, int K, const float* W, int N, float* y, const float* b, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) one_weight_row<M>(x, K, W + (long)n * K, y + n, N, b ? b[n] : 0.f);
}

// x: [M, K] row-major, W: [N, K] row-major, y: [M, N], b: [N] or null. Returns 0, or -1 for an unsupported M.
extern "C" int few_rows_linear(const float* x, int M, int K, const float* W, int N, float* y, const float* b,
                               int threads) {
    switch (M) {
        case 1: few_rows<1>(x, K, W, N, y, b, threads); return 0;
        case 2: few_rows<2>(x, K, W, N, y, b, threads); return 0;
        case 3: few_rows<3>(x, K, W, N, y, b, threads); return 0;
        case 4: few_rows<4>(x, K, W, N, y, b, threads); return 0;
        case 5: few_rows<5>(x, K, W, N, y, b, threads); return 0;
        case 6: few_rows<6>(x, K, W, N, y, b, threads); return 0;
        case 7: few_rows<7>(x, K, W, N, y, b, threads); return 0;
        case 8: few_rows<8>(x, K, W, N, y, b, threads); return 0;
        default: return -1;
    }
}
