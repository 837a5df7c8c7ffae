/* Decode attention's two block-level steps on one vector level, for one KV cache element type: written
 * once against ts_vec.h and included by paged_decode_kv.h once per (element type, level), with KV_T and
 * KV_NAME(x) of the type and TSV_ISA, TSV_LEVEL of the level set, and these tuning constants of the level
 * (undefined here at the end, for the next level):
 *   DECODE_DIM_MULTIPLE  head_dim must be a multiple of it for this level to take a block (KV_NAME(takes_...))
 *   DECODE_VALUE_HEADS   query heads of one values pass, and DECODE_VALUE_VECS the vectors of columns it
 *                        keeps of each, when head_dim allows (else one): their accumulators, the values
 *                        and a broadcast must fit the level's registers
 *
 *   scores[g][s] = q_g . k_s               (q scaled) V(LANES) / 2 keys per pass, whose sums fill one V(h),
 *                                          against up to three query heads, each key widened once for the
 *                                          heads it serves
 *   acc[g] += sum_s p[g][s] v_s            in key order, each value widened once for the heads it serves
 *
 * Each score sums head_dim / V(LANES) products per lane, then the lanes by V(hsums)'s tree, the last keys
 * of a call too, so a key's score does not depend on which keys share its call; each output column is a
 * chain of multiply-adds in key order, so the values' tiling does not change results. At AVX2 both are
 * the arithmetic of attn_rows.h, which prefill attention computes too.
 */

#define DECODE_FN(name) KV_NAME(V_FN(name))

static inline int DECODE_FN(takes)(int64_t head_dim) { return head_dim % DECODE_DIM_MULTIPLE == 0; }

/* NG (<= 3) query heads against the n keys of one block and KV head: per step of V(LANES) columns, the NG
 * query slices once and each key once for all NG heads; NG x KEYS accumulators. */
TS_ALWAYS_INLINE void DECODE_FN(scores_tile)(const float *q, const KV_T *k, int64_t token_stride, int64_t n,
                                            int64_t head_dim, float *scores, int64_t score_stride, const int NG) {
    enum { KEYS = V(LANES) / 2 };
    int64_t s = 0;
    for (; s + KEYS <= n; s += KEYS) {
        const KV_T *ks = k + s * token_stride;
        V(t) a[3][KEYS];
        for (int g = 0; g < NG; g++)
            for (int i = 0; i < KEYS; i++) a[g][i] = V(zero)();
        for (int64_t j = 0; j < head_dim; j += V(LANES)) {
            V(t) qv[3];
            for (int g = 0; g < NG; g++) qv[g] = V(load)(q + g * head_dim + j);
            for (int i = 0; i < KEYS; i++) {
                const V(t) kv = V_LOAD_AS_F32(ks + i * token_stride + j);
                for (int g = 0; g < NG; g++) a[g][i] = V(fma)(qv[g], kv, a[g][i]);
            }
        }
        for (int g = 0; g < NG; g++) V(h_store)(scores + g * score_stride + s, V(hsums)(a[g]));
    }
    for (; s < n; s++) { /* one key: its heads' sums through the same tree, one per lane of the half vector */
        const KV_T *ks = k + s * token_stride;
        V(t) a[KEYS];
        for (int g = 0; g < NG; g++) a[g] = V(zero)();
        for (int64_t j = 0; j < head_dim; j += V(LANES)) {
            const V(t) kv = V_LOAD_AS_F32(ks + j);
            for (int g = 0; g < NG; g++) a[g] = V(fma)(V(load)(q + g * head_dim + j), kv, a[g]);
        }
        for (int i = NG; i < KEYS; i++) a[i] = a[0];
        float sums[KEYS];
        V(h_store)(sums, V(hsums)(a));
        for (int g = 0; g < NG; g++) scores[g * score_stride + s] = sums[g];
    }
}

static void DECODE_FN(scores)(const float *q, const KV_T *k, int64_t token_stride, int64_t n, int64_t group,
                              int64_t head_dim, float *scores, int64_t score_stride) {
    TS_SCORES_BY_THREES(DECODE_FN(scores_tile));
}

/* acc rows [0, NG) x NV vectors of columns at a time, over the n values: each value vector is loaded (and
 * widened) once for all NG query heads. Constant NG and NV keep the accumulators in registers. */
TS_ALWAYS_INLINE void DECODE_FN(values_tile)(const float *p, int64_t p_stride, const KV_T *v, int64_t token_stride,
                                            int64_t n, int64_t head_dim, float *acc, const int NG, const int NV) {
    for (int64_t j0 = 0; j0 < head_dim; j0 += V(LANES) * NV) {
        V(t) a[DECODE_VALUE_HEADS][DECODE_VALUE_VECS];
        for (int g = 0; g < NG; g++)
            for (int u = 0; u < NV; u++) a[g][u] = V(load)(acc + g * head_dim + j0 + V(LANES) * u);
        for (int64_t s = 0; s < n; s++) {
            const KV_T *vs = v + s * token_stride + j0;
            V(t) vv[DECODE_VALUE_VECS];
            /* a 64-bit u: each vector's address is vs plus a constant, which keeps the key loop small enough
             * for the compiler to unroll it when n is known to be at most a prefetch chunk */
            for (int64_t u = 0; u < NV; u++) vv[u] = V_LOAD_AS_F32(vs + V(LANES) * u);
            for (int g = 0; g < NG; g++) {
                const V(t) pv = V(broadcast)(p + g * p_stride + s);
                for (int u = 0; u < NV; u++) a[g][u] = V(fma)(pv, vv[u], a[g][u]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int u = 0; u < NV; u++) V(store)(acc + g * head_dim + j0 + V(LANES) * u, a[g][u]);
    }
}

/* Query heads [0, ng) of a values pass (ng <= DECODE_VALUE_HEADS), NV vectors of columns at a time. */
TS_ALWAYS_INLINE void DECODE_FN(values_heads)(int ng, const float *p, int64_t p_stride, const KV_T *v,
                                             int64_t token_stride, int64_t n, int64_t head_dim, float *acc,
                                             const int NV) {
    switch (ng) {
    case 1: DECODE_FN(values_tile)(p, p_stride, v, token_stride, n, head_dim, acc, 1, NV); break;
    case 2: DECODE_FN(values_tile)(p, p_stride, v, token_stride, n, head_dim, acc, 2, NV); break;
#if DECODE_VALUE_HEADS > 3
    case 3: DECODE_FN(values_tile)(p, p_stride, v, token_stride, n, head_dim, acc, 3, NV); break;
#endif
    default: DECODE_FN(values_tile)(p, p_stride, v, token_stride, n, head_dim, acc, DECODE_VALUE_HEADS, NV); break;
    }
}

static void DECODE_FN(values)(const float *p, int64_t p_stride, const KV_T *v, int64_t token_stride, int64_t n,
                              int64_t group, int64_t head_dim, float *acc) {
    /* whole DECODE_VALUE_VECS-vector columns; constant where every head_dim this level takes has them */
    const int wide = DECODE_DIM_MULTIPLE % (V(LANES) * DECODE_VALUE_VECS) == 0 ||
                     head_dim % (V(LANES) * DECODE_VALUE_VECS) == 0;
    for (int64_t g0 = 0; g0 < group; g0 += DECODE_VALUE_HEADS) {
        const int ng = group - g0 < DECODE_VALUE_HEADS ? (int)(group - g0) : DECODE_VALUE_HEADS;
        if (wide)
            DECODE_FN(values_heads)(ng, p + g0 * p_stride, p_stride, v, token_stride, n, head_dim, acc + g0 * head_dim,
                                    DECODE_VALUE_VECS);
        else
            DECODE_FN(values_heads)(ng, p + g0 * p_stride, p_stride, v, token_stride, n, head_dim, acc + g0 * head_dim, 1);
    }
}

#undef DECODE_FN
#undef DECODE_DIM_MULTIPLE
#undef DECODE_VALUE_HEADS
#undef DECODE_VALUE_VECS
