/* Rotary embedding on the fused q|k|v projection, and the new keys and values stored in the paged cache,
 * in one pass. In torch these are about a dozen small operators per layer (halves, products, copies back,
 * a dtype cast and two index_copy_ calls), whose dispatch costs more than their arithmetic when a step
 * has few tokens.
 *
 * Layouts:
 *   qkv        [tokens, (num_heads + 2 * num_kv_heads) * head_dim] float32, rows qkv_stride floats apart;
 *              q and k are rotated in place (HF "rotate_half": the first and second halves of a head pair up)
 *   cos, sin   [tokens, head_dim / 2] float32
 *   slots      [tokens] int64, cache slot (block * block_size + offset) of each token
 *   k/v cache  [num_slots, num_kv_heads, head_dim], float32 (kv_bf16 = 0) or bfloat16 (kv_bf16 = 1)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TS_ROPE_PARALLEL_MIN 16

static inline void rotate_head(float *x, const float *cos, const float *sin, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* float32 -> bfloat16, rounding to nearest even as torch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline void store_row(const float *src, void *cache, int64_t offset, int64_t n, int kv_bf16) {
    if (kv_bf16) {
        uint16_t *dst = (uint16_t *)cache + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + offset, src, sizeof(float) * (size_t)n);
    }
}

void ts_rope_store_f32(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
                       void *v_cache, int kv_bf16, int num_threads) {
    const int64_t half = head_dim / 2;
    const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (tokens >= TS_ROPE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rotate_head(row + h * head_dim, c, s, half);
        const float *k = row + num_heads * head_dim;
        store_row(k, k_cache, slots[t] * kv_width, kv_width, kv_bf16);
        store_row(k + kv_width, v_cache, slots[t] * kv_width, kv_width, kv_bf16);
    }
}
