/* Rotary embedding on the fused q|k|v projection, and the new keys and values stored in the paged cache,
 * in one pass. In torch these are about a dozen small operators per layer (halves, products, copies back,
 * a dtype cast and two index_copy_ calls), whose dispatch costs more than their arithmetic when a step
 * has few tokens.
 *
 * Layouts:
 *   qkv        [tokens, (num_heads + 2 * num_kv_heads) * head_dim] float32 or bfloat16, rows qkv_stride
 *              elements apart; q and k are rotated in place (HF "rotate_half": the first and second halves
 *              of a head's first rotary_dim values pair up; the values after them pass through, as in
 *              partial rotary, e.g. Phi-4-mini's 96 of 128)
 *   cos, sin   [tokens, rotary_dim / 2], qkv's dtype
 *   slots      [tokens] int64, cache slot (block * block_size + offset) of each token
 *   k/v cache  [num_slots, num_kv_heads, head_dim], float32, bfloat16 or float8 e4m3 (kv_dtype: TS_DTYPE_*)
 *
 * The results are those of the torch operators this replaces, bit for bit: in float32, x1 * cos - x2 * sin
 * without fused multiply-adds; in bfloat16, each product and the sum rounded to bfloat16 as torch's
 * bfloat16 operators round them (the only exception: the AVX-512 BF16 path's vcvtneps2bf16 flushes
 * subnormal values, below 1.2e-38, to zero). A cache of another type gets those values rounded once to its
 * type, as torch's cast rounds (e4m3 saturating at +-448). Paths: scalar, and one body per vector level
 * (ts_isa_level; rope_store_vec.h for the rotation, convert_vec.h for the store, ts_vec.h).
 */
#include "ts_align_loops.h" /* first: see there */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"
#include "ts_vec.h"

#define TS_ROPE_PARALLEL_MIN 16

/* ---------------------------------------------------------------- scalar reference */

/* Column pair (i, i + half) of a float32 head: x1 c - x2 s, x2 c + x1 s, without fused multiply-adds. */
static inline void rotate_f32_at(float *x, const float *cos, const float *sin, int64_t half, int64_t i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
}

static void rotate_f32_scalar(float *x, const float *cos, const float *sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) rotate_f32_at(x, cos, sin, half, i);
}

/* o1 = bf16(bf16(x1 c) - bf16(x2 s)), o2 = bf16(bf16(x2 c) + bf16(x1 s)): torch's four products and two
 * sums, each a bfloat16 tensor. Products of two bfloat16 values are exact in float32. */
static inline void rotate_bf16_at(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half, int64_t i) {
    const float x1 = ts_bf16_to_f32(x[i]), x2 = ts_bf16_to_f32(x[i + half]);
    const float c = ts_bf16_to_f32(cos[i]), s = ts_bf16_to_f32(sin[i]);
    x[i] = ts_f32_to_bf16(ts_round_bf16(x1 * c) - ts_round_bf16(x2 * s));
    x[i + half] = ts_f32_to_bf16(ts_round_bf16(x2 * c) + ts_round_bf16(x1 * s));
}

static void rotate_bf16_scalar(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) rotate_bf16_at(x, cos, sin, half, i);
}

/* n float32 values rounded into a bfloat16 (TS_DTYPE_BF16) or e4m3 (TS_DTYPE_FP8) row. */
static void narrow_row_scalar(const float *src, void *dst, int dtype, int64_t n) {
    if (dtype == TS_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = ts_f32_to_bf16(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = ts_f32_to_fp8(src[i]);
    }
}

/* ---------------------------------------------------------------- vector levels and dispatch */

#define TSV_BODY "rope_store_vec.h"
#define TSV_BODY_FTZ
#include "ts_vec_each.h"
#undef TSV_BODY_FTZ
#undef TSV_BODY
#define TSV_BODY "convert_vec.h"
#include "ts_vec_each.h"
#undef TSV_BODY

static void rotate_f32(int isa, float *x, const float *cos, const float *sin, int64_t half) {
    TSV_CALL(isa, rotate_f32, x, cos, sin, half);
}

static void rotate_bf16(int isa, uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    TSV_CALL_FTZ(isa, rotate_bf16, x, cos, sin, half);
}

/* ---------------------------------------------------------------- cache stores */

/* n float32 values into the cache at ``offset`` elements, as float32 or rounded to bfloat16 or e4m3. */
static void store_row_f32(int isa, const float *src, void *cache, int64_t offset, int64_t n, int kv_dtype) {
    if (kv_dtype == TS_DTYPE_F32) {
        memcpy((float *)cache + offset, src, sizeof(float) * (size_t)n);
        return;
    }
    void *dst = kv_dtype == TS_DTYPE_FP8 ? (void *)((uint8_t *)cache + offset) : (void *)((uint16_t *)cache + offset);
    TSV_CALL(isa, narrow_row, src, dst, kv_dtype, n);
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
                       int64_t head_dim, int64_t rotary_dim, const float *cos, const float *sin, const int64_t *slots,
                       void *k_cache, void *v_cache, int kv_dtype, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t half = rotary_dim / 2;
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
                        int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, const uint16_t *cos,
                        const uint16_t *sin, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype,
                        int num_threads) {
    const int isa = ts_isa_level();
    const int64_t half = rotary_dim / 2;
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
