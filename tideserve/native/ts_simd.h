/* SIMD helpers shared by the kernels: which instruction sets this build has, horizontal sums, bfloat16 <->
 * float32 conversion and exp, for each ISA path. One copy here instead of one per kernel file, so every
 * path of every kernel rounds and sums the same way.
 *
 * Compile-time: a path exists only when the compiler's -march=native enables it (TS_HAVE_* below). Run
 * time: ts_isa_level() (isa.c) says which of the compiled paths may run; kernels pick theirs once per call.
 * Every name here starts with ts_ so qgemm.c and decode_forward.c can include this header next to their own
 * helpers.
 */
#ifndef TS_SIMD_H
#define TS_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TS_HAVE_AVX2 1
#endif
#if defined(TS_HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define TS_HAVE_AVX512 1
#endif
#if defined(TS_HAVE_AVX512) && defined(__AVX512BF16__)
#define TS_HAVE_AVX512BF16 1
#endif
#if defined(TS_HAVE_AVX512) && defined(__AVX512VNNI__)
#define TS_HAVE_AVX512VNNI 1
#endif
#if defined(TS_HAVE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TS_HAVE_AMX 1
#endif

#define TS_ALWAYS_INLINE static inline __attribute__((always_inline))

/* AMX's tile configuration (palette 1), as _tile_loadconfig reads it: the kernels give their first
 * ``tiles`` registers 16 rows of 64 bytes (16 float32 or 32 bfloat16 per row) and use no other shape. */
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ts_tilecfg;

static inline ts_tilecfg ts_tilecfg_16x64(int tiles) {
    ts_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < tiles; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    return cfg;
}

/* ---------------------------------------------------------------- scalar */

/* Hints the cache lines of [p, p + bytes) towards L1 (no fault on any address). */
TS_ALWAYS_INLINE void ts_prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* The same into L2 only (prefetcht1): the L1 line-fill buffers, not the L2 queue, were what a batch's decode
 * attention waited on on Intel cores (docs/benchmarks.md). */
TS_ALWAYS_INLINE void ts_prefetch_bytes_l2(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

/* [p, p + bytes) into L2 with to_l2, else into L1. */
TS_ALWAYS_INLINE void ts_prefetch_bytes_to(const void *p, int64_t bytes, int to_l2) {
    if (to_l2) ts_prefetch_bytes_l2(p, bytes);
    else ts_prefetch_bytes(p, bytes);
}

/* Hints the next slice of [block, block + block_bytes), *left bytes of it still unasked, into L1 (or L2 with
 * to_l2); a block asked for a slice at a time lets the arithmetic between slices run while its lines come. */
TS_ALWAYS_INLINE void ts_prefetch_next_slice(const char *block, int64_t block_bytes, int64_t slice, int64_t *left,
                                             int to_l2) {
    if (*left <= 0) return;
    const int64_t now = *left < slice ? *left : slice;
    ts_prefetch_bytes_to(block + (block_bytes - *left), now, to_l2);
    *left -= now;
}

/* bfloat16 is the top half of a float32: widening is a shift. */
TS_ALWAYS_INLINE float ts_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* float32 -> bfloat16, rounding to nearest even as torch does (subnormals kept); NaN stays a quiet NaN. */
TS_ALWAYS_INLINE uint16_t ts_f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* x rounded to the nearest bfloat16, as a float32 (what torch's bf16 operators keep between two ops). */
/* float8 e4m3 ("fn": no infinities, 0x7f / 0xff the only NaNs; largest finite 448), the KV cache's
 * --kv-cache-dtype fp8. Placed in the low byte of a float16's exponent and mantissa fields, its seven
 * magnitude bits (exponent bias 7 against 15) read as value / 256, subnormals included. */
TS_ALWAYS_INLINE float ts_fp8_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e) { /* a normal value: rebias the exponent (7 -> 127), mantissa on top */
        const uint32_t bits = ((e + 120u) << 23) | (m << 20);
        memcpy(&v, &bits, sizeof v);
    } else { /* subnormal: m * 2^-9 */
        v = (float)m * 0.001953125f;
    }
    return b & 0x80 ? -v : v;
}

/* float32 -> e4m3, rounding to nearest even and saturating at +-448 as torch's cast does. */
TS_ALWAYS_INLINE uint8_t ts_f32_to_fp8(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (!(a == a)) return (uint8_t)(sign | 0x7f); /* NaN */
    if (a >= 448.0f) return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) return (uint8_t)(sign | (uint8_t)lrintf(a * 512.0f)); /* subnormal: multiples of 2^-9 */
    memcpy(&u, &a, sizeof u);
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the 23-bit mantissa to 3 bits, ties to even */
    return (uint8_t)(sign | ((u >> 20) - ((127u - 7u) << 3)));
}

TS_ALWAYS_INLINE float ts_round_bf16(float x) { return ts_bf16_to_f32(ts_f32_to_bf16(x)); }

/* exp(x), clamped to [-87, 88] (the float32 range), written so loops that call it vectorize: range
 * reduction by ln 2 and a degree-6 polynomial (about 2 ulp), no libm call. The vector versions below
 * compute the same polynomial. */
TS_ALWAYS_INLINE float ts_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* ---------------------------------------------------------------- AVX2 */
#ifdef TS_HAVE_AVX2

TS_ALWAYS_INLINE float ts_hsum256(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

TS_ALWAYS_INLINE float ts_hmax256(__m256 a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* Eight bfloat16 values -> float32. */
TS_ALWAYS_INLINE __m256 ts_load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The bfloat16 bit patterns (in the low half of each 32-bit lane) of x, rounded as ts_f32_to_bf16. */
/* Eight e4m3 values as float32: sign-extended to 16 bits and shifted, the byte is a float16 of value / 256. */
TS_ALWAYS_INLINE __m256 ts_load_fp8x8(const uint8_t *p) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* The e4m3 codes of eight float32 values (in the low byte of each lane), as ts_f32_to_fp8. */
TS_ALWAYS_INLINE __m256i ts_fp8_codes256(__m256 x) {
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
    return _mm256_or_si256(sign, _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), nan));
}

TS_ALWAYS_INLINE void ts_store_fp8x8(uint8_t *p, __m256 x) {
    const __m256i c = ts_fp8_codes256(x); /* bytes 0, 4, 8, ... of each 128-bit lane */
    const __m256i packed = _mm256_shuffle_epi8(c, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                   -1, -1, -1, -1));
    const uint32_t lo = (uint32_t)_mm256_extract_epi32(packed, 0), hi = (uint32_t)_mm256_extract_epi32(packed, 4);
    memcpy(p, &lo, 4);
    memcpy(p + 4, &hi, 4);
}

TS_ALWAYS_INLINE __m256i ts_bf16_bits256(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb),
                                              16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* Eight float32 -> bfloat16 at p. */
TS_ALWAYS_INLINE void ts_store_bf16x8(uint16_t *p, __m256 x) {
    const __m256i b = ts_bf16_bits256(x);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* x rounded to the nearest bfloat16, kept as float32. */
TS_ALWAYS_INLINE __m256 ts_round_bf16_256(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(ts_bf16_bits256(x), 16));
}

TS_ALWAYS_INLINE __m256 ts_exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}
#endif /* TS_HAVE_AVX2 */

/* ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ) */
#ifdef TS_HAVE_AVX512

/* Sixteen bfloat16 values -> float32 (the masked form reads only the lanes in m; the rest are 0). */
TS_ALWAYS_INLINE __m512 ts_load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

TS_ALWAYS_INLINE __m512 ts_load_fp8x16(const uint8_t *p) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

TS_ALWAYS_INLINE void ts_store_fp8x16(uint8_t *p, __m512 x) {
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
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_or_si512(sign, code)));
}

TS_ALWAYS_INLINE __m512 ts_maskz_load_bf16x16(__mmask16 m, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* The bfloat16 bit patterns of x, rounded as ts_f32_to_bf16 (integer arithmetic: no AVX512-BF16 needed). */
TS_ALWAYS_INLINE __m256i ts_bf16_bits512(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

TS_ALWAYS_INLINE void ts_store_bf16x16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, ts_bf16_bits512(x));
}

TS_ALWAYS_INLINE void ts_mask_store_bf16x16(uint16_t *p, __mmask16 m, __m512 x) {
    _mm256_mask_storeu_epi16(p, m, ts_bf16_bits512(x));
}

TS_ALWAYS_INLINE __m512 ts_round_bf16_512(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ts_bf16_bits512(x)), 16));
}

/* The sixteen horizontal sums of a[0..15], as one vector [sum(a[0]), ..., sum(a[15])]: a tree of
 * 15 adds (each halving the lanes that still need summing), so a dot product per lane costs about one add. */
TS_ALWAYS_INLINE __m512 ts_hsum512x16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    /* Level 1: pairs of vectors -> lanes interleaved in pairs of 2 (within 128-bit lanes). */
    for (int i = 0; i < 8; i++) {
        const __m512 lo = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
        const __m512 hi = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
        b[i] = _mm512_add_ps(lo, hi); /* per 128-bit lane: two partial sums for each of 2 vectors */
    }
    for (int i = 0; i < 4; i++) {
        const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1])));
        const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1])));
        c[i] = _mm512_add_ps(lo, hi); /* per 128-bit lane: one partial sum for each of 4 vectors */
    }
    for (int i = 0; i < 2; i++) {
        const __m512 lo = _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88); /* lanes 0, 2 of each */
        const __m512 hi = _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd); /* lanes 1, 3 of each */
        d[i] = _mm512_add_ps(lo, hi);
    }
    const __m512 lo = _mm512_shuffle_f32x4(d[0], d[1], 0x88);
    const __m512 hi = _mm512_shuffle_f32x4(d[0], d[1], 0xdd);
    return _mm512_add_ps(lo, hi); /* 128-bit lane j holds the sums of a[4j .. 4j + 3], in order */
}

/* The eight horizontal sums of a[0..8), in order, as one 8-float vector (the same tree, one level short). */
TS_ALWAYS_INLINE __m256 ts_hsum512x8(const __m512 a[8]) {
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

/* dst row c = src column c, for a 16 x 16 block of floats (strides in elements): unpacks and in-lane
 * shuffles transpose each 128-bit lane's 4 x 4 blocks, then two rounds of 128-bit lane shuffles move the
 * blocks into place. */
TS_ALWAYS_INLINE void ts_transpose16x16(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i++) { /* lane L of t[2i]: rows 2i, 2i+1 at columns 4L, 4L+1; t[2i+1]: 4L+2, 4L+3 */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* lane L of r[4i+k]: rows 4i .. 4i+3 at column 4L+k */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) { /* column 4L+k gathers lane L of r[k], r[4+k], r[8+k], r[12+k] */
        const __m512 v0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xee);
        const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xee);
        _mm512_storeu_ps(dst + k * dst_stride, _mm512_shuffle_f32x4(v0, v2, 0x88));
        _mm512_storeu_ps(dst + (4 + k) * dst_stride, _mm512_shuffle_f32x4(v0, v2, 0xdd));
        _mm512_storeu_ps(dst + (8 + k) * dst_stride, _mm512_shuffle_f32x4(v1, v3, 0x88));
        _mm512_storeu_ps(dst + (12 + k) * dst_stride, _mm512_shuffle_f32x4(v1, v3, 0xdd));
    }
}

TS_ALWAYS_INLINE __m512 ts_exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n); /* y * 2^n */
}
#endif /* TS_HAVE_AVX512 */

/* ---------------------------------------------------------------- AVX-512 BF16 */
#ifdef TS_HAVE_AVX512BF16
/* float32 -> bfloat16 with vcvtneps2bf16: round to nearest even like ts_f32_to_bf16, except that the
 * instruction flushes subnormal inputs (|x| < 1.2e-38) to zero. */
TS_ALWAYS_INLINE void ts_store_bf16x16_bf16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

TS_ALWAYS_INLINE void ts_mask_store_bf16x16_bf16(uint16_t *p, __mmask16 m, __m512 x) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

TS_ALWAYS_INLINE __m512 ts_round_bf16_512_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif /* TS_HAVE_AVX512BF16 */

#endif /* TS_SIMD_H */
