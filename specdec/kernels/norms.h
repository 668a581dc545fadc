// norms.h: RMSNorm and the rotary embedding, each row on its own.
#pragma once

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
