// selection.h: what is read from a pass's logits: top-k with log-sum-exp, argmax, the seeded sampling race.
#pragma once

// The k largest logits of each row (descending; ties keep the lower index) and each row's log-sum-exp: what
// the recycle drafter keeps of every verify pass (drafters/recycle.py). Blocks of 64 whose maximum cannot enter the
// current top k are skipped after 3 vector maxima, so a row costs about one read plus one exp pass.
static void topk_rows(const float* x, int R, int V, int k, int* idx, float* val, float* lse, int threads) {
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
static void argmax_rows(const float* x, int R, int V, long* out, int threads) {
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
static void race_rows(const double* p, int R, int V, const uint64_t* keys, long* out, int threads) {
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
