/* Decode attention straight from the paged KV cache, on CPU.
 *
 * The torch path gathers each request's blocks into a contiguous copy before attention; at decode time
 * that copy doubles the memory traffic of a step that is bound by memory traffic. Here every (request,
 * KV head) pair walks its own block table and reads each key and value once, in place. The query heads
 * that share a KV head (grouped-query attention) are served by the same read.
 *
 * Layouts (all contiguous in their last dimension):
 *   q            [num_seqs, num_heads, head_dim], float32 or bfloat16, rows q_stride elements apart
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim], float32, bfloat16 or float8 e4m3
 *   block_tables [num_seqs, table_width] int64
 *   context_lens [num_seqs] int64, keys per request including the token of this step
 *   out          [num_seqs, num_heads, head_dim], float32 or bfloat16, rows out_stride elements apart
 *
 * Arithmetic is float32 throughout (bfloat16 and e4m3 inputs widen exactly; a bfloat16 output is rounded once, at
 * the end). Paths (ts_isa_level): scalar reference; AVX2 + FMA; AVX-512; AVX-512 BF16, which takes the
 * q . k products of a bfloat16 q and cache with vdpbf16ps (exact products of bfloat16 pairs, summed in
 * float32). AMX is not used: a decode query is a handful of rows per KV head, so the tiles would be
 * mostly empty, and the kernel is bound by reading the cache, not by arithmetic (docs/benchmarks.md).
 * AVX2 and AVX-512 are one body each for the block steps (paged_decode_vec.h) and the softmax
 * (softmax_vec.h), compiled per vector level (ts_vec.h).
 */
#include "ts_align_loops.h" /* first: see there */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"
#include "ts_vec.h"

/* Fewest blocks a part of a split request covers: below this the merge costs more than it spreads. */
#define TS_MIN_BLOCKS_PER_PART 4

/* In place over scores s[0..n): s[t] = exp(s[t] - max); *max_out = max, *sum_out = sum of the new s. */
static void softmax_scalar(float *s, int64_t n, float *max_out, float *sum_out) {
    float m = s[0];
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        const float e = ts_exp(s[t] - m);
        s[t] = e;
        sum += e;
    }
    *max_out = m;
    *sum_out = sum;
}

#define TSV_BODY "softmax_vec.h"
#include "ts_vec_each.h"
#undef TSV_BODY

static void softmax(int isa, float *s, int64_t n, float *max_out, float *sum_out) {
    TSV_CALL(isa, softmax, s, n, max_out, sum_out);
}

#define KV_T float
#define KV_IS_BF16 0
#define KV_NAME(x) TSV_CAT(x, _f32)
#define KV_LOAD1(p) (*(p))
#include "paged_decode_kv.h"

#define KV_T uint16_t
#define KV_IS_BF16 1
#define KV_NAME(x) TSV_CAT(x, _bf16)
#define KV_LOAD1(p) ts_bf16_to_f32(*(p))
#include "paged_decode_kv.h"

/* e4m3: half bfloat16's bytes, for a decode step that waits on reading the cache (docs/benchmarks.md). */
#define KV_T uint8_t
#define KV_IS_BF16 0
#define KV_NAME(x) TSV_CAT(x, _fp8)
#define KV_LOAD1(p) ts_fp8_to_f32(*(p))
#include "paged_decode_kv.h"

int ts_paged_decode(const void *q, int64_t q_stride, int q_dtype, const void *k_cache, const void *v_cache,
                    int kv_dtype, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                    void *out, int64_t out_stride, int out_dtype, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    if ((q_dtype != TS_DTYPE_F32 && q_dtype != TS_DTYPE_BF16) || (out_dtype != TS_DTYPE_F32 && out_dtype != TS_DTYPE_BF16))
        return 1;
    if (kv_dtype == TS_DTYPE_F32)
        return paged_decode_f32(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                num_threads);
    if (kv_dtype == TS_DTYPE_BF16)
        return paged_decode_bf16(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                 out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                 num_threads);
    if (kv_dtype == TS_DTYPE_FP8)
        return paged_decode_fp8(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                num_threads);
    return 1;
}

int ts_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                        int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return paged_decode_f32(q, q_stride, TS_DTYPE_F32, k_cache, v_cache, block_tables, table_width, context_lens, out,
                            out_stride, TS_DTYPE_F32, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                            num_threads);
}

int ts_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                         int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return paged_decode_bf16(q, q_stride, TS_DTYPE_F32, k_cache, v_cache, block_tables, table_width, context_lens, out,
                             out_stride, TS_DTYPE_F32, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                             num_threads);
}
