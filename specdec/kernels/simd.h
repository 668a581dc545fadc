// simd.h: the 16 fp32 lanes every kernel computes in (one __m512 on AVX-512, two __m256 on AVX2), their fixed
// lane-sum tree and exp: the same operations lane by lane on both instruction sets.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#include <omp.h>

#include <vector>

// ---- 16 fp32 lanes ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
struct V16 { __m512 v; };
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vset1(float f) { return {_mm512_set1_ps(f)}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline V16 vfloor(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
static inline V16 vzero_where_less(V16 a, V16 x, V16 t) {  // lanes with x < t become 0
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, t.v, _CMP_LT_OQ), a.v, _mm512_setzero_ps())};
}
static inline V16 vpow2i(V16 n) {  // 2^n for integral n in [-126, 127]
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(e)};
}
static inline __m256 vlo(V16 a) { return _mm512_castps512_ps256(a.v); }
static inline __m256 vhi(V16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)); }
static inline V16 vfrom_i32(__m512i i) { return {_mm512_cvtepi32_ps(i)}; }
static inline V16 u8_to_f(const uint8_t* p) { return vfrom_i32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline V16 i8_to_f(const int8_t* p) { return vfrom_i32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline V16 f16_to_f(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
static inline V16 bf16_to_f(const uint16_t* p) {
    __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(i, 16))};
}
// Q4_1 / Q4_0: the 16 weights a nibble can name, looked up by the packed bytes (vpermps reads the low 4 bits)
static inline void q4_pair(const uint8_t* qs, V16 table, V16* lo, V16* hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    lo->v = _mm512_permutexvar_ps(b, table.v);
    hi->v = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table.v);
}
static const float IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const float IOTA_8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// The 32 weights of 16 packed bytes (low nibbles, then high): d*q + m (Q4_1), or d*(q - 8) (Q4_0), each product
// rounded, then the add: a table of the 16 values, then a lookup
static inline void q4_affine(const uint8_t* qs, float d, float m, V16* lo, V16* hi) {
    q4_pair(qs, vadd(vmul(vset1(d), vload(IOTA)), vset1(m)), lo, hi);
}
static inline void q4_centered(const uint8_t* qs, float d, V16* lo, V16* hi) {
    q4_pair(qs, vmul(vset1(d), vload(IOTA_8)), lo, hi);
}
#else
struct V16 { __m256 lo, hi; };
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline V16 vfloor(V16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
static inline V16 vzero_where_less(V16 a, V16 x, V16 t) {
    return {_mm256_blendv_ps(a.lo, _mm256_setzero_ps(), _mm256_cmp_ps(x.lo, t.lo, _CMP_LT_OQ)),
            _mm256_blendv_ps(a.hi, _mm256_setzero_ps(), _mm256_cmp_ps(x.hi, t.hi, _CMP_LT_OQ))};
}
static inline __m256 pow2i8(__m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline V16 vpow2i(V16 n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
static inline __m256 vlo(V16 a) { return a.lo; }
static inline __m256 vhi(V16 a) { return a.hi; }
static inline V16 u8_to_f(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
static inline V16 i8_to_f(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
static inline V16 f16_to_f(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static inline V16 bf16_to_f(const uint16_t* p) {
    __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
// the same values as the AVX-512 table lookup: each weight is fl(fl(d*q) + m) either way
static inline void q4_nibbles(const uint8_t* qs, V16* lo, V16* hi) {
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
    const __m256i f = _mm256_set1_epi32(15);
    *lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, f)), _mm256_cvtepi32_ps(_mm256_and_si256(b, f))};
    *hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
// The same values as AVX-512's table: the nibbles widened, then d*q + m or d*(q - 8) (q - 8 is exact in fp32)
static inline void q4_affine(const uint8_t* qs, float d, float m, V16* lo, V16* hi) {
    q4_nibbles(qs, lo, hi);
    *lo = vadd(vmul(vset1(d), *lo), vset1(m));
    *hi = vadd(vmul(vset1(d), *hi), vset1(m));
}
static inline void q4_centered(const uint8_t* qs, float d, V16* lo, V16* hi) {
    q4_nibbles(qs, lo, hi);
    *lo = vmul(vset1(d), vadd(*lo, vset1(-8.f)));
    *hi = vmul(vset1(d), vadd(*hi, vset1(-8.f)));
}
#endif

// The lanes summed in one fixed tree (the same on both instruction sets): 8+8, 4+4, 2+2, 1+1.
static inline float vsum(V16 a) {
    __m256 s8 = _mm256_add_ps(vhi(a), vlo(a));
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128 s1 = _mm_add_ps(s2, _mm_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(s1);
}


// exp on 16 lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n; ~1 ulp), the same
// operations lane by lane on both instruction sets. exp(x) for x < -87.3 is exactly 0, never a subnormal (a softmax
// over far-apart scores would otherwise feed subnormal weights to the value sums: slow microcode assists).
static inline V16 vexp(V16 x0) {
    V16 x = vmax(vmin(x0, vset1(88.3762626647949f)), vset1(-87.3365447504f));
    V16 n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    V16 r = vsub(vsub(x, vmul(n, vset1(0.693359375f))), vmul(n, vset1(-2.12194440e-4f)));
    V16 y = vset1(1.9875691500e-4f);
    y = vfma(y, r, vset1(1.3981999507e-3f));
    y = vfma(y, r, vset1(8.3334519073e-3f));
    y = vfma(y, r, vset1(4.1665795894e-2f));
    y = vfma(y, r, vset1(1.6666665459e-1f));
    y = vfma(y, r, vset1(5.0000001201e-1f));
    y = vadd(vfma(y, vmul(r, r), r), vset1(1.0f));
    return vzero_where_less(vmul(y, vpow2i(n)), x0, vset1(-87.3365447504f));
}
