/* The arithmetic of one query row's attention that prefill (paged_prefill.c) and decode (paged_decode.c)
 * share at the scalar and AVX2 levels, so that a query at position p attending keys 0 .. p gets the same
 * bits from either kernel and however its step was cut (a whole prompt, a tail after a cached prefix,
 * chunks of any size, a decode step, any batch, any thread count):
 *
 *   - keys in tiles of ATTN_KEY_TILE at absolute positions 0, 32, 64, ..., grouped in parts of
 *     ATTN_PART_KEYS aligned the same way; both sizes are constants, never chosen per call;
 *   - a score is q' . k, q' = q * scale rounded to float32 first; AVX2 sums each product chain in 8 lanes
 *     (one FMA per step of 8 columns) and then the lanes by tsv_avx2_hsums' tree, whichever keys share the
 *     call; scalar sums the products in column order;
 *   - within a part the tiles fold into a running max m, sum l and unnormalised output o by
 *     attn_softmax_tile_*; o[d] gains p_j v_j[d] in key order (an FMA on AVX2, a product then a sum in
 *     scalar), so how the values are tiled over columns, heads or blocks does not change it;
 *   - the parts fold into one another in key order (attn_fold_part);
 *   - the output is o * (1 / l).
 * A sliding window (a query at p attends keys p - window + 1 .. p) keeps all of this: tiles and parts stay
 * at their absolute positions, the first tile holding a window key is the first one attended, and the keys
 * before the window in it are masked (probability 0) by attn_softmax_tile's ``lo``; parts before the window
 * are skipped (a part that sees no key folds as nothing). Soft-capped scores (attn_softcap) are capped
 * before the softmax by the same libm call in both kernels.
 * The AVX2 forms apply wherever the level is at least AVX2 and head_dim is a multiple of 8 (attn_vec_rows);
 * otherwise both kernels run the scalar ones.
 */
#ifndef TS_ATTN_ROWS_H
#define TS_ATTN_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"

#define ATTN_KEY_TILE 32  /* keys per tile of the online softmax */
#define ATTN_PART_KEYS 64 /* keys per part: a decode step may attend its parts on different threads */

/* Whether a row takes the AVX2 forms at ISA level `isa`. */
static inline int attn_vec_rows(int isa, int64_t head_dim) {
#ifdef TS_HAVE_AVX2
    return isa >= TS_ISA_AVX2 && head_dim % 8 == 0;
#else
    (void)isa;
    (void)head_dim;
    return 0;
#endif
}

/* The first key a query at position pos attends: pos - window + 1 for a sliding window (window > 0), else 0. */
static inline int64_t attn_window_first(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* s[j] = cap * tanh(s[j] / cap) for j < n when cap > 0 (soft-capped scores, as transformers' Gemma 2 computes
 * them). A scalar libm call, never vectorized, so both kernels get the same bits. */
static inline void attn_softcap(float *s, int64_t n, float cap) {
    if (cap > 0.0f)
        for (int64_t j = 0; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
}

/* One row's scores s[lo..n) of a tile (0 <= lo < n) as probabilities folded into its running max *m, sum *l
 * and output o (rescaled when the max grows); s[0 .. lo) (keys before a sliding window) and s[n ..
 * ATTN_KEY_TILE) become 0. */
static void attn_softmax_tile_scalar(float *s, int64_t lo, int64_t n, float *m, float *l, float *o, int64_t dim) {
    float mx = s[lo];
    for (int64_t j = lo + 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const float m_new = mx > *m ? mx : *m;
    const float alpha = *m == -INFINITY ? 0.0f : ts_exp(*m - m_new);
    float sum = 0.0f;
    for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
    for (int64_t j = lo; j < n; j++) {
        s[j] = ts_exp(s[j] - m_new);
        sum += s[j];
    }
    for (int64_t j = n; j < ATTN_KEY_TILE; j++) s[j] = 0.0f;
    if (alpha != 1.0f)
        for (int64_t d = 0; d < dim; d++) o[d] *= alpha;
    *l = *l * alpha + sum;
    *m = m_new;
}

#ifdef TS_HAVE_AVX2
/* As attn_softmax_tile_scalar in vectors of 8 (head_dim a multiple of 8). */
static void attn_softmax_tile_avx2(float *s, int64_t lo, int64_t n, float *m, float *l, float *o, int64_t dim) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 count = _mm256_set1_ps((float)n), start = _mm256_set1_ps((float)lo);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
#define ATTN_KEEP(j)                                                                                   \
    _mm256_and_ps(_mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)(j))), count, _CMP_LT_OQ), \
                  _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)(j))), start, _CMP_GE_OQ))
    for (int64_t j = 0; j < ATTN_KEY_TILE; j += 8) {
        const __m256 keep = ATTN_KEEP(j);
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), keep));
    }
    const float mx = ts_hmax256(vmax);
    const float m_new = mx > *m ? mx : *m;
    const float alpha = *m == -INFINITY ? 0.0f : ts_exp(*m - m_new);
    const __m256 bm = _mm256_set1_ps(m_new);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < ATTN_KEY_TILE; j += 8) {
        const __m256 keep = ATTN_KEEP(j);
        const __m256 e = _mm256_and_ps(ts_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), bm)), keep);
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (alpha != 1.0f) {
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
    }
    *l = *l * alpha + ts_hsum256(vsum);
    *m = m_new;
#undef ATTN_KEEP
}
#endif

static inline void attn_softmax_tile(int vec, float *s, int64_t lo, int64_t n, float *m, float *l, float *o,
                                     int64_t dim) {
#ifdef TS_HAVE_AVX2
    if (vec) {
        attn_softmax_tile_avx2(s, lo, n, m, l, o, dim);
        return;
    }
#endif
    (void)vec;
    attn_softmax_tile_scalar(s, lo, n, m, l, o, dim);
}

/* Folds one part's state (m, l, o) into the state of the parts before it (*M, *L, O), in key order. A part
 * that saw no key (l == 0) leaves it as it is; the first part that did is taken as it is. Elementwise
 * products and sums, so its vector and scalar forms agree. */
static inline void attn_fold_part(float *M, float *L, float *O, float m, float l, const float *o, int64_t dim) {
    if (l == 0.0f) return;
    if (*L == 0.0f) {
        *M = m;
        *L = l;
        memcpy(O, o, (size_t)dim * sizeof(float));
        return;
    }
    const float mn = m > *M ? m : *M;
    const float a = ts_exp(*M - mn), b = ts_exp(m - mn);
    *L = *L * a + l * b;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) O[d] = O[d] * a + o[d] * b;
    *M = mn;
}

#ifdef TS_HAVE_AVX512
/* The sum of a tile's ATTN_KEY_TILE probabilities in the AVX-512 forms, by one fixed tree: key j + 16 to key
 * j, then j + 8, j + 4, j + 2, j + 1. Prefill holds 16 query rows per vector (attn_tile_sum_rows512: keys are
 * rows of st, ``stride`` floats apart, every key up to the tile's 32 written, 0 where a row does not see
 * it); decode holds 16 keys per vector (attn_tile_sum_keys512: keys 0-15 in p0, 16-31 in p1). The same adds
 * of the same operands, so a row's sum has the same bits in both. */
TS_ALWAYS_INLINE __m512 attn_tile_sum_rows512(const float *st, int64_t stride) {
    __m512 t[16];
    for (int j = 0; j < 16; j++) t[j] = _mm512_add_ps(_mm512_loadu_ps(st + j * stride), _mm512_loadu_ps(st + (j + 16) * stride));
    for (int j = 0; j < 8; j++) t[j] = _mm512_add_ps(t[j], t[j + 8]);
    for (int j = 0; j < 4; j++) t[j] = _mm512_add_ps(t[j], t[j + 4]);
    for (int j = 0; j < 2; j++) t[j] = _mm512_add_ps(t[j], t[j + 2]);
    return _mm512_add_ps(t[0], t[1]);
}

TS_ALWAYS_INLINE float attn_tile_sum_keys512(__m512 p0, __m512 p1) {
    const __m512 t16 = _mm512_add_ps(p0, p1);
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(t16), _mm512_extractf32x8_ps(t16, 1));
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
#endif

#endif /* TS_ATTN_ROWS_H */
