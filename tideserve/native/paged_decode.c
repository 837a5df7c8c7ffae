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
 * the end). Keys go in tiles and parts at fixed absolute positions with an online softmax (attn_rows.h); at
 * the scalar and AVX2 levels every step is the arithmetic prefill attention (paged_prefill.c) computes, so
 * a decode step's output has the bits the same token gets in any prefill, in any batch, on any number of
 * threads. Paths (ts_attn_isa_level): scalar reference; AVX2 + FMA; AVX-512; AVX-512 BF16, which takes the
 * q . k products of a bfloat16 q and cache with vdpbf16ps (exact products of bfloat16 pairs, summed in
 * float32). From AVX-512 up, the scores are summed in 16 lanes (or by vdpbf16ps), where prefill's AVX-512
 * form sums each in column order, so there the two kernels agree to rounding, not to the bit; in attention's
 * invariant mode (ts_set_attn_invariant) those forms are not taken, and a bfloat16 cache on AVX-512 BF16
 * takes paged_decode_pairs.h, prefill's vdpbf16ps arithmetic per query, instead. AMX is not
 * used: a decode query is a handful of rows per KV head, so the tiles would be mostly empty, and the kernel
 * is bound by reading the cache, not by arithmetic (docs/benchmarks.md). AVX2 and AVX-512 are one body
 * for the block steps (paged_decode_vec.h), compiled per vector level (ts_vec.h).
 */
#include "ts_align_loops.h" /* first: see there */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attn_rows.h"
#include "tideserve_native.h"
#include "ts_simd.h"
#include "ts_vec.h"

/* Most bytes of per-part states a call keeps to attend a request's parts on several threads; past it
 * (very long contexts) each request is one task. */
#define TS_DECODE_SPLIT_MAX_BYTES ((int64_t)64 << 20)

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

#include "paged_decode_pairs.h"

int ts_paged_decode(const void *q, int64_t q_stride, int q_dtype, const void *k_cache, const void *v_cache,
                    int kv_dtype, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                    void *out, int64_t out_stride, int out_dtype, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return ts_paged_decode_window(q, q_stride, q_dtype, k_cache, v_cache, kv_dtype, block_tables, table_width,
                                  context_lens, out, out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim,
                                  block_size, scale, 0, 0.0f, num_threads);
}

int ts_paged_decode_window(const void *q, int64_t q_stride, int q_dtype, const void *k_cache, const void *v_cache,
                           int kv_dtype, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                           void *out, int64_t out_stride, int out_dtype, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                           float softcap, int num_threads) {
    if ((q_dtype != TS_DTYPE_F32 && q_dtype != TS_DTYPE_BF16) || (out_dtype != TS_DTYPE_F32 && out_dtype != TS_DTYPE_BF16)
        || window < 0 || !(softcap >= 0.0f))
        return 1;
    if (kv_dtype == TS_DTYPE_F32)
        return paged_decode_f32(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                window, softcap, num_threads);
#ifdef TS_HAVE_AVX512BF16
    if (kv_dtype == TS_DTYPE_BF16 && ts_attn_invariant() && ts_attn_isa_level(kv_dtype, head_dim) == TS_ISA_AVX512_BF16
        && num_kv_heads > 0 && num_heads % num_kv_heads == 0)
        return paged_decode_pairs_bf16(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens,
                                       out, out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim,
                                       block_size, scale, window, softcap, num_threads);
#endif
    if (kv_dtype == TS_DTYPE_BF16)
        return paged_decode_bf16(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                 out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                 window, softcap, num_threads);
    if (kv_dtype == TS_DTYPE_FP8)
        return paged_decode_fp8(q, q_stride, q_dtype, k_cache, v_cache, block_tables, table_width, context_lens, out,
                                out_stride, out_dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                window, softcap, num_threads);
    return 1;
}

int ts_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                        int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return paged_decode_f32(q, q_stride, TS_DTYPE_F32, k_cache, v_cache, block_tables, table_width, context_lens, out,
                            out_stride, TS_DTYPE_F32, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                            0, 0.0f, num_threads);
}

int ts_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                         int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return paged_decode_bf16(q, q_stride, TS_DTYPE_F32, k_cache, v_cache, block_tables, table_width, context_lens, out,
                             out_stride, TS_DTYPE_F32, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                             0, 0.0f, num_threads);
}
