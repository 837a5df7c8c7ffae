/* The width-generic vector layer of the float kernels: one vocabulary of vector operations, implemented
 * once per ISA level, so that each float kernel's body is written once (a body header) and compiled once
 * per level. The levels differ only where their instructions do; the quantized kernels (qgemm*.h) and the
 * dot-product and tile paths (vdpbf16ps, AMX) stay written for their instructions.
 *
 * Levels, by the names a body is compiled under (TSV_ISA: whose operations; TSV_LEVEL: whose functions):
 *   avx2        8 float32 lanes, 16 registers, no masks
 *   avx512      16 lanes, 32 registers, masks
 *   avx512bf16  avx512's operations, but rounding to bfloat16 with vcvtneps2bf16 where a body allows it
 *
 * A body names an operation V(op): V(t) is the vector type, V(LANES) its float32 count, V(h) the half
 * vector that V(hsums) fills; V_FN(name) names the body's own functions (name_avx2, ...). ts_vec_each.h
 * compiles a body once per level this build has (avx512bf16 only for the functions that round with
 * V_FTZ); TSV_CALL(isa, fn, args) calls fn's variant for the highest of them at or below isa, else
 * fn_scalar, the reference every level is tested against.
 *
 * Results: each operation is one fixed instruction sequence per level, so what a body computes on a level
 * follows from its order of operations alone; the tail rule below lets every level keep its own order of
 * summation, and the scalar reference stays plain C that the compiler vectorizes.
 *
 * bfloat16: V(round_bf16) and V(store_bf16*) round to nearest even as torch does, subnormals kept, on
 * every level; V_FTZ(round_bf16) and V_FTZ(store_bf16_part) are the level's fastest rounding, which may
 * flush subnormal values (below 1.2e-38) to zero: vcvtneps2bf16 on avx512bf16, the same as V() below it.
 *
 * Tails: a loop `for (; V(step)(i, n, unit); i += V(LANES))` with the *_part operations (left = n - i)
 * takes the last partial vector too where masks make that free: on AVX-512, V(step) goes on while i < n
 * and a part operation reads and writes only min(left, LANES) lanes. On AVX2, V(step) goes on while a
 * whole unit is left (unit: the loop's whole-vector stride, LANES or a multiple), a part operation is the
 * whole-vector one, and the body finishes the elements left in scalar code, after any horizontal sum. So
 * each level sums its elements in its own order, which is what its results depend on. V(MASKS) says which
 * of the two a level does (1: masked parts), for a loop that only the masked levels have.
 */
#ifndef TS_VEC_H
#define TS_VEC_H

#include <stdint.h>
#include <string.h>

#include "ts_simd.h"

#define TSV_CAT_(a, b) a##b
#define TSV_CAT(a, b) TSV_CAT_(a, b)
/* V(op): operation op of TSV_ISA (tsv_avx2_op, ...); V_FTZ(op): of TSV_LEVEL; V_FN(name): name_avx2, ... */
#define V(op) TSV_CAT(TSV_CAT(tsv_, TSV_ISA), _##op)
#define V_FTZ(op) TSV_CAT(TSV_CAT(tsv_, TSV_LEVEL), _##op)
#define V_FN(name) TSV_CAT(name##_, TSV_LEVEL)
/* A float32 vector from p's elements, by p's type: float32, bfloat16 (uint16_t) or e4m3 (uint8_t). */
#define V_LOAD_AS_F32(p) _Generic((p), const float *: V(load), const uint16_t *: V(load_bf16), \
                                  const uint8_t *: V(load_fp8))(p)

/* ---------------------------------------------------------------- AVX2 + FMA + F16C */
#ifdef TS_HAVE_AVX2
typedef __m256 tsv_avx2_t;
typedef __m128 tsv_avx2_h;
enum { tsv_avx2_LANES = 8, tsv_avx2_MASKS = 0 };

TS_ALWAYS_INLINE int tsv_avx2_step(int64_t i, int64_t n, int64_t unit) { return i + unit <= n; }
#define tsv_avx2_zero _mm256_setzero_ps
#define tsv_avx2_set1 _mm256_set1_ps
/* *p in every lane */
#define tsv_avx2_broadcast _mm256_broadcast_ss
/* a function, not an alias: V_LOAD_AS_F32 names it without calling it */
TS_ALWAYS_INLINE __m256 tsv_avx2_load(const float *p) { return _mm256_loadu_ps(p); }
#define tsv_avx2_store _mm256_storeu_ps
#define tsv_avx2_add _mm256_add_ps
#define tsv_avx2_sub _mm256_sub_ps
#define tsv_avx2_mul _mm256_mul_ps
#define tsv_avx2_max _mm256_max_ps
/* a * b + c, rounded once */
#define tsv_avx2_fma _mm256_fmadd_ps
#define tsv_avx2_hsum ts_hsum256
#define tsv_avx2_hmax ts_hmax256
#define tsv_avx2_exp ts_exp256

/* The sums of a[0..3], in order, as one half vector: a tree of horizontal adds. */
TS_ALWAYS_INLINE __m128 tsv_avx2_hsums(const __m256 a[4]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#define tsv_avx2_h_set1 _mm_set1_ps
#define tsv_avx2_h_mul _mm_mul_ps
#define tsv_avx2_h_store _mm_storeu_ps

/* bfloat16 is the top half of a float32: widening is a shift. */
TS_ALWAYS_INLINE __m256 tsv_avx2_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The bfloat16 bit patterns (in the low half of each 32-bit lane) of x, rounded as ts_f32_to_bf16. */
TS_ALWAYS_INLINE __m256i tsv_avx2_bf16_bits(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb),
                                              16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

TS_ALWAYS_INLINE void tsv_avx2_store_bf16(uint16_t *p, __m256 x) {
    const __m256i b = tsv_avx2_bf16_bits(x);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* x rounded to the nearest bfloat16, kept as float32. */
TS_ALWAYS_INLINE __m256 tsv_avx2_round_bf16(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(tsv_avx2_bf16_bits(x), 16));
}


/* e4m3 -> float32: sign-extended to 16 bits and shifted, the byte is a float16 of value / 256. */
TS_ALWAYS_INLINE __m256 tsv_avx2_load_fp8(const uint8_t *p) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* float32 -> e4m3 at p, as ts_f32_to_fp8 rounds and saturates. */
TS_ALWAYS_INLINE void tsv_avx2_store_fp8(uint8_t *p, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    const __m256 a = _mm256_min_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))),
                                   _mm256_set1_ps(448.0f));
    const __m256i ua = _mm256_castps_si256(a);
    const __m256i rounded = _mm256_add_epi32(
        ua, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), _mm256_and_si256(_mm256_srli_epi32(ua, 20), _mm256_set1_epi32(1))));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32((127 - 7) << 3));
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f))); /* ties to even */
    const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(is_sub));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i c = _mm256_or_si256(sign, _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), nan));
    /* the codes are bytes 0, 4, 8, 12 of each 128-bit lane */
    const __m256i packed = _mm256_shuffle_epi8(c, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, -1, -1));
    const uint32_t lo = (uint32_t)_mm256_extract_epi32(packed, 0), hi = (uint32_t)_mm256_extract_epi32(packed, 4);
    memcpy(p, &lo, 4);
    memcpy(p + 4, &hi, 4);
}

/* No masks: a part is a whole vector (V(step) keeps left >= 8), the scalar code after the loop the rest. */
TS_ALWAYS_INLINE __m256 tsv_avx2_load_part(const float *p, int64_t left) { (void)left; return tsv_avx2_load(p); }
TS_ALWAYS_INLINE void tsv_avx2_store_part(float *p, __m256 x, int64_t left) { (void)left; tsv_avx2_store(p, x); }
TS_ALWAYS_INLINE __m256 tsv_avx2_load_bf16_part(const uint16_t *p, int64_t left) { (void)left; return tsv_avx2_load_bf16(p); }
TS_ALWAYS_INLINE void tsv_avx2_store_bf16_part(uint16_t *p, __m256 x, int64_t left) { (void)left; tsv_avx2_store_bf16(p, x); }
TS_ALWAYS_INLINE __m256 tsv_avx2_load_fp8_part(const uint8_t *p, int64_t left) { (void)left; return tsv_avx2_load_fp8(p); }
TS_ALWAYS_INLINE void tsv_avx2_store_fp8_part(uint8_t *p, __m256 x, int64_t left) { (void)left; tsv_avx2_store_fp8(p, x); }
TS_ALWAYS_INLINE __m256 tsv_avx2_max_part(__m256 acc, __m256 x, int64_t left) { (void)left; return tsv_avx2_max(acc, x); }
TS_ALWAYS_INLINE __m256 tsv_avx2_add_part(__m256 acc, __m256 x, int64_t left) { (void)left; return tsv_avx2_add(acc, x); }
#endif /* TS_HAVE_AVX2 */

/* ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ) */
#ifdef TS_HAVE_AVX512
typedef __m512 tsv_avx512_t;
typedef __m256 tsv_avx512_h;
enum { tsv_avx512_LANES = 16, tsv_avx512_MASKS = 1 };

TS_ALWAYS_INLINE int tsv_avx512_step(int64_t i, int64_t n, int64_t unit) { (void)unit; return i < n; }
/* The lanes of a part of left elements. */
TS_ALWAYS_INLINE __mmask16 tsv_avx512_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#define tsv_avx512_zero _mm512_setzero_ps
#define tsv_avx512_set1 _mm512_set1_ps
TS_ALWAYS_INLINE __m512 tsv_avx512_broadcast(const float *p) { return _mm512_set1_ps(*p); }
TS_ALWAYS_INLINE __m512 tsv_avx512_load(const float *p) { return _mm512_loadu_ps(p); }
#define tsv_avx512_store _mm512_storeu_ps
#define tsv_avx512_add _mm512_add_ps
#define tsv_avx512_sub _mm512_sub_ps
#define tsv_avx512_mul _mm512_mul_ps
#define tsv_avx512_max _mm512_max_ps
#define tsv_avx512_fma _mm512_fmadd_ps
#define tsv_avx512_hsum _mm512_reduce_add_ps
#define tsv_avx512_hmax _mm512_reduce_max_ps
#define tsv_avx512_exp ts_exp512

/* The sums of a[0..7], in order, as one half vector: a tree of 7 adds over lanes interleaved by unpacks
 * and 128-bit shuffles, each add halving the lanes still to be summed. */
TS_ALWAYS_INLINE __m256 tsv_avx512_hsums(const __m512 a[8]) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* c[i]'s 128-bit lane L: lane L's partial sums of a[4i .. 4i + 3]; add the four lanes of each. */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(d, d, 0x88), _mm512_shuffle_f32x4(d, d, 0xdd));
    return _mm512_castps512_ps256(e);
}
#define tsv_avx512_h_set1 _mm256_set1_ps
#define tsv_avx512_h_mul _mm256_mul_ps
#define tsv_avx512_h_store _mm256_storeu_ps

TS_ALWAYS_INLINE __m512 tsv_avx512_bf16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TS_ALWAYS_INLINE __m512 tsv_avx512_load_bf16(const uint16_t *p) {
    return tsv_avx512_bf16_widen(_mm256_loadu_si256((const __m256i *)p));
}

/* The bfloat16 bit patterns of x, rounded as ts_f32_to_bf16 (integer arithmetic: no AVX512-BF16 needed). */
TS_ALWAYS_INLINE __m256i tsv_avx512_bf16_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}
TS_ALWAYS_INLINE void tsv_avx512_store_bf16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, tsv_avx512_bf16_bits(x));
}
TS_ALWAYS_INLINE __m512 tsv_avx512_round_bf16(__m512 x) { return tsv_avx512_bf16_widen(tsv_avx512_bf16_bits(x)); }

TS_ALWAYS_INLINE __m512 tsv_avx512_fp8_widen(__m128i b) {
    const __m256i w = _mm256_cvtepi8_epi16(b);
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
TS_ALWAYS_INLINE __m512 tsv_avx512_load_fp8(const uint8_t *p) {
    return tsv_avx512_fp8_widen(_mm_loadu_si128((const __m128i *)p));
}

/* The e4m3 codes of x, one a byte, as ts_f32_to_fp8 rounds and saturates. */
TS_ALWAYS_INLINE __m128i tsv_avx512_fp8_codes(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(448.0f));
    const __m512i ua = _mm512_castps_si512(a);
    const __m512i rounded = _mm512_add_epi32(
        ua, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), _mm512_and_si512(_mm512_srli_epi32(ua, 20), _mm512_set1_epi32(1))));
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32((127 - 7) << 3));
    const __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    code = _mm512_mask_mov_epi32(code, is_sub, _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f))));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(sign, code));
}
TS_ALWAYS_INLINE void tsv_avx512_store_fp8(uint8_t *p, __m512 x) {
    _mm_storeu_si128((__m128i *)p, tsv_avx512_fp8_codes(x));
}

/* Masked: a part reads and writes only its min(left, 16) lanes; lanes past it load as 0. */
TS_ALWAYS_INLINE __m512 tsv_avx512_load_part(const float *p, int64_t left) {
    return _mm512_maskz_loadu_ps(tsv_avx512_mask(left), p);
}
TS_ALWAYS_INLINE void tsv_avx512_store_part(float *p, __m512 x, int64_t left) {
    _mm512_mask_storeu_ps(p, tsv_avx512_mask(left), x);
}
TS_ALWAYS_INLINE __m512 tsv_avx512_load_bf16_part(const uint16_t *p, int64_t left) {
    return tsv_avx512_bf16_widen(_mm256_maskz_loadu_epi16(tsv_avx512_mask(left), p));
}
TS_ALWAYS_INLINE void tsv_avx512_store_bf16_part(uint16_t *p, __m512 x, int64_t left) {
    _mm256_mask_storeu_epi16(p, tsv_avx512_mask(left), tsv_avx512_bf16_bits(x));
}
TS_ALWAYS_INLINE __m512 tsv_avx512_load_fp8_part(const uint8_t *p, int64_t left) {
    return tsv_avx512_fp8_widen(_mm_maskz_loadu_epi8(tsv_avx512_mask(left), p));
}
TS_ALWAYS_INLINE void tsv_avx512_store_fp8_part(uint8_t *p, __m512 x, int64_t left) {
    _mm_mask_storeu_epi8(p, tsv_avx512_mask(left), tsv_avx512_fp8_codes(x));
}
/* acc's lanes of the part combined with x's; acc's other lanes kept. */
TS_ALWAYS_INLINE __m512 tsv_avx512_max_part(__m512 acc, __m512 x, int64_t left) {
    return _mm512_mask_max_ps(acc, tsv_avx512_mask(left), acc, x);
}
TS_ALWAYS_INLINE __m512 tsv_avx512_add_part(__m512 acc, __m512 x, int64_t left) {
    return _mm512_mask_add_ps(acc, tsv_avx512_mask(left), acc, x);
}
#endif /* TS_HAVE_AVX512 */

/* ---------------------------------------------------------------- AVX-512 BF16: its roundings for V_FTZ */
#ifdef TS_HAVE_AVX512BF16
/* vcvtneps2bf16 rounds to nearest even like ts_f32_to_bf16, except that it flushes subnormal inputs to zero. */
TS_ALWAYS_INLINE __m512 tsv_avx512bf16_round_bf16(__m512 x) {
    return tsv_avx512_bf16_widen((__m256i)_mm512_cvtneps_pbh(x));
}
TS_ALWAYS_INLINE void tsv_avx512bf16_store_bf16_part(uint16_t *p, __m512 x, int64_t left) {
    _mm256_mask_storeu_epi16(p, tsv_avx512_mask(left), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif /* TS_HAVE_AVX512BF16 */

/* ---------------------------------------------------------------- dispatch */
#ifdef TS_HAVE_AVX512BF16
#define TSV_CALL_AVX512BF16(isa, fn, ...) if ((isa) >= TS_ISA_AVX512_BF16) fn##_avx512bf16(__VA_ARGS__); else
#else
#define TSV_CALL_AVX512BF16(isa, fn, ...)
#endif
#ifdef TS_HAVE_AVX512
#define TSV_CALL_AVX512(isa, fn, ...) if ((isa) >= TS_ISA_AVX512) fn##_avx512(__VA_ARGS__); else
#else
#define TSV_CALL_AVX512(isa, fn, ...)
#endif
#ifdef TS_HAVE_AVX2
#define TSV_CALL_AVX2(isa, fn, ...) if ((isa) >= TS_ISA_AVX2) fn##_avx2(__VA_ARGS__); else
#else
#define TSV_CALL_AVX2(isa, fn, ...)
#endif
/* fn's variant for the highest level at or below isa that this build has, else fn_scalar; the levels above
 * AVX-512 run its variant (TSV_CALL_FTZ: fn rounds with V_FTZ and has an avx512bf16 variant too). A
 * statement; fn's result, if any, is dropped. */
#define TSV_CALL(isa, fn, ...)                                                                              \
    TSV_CALL_AVX512(isa, fn, __VA_ARGS__) TSV_CALL_AVX2(isa, fn, __VA_ARGS__) ((void)(isa), fn##_scalar(__VA_ARGS__))
#define TSV_CALL_FTZ(isa, fn, ...) TSV_CALL_AVX512BF16(isa, fn, __VA_ARGS__) TSV_CALL(isa, fn, __VA_ARGS__)

#endif /* TS_VEC_H */
