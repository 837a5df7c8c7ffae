/* Decode attention straight from the paged KV cache, for float32 on CPU.
 *
 * The torch path gathers each request's blocks into a contiguous copy before attention; at decode time
 * that copy doubles the memory traffic of a step that is bound by memory traffic. Here every (request,
 * KV head) pair walks its own block table and reads each key and value once, in place. The query heads
 * that share a KV head (grouped-query attention) are served by the same read.
 *
 * Layouts (all contiguous in their last dimension):
 *   q            [num_seqs, num_heads, head_dim], rows q_stride floats apart
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16 (read as float32)
 *   block_tables [num_seqs, table_width] int64
 *   context_lens [num_seqs] int64, keys per request including the token of this step
 *   out          [num_seqs, num_heads, head_dim], rows out_stride floats apart
 */
#include <math.h>
#include <stdint.h>

/* Fewest blocks a part of a split request covers: below this the merge costs more than it spreads. */
#define TS_MIN_BLOCKS_PER_PART 4
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their maximum), written so the compiler can vectorize the loop that
 * calls it: range reduction by ln 2 and a degree-6 polynomial (about 2 ulp), with no libm call. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1

/* The eight horizontal sums of a0..a7, as one vector [sum(a0), ..., sum(a7)]. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                           __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hsum(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

static inline float bf16_to_f32(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

#define KV_T float
#define KV_NAME(x) x##_f32
#define KV_LOAD1(p) (*(p))
#ifdef TS_AVX2
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#endif
#include "paged_decode_kv.h"
#undef KV_T
#undef KV_NAME
#undef KV_LOAD1
#undef KV_LOAD8

/* bfloat16 is the top half of a float32: widening is a shift. */
#define KV_T uint16_t
#define KV_NAME(x) x##_bf16
#define KV_LOAD1(p) bf16_to_f32(p)
#ifdef TS_AVX2
#define KV_LOAD8(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#include "paged_decode_kv.h"
