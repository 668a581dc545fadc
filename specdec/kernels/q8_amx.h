// q8_amx.h: a block's integer sums for all M rows of x in one AMX tile multiply (Intel Sapphire Rapids and later),
// where the CPU has AMX-INT8 and the OS grants its tile state. The sums are the exact int32 ones q8_sums.h makes, so
// q8_tile's float chain, and every bit of a pass, are the same whichever computes them: rows stay invariant.
// A tile multiply, its two tile loads and the store of its sums cost about what 8 rows of vpdpbusd cost, so tiles
// serve 9-16 rows of x (q8_group); the float work that scales each block's sums (q8_tile) stays either way.
#pragma once

#if defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__linux__)  // (Linux grants the tile state)
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#define Q8_HAS_AMX 1

// Tiles of at least this many x rows take AMX; 0: never (rows_amx sets it once the OS granted the tile state).
static int q8_amx_rows = 0;

static bool amx_granted() {  // the CPU has AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25) and Linux grants them
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

// Palette 1: tiles 0, 1 hold sums (M rows of 16 int32), 2, 3 x (M rows of KB int8 columns), 4, 5 weights (KB / 4
// rows of 16 weight rows x 4 columns: vpdpbusd's layout, q8_unpack's registers stored in order).
// KB = 32: a whole block per multiply; 16: a half (Q6_K, Q3_K, Q2_K scale their halves apart).
struct TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
// A tile configuration is trusted within one entry point's call only: between calls other code in the thread (torch's
// oneDNN) may load its own. Each call that may run q8 tiles starts a new epoch before its parallel region.
static unsigned amx_epoch = 0;
static inline void amx_new_call() { amx_epoch++; }
static inline void amx_configure(int M, int KB) {
    static thread_local unsigned epoch = ~0u;
    static thread_local int rows = 0, kb = 0;
    if (epoch == amx_epoch && rows == M && kb == KB) return;
    epoch = amx_epoch, rows = M, kb = KB;
    TileConfig c = {};
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.rows[t] = (uint8_t)M, c.colsb[t] = 64;
        c.rows[2 + t] = (uint8_t)M, c.colsb[2 + t] = (uint16_t)KB;
        c.rows[4 + t] = (uint8_t)(KB / 4), c.colsb[4 + t] = 64;
    }
    _tile_loadconfig(&c);
}

// A block's weights as the u8 tile operand: q8_unpack's 8 registers (columns 4c..4c+3 of the 16 rows each) in order.
template <int FMT>
static inline void amx_weights(const uint8_t* qs, uint8_t* out) {
    WB w;
    q8_unpack<FMT>(qs, &w);
    for (int c = 0; c < 8; c++) _mm512_store_si512(out + 64 * c, w.g[c]);
}

#define AMX_CHUNK 8  // blocks whose sums one call makes (a Q4_K or Q6_K super-block), before q8_tile scales them

// Sums (without their starts) of blocks bl0..bl0+n-1 of group G against x rows m0..m0+M-1: a[j][m] (whole blocks),
// or a[j][m] and b[j][m] (the halves). All n blocks' weights are unpacked first, then the tile multiplies run two
// blocks (or halves) in flight on alternate tiles.
template <int FMT, int M>
static void amx_sums(const QX& Q, int m0, const uint8_t* G, int bl0, int n, int32_t (*a)[16][16],
                     int32_t (*b)[16][16]) {
    constexpr int U = FMT == Q4_K ? Q4_1 : FMT;  // Q4_K's quants are Q4_1's
    alignas(64) uint8_t w[AMX_CHUNK][512];
    for (int j = 0; j < n; j++) amx_weights<U>(q8_quants<FMT>(G, bl0 + j), w[j]);
    const int8_t* x = Q.q + (long)m0 * Q.K + 32L * bl0;
    const long ld = Q.K;
    if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K) {
        for (int j = 0; j < n; j++) {
            _tile_loadd(2, x + 32 * j, ld);
            _tile_loadd(4, w[j], 64);
            _tile_loadd(3, x + 32 * j + 16, ld);
            _tile_loadd(5, w[j] + 256, 64);
            _tile_zero(0);
            _tile_dpbsud(0, 2, 4);
            _tile_zero(1);
            _tile_dpbsud(1, 3, 5);
            _tile_stored(0, a[j], 64);
            _tile_stored(1, b[j], 64);
        }
        return;
    }
    int j = 0;
    for (; j + 1 < n; j += 2) {
        _tile_loadd(2, x + 32 * j, ld);
        _tile_loadd(4, w[j], 64);
        _tile_loadd(3, x + 32 * j + 32, ld);
        _tile_loadd(5, w[j + 1], 64);
        _tile_zero(0);
        _tile_dpbsud(0, 2, 4);
        _tile_zero(1);
        _tile_dpbsud(1, 3, 5);
        _tile_stored(0, a[j], 64);
        _tile_stored(1, a[j + 1], 64);
    }
    if (j < n) {
        _tile_loadd(2, x + 32 * j, ld);
        _tile_loadd(4, w[j], 64);
        _tile_zero(0);
        _tile_dpbsud(0, 2, 4);
        _tile_stored(0, a[j], 64);
    }
}

// Block j's sums of the chunk as q8_block_sums gives them: each row's from its start.
template <int FMT, int M>
static inline void amx_block_sums(const QX& Q, int m0, int bl, const int32_t (*a)[16], const int32_t (*b)[16], I16* ia,
                                  I16* ib) {
    for (int m = 0; m < M; m++) {
        int32_t sa, sb;
        q8_starts<FMT>(Q, (long)(m0 + m) * Q.nb + bl, &sa, &sb);
        ia[m].v = _mm512_add_epi32(_mm512_load_si512(a[m]), _mm512_set1_epi32(sa));
        if constexpr (FMT == Q6_K || FMT == Q3_K || FMT == Q2_K)
            ib[m].v = _mm512_add_epi32(_mm512_load_si512(b[m]), _mm512_set1_epi32(sb));
    }
}
#else
static const int q8_amx_rows = 0;
static bool amx_granted() { return false; }
static inline void amx_new_call() {}
#endif
