/* The decode-attention kernels for one KV cache element type; included once per type by paged_decode.c
 * with KV_T (the stored type), KV_IS_BF16 (0 or 1), KV_NAME(x) (x with the type's suffix) and KV_LOAD1(p)
 * (one element as float) defined; it undefines them at its end, for the next type.
 *
 * Every path computes the same two block-level steps, so each can be checked against the scalar one:
 *   scores[g][s] = q_g . k_s                     for n keys of one block and one KV head (q scaled)
 *   acc[g] += sum_s p[g][s] v_s                  for the n values of the same keys and head
 * for the ``group`` query heads g that share the KV head (rows head_dim floats apart in q and acc). The
 * vector levels share one body (paged_decode_vec.h); vdpbf16ps has its own scores. At the scalar and AVX2
 * levels both are the arithmetic of attn_rows.h.
 */

#ifndef TS_SCORES_BY_THREES
/* A group's query heads in chunks of up to three, each chunk through TILE with a constant head count (so
 * the tile's accumulators stay in registers). */
#define TS_SCORES_BY_THREES(TILE)                                                                   \
    for (int64_t g0 = 0; g0 < group; g0 += 3) {                                                     \
        const float *qg = q + g0 * head_dim;                                                        \
        float *sg = scores + g0 * score_stride;                                                     \
        switch (group - g0 < 3 ? group - g0 : 3) {                                                  \
        case 1: TILE(qg, k, token_stride, n, head_dim, sg, score_stride, 1); break;                 \
        case 2: TILE(qg, k, token_stride, n, head_dim, sg, score_stride, 2); break;                 \
        default: TILE(qg, k, token_stride, n, head_dim, sg, score_stride, 3); break;                \
        }                                                                                           \
    }
#endif

/* ---------------------------------------------------------------- scalar reference */

/* The products summed in column order (attn_rows.h): no reassociated reduction. */
static void KV_NAME(scores_scalar)(const float *q, const KV_T *k, int64_t token_stride, int64_t n, int64_t group,
                                   int64_t head_dim, float *scores, int64_t score_stride) {
    for (int64_t s = 0; s < n; s++) {
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * KV_LOAD1(k + s * token_stride + d);
            scores[g * score_stride + s] = dot;
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
#define DECODE_DIM_MULTIPLE 8 /* where attn_rows.h takes its AVX2 forms */
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

/* q: the float32 query rows, scaled; qb: the query rows as they came in bfloat16, unscaled (their products
 * are multiplied by scale), or NULL when they came as float32. */
static inline void KV_NAME(block_scores)(int isa, const float *q, const uint16_t *qb, float scale, const KV_T *k,
                                         int64_t token_stride, int64_t n, int64_t group, int64_t head_dim,
                                         float *scores, int64_t score_stride) {
#if KV_IS_BF16 && defined(TS_HAVE_AVX512BF16)
    if (isa >= TS_ISA_AVX512_BF16 && qb != NULL && head_dim % 32 == 0) {
        KV_NAME(scores_dpbf16)(qb, k, token_stride, n, group, head_dim, scale, scores, score_stride);
        return;
    }
#endif
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512 && KV_NAME(takes_avx512)(head_dim)) {
        KV_NAME(scores_avx512)(q, k, token_stride, n, group, head_dim, scores, score_stride);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2 && KV_NAME(takes_avx2)(head_dim)) {
        KV_NAME(scores_avx2)(q, k, token_stride, n, group, head_dim, scores, score_stride);
        return;
    }
#endif
    (void)isa;
    (void)qb;
    (void)scale;
    KV_NAME(scores_scalar)(q, k, token_stride, n, group, head_dim, scores, score_stride);
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

/* Asks for the token rows (every KV head) at positions [p0, p1) of a request's keys or values: blocks lie
 * anywhere in the pool, out of the hardware prefetchers' reach. */
static inline void KV_NAME(prefetch_rows)(const KV_T *cache, const int64_t *table, int64_t p0, int64_t p1,
                                          int64_t block_size, int64_t token_stride, int to_l2) {
    for (int64_t p = p0, run; p < p1; p += run) {
        const int64_t off = p % block_size;
        run = block_size - off < p1 - p ? block_size - off : p1 - p;
        ts_prefetch_bytes_to(cache + (table[p / block_size] * block_size + off) * token_stride,
                             (int64_t)sizeof(KV_T) * run * token_stride, to_l2);
    }
}

/* One pass over a tile's positions [t0, t1) of one cache, run by run within blocks and head after head:
 * the keys' scores into ``scores`` (values 0) or the values weighted by them into ``acc`` (values 1).
 * Before each (run, head) step a slice of the next tile's rows, [t1, ahead), is asked for: a whole tile
 * asked for at once stalls the core on the line-fill buffers until it comes. */
static inline __attribute__((always_inline)) void KV_NAME(tile_pass)(
    const int values, int isa, const float *q, const uint16_t *qb, float scale, const KV_T *cache,
    const int64_t *table, int64_t t0, int64_t t1, int64_t ahead, int64_t slice, int64_t group, int64_t head_dim,
    int64_t block_size, int64_t num_kv_heads, float *scores, float *acc, int to_l2) {
    const int64_t token_stride = num_kv_heads * head_dim;
    int64_t fetched = t1;
    for (int64_t p = t0, run; p < t1; p += run) {
        const int64_t off = p % block_size;
        run = block_size - off < t1 - p ? block_size - off : t1 - p;
        const KV_T *at = cache + (table[p / block_size] * block_size + off) * token_stride;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t r0 = h * group;
            const int64_t upto = fetched + slice < ahead ? fetched + slice : ahead;
            KV_NAME(prefetch_rows)(cache, table, fetched, upto, block_size, token_stride, to_l2);
            fetched = upto;
            if (values)
                KV_NAME(block_values)(isa, scores + r0 * ATTN_KEY_TILE + (p - t0), ATTN_KEY_TILE, at + h * head_dim,
                                      token_stride, run, group, head_dim, acc + r0 * head_dim);
            else
                KV_NAME(block_scores)(isa, q + r0 * head_dim, qb != NULL ? qb + r0 * head_dim : NULL, scale,
                                      at + h * head_dim, token_stride, run, group, head_dim,
                                      scores + r0 * ATTN_KEY_TILE + (p - t0), ATTN_KEY_TILE);
        }
    }
}

/* Attention of one request's query heads over its keys [key_lo, key_hi), one part of attn_rows.h (key_lo
 * a multiple of ATTN_PART_KEYS, key_hi at most ATTN_PART_KEYS further, key_hi > first), tile by tile with
 * its online softmax, from the tile holding ``first`` (the first key of a sliding window; keys before it are
 * masked), scores soft-capped by ``softcap`` when it is > 0: for each query head r, m[r] and l[r] the running max and sum and acc[r] the unnormalised output.
 * q: the scaled float32 query rows (qb, scale: see block_scores). A tile's keys are read block by block,
 * head after head, each serving every query head that shares it; the next tile's keys (up to ahead_hi)
 * are asked for before this tile's scores, its values before this tile's values. */
static void KV_NAME(attend_part)(int isa, const float *q, const uint16_t *qb, float scale, const KV_T *k_cache,
                                 const KV_T *v_cache, const int64_t *table, int64_t key_lo, int64_t key_hi,
                                 int64_t ahead_hi, int64_t first, float softcap, int64_t group, int64_t head_dim,
                                 int64_t block_size, int64_t num_kv_heads, float *scores, float *acc, float *m,
                                 float *l, int to_l2) {
    const int64_t rows = num_kv_heads * group; /* every query head */
    const int vec = attn_vec_rows(isa, head_dim);
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t first_tile = first / ATTN_KEY_TILE * ATTN_KEY_TILE;
    for (int64_t t0 = key_lo > first_tile ? key_lo : first_tile; t0 < key_hi; t0 += ATTN_KEY_TILE) {
        const int64_t t1 = t0 + ATTN_KEY_TILE < key_hi ? t0 + ATTN_KEY_TILE : key_hi;
        const int64_t ahead = t1 + ATTN_KEY_TILE < ahead_hi ? t1 + ATTN_KEY_TILE : ahead_hi;
        const int64_t steps = ((t1 - 1) / block_size - t0 / block_size + 1) * num_kv_heads; /* (run, head) steps */
        const int64_t slice = (ATTN_KEY_TILE + steps - 1) / steps;
        KV_NAME(tile_pass)(0, isa, q, qb, scale, k_cache, table, t0, t1, ahead, slice, group, head_dim, block_size,
                           num_kv_heads, scores, acc, to_l2);
        for (int64_t r = 0; r < rows; r++) {
            attn_softcap(scores + r * ATTN_KEY_TILE, t1 - t0, softcap);
            attn_softmax_tile(vec, scores + r * ATTN_KEY_TILE, first > t0 ? first - t0 : 0, t1 - t0, m + r, l + r,
                              acc + r * head_dim, head_dim);
        }
        KV_NAME(tile_pass)(1, isa, q, qb, scale, v_cache, table, t0, t1, ahead, slice, group, head_dim, block_size,
                           num_kv_heads, scores, acc, to_l2);
    }
}

/* Returns 0 on success, 1 when scratch memory could not be had (the caller falls back). */
static int KV_NAME(paged_decode)(const void *q, int64_t q_stride, int q_dtype, const KV_T *k_cache,
                                 const KV_T *v_cache, const int64_t *block_tables, int64_t table_width,
                                 const int64_t *context_lens, void *out, int64_t out_stride, int out_dtype,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int64_t window, float softcap, int num_threads) {
    const int isa = ts_attn_isa_level(KV_IS_BF16 ? TS_DTYPE_BF16 : (sizeof(KV_T) == 1 ? TS_DTYPE_FP8 : TS_DTYPE_F32), head_dim);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_width = num_heads * head_dim;
    int64_t max_context = 1;
    for (int64_t i = 0; i < num_seqs; i++) max_context = context_lens[i] > max_context ? context_lens[i] : max_context;
    const int64_t max_parts = (max_context + ATTN_PART_KEYS - 1) / ATTN_PART_KEYS;
    /* Whole requests per task stream their blocks best, folding their parts in order as they go. With too
     * few requests to keep every thread busy, each part is a task of its own and a request's parts fold
     * once all are done: the same folds in the same order, so the same bits either way. */
    const int split = num_threads > 1 && num_seqs < 2 * (int64_t)num_threads && max_parts > 1 &&
                      num_seqs * max_parts * (row_width + 2 * num_heads) * (int64_t)sizeof(float) <=
                          TS_DECODE_SPLIT_MAX_BYTES;
    const int64_t parts = split ? max_parts : 1; /* states kept per request */
    const int64_t tasks = num_seqs * parts;
    /* A batch (whole requests per task) on an Intel core asks for its blocks into L2: at 64 requests of 250
     * keys the step's attention took 6-9% less time than with prefetcht0; a single request (split in parts)
     * measured the same or 3% slower, so it keeps L1. Other vendors were not measured and keep L1. */
    const int to_l2 = !split && (ts_cpu_features() & TS_CPU_VENDOR_INTEL) != 0;
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
        /* Per thread: one tile's scores, the scaled float32 query, one part's state, a folded output row. */
        float *scratch = (float *)malloc(sizeof(float) * (num_heads * ATTN_KEY_TILE + 2 * row_width + 2 * num_heads +
                                                          head_dim));
        if (scratch == NULL) failed = 1;
        float *scores = scratch;
        float *q32 = scores + num_heads * ATTN_KEY_TILE;
        float *acc = q32 + row_width;
        float *m = acc + row_width, *l = m + num_heads;
        float *o32 = l + num_heads;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scratch == NULL) continue;
            const int64_t seq = task / parts, part = task % parts, context = context_lens[seq];
            const int64_t first = attn_window_first(context - 1, window); /* its sliding window's first key */
            const uint16_t *qb = NULL;
            if (q_dtype == TS_DTYPE_BF16) {
                qb = (const uint16_t *)q + seq * q_stride;
                for (int64_t i = 0; i < row_width; i++) q32[i] = ts_bf16_to_f32(qb[i]) * scale;
            } else {
                const float *qf = (const float *)q + seq * q_stride;
                for (int64_t i = 0; i < row_width; i++) q32[i] = qf[i] * scale;
            }
            const int64_t *table = block_tables + seq * table_width;
            float *t_acc = part_acc + task * row_width, *t_max = part_max + task * num_heads;
            float *t_sum = part_sum + task * num_heads;
            if (split) { /* this part's own state */
                const int64_t lo = part * ATTN_PART_KEYS;
                const int64_t hi = lo + ATTN_PART_KEYS < context ? lo + ATTN_PART_KEYS : context;
                if (hi <= first) { /* before the window: folds as nothing */
                    for (int64_t r = 0; r < num_heads; r++) t_sum[r] = 0.0f;
                    continue;
                }
                KV_NAME(attend_part)(isa, q32, qb, scale, k_cache, v_cache, table, lo, hi, hi, first, softcap, group,
                                     head_dim, block_size, num_kv_heads, scores, t_acc, t_max, t_sum, to_l2);
                continue;
            }
            for (int64_t r = 0; r < num_heads; r++) t_sum[r] = 0.0f;
            memset(t_acc, 0, sizeof(float) * row_width); /* an empty context's output: zeros */
            /* every part from the window's, folded in order */
            for (int64_t lo = first / ATTN_PART_KEYS * ATTN_PART_KEYS; lo < context; lo += ATTN_PART_KEYS) {
                const int64_t hi = lo + ATTN_PART_KEYS < context ? lo + ATTN_PART_KEYS : context;
                KV_NAME(attend_part)(isa, q32, qb, scale, k_cache, v_cache, table, lo, hi, context, first, softcap,
                                     group, head_dim, block_size, num_kv_heads, scores, acc, m, l, to_l2);
                for (int64_t r = 0; r < num_heads; r++)
                    attn_fold_part(t_max + r, t_sum + r, t_acc + r * head_dim, m[r], l[r], acc + r * head_dim,
                                   head_dim);
            }
        }
        /* Each query head's output: its parts folded in order (split), then divided by their sum. */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < num_seqs * num_heads; row++) {
            if (scratch == NULL) continue;
            const int64_t seq = row / num_heads, r = row % num_heads;
            float mx = -INFINITY, sum = 0.0f;
            const float *o = part_acc + seq * parts * row_width + r * head_dim;
            if (split) {
                memset(o32, 0, sizeof(float) * head_dim);
                for (int64_t p = 0; p < parts; p++) {
                    const int64_t i = (seq * parts + p) * num_heads + r;
                    attn_fold_part(&mx, &sum, o32, part_max[i], part_sum[i], part_acc + i * head_dim, head_dim);
                }
                o = o32;
            } else {
                sum = part_sum[seq * num_heads + r];
            }
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            if (out_dtype == TS_DTYPE_F32) {
                float *dst = (float *)out + seq * out_stride + r * head_dim;
                for (int64_t d = 0; d < head_dim; d++) dst[d] = o[d] * inv;
            } else {
                uint16_t *dst = (uint16_t *)out + seq * out_stride + r * head_dim;
                for (int64_t d = 0; d < head_dim; d++) dst[d] = ts_f32_to_bf16(o[d] * inv);
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
