// layer.h: one decoder layer over R rows: norms, fused linears, rotary, K/V stores, attention, the gated MLP.
#pragma once

// silu(g) = g / (1 + exp(-g)); gelu(g) = g/2 (1 + tanh(√(2/π) (g + 0.044715 g³))), tanh(u) = 1 - 2 / (1 + exp(2u))
// (exp saturates: tanh is ±1 there), as torch's gelu(approximate="tanh") defines it.
static inline V16 vsilu(V16 g) { return vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))); }
static inline V16 vgelu(V16 g) {
    const V16 u = vmul(vset1(0.7978845608028654f), vadd(g, vmul(vset1(0.044715f), vmul(g, vmul(g, g)))));
    const V16 t = vsub(vset1(1.0f), vdiv(vset1(2.0f), vadd(vset1(1.0f), vexp(vadd(u, u)))));
    return vmul(vmul(vset1(0.5f), g), vadd(vset1(1.0f), t));
}
static inline float lane0(V16 (*f)(V16), float g) {  // the tail of a row whose width is not a multiple of 16
    float t[16] = {g}, e[16];
    vstore(e, f(vload(t)));
    return e[0];
}
static inline float silu(float g) { return lane0(vsilu, g); }
static inline float gelu(float g) { return lane0(vgelu, g); }

struct Scratch { float *h, *qkv, *att, *gu, *act, *p; int plen; QXBuf* xq; };

static const QX* q8_input(const Dims* d, const Scratch& s, const float* x, int R, int K, QX* view);
// x += W·in, or with a post-norm (Gemma) x += norm(W·in): the product lands in s.h, is normed in place, then added.
static void residual_add(const Lin& W, const float* post_norm, const Dims* d, const Scratch& s, const float* in, int R,
                         int K, float* x, QX* view) {
    if (!post_norm) {
        linear(&W, in, R, K, x, true, q8_input(d, s, in, R, K, view));
        return;
    }
    const int D = d->hidden;
    linear(&W, in, R, K, s.h, false, q8_input(d, s, in, R, K, view));
    rmsnorm(s.h, R, D, post_norm, d->eps, s.h);
#pragma omp for schedule(static)
    for (long i = 0; i < (long)R * D; i++) x[i] = x[i] + s.h[i];
}

// x quantized for the next linear (q8 mode), or null (exact)
static const QX* q8_input(const Dims* d, const Scratch& s, const float* x, int R, int K, QX* view) {
    if (!d->q8) return nullptr;
    *view = s.xq->view(K);
    q8_quantize(x, R, *view);
    return view;
}

// One decoder layer over R rows, in place on the residual stream x [R, hidden], inside the pass's parallel region.
// Row r is at position pos[r] of KV slot slot[r]; its key and value are written there first, so a row sees the
// earlier rows of its own slot in this pass (causal) and nothing of other slots. With a tree (Tree, below) a row's
// key and value go to its storage position and it attends through its ancestors' map.
struct Tree {
    const int* store;  // [R] storage position of each row
    const int* kbase;  // [R] first mapped logical position (pos + 1: none)
    const int* moff;   // [R] offset of the row's map in `map`
    const int* map;
    inline int stored(const int* pos, int r) const { return store ? store[r] : pos[r]; }
    inline Keys keys(const int* pos, int r) const {
        return store ? Keys{kbase[r], map + moff[r]} : Keys{pos[r] + 1, nullptr};
    }
};

static void layer_body(const Dims* d, const Layer* L, int layer, float* x, int R, const int* slot, const int* pos,
                       const Tree& tree, const Scratch& s) {
    const int D = d->hidden, hd = d->head_dim, H = d->heads, G = d->kv_heads, I = d->inter;
    const int nq = H * hd, nkv = G * hd, nqkv = nq + 2 * nkv;
    QX view;
    rmsnorm(x, R, D, L->attn_norm, d->eps, s.h);
    linear(&L->qkv, s.h, R, D, s.qkv, false, q8_input(d, s, s.h, R, D, &view));
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        float* row = s.qkv + (long)r * nqkv;
        const float* cs = (L->cos ? L->cos : d->cos) + (long)pos[r] * (hd / 2);
        const float* sn = (L->sin ? L->sin : d->sin) + (long)pos[r] * (hd / 2);
        for (int h = 0; L->q_norm && h < H; h++) rmsnorm_row(row + h * hd, hd, L->q_norm, d->eps, row + h * hd);
        for (int h = 0; L->k_norm && h < G; h++) rmsnorm_row(row + nq + h * hd, hd, L->k_norm, d->eps, row + nq + h * hd);
        rope_row(row, H, hd, cs, sn, d->interleaved);
        rope_row(row + nq, G, hd, cs, sn, d->interleaved);
        const int st = tree.stored(pos, r);
        for (int g = 0; g < G; g++) {
            const float *k = row + nq + g * hd, *v = row + nq + nkv + g * hd;
            if (d->kv16) store_kv<uint16_t>(d, slot[r], layer, g, st, k, v);
            else store_kv<float>(d, slot[r], layer, g, st, k, v);
        }
    }
    float* p = s.p + (long)omp_get_thread_num() * s.plen;
#pragma omp for schedule(static)
    for (int rg = 0; rg < R * G; rg++) {  // query heads g*rep .. g*rep+rep-1 share KV head g
        const int r = rg / G, g = rg % G, h0 = g * (H / G);
        attend_group(d, layer, slot[r], pos[r], tree.keys(pos, r), g, s.qkv + (long)r * nqkv + h0 * hd,
                     s.att + (long)r * nq + h0 * hd, p, L->window);
    }
    residual_add(L->o, L->post_attn_norm, d, s, s.att, R, nq, x, &view);  // x += o(att)
    rmsnorm(x, R, D, L->ffn_norm, d->eps, s.h);
    linear(&L->gate_up, s.h, R, D, s.gu, false, q8_input(d, s, s.h, R, D, &view));
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {  // act = f(gate) * up, 16 lanes at a time
        const float* gate = s.gu + (long)r * 2 * I;
        float* a = s.act + (long)r * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) vstore(a + i, vmul(d->act ? vgelu(vload(gate + i)) : vsilu(vload(gate + i)), vload(gate + I + i)));
        for (; i < I; i++) a[i] = (d->act ? gelu : silu)(gate[i]) * gate[I + i];
    }
    residual_add(L->down, L->post_ffn_norm, d, s, s.act, R, I, x, &view);  // x += down(act)
}
