// dispatch.h: one linear over up to 3 weight matrices of any format (fused q/k/v, gate/up), exact or q8.
#pragma once

template <int NR>
static inline void rows_of(const Seg& s, const float* x, int R, int K, int n0, float* y, long ldy, bool acc_out) {
    const long rb = row_bytes_of(s.fmt, K);
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
        case Q8_0: weight_rows<FmtQ8_0, NR>(x, K, R, K, s.w, rb, n0, y, ldy, s.bias, acc_out); break;
        default: break;  // unreachable: servable() refuses a format FORMAT_TABLE lacks
    }
}

static bool servable(const Lin* L, int K) {
    for (int i = 0; i < L->count; i++) {
        const int fmt = L->seg[i].fmt;
        if (row_bytes_of(fmt, K) < 0) return false;
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
                case Q5_0: q8_group<Q5_0>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q4_K: q8_group<Q4_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q6_K: q8_group<Q6_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q5_K: q8_group<Q5_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q3_K: q8_group<Q3_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q2_K: q8_group<Q2_K>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                case Q8_0: q8_group<Q8_0>(*Q, R, s.wq, g - starts[i], s.n, ys, ldy, s.bias, acc_out); break;
                default: break;  // unreachable: per[i] == 16 only for a q8 layout
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
