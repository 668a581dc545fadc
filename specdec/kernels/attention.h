// attention.h: attention over the paged KV cache: plain rows, sliding windows and tree rows.
#pragma once

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
// one multiply-add chain over the dimensions in order (a tree row's mapped keys gathered into a block of that layout);
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
    auto score = [&](const T* blk, const T* next, int j) {  // 16 keys' scores, one lane each
        V16 acc[NH];
        for (int h = 0; h < NH; h++) acc[h] = vzero();
        for (int c = 0; c < hd; c++) {
            _mm_prefetch((const char*)(next + 16 * c), _MM_HINT_T0);
            const V16 k = kv_load(blk + 16 * c);
            for (int h = 0; h < NH; h++) acc[h] = vfma(vset1(q[h * hd + c]), k, acc[h]);
        }
        for (int h = 0; h < NH; h++) vstore(p + h * L16 + j, vmul(acc[h], vset1(scale)));
    };
    int j = j0;
    // whole blocks, and the partial block of plain keys as lanes too (a lane's chain is the scalar fmaf chain; lanes
    // past L are padding, set to -inf below)
    for (; j < Lplain && (j + 16 <= Lplain || Lplain == L); j += 16)
        score(K.block(j), j + 16 < Lplain ? K.block(j + 16) : K.block(j), j);  // blocks are apart: prefetch the next
    // the rest of a tree row (a partial block of plain keys, then its path): each key's column copied into a block of
    // the same layout, so each lane is the same chain as above; unused lanes are zeros (padding, set to -inf below)
    alignas(64) T gathered[16 * 256];
    for (; j < L; j += 16) {
        const int n = L - j < 16 ? L - j : 16;
        for (int i = 0; i < 16; i++) {
            const T* key = i < n ? K.key(keys.at(j + i)) : nullptr;
            for (int c = 0; c < hd; c++) gathered[16 * c + i] = key ? key[16 * c] : (T)0;
        }
        score(gathered, gathered, j);
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
