/* What every kernel file shares: which instruction sets this build has, the scalar conversions between
 * float32, bfloat16 and e4m3, exp, prefetch hints, and the vector helpers of the paths written for their
 * instructions (horizontal sums, exp and the 16 x 16 transpose that the quantized GEMMs, vdpbf16ps and AMX
 * use). One copy here instead of one per kernel file, so every path of every kernel rounds the same way.
 * The float kernels' width-generic vector layer, built on these, is ts_vec.h.
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

/* x rounded to the nearest bfloat16, as a float32 (what torch's bf16 operators keep between two ops). */
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

#endif /* TS_SIMD_H */
