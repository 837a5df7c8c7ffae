/* The decode-attention kernels for one KV cache element type; included once per type by paged_decode.c
 * with KV_T (the stored type), KV_IS_BF16 (0 or 1), KV_NAME(x) (x with the type's suffix) and KV_LOAD1(p)
 * (one element as float) defined; it undefines them at its end, for the next type.
 *
 * Every path computes the same two block-level steps, so each can be checked against the scalar one:
 *   scores[g][s] = q_g . k_s * scale             for the n keys of one block and one KV head
 *   acc[g] += sum_s p[g][s] v_s                  for the n values of the same block and head
 * for the ``group`` query heads g that share the KV head (rows head_dim floats apart in q and acc). The
 * vector levels share one body (paged_decode_vec.h); vdpbf16ps has its own scores.
 */

#ifndef TS_PREFETCH_AHEAD_BYTES
#define TS_PREFETCH_AHEAD_BYTES 12288 /* how far ahead in the stream of K then V blocks the kernel prefetches */
#endif
#ifndef TS_PREFETCH_CHUNK
#define TS_PREFETCH_CHUNK 16 /* keys of one head computed between two slices of prefetch */
#endif

#ifndef TS_SCORES_BY_THREES
/* A group's query heads in chunks of up to three, each chunk through TILE with a constant head count (so
 * the tile's accumulators stay in registers). */
#define TS_SCORES_BY_THREES(TILE)                                                                   \
    for (int64_t g0 = 0; g0 < group; g0 += 3) {                                                     \
        const float *qg = q + g0 * head_dim;                                                        \
        float *sg = scores + g0 * score_stride;                                                     \
        switch (group - g0 < 3 ? group - g0 : 3) {                                                  \
        case 1: TILE(qg, k, token_stride, n, head_dim, scale, sg, score_stride, 1); break;          \
        case 2: TILE(qg, k, token_stride, n, head_dim, scale, sg, score_stride, 2); break;          \
        default: TILE(qg, k, token_stride, n, head_dim, scale, sg, score_stride, 3); break;         \
        }                                                                                           \
    }
#endif

/* ---------------------------------------------------------------- scalar reference */

static void KV_NAME(scores_scalar)(const float *q, const KV_T *k, int64_t token_stride, int64_t n, int64_t group,
                                   int64_t head_dim, float scale, float *scores, int64_t score_stride) {
    for (int64_t s = 0; s < n; s++) {
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * KV_LOAD1(k + s * token_stride + d);
            scores[g * score_stride + s] = dot * scale;
        }
    }
}

static void KV_NAME(values_scalar)(const float *p, int64_t p_stride, const KV_T *v, int64_t token_stride, int64_t n,
                                   int64_t group, int64_t head_dim, float *acc) {
    for (int64_t s = 0; s < n; s++) {
        for (int64_t g = 0; g < group; g++) {
            const float pgs = p[g * p_stride + s];
            float *ag = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ag[d] += pgs * KV_LOAD1(v + s * token_stride + d);
        }
    }
}

/* ---------------------------------------------------------------- AVX2 + FMA and AVX-512: paged_decode_vec.h */
#ifdef TS_HAVE_AVX2
#define TSV_ISA avx2
#define TSV_LEVEL avx2
#define DECODE_DIM_MULTIPLE 32
#define DECODE_VALUE_HEADS 3 /* 3 x 2 accumulators, two values and a broadcast in the sixteen ymm registers */
#define DECODE_VALUE_VECS 2
#include "paged_decode_vec.h"
#undef TSV_LEVEL
#undef TSV_ISA
#endif
#ifdef TS_HAVE_AVX512
#define TSV_ISA avx512
#define TSV_LEVEL avx512
#define DECODE_DIM_MULTIPLE 16
#define DECODE_VALUE_HEADS 4 /* 4 x 4 accumulators and four values of 32 zmm registers */
#define DECODE_VALUE_VECS 4
#include "paged_decode_vec.h"
#undef TSV_LEVEL
#undef TSV_ISA
#endif

/* ---------------------------------------------------------------- AVX-512 BF16: bf16 q . bf16 k (head_dim % 32) */
#if KV_IS_BF16 && defined(TS_HAVE_AVX512BF16)
static void KV_NAME(scores_dpbf16)(const uint16_t *q, const KV_T *k, int64_t token_stride, int64_t n, int64_t group,
                                   int64_t head_dim, float scale, float *scores, int64_t score_stride) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < group; g++) {
        const uint16_t *qg = q + g * head_dim;
        float *sg = scores + g * score_stride;
        int64_t s = 0;
        for (; s + 16 <= n; s += 16) {
            const KV_T *ks = k + s * token_stride;
            __m512 a[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            for (int64_t j = 0; j < head_dim; j += 32) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + j);
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_loadu_si512(ks + i * token_stride + j));
            }
            _mm512_storeu_ps(sg + s, _mm512_mul_ps(ts_hsum512x16(a), vscale));
        }
        for (; s < n; s++) {
            const KV_T *ks = k + s * token_stride;
            __m512 a = _mm512_setzero_ps();
            for (int64_t j = 0; j < head_dim; j += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + j), (__m512bh)_mm512_loadu_si512(ks + j));
            sg[s] = _mm512_reduce_add_ps(a) * scale;
        }
    }
}
#endif

/* ---------------------------------------------------------------- dispatch (one predictable branch per block) */

/* q: the float32 query rows; qb: the same rows in bfloat16 when the query came as bfloat16, else NULL. */
static inline void KV_NAME(block_scores)(int isa, const float *q, const uint16_t *qb, const KV_T *k,
                                         int64_t token_stride, int64_t n, int64_t group, int64_t head_dim,
                                         float scale, float *scores, int64_t score_stride) {
#if KV_IS_BF16 && defined(TS_HAVE_AVX512BF16)
    if (isa >= TS_ISA_AVX512_BF16 && qb != NULL && head_dim % 32 == 0) {
        KV_NAME(scores_dpbf16)(qb, k, token_stride, n, group, head_dim, scale, scores, score_stride);
        return;
    }
#endif
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512 && KV_NAME(takes_avx512)(head_dim)) {
        KV_NAME(scores_avx512)(q, k, token_stride, n, group, head_dim, scale, scores, score_stride);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2 && KV_NAME(takes_avx2)(head_dim)) {
        KV_NAME(scores_avx2)(q, k, token_stride, n, group, head_dim, scale, scores, score_stride);
        return;
    }
#endif
    (void)isa;
    (void)qb;
    KV_NAME(scores_scalar)(q, k, token_stride, n, group, head_dim, scale, scores, score_stride);
}

static inline void KV_NAME(block_values)(int isa, const float *p, int64_t p_stride, const KV_T *v, int64_t token_stride,
                                         int64_t n, int64_t group, int64_t head_dim, float *acc) {
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512 && KV_NAME(takes_avx512)(head_dim)) {
        KV_NAME(values_avx512)(p, p_stride, v, token_stride, n, group, head_dim, acc);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2 && KV_NAME(takes_avx2)(head_dim)) {
        KV_NAME(values_avx2)(p, p_stride, v, token_stride, n, group, head_dim, acc);
        return;
    }
#endif
    (void)isa;
    KV_NAME(values_scalar)(p, p_stride, v, token_stride, n, group, head_dim, acc);
}

/* Attention of one request's query heads over the keys of blocks [blk_lo, blk_hi) of its table, left
 * unnormalized so that several such parts merge exactly: for each query head r, part_max[r] = the largest
 * score, part_sum[r] = sum_t exp(score_t - part_max[r]) and acc[r] = sum_t exp(score_t - part_max[r]) v_t.
 * A block is read head after head while it is hot in cache, and each key and value serves every query
 * head that shares it. An empty range leaves part_sum at 0. */
static void KV_NAME(attend_part)(int isa, const float *q, const uint16_t *qb, const KV_T *k_cache,
                                 const KV_T *v_cache, const int64_t *table, int64_t context_len, int64_t blk_lo,
                                 int64_t blk_hi, int64_t group, int64_t head_dim, int64_t block_size,
                                 int64_t num_kv_heads, float scale, float *scores, float *acc, float *part_max,
                                 float *part_sum, int64_t max_context, int to_l2) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t rows = num_kv_heads * group; /* every query head */
    const int64_t first = blk_lo * block_size;
    const int64_t last = blk_hi * block_size < context_len ? blk_hi * block_size : context_len;
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        part_max[r] = -INFINITY;
        part_sum[r] = 0.0f;
    }
    if (last <= first) return;

    /* Blocks lie anywhere in the pool, out of the hardware prefetchers' reach, so the kernel asks for the
     * block about TS_PREFETCH_AHEAD_BYTES ahead itself, a slice of it before each chunk of TS_PREFETCH_CHUNK keys
     * of one head. Asked for whole, a bf16 or fp8 block stalled the core on the line-fill buffers until it came
     * (30% of the kernel's time at 64 requests); sliced, the arithmetic runs while it comes. */
    const int64_t block_bytes = (int64_t)sizeof(KV_T) * block_stride;
    /* A float32 block (12 KiB for SmolLM2's heads) streamed best asked for whole, before its keys, which go
     * through in one call per head as they did before slicing. */
    const int64_t chunk_keys = sizeof(KV_T) >= 4 ? block_size : TS_PREFETCH_CHUNK;
    const int64_t chunks = sizeof(KV_T) >= 4 ? 1 : num_kv_heads * ((block_size + chunk_keys - 1) / chunk_keys);
    const int64_t slice = (block_bytes / chunks + 63) / 64 * 64;
    const int64_t span = blk_hi - blk_lo;
    const int64_t blocks_ahead = block_bytes < TS_PREFETCH_AHEAD_BYTES ? TS_PREFETCH_AHEAD_BYTES / block_bytes : 1;
    /* The key blocks come first, then the value blocks: the stream pass 1 and pass 2 read, in order. */
#define TS_STREAM_BLOCK(i) ((i) < span ? k_cache + table[blk_lo + (i)] * block_stride \
                                       : v_cache + table[blk_lo + (i) - span] * block_stride)
    for (int64_t i = 0; i < blocks_ahead && i < 2 * span; i++) ts_prefetch_bytes_to(TS_STREAM_BLOCK(i), block_bytes, to_l2);

    /* Pass 1: scores[r][t - first] = q_r . k_t * scale. */
    for (int64_t blk = blk_lo; blk < blk_hi; blk++) {
        const int64_t t0 = blk * block_size;
        const int64_t n = last - t0 < block_size ? last - t0 : block_size;
        const int64_t ahead_at = blk - blk_lo + blocks_ahead;
        const char *ahead = ahead_at < 2 * span ? (const char *)TS_STREAM_BLOCK(ahead_at) : NULL;
        int64_t to_fetch = ahead != NULL ? block_bytes : 0;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t r0 = h * group;
            for (int64_t c = 0; c < n; c += chunk_keys) {
                ts_prefetch_next_slice(ahead, block_bytes, slice, &to_fetch, to_l2);
                KV_NAME(block_scores)(isa, q + r0 * head_dim, qb != NULL ? qb + r0 * head_dim : NULL,
                                      k_cache + table[blk] * block_stride + c * token_stride + h * head_dim,
                                      token_stride, n - c < chunk_keys ? n - c : chunk_keys, group,
                                      head_dim, scale, scores + r0 * max_context + (t0 + c - first), max_context);
            }
        }
    }

    /* exp(score - max) per query head, in float32. */
    const int64_t count = last - first;
    for (int64_t r = 0; r < rows; r++) softmax(isa, scores + r * max_context, count, part_max + r, part_sum + r);

    /* Pass 2: acc_r = sum_t e[r][t] v_t. */
    for (int64_t blk = blk_lo; blk < blk_hi; blk++) {
        const int64_t t0 = blk * block_size;
        const int64_t n = last - t0 < block_size ? last - t0 : block_size;
        const int64_t ahead_at = span + blk - blk_lo + blocks_ahead;
        const char *ahead = ahead_at < 2 * span ? (const char *)TS_STREAM_BLOCK(ahead_at) : NULL;
        int64_t to_fetch = ahead != NULL ? block_bytes : 0;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t r0 = h * group;
            for (int64_t c = 0; c < n; c += chunk_keys) {
                ts_prefetch_next_slice(ahead, block_bytes, slice, &to_fetch, to_l2);
                KV_NAME(block_values)(isa, scores + r0 * max_context + (t0 + c - first), max_context,
                                      v_cache + table[blk] * block_stride + c * token_stride + h * head_dim,
                                      token_stride, n - c < chunk_keys ? n - c : chunk_keys, group,
                                      head_dim, acc + r0 * head_dim);
            }
        }
    }
#undef TS_STREAM_BLOCK
}

/* Returns 0 on success, 1 when scratch memory could not be had (the caller falls back). */
static int KV_NAME(paged_decode)(const void *q, int64_t q_stride, int q_dtype, const KV_T *k_cache,
                                 const KV_T *v_cache, const int64_t *block_tables, int64_t table_width,
                                 const int64_t *context_lens, void *out, int64_t out_stride, int out_dtype,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_width = num_heads * head_dim;
    int64_t max_context = 1;
    for (int64_t i = 0; i < num_seqs; i++) max_context = context_lens[i] > max_context ? context_lens[i] : max_context;
    const int64_t max_blocks = (max_context + block_size - 1) / block_size;
    /* Whole requests per task stream their blocks best. With too few requests to keep every thread busy,
     * each request's blocks are split into parts (all heads each, so each part reads whole tokens), whose
     * unnormalized results merge exactly; the parts are small enough for dynamic scheduling to even out. */
    int64_t splits = 1;
    if (num_seqs < 2 * (int64_t)num_threads && max_blocks >= 2 * TS_MIN_BLOCKS_PER_PART) {
        splits = (4 * (int64_t)num_threads + num_seqs - 1) / num_seqs;
        const int64_t most = max_blocks / TS_MIN_BLOCKS_PER_PART;
        splits = splits < most ? splits : most;
    }
    const int64_t tasks = num_seqs * splits;
    /* A batch (whole requests per task) on an Intel core asks for its blocks into L2: at 64 requests of 250
     * keys the step's attention took 6-9% less time than with prefetcht0; a single request (split in parts)
     * measured the same or 3% slower, so it keeps L1. Other vendors were not measured and keep L1. */
    const int to_l2 = splits == 1 && (ts_cpu_features() & TS_CPU_VENDOR_INTEL) != 0;
    const int64_t part_len = (max_blocks + splits - 1) / splits * block_size; /* keys one part may hold */
    const int64_t score_len = splits > 1 ? part_len : max_context;
    float *part_acc = (float *)malloc(sizeof(float) * tasks * row_width);
    float *part_max = (float *)malloc(sizeof(float) * tasks * num_heads);
    float *part_sum = (float *)malloc(sizeof(float) * tasks * num_heads);
    int failed = 0;
    if (part_acc == NULL || part_max == NULL || part_sum == NULL) {
        free(part_acc);
        free(part_max);
        free(part_sum);
        return 1;
    }

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* Per thread: the scores of one task, a float32 copy of a bfloat16 query, a float32 output row. */
        float *scratch = (float *)malloc(sizeof(float) * (num_heads * score_len + row_width + head_dim));
        if (scratch == NULL) failed = 1;
        float *scores = scratch;
        float *q32 = scratch + num_heads * score_len;
        float *o32 = q32 + row_width;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t seq = task / splits, part = task % splits;
            const int64_t nb = (context_lens[seq] + block_size - 1) / block_size;
            const int64_t per = (nb + splits - 1) / splits;
            const int64_t lo = part * per < nb ? part * per : nb;
            const int64_t hi = lo + per < nb ? lo + per : nb;
            if (scratch == NULL) continue;
            const float *qf;
            const uint16_t *qb = NULL;
            if (q_dtype == TS_DTYPE_BF16) {
                qb = (const uint16_t *)q + seq * q_stride;
                for (int64_t i = 0; i < row_width; i++) q32[i] = ts_bf16_to_f32(qb[i]);
                qf = q32;
            } else {
                qf = (const float *)q + seq * q_stride;
            }
            KV_NAME(attend_part)(isa, qf, qb, k_cache, v_cache, block_tables + seq * table_width, context_lens[seq],
                                 lo, hi, group, head_dim, block_size, num_kv_heads, scale, scores,
                                 part_acc + task * row_width, part_max + task * num_heads, part_sum + task * num_heads,
                                 score_len, to_l2);
        }
        /* Merge each request's parts: out = sum_p acc_p e^(max_p - M) / sum_p sum_p e^(max_p - M). */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < num_seqs * num_heads; row++) {
            if (scratch == NULL) continue;
            const int64_t seq = row / num_heads, r = row % num_heads;
            float *o = out_dtype == TS_DTYPE_F32 ? (float *)out + seq * out_stride + r * head_dim : o32;
            const int64_t base = seq * splits;
            float m = -INFINITY;
            for (int64_t p = 0; p < splits; p++) {
                const int64_t i = (base + p) * num_heads + r;
                if (part_sum[i] > 0.0f && part_max[i] > m) m = part_max[i];
            }
            float total = 0.0f;
            memset(o, 0, sizeof(float) * head_dim);
            for (int64_t p = 0; p < splits; p++) {
                const int64_t i = (base + p) * num_heads + r;
                if (part_sum[i] <= 0.0f) continue;
                const float w = splits > 1 ? ts_exp(part_max[i] - m) : 1.0f;
                total += w * part_sum[i];
                const float *a = part_acc + i * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += w * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
            if (out_dtype == TS_DTYPE_BF16) {
                uint16_t *ob = (uint16_t *)out + seq * out_stride + r * head_dim;
                for (int64_t d = 0; d < head_dim; d++) ob[d] = ts_f32_to_bf16(o[d]);
            }
        }
        free(scratch);
    }
    free(part_acc);
    free(part_max);
    free(part_sum);
    return failed;
}

#undef KV_T
#undef KV_IS_BF16
#undef KV_NAME
#undef KV_LOAD1
