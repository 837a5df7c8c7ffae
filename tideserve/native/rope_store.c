/* Rotary embedding on the fused q|k|v projection, and the new keys and values stored in the paged cache,
 * in one pass. In torch these are about a dozen small operators per layer (halves, products, copies back,
 * a dtype cast and two index_copy_ calls), whose dispatch costs more than their arithmetic when a step
 * has few tokens.
 *
 * Layouts:
 *   qkv        [tokens, (num_heads + 2 * num_kv_heads) * head_dim] float32 or bfloat16, rows qkv_stride
 *              elements apart; q and k are rotated in place (HF "rotate_half": the first and second halves
 *              of a head pair up)
 *   cos, sin   [tokens, head_dim / 2], qkv's dtype
 *   slots      [tokens] int64, cache slot (block * block_size + offset) of each token
 *   k/v cache  [num_slots, num_kv_heads, head_dim], float32, bfloat16 or float8 e4m3 (kv_dtype: TS_DTYPE_*)
 *
 * The results are those of the torch operators this replaces, bit for bit: in float32, x1 * cos - x2 * sin
 * without fused multiply-adds; in bfloat16, each product and the sum rounded to bfloat16 as torch's
 * bfloat16 operators round them (the only exception: the AVX-512 BF16 path's vcvtneps2bf16 flushes
 * subnormal values, below 1.2e-38, to zero). A cache of another type gets those values rounded once to its
 * type, as torch's cast rounds (e4m3 saturating at +-448). Paths: scalar, AVX2, AVX-512 (ts_isa_level).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"

#define TS_ROPE_PARALLEL_MIN 16

/* ---------------------------------------------------------------- rotation, float32 */

static void rotate_f32_scalar(float *x, const float *cos, const float *sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

#ifdef TS_HAVE_AVX2
static void rotate_f32_avx2(float *x, const float *cos, const float *sin, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + i + half);
        const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(x + i + half, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
    }
    for (; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}
#endif

#ifdef TS_HAVE_AVX512
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static void rotate_f32_avx512(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = _mm512_maskz_loadu_ps(m, x + i), x2 = _mm512_maskz_loadu_ps(m, x + i + half);
        const __m512 c = _mm512_maskz_loadu_ps(m, cos + i), s = _mm512_maskz_loadu_ps(m, sin + i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
        _mm512_mask_storeu_ps(x + i + half, m, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
    }
}
#endif

static void rotate_f32(int isa, float *x, const float *cos, const float *sin, int64_t half) {
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512) {
        rotate_f32_avx512(x, cos, sin, half);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2) {
        rotate_f32_avx2(x, cos, sin, half);
        return;
    }
#endif
    (void)isa;
    rotate_f32_scalar(x, cos, sin, half);
}

/* ---------------------------------------------------------------- rotation, bfloat16 */

/* o1 = bf16(bf16(x1 c) - bf16(x2 s)), o2 = bf16(bf16(x2 c) + bf16(x1 s)): torch's four products and two
 * sums, each a bfloat16 tensor. Products of two bfloat16 values are exact in float32. */
static void rotate_bf16_scalar(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = ts_bf16_to_f32(x[i]), x2 = ts_bf16_to_f32(x[i + half]);
        const float c = ts_bf16_to_f32(cos[i]), s = ts_bf16_to_f32(sin[i]);
        x[i] = ts_f32_to_bf16(ts_round_bf16(x1 * c) - ts_round_bf16(x2 * s));
        x[i + half] = ts_f32_to_bf16(ts_round_bf16(x2 * c) + ts_round_bf16(x1 * s));
    }
}

#ifdef TS_HAVE_AVX2
static void rotate_bf16_avx2(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = ts_load_bf16x8(x + i), x2 = ts_load_bf16x8(x + i + half);
        const __m256 c = ts_load_bf16x8(cos + i), s = ts_load_bf16x8(sin + i);
        ts_store_bf16x8(x + i, _mm256_sub_ps(ts_round_bf16_256(_mm256_mul_ps(x1, c)),
                                             ts_round_bf16_256(_mm256_mul_ps(x2, s))));
        ts_store_bf16x8(x + i + half, _mm256_add_ps(ts_round_bf16_256(_mm256_mul_ps(x2, c)),
                                                    ts_round_bf16_256(_mm256_mul_ps(x1, s))));
    }
    for (; i < half; i++) {
        const float x1 = ts_bf16_to_f32(x[i]), x2 = ts_bf16_to_f32(x[i + half]);
        const float c = ts_bf16_to_f32(cos[i]), s = ts_bf16_to_f32(sin[i]);
        x[i] = ts_f32_to_bf16(ts_round_bf16(x1 * c) - ts_round_bf16(x2 * s));
        x[i + half] = ts_f32_to_bf16(ts_round_bf16(x2 * c) + ts_round_bf16(x1 * s));
    }
}
#endif

#ifdef TS_HAVE_AVX512
/* ``cvt``: round with vcvtneps2bf16 (AVX-512 BF16); a constant per caller. */
TS_ALWAYS_INLINE __m512 round512(__m512 v, const int cvt) {
#ifdef TS_HAVE_AVX512BF16
    if (cvt) return ts_round_bf16_512_bf16(v);
#endif
    (void)cvt;
    return ts_round_bf16_512(v);
}

TS_ALWAYS_INLINE void store512(uint16_t *p, __mmask16 m, __m512 v, const int cvt) {
#ifdef TS_HAVE_AVX512BF16
    if (cvt) {
        ts_mask_store_bf16x16_bf16(p, m, v);
        return;
    }
#endif
    (void)cvt;
    ts_mask_store_bf16x16(p, m, v);
}

TS_ALWAYS_INLINE void rotate_bf16_avx512(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half,
                                         const int cvt) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = ts_maskz_load_bf16x16(m, x + i), x2 = ts_maskz_load_bf16x16(m, x + i + half);
        const __m512 c = ts_maskz_load_bf16x16(m, cos + i), s = ts_maskz_load_bf16x16(m, sin + i);
        store512(x + i, m, _mm512_sub_ps(round512(_mm512_mul_ps(x1, c), cvt), round512(_mm512_mul_ps(x2, s), cvt)),
                 cvt);
        store512(x + i + half, m,
                 _mm512_add_ps(round512(_mm512_mul_ps(x2, c), cvt), round512(_mm512_mul_ps(x1, s), cvt)), cvt);
    }
}
#endif

static void rotate_bf16(int isa, uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
#ifdef TS_HAVE_AVX512BF16
    if (isa >= TS_ISA_AVX512_BF16) {
        rotate_bf16_avx512(x, cos, sin, half, 1);
        return;
    }
#endif
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512) {
        rotate_bf16_avx512(x, cos, sin, half, 0);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2) {
        rotate_bf16_avx2(x, cos, sin, half);
        return;
    }
#endif
    (void)isa;
    rotate_bf16_scalar(x, cos, sin, half);
}

/* ---------------------------------------------------------------- cache stores */

/* n float32 values into the cache at ``offset`` elements, as float32 or rounded to bfloat16 or e4m3. */
static void store_row_f32(int isa, const float *src, void *cache, int64_t offset, int64_t n, int kv_dtype) {
    if (kv_dtype == TS_DTYPE_F32) {
        memcpy((float *)cache + offset, src, sizeof(float) * (size_t)n);
        return;
    }
    int64_t i = 0;
    if (kv_dtype == TS_DTYPE_FP8) {
        uint8_t *dst = (uint8_t *)cache + offset;
#ifdef TS_HAVE_AVX512
        if (isa >= TS_ISA_AVX512)
            for (; i + 16 <= n; i += 16) ts_store_fp8x16(dst + i, _mm512_loadu_ps(src + i));
#endif
#ifdef TS_HAVE_AVX2
        if (isa >= TS_ISA_AVX2)
            for (; i + 8 <= n; i += 8) ts_store_fp8x8(dst + i, _mm256_loadu_ps(src + i));
#endif
        for (; i < n; i++) dst[i] = ts_f32_to_fp8(src[i]);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + offset;
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512)
        for (; i + 16 <= n; i += 16) ts_store_bf16x16(dst + i, _mm512_loadu_ps(src + i));
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2)
        for (; i + 8 <= n; i += 8) ts_store_bf16x8(dst + i, _mm256_loadu_ps(src + i));
#endif
    (void)isa;
    for (; i < n; i++) dst[i] = ts_f32_to_bf16(src[i]);
}

/* n bfloat16 values into the cache: as bfloat16, widened to float32 (both exact) or rounded to e4m3. */
static void store_row_bf16(const uint16_t *src, void *cache, int64_t offset, int64_t n, int kv_dtype) {
    if (kv_dtype == TS_DTYPE_BF16) {
        memcpy((uint16_t *)cache + offset, src, sizeof(uint16_t) * (size_t)n);
        return;
    }
    if (kv_dtype == TS_DTYPE_FP8) {
        uint8_t *dst = (uint8_t *)cache + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = ts_f32_to_fp8(ts_bf16_to_f32(src[i]));
        return;
    }
    float *dst = (float *)cache + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = ts_bf16_to_f32(src[i]);
}

void ts_rope_store_f32(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
                       void *v_cache, int kv_dtype, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t half = head_dim / 2;
    const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (tokens >= TS_ROPE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rotate_f32(isa, row + h * head_dim, c, s, half);
        const float *k = row + num_heads * head_dim;
        store_row_f32(isa, k, k_cache, slots[t] * kv_width, kv_width, kv_dtype);
        store_row_f32(isa, k + kv_width, v_cache, slots[t] * kv_width, kv_width, kv_dtype);
    }
}

void ts_rope_store_bf16(uint16_t *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, const uint16_t *cos, const uint16_t *sin,
                        const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t half = head_dim / 2;
    const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (tokens >= TS_ROPE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        uint16_t *row = qkv + t * qkv_stride;
        const uint16_t *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rotate_bf16(isa, row + h * head_dim, c, s, half);
        const uint16_t *k = row + num_heads * head_dim;
        store_row_bf16(k, k_cache, slots[t] * kv_width, kv_width, kv_dtype);
        store_row_bf16(k + kv_width, v_cache, slots[t] * kv_width, kv_width, kv_dtype);
    }
}
