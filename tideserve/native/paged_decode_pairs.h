/* Decode attention in prefill's vdpbf16ps arithmetic (AVX-512 BF16, a bfloat16 cache, head_dim a multiple
 * of 32), for attention's invariant mode (ts_set_attn_invariant): a decode step gives a query the bits the
 * same token gets from paged_prefill.c's dpbf16 form in any prefill, chunk or batch.
 *
 * Prefill holds 16 query rows per vector and broadcasts keys; a decode step has a handful of rows per KV
 * head, so here a vector holds 16 keys (scores) or 16 output columns (values) and broadcasts the rows'
 * pairs. Per (row, key) and per (row, column) the operations are prefill's, in its order:
 *   - q' = q * scale in float32, rounded to bfloat16 (round to nearest even);
 *   - a score is a chain of vdpbf16ps over the head's pairs of columns, in column order, from zero (the
 *     instruction's two products are exact and symmetric in its operands, so which side is broadcast does
 *     not matter);
 *   - per tile of ATTN_KEY_TILE keys at absolute positions: the running max m (from -FLT_MAX), alpha =
 *     exp(m - max), l = l * alpha + the tile's probabilities summed by attn_rows.h's fixed tree, o = o *
 *     alpha, then o gains the probabilities rounded to bfloat16 pairs of keys times the values' key pairs,
 *     one vdpbf16ps per pair in key order; no parts (prefill's AVX-512 forms fold none), so a KV head's
 *     keys are one task's whatever the thread count;
 *   - the output is o * (1 / l).
 * Keys outside a query's window or past its position weigh exactly 0, whose products add nothing; a key or
 * value row past the context is read as zeros, so whatever a free slot holds never reaches the sum.
 */
#if defined(TS_HAVE_AVX512BF16)

/* Scratch for one thread: the rows' query pairs, a tile's scores, the rows' running state and the
 * probabilities' bfloat16 pairs. */
typedef struct {
    uint32_t *qp;   /* [group][head_dim / 2] */
    float *s;       /* [group][ATTN_KEY_TILE] */
    float *o;       /* [group][head_dim] */
    float *m, *l;   /* [group] */
    float *alpha;   /* [group], this tile's rescale */
    uint32_t *pv;   /* [group][ATTN_KEY_TILE / 2] */
    uint32_t *kt;   /* [head_dim / 2][ATTN_KEY_TILE], a tile's keys as pairs x keys */
    uint16_t *zero; /* [head_dim], the row read past the context */
} pairs_scratch;

#define PAIRS_ROWS 4   /* query rows whose accumulators share each key (and value) vector */
#define PAIRS_CHUNKS 4 /* 16-column chunks of the values accumulated side by side */

/* t[i] lane j = the pair (32 bits) at column 2 (c + i) of row j: sixteen rows' pairs c .. c + 15 transposed in
 * registers (ts_transpose16x16's shuffles, read from row pointers). */
TS_ALWAYS_INLINE void pairs_transpose(const uint16_t *const rows[16], int64_t c, __m512 t[16]) {
    __m512 r[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)(rows[i] + 2 * c));
    for (int i = 0; i < 8; i++) {
        u[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        u[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(u[4 * i], u[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        const __m512 v0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xee);
        const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xee);
        t[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        t[8 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}

/* w's arrays offset to its row r. */
static inline pairs_scratch pairs_head(const pairs_scratch *w, int64_t r, int64_t head_dim) {
    pairs_scratch v = *w;
    v.qp += r * (head_dim / 2);
    v.s += r * ATTN_KEY_TILE;
    v.o += r * head_dim;
    v.m += r;
    v.l += r;
    v.alpha += r;
    v.pv += r * (ATTN_KEY_TILE / 2);
    return v;
}

/* q' = bfloat16(q * scale) of query heads row0 .. row0 + rows - 1 (as prefill's pack_queries_amx), and their
 * empty state. */
static void pairs_start(pairs_scratch *w, const void *q, int q_dtype, int64_t q_stride, int64_t seq, int64_t row0,
                        int64_t rows, int64_t head_dim, float scale) {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = seq * q_stride + (row0 + r) * head_dim;
        for (int64_t d = 0; d < head_dim; d += 32) {
            __m512 lo, hi;
            if (q_dtype == TS_DTYPE_BF16) {
                const uint16_t *qb = (const uint16_t *)q + at + d;
                lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)qb)), 16));
                hi = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qb + 16))), 16));
            } else {
                lo = _mm512_loadu_ps((const float *)q + at + d);
                hi = _mm512_loadu_ps((const float *)q + at + d + 16);
            }
            const __m512 vs = _mm512_set1_ps(scale);
            _mm512_storeu_si512(w->qp + r * half + d / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, vs), _mm512_mul_ps(lo, vs)));
        }
        w->m[r] = -FLT_MAX;
        w->l[r] = 0.0f;
        memset(w->o + r * head_dim, 0, (size_t)head_dim * sizeof(float));
    }
}

/* One tile of keys (krows, vrows: its ATTN_KEY_TILE rows, zeros past the context) folded into KV head g's
 * rows: nk keys, the first lo of them before the window. */
static void pairs_tile(pairs_scratch *w, const uint16_t *const *krows, const uint16_t *const *vrows, int64_t nk,
                       int64_t lo, int64_t group, int64_t head_dim, float softcap) {
    const int64_t half = head_dim / 2, chunks = head_dim / 16;
    /* the tile's keys as pairs x keys: kt[pr][j] = key j's pair pr */
    for (int64_t h = 0; h < ATTN_KEY_TILE; h += 16)
        for (int64_t c = 0; c < half; c += 16) {
            __m512 t[16];
            pairs_transpose(krows + h, c, t);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(w->kt + (c + i) * ATTN_KEY_TILE + h), t[i]);
        }
    /* scores: per (row, key) a chain of vdpbf16ps over the pairs in column order; PAIRS_ROWS rows times both
     * halves of the tile run side by side */
    for (int64_t r0 = 0; r0 < group; r0 += PAIRS_ROWS) {
        const int64_t nr = group - r0 < PAIRS_ROWS ? group - r0 : PAIRS_ROWS;
        __m512 acc[PAIRS_ROWS][2];
        for (int r = 0; r < PAIRS_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t pr = 0; pr < half; pr++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(w->kt + pr * ATTN_KEY_TILE);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(w->kt + pr * ATTN_KEY_TILE + 16);
            for (int r = 0; r < nr; r++) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int32_t)w->qp[(r0 + r) * half + pr]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm512_storeu_ps(w->s + (r0 + r) * ATTN_KEY_TILE, acc[r][0]);
            _mm512_storeu_ps(w->s + (r0 + r) * ATTN_KEY_TILE + 16, acc[r][1]);
        }
    }
    const __mmask32 seen = (__mmask32)((nk == 32 ? 0xffffffffu : ((1u << nk) - 1u)) & ~((1u << lo) - 1u));
    const __m512 floor = _mm512_set1_ps(-FLT_MAX);
    for (int64_t r = 0; r < group; r++) { /* the online softmax, row by row */
        float *sr = w->s + r * ATTN_KEY_TILE;
        attn_softcap(sr, nk, softcap);
        const __m512 s0 = _mm512_loadu_ps(sr), s1 = _mm512_loadu_ps(sr + 16);
        /* the max over the keys it sees (exact in any order) */
        const float seen_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(floor, (__mmask16)seen, s0),
                                                                  _mm512_mask_mov_ps(floor, (__mmask16)(seen >> 16), s1)));
        const float mx = seen_max > w->m[r] ? seen_max : w->m[r];
        const float alpha = _mm512_cvtss_f32(ts_exp512(_mm512_set1_ps(w->m[r] - mx)));
        const __m512 vmx = _mm512_set1_ps(mx);
        const __m512 p0 = _mm512_maskz_mov_ps((__mmask16)seen, ts_exp512(_mm512_sub_ps(s0, vmx)));
        const __m512 p1 = _mm512_maskz_mov_ps((__mmask16)(seen >> 16), ts_exp512(_mm512_sub_ps(s1, vmx)));
        w->l[r] = w->l[r] * alpha + attn_tile_sum_keys512(p0, p1);
        w->m[r] = mx;
        w->alpha[r] = alpha;
        /* pair rp = the probabilities of keys 2 rp, 2 rp + 1, rounded to bfloat16 */
        _mm512_storeu_si512(w->pv + r * (ATTN_KEY_TILE / 2), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    /* values: o = o * alpha, then per column a chain of vdpbf16ps over the key pairs in key order; PAIRS_ROWS
     * rows times PAIRS_CHUNKS column chunks run side by side, each pair of value rows interleaved once */
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t r0 = 0; r0 < group; r0 += PAIRS_ROWS) {
        const int64_t nr = group - r0 < PAIRS_ROWS ? group - r0 : PAIRS_ROWS;
        for (int64_t c0 = 0; c0 < chunks; c0 += PAIRS_CHUNKS) {
            const int64_t nc = chunks - c0 < PAIRS_CHUNKS ? chunks - c0 : PAIRS_CHUNKS;
            __m512 acc[PAIRS_ROWS][PAIRS_CHUNKS];
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++)
                    acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(w->o + (r0 + r) * head_dim + 16 * (c0 + c)),
                                              _mm512_set1_ps(w->alpha[r0 + r]));
            for (int64_t rp = 0; rp < pairs; rp++) {
                __m512bh vp[PAIRS_CHUNKS];
                for (int c = 0; c < nc; c++) {
                    const int64_t d = 16 * (c0 + c);
                    const __m512i e = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrows[2 * rp] + d)));
                    const __m512i o = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrows[2 * rp + 1] + d)));
                    vp[c] = (__m512bh)_mm512_or_si512(e, _mm512_slli_epi32(o, 16));
                }
                for (int r = 0; r < nr; r++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int32_t)w->pv[(r0 + r) * (ATTN_KEY_TILE / 2) + rp]);
                    for (int c = 0; c < nc; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vp[c]);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++) _mm512_storeu_ps(w->o + (r0 + r) * head_dim + 16 * (c0 + c), acc[r][c]);
        }
    }
}

/* The outputs of query heads row0 .. row0 + rows - 1, o * (1 / l), into out. */
static void pairs_finish(const pairs_scratch *w, void *out, int64_t out_stride, int out_dtype, int64_t seq,
                         int64_t row0, int64_t rows, int64_t head_dim) {
    const int64_t chunks = head_dim / 16;
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(w->l[r]));
        const float *orow = w->o + r * head_dim;
        const int64_t at = seq * out_stride + (row0 + r) * head_dim;
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * c), inv);
            if (out_dtype == TS_DTYPE_F32) {
                _mm512_storeu_ps((float *)out + at + 16 * c, y);
            } else {
                float tmp[16];
                _mm512_storeu_ps(tmp, y);
                for (int i = 0; i < 16; i++) ((uint16_t *)out)[at + 16 * c + i] = ts_f32_to_bf16(tmp[i]);
            }
        }
    }
}

/* Query heads r0 .. r1 - 1 of one request's decode step over keys first .. pos, tile by tile; in each tile the
 * KV heads they share are read token by token, so the cache streams as it lies. */
static void decode_pairs_task(pairs_scratch *w, const void *q, int q_dtype, int64_t q_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *table, int64_t pos, int64_t first, int64_t r0,
                              int64_t r1, int64_t group, int64_t head_dim, int64_t block_size, int64_t num_kv_heads,
                              float scale, float softcap, void *out, int64_t out_stride, int out_dtype, int64_t seq) {
    const int64_t token_stride = num_kv_heads * head_dim, g0 = r0 / group, g1 = (r1 - 1) / group + 1;
#define PAIRS_HEAD_ROWS(g) /* this task's rows of KV head g: [ra, rb) */                                  \
    const int64_t ra = (g) * group > r0 ? (g) * group : r0, rb = ((g) + 1) * group < r1 ? ((g) + 1) * group : r1
    for (int64_t g = g0; g < g1; g++) {
        PAIRS_HEAD_ROWS(g);
        pairs_scratch h = pairs_head(w, ra - r0, head_dim);
        pairs_start(&h, q, q_dtype, q_stride, seq, ra, rb - ra, head_dim, scale);
    }
    const int64_t row_bytes = (g1 - g0) * head_dim * (int64_t)sizeof(uint16_t);
    int64_t at[2 * ATTN_KEY_TILE]; /* this tile's and the next one's token rows, in elements from the cache's start */
    int64_t kb = first / ATTN_KEY_TILE * ATTN_KEY_TILE;
    int64_t block = kb / block_size, off = kb % block_size; /* where position kb + (tokens placed) lies */
    int64_t placed = 0; /* positions kb .. kb + placed - 1 have their at[] */
    for (; kb <= pos; kb += ATTN_KEY_TILE) {
        const int64_t nk = pos - kb + 1 < ATTN_KEY_TILE ? pos - kb + 1 : ATTN_KEY_TILE;
        const int64_t lo = first > kb ? first - kb : 0; /* keys of the tile before the window */
        const int64_t want = pos + 1 - kb < 2 * ATTN_KEY_TILE ? pos + 1 - kb : 2 * ATTN_KEY_TILE;
        for (; placed < want; placed++) { /* block by block, no division per key */
            at[placed] = (table[block] * block_size + off) * token_stride;
            if (++off == block_size) {
                off = 0;
                block++;
            }
        }
        for (int64_t j = ATTN_KEY_TILE; j < placed; j++) { /* the next tile */
            ts_prefetch_bytes(k_cache + at[j] + g0 * head_dim, row_bytes);
            ts_prefetch_bytes(v_cache + at[j] + g0 * head_dim, row_bytes);
        }
        for (int64_t g = g0; g < g1; g++) {
            PAIRS_HEAD_ROWS(g);
            const uint16_t *krows[ATTN_KEY_TILE], *vrows[ATTN_KEY_TILE];
            for (int64_t j = 0; j < ATTN_KEY_TILE; j++) {
                krows[j] = j < nk ? k_cache + at[j] + g * head_dim : w->zero;
                vrows[j] = j < nk ? v_cache + at[j] + g * head_dim : w->zero;
            }
            pairs_scratch h = pairs_head(w, ra - r0, head_dim);
            pairs_tile(&h, krows, vrows, nk, lo, rb - ra, head_dim, softcap);
        }
        /* the next tile's rows move to the front */
        const int64_t kept = placed > ATTN_KEY_TILE ? placed - ATTN_KEY_TILE : 0;
        memmove(at, at + ATTN_KEY_TILE, (size_t)kept * sizeof(int64_t));
        placed = kept;
    }
    for (int64_t g = g0; g < g1; g++) {
        PAIRS_HEAD_ROWS(g);
        const pairs_scratch h = pairs_head(w, ra - r0, head_dim);
        pairs_finish(&h, out, out_stride, out_dtype, seq, ra, rb - ra, head_dim);
    }
#undef PAIRS_HEAD_ROWS
}

/* The decode step in prefill's dpbf16 arithmetic. A task is a request's query heads, all of them (the cache
 * streams token by token), or with fewer requests than threads an equal share of them (so one request's step
 * keeps every thread busy): a query's bits do not depend on which task runs it. Returns 0, or 1 when scratch
 * memory could not be had. */
static int paged_decode_pairs_bf16(const void *q, int64_t q_stride, int q_dtype, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int64_t *block_tables, int64_t table_width,
                                   const int64_t *context_lens, void *out, int64_t out_stride, int out_dtype,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, int64_t window, float softcap, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, half = head_dim / 2;
    const int64_t shares = num_seqs < num_threads ? (num_threads + num_seqs - 1) / num_seqs : 1;
    const int64_t rows = (num_heads + shares - 1) / shares; /* query heads per task */
    const int64_t tasks_per_seq = (num_heads + rows - 1) / rows, tasks = num_seqs * tasks_per_seq;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t words = (size_t)(rows * half + rows * ATTN_KEY_TILE + rows * head_dim + 3 * rows +
                                      rows * ATTN_KEY_TILE / 2 + half * ATTN_KEY_TILE + half);
        uint32_t *mem = (uint32_t *)aligned_alloc(64, (words * sizeof(uint32_t) + 63) / 64 * 64);
        pairs_scratch w;
        if (mem == NULL) {
            failed = 1;
        } else {
            w.qp = mem;
            w.s = (float *)(w.qp + rows * half);
            w.o = w.s + rows * ATTN_KEY_TILE;
            w.m = w.o + rows * head_dim;
            w.l = w.m + rows;
            w.alpha = w.l + rows;
            w.pv = (uint32_t *)(w.alpha + rows);
            w.kt = w.pv + rows * ATTN_KEY_TILE / 2;
            w.zero = (uint16_t *)(w.kt + half * ATTN_KEY_TILE);
            memset(w.zero, 0, (size_t)head_dim * sizeof(uint16_t));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (mem == NULL) continue;
            const int64_t seq = task / tasks_per_seq, r0 = task % tasks_per_seq * rows;
            const int64_t r1 = r0 + rows < num_heads ? r0 + rows : num_heads, context = context_lens[seq];
            if (context <= 0) { /* an empty context's output: zeros */
                for (int64_t r = r0; r < r1; r++) {
                    const int64_t at = seq * out_stride + r * head_dim;
                    if (out_dtype == TS_DTYPE_F32)
                        memset((float *)out + at, 0, (size_t)head_dim * sizeof(float));
                    else
                        memset((uint16_t *)out + at, 0, (size_t)head_dim * sizeof(uint16_t));
                }
                continue;
            }
            const int64_t pos = context - 1;
            decode_pairs_task(&w, q, q_dtype, q_stride, k_cache, v_cache, block_tables + seq * table_width, pos,
                              attn_window_first(pos, window), r0, r1, group, head_dim, block_size, num_kv_heads,
                              scale, softcap, out, out_stride, out_dtype, seq);
        }
        free(mem);
    }
    return failed;
}

#endif /* TS_HAVE_AVX512BF16 */
