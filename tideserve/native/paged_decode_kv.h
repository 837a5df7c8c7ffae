/* The decode-attention kernels for one KV cache element type; included once per type by paged_decode.c
 * with KV_T (the stored type), KV_NAME(x) (x with the type's suffix), KV_LOAD8(p) (eight elements as
 * float32 in an AVX2 register) and KV_LOAD1(p) (one element as float) defined. */

/* scores[g][s] = q_g . k_s * scale for the n keys of one block and one KV head (k: its first key). */
static void KV_NAME(block_scores)(const float *q, const KV_T *k, int64_t token_stride, int64_t n, int64_t group,
                         int64_t head_dim, float scale, float *scores, int64_t score_stride) {
#ifdef TS_AVX2
    if (head_dim % 32 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            float *sg = scores + g * score_stride;
            int64_t s = 0;
            for (; s + 8 <= n; s += 8) { /* eight keys at once: one q load feeds eight FMAs */
                const KV_T *ks = k + s * token_stride;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t j = 0; j < head_dim; j += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + j);
                    a0 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + j), a0);
                    a1 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + token_stride + j), a1);
                    a2 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 2 * token_stride + j), a2);
                    a3 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 3 * token_stride + j), a3);
                    a4 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 4 * token_stride + j), a4);
                    a5 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 5 * token_stride + j), a5);
                    a6 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 6 * token_stride + j), a6);
                    a7 = _mm256_fmadd_ps(qv, KV_LOAD8(ks + 7 * token_stride + j), a7);
                }
                _mm256_storeu_ps(sg + s, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
            }
            for (; s < n; s++) {
                const KV_T *ks = k + s * token_stride;
                __m256 a = _mm256_setzero_ps();
                for (int64_t j = 0; j < head_dim; j += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j), KV_LOAD8(ks + j), a);
                sg[s] = hsum(a) * scale;
            }
        }
        return;
    }
#endif
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

/* acc[g] += sum_s p[g][s] v_s over the n values of one block and one KV head (v: its first value). */
static void KV_NAME(block_values)(const float *p, int64_t p_stride, const KV_T *v, int64_t token_stride, int64_t n,
                         int64_t group, int64_t head_dim, float *acc) {
#ifdef TS_AVX2
    if (head_dim % 32 == 0) {
        for (int64_t g = 0; g < group; g++) {
            const float *pg = p + g * p_stride;
            for (int64_t j = 0; j < head_dim; j += 32) { /* 32 outputs stay in registers over the block */
                float *ag = acc + g * head_dim + j;
                __m256 a0 = _mm256_loadu_ps(ag), a1 = _mm256_loadu_ps(ag + 8);
                __m256 a2 = _mm256_loadu_ps(ag + 16), a3 = _mm256_loadu_ps(ag + 24);
                for (int64_t s = 0; s < n; s++) {
                    const KV_T *vs = v + s * token_stride + j;
                    const __m256 pv = _mm256_broadcast_ss(pg + s);
                    a0 = _mm256_fmadd_ps(pv, KV_LOAD8(vs), a0);
                    a1 = _mm256_fmadd_ps(pv, KV_LOAD8(vs + 8), a1);
                    a2 = _mm256_fmadd_ps(pv, KV_LOAD8(vs + 16), a2);
                    a3 = _mm256_fmadd_ps(pv, KV_LOAD8(vs + 24), a3);
                }
                _mm256_storeu_ps(ag, a0);
                _mm256_storeu_ps(ag + 8, a1);
                _mm256_storeu_ps(ag + 16, a2);
                _mm256_storeu_ps(ag + 24, a3);
            }
        }
        return;
    }
#endif
    for (int64_t s = 0; s < n; s++) {
        for (int64_t g = 0; g < group; g++) {
            const float pgs = p[g * p_stride + s];
            float *ag = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ag[d] += pgs * KV_LOAD1(v + s * token_stride + d);
        }
    }
}

/* Attention of one request's query heads of KV heads [kv_lo, kv_hi) over the keys of blocks [blk_lo,
 * blk_hi) of its table, left unnormalized so that several such parts merge exactly: for each query head r,
 * part_max[r] = the largest score, part_sum[r] = sum_t exp(score_t - part_max[r]) and acc[r] = sum_t
 * exp(score_t - part_max[r]) v_t. A block is read head after head while it is hot in cache, and each key
 * and value serves every query head that shares it. An empty range leaves part_sum at 0. */
static void KV_NAME(attend_part)(const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table,
                       int64_t context_len, int64_t blk_lo, int64_t blk_hi, int64_t kv_lo, int64_t kv_hi,
                       int64_t group, int64_t head_dim, int64_t block_size, int64_t num_kv_heads, float scale,
                       float *scores, float *acc, float *part_max, float *part_sum, int64_t max_context) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t rows = (kv_hi - kv_lo) * group; /* query heads handled here, from q and acc's start */
    const int64_t first = blk_lo * block_size;
    const int64_t last = blk_hi * block_size < context_len ? blk_hi * block_size : context_len;
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        part_max[r] = -INFINITY;
        part_sum[r] = 0.0f;
    }
    if (last <= first) return;

    /* Pass 1: scores[r][t - first] = q_r . k_t * scale. */
    for (int64_t blk = blk_lo; blk < blk_hi; blk++) {
        const int64_t t0 = blk * block_size;
        const int64_t n = last - t0 < block_size ? last - t0 : block_size;
        for (int64_t h = kv_lo; h < kv_hi; h++) {
            const int64_t r0 = (h - kv_lo) * group;
            KV_NAME(block_scores)(q + r0 * head_dim, k_cache + table[blk] * block_stride + h * head_dim, token_stride, n,
                         group, head_dim, scale, scores + r0 * max_context + (t0 - first), max_context);
        }
    }

    /* exp(score - max) per query head, in float32. */
    const int64_t count = last - first;
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores + r * max_context;
        float m = sr[0];
        for (int64_t t = 1; t < count; t++) m = sr[t] > m ? sr[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < count; t++) {
            float e = exp_nonpositive(sr[t] - m);
            sr[t] = e;
            sum += e;
        }
        part_max[r] = m;
        part_sum[r] = sum;
    }

    /* Pass 2: acc_r = sum_t e[r][t] v_t. */
    for (int64_t blk = blk_lo; blk < blk_hi; blk++) {
        const int64_t t0 = blk * block_size;
        const int64_t n = last - t0 < block_size ? last - t0 : block_size;
        for (int64_t h = kv_lo; h < kv_hi; h++) {
            const int64_t r0 = (h - kv_lo) * group;
            KV_NAME(block_values)(scores + r0 * max_context + (t0 - first), max_context,
                         v_cache + table[blk] * block_stride + h * head_dim, token_stride, n, group, head_dim,
                         acc + r0 * head_dim);
        }
    }
}

/* Returns 0 on success, 1 when scratch memory could not be had (the caller falls back). */
int KV_NAME(ts_paged_decode)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                        const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                        float *out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
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
    const int64_t part_len = (max_blocks + splits - 1) / splits * block_size; /* keys one part may hold */
    float *part_acc = (float *)malloc(sizeof(float) * tasks * num_heads * head_dim);
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
        float *scores = (float *)malloc(sizeof(float) * num_heads * (splits > 1 ? part_len : max_context));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t seq = task / splits, part = task % splits;
            const int64_t nb = (context_lens[seq] + block_size - 1) / block_size;
            const int64_t per = (nb + splits - 1) / splits;
            const int64_t lo = part * per < nb ? part * per : nb;
            const int64_t hi = lo + per < nb ? lo + per : nb;
            if (scores == NULL) continue;
            KV_NAME(attend_part)(q + seq * q_stride, k_cache, v_cache, block_tables + seq * table_width,
                       context_lens[seq], lo, hi, 0, num_kv_heads, group, head_dim, block_size, num_kv_heads, scale,
                       scores, part_acc + task * num_heads * head_dim, part_max + task * num_heads,
                       part_sum + task * num_heads, splits > 1 ? part_len : max_context);
        }
        free(scores);
        /* Merge each request's parts: out = sum_p acc_p e^(max_p - M) / sum_p sum_p e^(max_p - M). */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < num_seqs * num_heads; row++) {
            const int64_t seq = row / num_heads, r = row % num_heads;
            float *o = out + seq * out_stride + r * head_dim;
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
                const float w = splits > 1 ? exp_nonpositive(part_max[i] - m) : 1.0f;
                total += w * part_sum[i];
                const float *a = part_acc + i * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += w * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(part_acc);
    free(part_max);
    free(part_sum);
    return failed;
}
