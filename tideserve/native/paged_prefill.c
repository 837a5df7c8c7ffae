/* Prefill attention on CPU: causal, grouped-query, read from the paged KV cache in place.
 *
 * Why a kernel of our own: torch's CPU flash attention runs a 305-token prompt's heads at 13-25 GFLOPS
 * here, a third of a prefill's time on a 135M model (docs/benchmarks.md), and with a cached
 * prefix it needs the context gathered into a contiguous copy first. Here each work item is a handful
 * of consecutive query tokens times the query heads of one KV head (so grouped-query heads share every
 * key and value read), walking the keys a tile at a time with an online softmax (flash attention's
 * recurrence), and reading each key and value where it lies: in the paged cache (any of its dtypes), or
 * in the step's own fused qkv rows when the caller passes those with a block size of 1.
 *
 * Layouts (all contiguous in their last dimension):
 *   q          [tokens, num_heads, head_dim], float32 or bfloat16, rows q_stride elements apart
 *   k/v        slots of [num_kv_heads, head_dim], kv_stride elements apart (a contiguous cache
 *              [num_blocks, block_size, num_kv_heads, head_dim] has kv_stride = num_kv_heads * head_dim),
 *              float32, bfloat16 or float8 e4m3
 *   tables     [num_spans, table_width] int64: span s's key at position p lies in slot
 *              tables[s][p / block_size] * block_size + p % block_size
 *   query_start, query_lens [num_spans] int64: span s's query tokens are rows query_start[s] ..
 *              query_start[s] + query_lens[s] - 1
 *   computed   [num_spans] int64: the position of span s's first query token (keys before it are the
 *              cached prefix); query i of span s attends keys 0 .. computed[s] + i, or, with a sliding
 *              window W > 0, keys computed[s] + i - W + 1 .. computed[s] + i (attn_rows.h)
 *   out        [tokens, num_heads, head_dim], float32 or bfloat16, rows out_stride elements apart
 *
 * Arithmetic is float32 (inputs widen exactly, convert_vec.h; a bfloat16 output is rounded once). Paths: scalar
 * reference; AVX2 + FMA (head_dim a multiple of 8), rows by keys with the dot products summed across
 * lanes; AVX-512, which turns the item around: a vector holds one element of 16 query rows, so a tile's
 * scores are broadcast keys times transposed queries with no horizontal sums, the online softmax runs on
 * whole vectors of rows, and the values go through the same way (any head_dim); AMX (bfloat16 caches,
 * head_dim a multiple of 32), the AVX-512 form with both products on tiles: scores transposed as
 * keys times the queries' bfloat16 pairs, which lands them in the AVX-512 form's layout for the same online
 * softmax, and outputs transposed as the values' key pairs times the probabilities rounded to bfloat16. A
 * float32 or fp8 cache keeps the AVX-512 form. The bfloat16 forms first pack each span's keys and values
 * into the tiles' order, once per call, and every work item reads them there.
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

#if defined(TS_HAVE_AMX) || defined(TS_HAVE_AVX512BF16)
#define TS_PREFILL_PAIRS 1 /* the bfloat16 forms (AMX tiles, vdpbf16ps) and their packing */
#endif

#define KEY_TILE ATTN_KEY_TILE /* keys per tile (attn_rows.h): its scores stay in L1 next to its widened K/V */
#define ROWS_PER_ITEM 32 /* query rows (tokens x grouped heads) per work item */
#define LANE_ROWS 32     /* query rows per pass of the AVX-512 path: two vectors of 16 */
#define KEY_BLOCK 8      /* keys whose scores the AVX-512 path accumulates at once (16 of 32 registers) */

typedef struct {
    const void *q;
    int64_t q_stride;
    int q_dtype;
    const void *k, *v;
    int kv_dtype;
    int64_t kv_stride;
    const int64_t *tables;
    int64_t table_width, block_size;
    const int64_t *query_start, *query_lens, *computed;
    void *out;
    int64_t out_stride;
    int out_dtype;
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
    int64_t window; /* keys a query attends, itself included; 0: all before it */
    float softcap;  /* scores capped to softcap * tanh(s / softcap) when > 0 */
} prefill_args;

/* One thread's working set for one work item. */
typedef struct {
    float *q;       /* [rows][head_dim], scaled queries */
    float *o;       /* [rows][head_dim], unnormalised outputs over the current part's keys */
    float *s;       /* [rows][KEY_TILE], scores, then probabilities */
    float *m, *l;   /* [rows], running max and sum over the current part's keys */
    float *po;      /* [rows][head_dim], the unnormalised outputs of the parts before it, folded */
    float *pm, *pl; /* [rows], their max and sum */
    int64_t *valid; /* [rows], keys of the current tile each row may see */
    float *kw, *vw; /* [KEY_TILE][head_dim], widened keys and values (caches not in float32) */
    const float *krow[KEY_TILE + KEY_BLOCK], *vrow[KEY_TILE + KEY_BLOCK];
    /* The AVX-512 path's, transposed: element d of LANE_ROWS rows side by side. */
    float *qt, *ot; /* [head_dim][LANE_ROWS], scaled queries and unnormalised outputs */
    float *st;      /* [KEY_TILE + KEY_BLOCK][LANE_ROWS], scores, then probabilities */
    float *rows;    /* [LANE_ROWS][head_dim], the rows of qt or ot untransposed */
    /* The AMX path's, bfloat16 (pairs of it as uint32 where a tile wants them): */
    uint16_t *kb, *vb; /* [KEY_TILE][head_dim], the tile's keys and values */
    const uint16_t *ktile; /* the keys the products read: kb, or the call's packed keys (ts_paged_prefill) */
    const uint32_t *vtile; /* the values' A tiles the products read: vt, or the call's packed ones */
    const uint16_t *packed_k;  /* this item's KV head's keys, packed for the whole span, or NULL */
    const uint32_t *packed_vt; /* and its values' A tiles */
    uint32_t *qb;      /* B tiles of the queries: [LANE_ROWS / 16][head_dim / 32][16][16] */
    uint32_t *vt;      /* A tiles of the values transposed: [head_dim / 16][16][16] */
    uint32_t *pb;      /* B tiles of the probabilities: [LANE_ROWS / 16][16][16] */
    uint32_t *pairs;   /* [16][max(head_dim / 2, 16)], rows on their way into a tile's order */
} scratch;

static float load_elem(const void *p, int dtype, int64_t i) {
    if (dtype == TS_DTYPE_F32) return ((const float *)p)[i];
    if (dtype == TS_DTYPE_BF16) return ts_bf16_to_f32(((const uint16_t *)p)[i]);
    return ts_fp8_to_f32(((const uint8_t *)p)[i]);
}

static void widen_row_scalar(const void *src, int dtype, float *dst, int64_t n) {
    for (int64_t d = 0; d < n; d++) dst[d] = load_elem(src, dtype, d);
}

#define TSV_BODY "convert_vec.h"
#include "ts_vec_each.h"
#undef TSV_BODY

/* dst[0..n) = src[offset ..] widened to float32. */
static void widen(int isa, const void *src, int dtype, int64_t offset, float *dst, int64_t n) {
    if (dtype == TS_DTYPE_F32) { /* a float32 model's queries: a copy (element by element it was 8% of the kernel) */
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
        return;
    }
    const void *at = dtype == TS_DTYPE_BF16 ? (const void *)((const uint16_t *)src + offset)
                                            : (const void *)((const uint8_t *)src + offset);
    TSV_CALL(isa, widen_row, at, dtype, dst, n);
}

/* Where key (and value) position p of KV head g starts in k and v, in elements. */
static inline int64_t key_offset(const prefill_args *a, const int64_t *table, int64_t g, int64_t p) {
    return (table[p / a->block_size] * a->block_size + p % a->block_size) * a->kv_stride + g * a->head_dim;
}

/* w->krow[j], w->vrow[j] = float32 rows of key and value kb + j (j < nk) of KV head g: in the cache itself
 * when it holds float32, else widened into w->kw / w->vw. */
static void point_tile_rows(const prefill_args *a, int isa, scratch *w, const int64_t *table, int64_t g, int64_t kb,
                            int64_t nk) {
    const int64_t dim = a->head_dim;
    for (int64_t j = 0; j < nk; j++) {
        const int64_t at = key_offset(a, table, g, kb + j);
        if (a->kv_dtype == TS_DTYPE_F32) {
            w->krow[j] = (const float *)a->k + at;
            w->vrow[j] = (const float *)a->v + at;
        } else {
            widen(isa, a->k, a->kv_dtype, at, w->kw + j * dim, dim);
            widen(isa, a->v, a->kv_dtype, at, w->vw + j * dim, dim);
            w->krow[j] = w->kw + j * dim;
            w->vrow[j] = w->vw + j * dim;
        }
    }
}

/* s[r][j] = q[r] . krow[j] for j < nk. */
static void scores_scalar(const float *q, int64_t rows, int64_t dim, const float *const *krow, int64_t nk, float *s) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nk; j++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < dim; d++) acc += q[r * dim + d] * krow[j][d];
            s[r * KEY_TILE + j] = acc;
        }
}

/* o[r] += sum_j s[r][j] * vrow[j] over each row's valid keys. */
static void pv_scalar(const float *s, const int64_t *valid, int64_t rows, int64_t dim, const float *const *vrow,
                      float *o) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < valid[r]; j++) {
            const float p = s[r * KEY_TILE + j];
            for (int64_t d = 0; d < dim; d++) o[r * dim + d] += p * vrow[j][d];
        }
}

#ifdef TS_HAVE_AVX2
/* acc[0..4) += x0 * y[0..4), acc[4..8) += x1 * y[0..4): two rows against four vectors, the shape both
 * products of a tile take (rows x keys for the scores, rows x columns for the values). */
TS_ALWAYS_INLINE void fma_2x4(__m256 x0, __m256 x1, const __m256 y[4], __m256 acc[8]) {
    for (int i = 0; i < 4; i++) {
        acc[i] = _mm256_fmadd_ps(x0, y[i], acc[i]);
        acc[4 + i] = _mm256_fmadd_ps(x1, y[i], acc[4 + i]);
    }
}

/* As scores_scalar, two rows by four keys at a time; nk a multiple of 4 (padding keys point at real rows). */
static void scores_avx2(const float *q, int64_t rows, int64_t dim, const float *const *krow, int64_t nk, float *s) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
        const float *q0 = q + r * dim, *q1 = q0 + dim;
        for (int64_t j = 0; j < nk; j += 4) {
            const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 y[4] = {_mm256_loadu_ps(k0 + d), _mm256_loadu_ps(k1 + d), _mm256_loadu_ps(k2 + d),
                                     _mm256_loadu_ps(k3 + d)};
                fma_2x4(_mm256_loadu_ps(q0 + d), _mm256_loadu_ps(q1 + d), y, acc);
            }
            _mm_storeu_ps(s + r * KEY_TILE + j, tsv_avx2_hsums(acc));
            _mm_storeu_ps(s + (r + 1) * KEY_TILE + j, tsv_avx2_hsums(acc + 4));
        }
    }
    for (; r < rows; r++) {
        const float *q0 = q + r * dim;
        for (int64_t j = 0; j < nk; j += 4) {
            const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 x0 = _mm256_loadu_ps(q0 + d);
                a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k3 + d), a3);
            }
            _mm_storeu_ps(s + r * KEY_TILE + j, tsv_avx2_hsums((const __m256[4]){a0, a1, a2, a3}));
        }
    }
}

/* As pv_scalar, two rows by 32 (then 8) output columns at a time. Probabilities past a row's valid
 * keys are 0, so a pair runs to the longer of its two rows. */
static void pv_avx2(const float *s, const int64_t *valid, int64_t rows, int64_t dim, const float *const *vrow,
                    float *o) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
        const int64_t nj = valid[r] > valid[r + 1] ? valid[r] : valid[r + 1];
        const float *p0 = s + r * KEY_TILE, *p1 = p0 + KEY_TILE;
        float *o0 = o + r * dim, *o1 = o0 + dim;
        int64_t d = 0;
        for (; d + 32 <= dim; d += 32) {
            __m256 acc[8];
            for (int i = 0; i < 4; i++) {
                acc[i] = _mm256_loadu_ps(o0 + d + 8 * i);
                acc[4 + i] = _mm256_loadu_ps(o1 + d + 8 * i);
            }
            for (int64_t j = 0; j < nj; j++) {
                const float *vj = vrow[j] + d;
                const __m256 y[4] = {_mm256_loadu_ps(vj), _mm256_loadu_ps(vj + 8), _mm256_loadu_ps(vj + 16),
                                     _mm256_loadu_ps(vj + 24)};
                fma_2x4(_mm256_broadcast_ss(p0 + j), _mm256_broadcast_ss(p1 + j), y, acc);
            }
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(o0 + d + 8 * i, acc[i]);
                _mm256_storeu_ps(o1 + d + 8 * i, acc[4 + i]);
            }
        }
        for (; d < dim; d += 8) {
            __m256 a0 = _mm256_loadu_ps(o0 + d), b0 = _mm256_loadu_ps(o1 + d);
            for (int64_t j = 0; j < nj; j++) {
                const __m256 y0 = _mm256_loadu_ps(vrow[j] + d);
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), y0, a0);
                b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), y0, b0);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o1 + d, b0);
        }
    }
    for (; r < rows; r++) {
        const float *p0 = s + r * KEY_TILE;
        float *o0 = o + r * dim;
        for (int64_t d = 0; d < dim; d += 8) {
            __m256 a0 = _mm256_loadu_ps(o0 + d);
            for (int64_t j = 0; j < valid[r]; j++)
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), _mm256_loadu_ps(vrow[j] + d), a0);
            _mm256_storeu_ps(o0 + d, a0);
        }
    }
}
#endif /* TS_HAVE_AVX2 */

#ifdef TS_HAVE_AVX512
/* st[j] = the scores of key j against the LANE_ROWS rows of qt, for j < nk rounded up to KEY_BLOCK
 * (padding keys point at real rows; their scores are never read). */
static void scores_avx512(const float *qt, int64_t dim, const float *const *krow, int64_t nk, float *st) {
    for (int64_t j = 0; j < nk; j += KEY_BLOCK) {
        const float *k[KEY_BLOCK];
        __m512 acc[2 * KEY_BLOCK];
        for (int i = 0; i < KEY_BLOCK; i++) {
            k[i] = krow[j + i];
            acc[2 * i] = acc[2 * i + 1] = _mm512_setzero_ps();
        }
        for (int64_t d = 0; d < dim; d++) {
            const __m512 q0 = _mm512_loadu_ps(qt + d * LANE_ROWS), q1 = _mm512_loadu_ps(qt + d * LANE_ROWS + 16);
            for (int i = 0; i < KEY_BLOCK; i++) {
                const __m512 kd = _mm512_set1_ps(k[i][d]);
                acc[2 * i] = _mm512_fmadd_ps(kd, q0, acc[2 * i]);
                acc[2 * i + 1] = _mm512_fmadd_ps(kd, q1, acc[2 * i + 1]);
            }
        }
        for (int i = 0; i < KEY_BLOCK; i++) {
            _mm512_storeu_ps(st + (j + i) * LANE_ROWS, acc[2 * i]);
            _mm512_storeu_ps(st + (j + i) * LANE_ROWS + 16, acc[2 * i + 1]);
        }
    }
}

/* ot[d] = ot[d] * alpha + sum_j st[j] * vrow[j][d]: eight columns of both row vectors at a time. */
static void pv_avx512(const float *st, int64_t nk, int64_t dim, const float *const *vrow, __m512 alpha0,
                      __m512 alpha1, float *ot) {
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        __m512 acc[16];
        for (int i = 0; i < 8; i++) {
            acc[2 * i] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + i) * LANE_ROWS), alpha0);
            acc[2 * i + 1] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + i) * LANE_ROWS + 16), alpha1);
        }
        for (int64_t j = 0; j < nk; j++) {
            const __m512 p0 = _mm512_loadu_ps(st + j * LANE_ROWS), p1 = _mm512_loadu_ps(st + j * LANE_ROWS + 16);
            const float *vj = vrow[j] + d;
            for (int i = 0; i < 8; i++) {
                const __m512 vd = _mm512_set1_ps(vj[i]);
                acc[2 * i] = _mm512_fmadd_ps(vd, p0, acc[2 * i]);
                acc[2 * i + 1] = _mm512_fmadd_ps(vd, p1, acc[2 * i + 1]);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(ot + (d + i) * LANE_ROWS, acc[2 * i]);
            _mm512_storeu_ps(ot + (d + i) * LANE_ROWS + 16, acc[2 * i + 1]);
        }
    }
    for (; d < dim; d++) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(ot + d * LANE_ROWS), alpha0);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(ot + d * LANE_ROWS + 16), alpha1);
        for (int64_t j = 0; j < nk; j++) {
            const __m512 vd = _mm512_set1_ps(vrow[j][d]);
            a0 = _mm512_fmadd_ps(vd, _mm512_loadu_ps(st + j * LANE_ROWS), a0);
            a1 = _mm512_fmadd_ps(vd, _mm512_loadu_ps(st + j * LANE_ROWS + 16), a1);
        }
        _mm512_storeu_ps(ot + d * LANE_ROWS, a0);
        _mm512_storeu_ps(ot + d * LANE_ROWS + 16, a1);
    }
}

#ifdef TS_PREFILL_PAIRS
/* The scaled float32 query rows of w->rows (empty lanes zero) as B tiles: tile (qg, ks) row p holds the
 * bfloat16 pairs (q[16 qg + m][32 ks + 2p], q[16 qg + m][32 ks + 2p + 1]) for its 16 rows m, which is the
 * rows' pairs transposed. */
static void pack_queries_amx(scratch *w, int64_t dim, int64_t groups) {
    const int64_t half = dim / 2, ksteps = dim / 32;
    for (int64_t qg = 0; qg < groups; qg++) {
        for (int64_t m = 0; m < 16; m++) {
            const float *src = w->rows + (qg * 16 + m) * dim;
            for (int64_t d = 0; d < dim; d += 32)
                _mm512_storeu_si512(w->pairs + m * half + d / 2, (__m512i)_mm512_cvtne2ps_pbh(
                                        _mm512_loadu_ps(src + d + 16), _mm512_loadu_ps(src + d)));
        }
        for (int64_t ks = 0; ks < ksteps; ks++)
            ts_transpose16x16((const float *)(w->pairs + ks * 16), half, (float *)(w->qb + (qg * ksteps + ks) * 256),
                              16);
    }
}

/* Keys and values kb .. kb + nk - 1 of KV head g (a bfloat16 cache) as rows of ``keys`` and w->vb (rows nk ..
 * KEY_TILE zero), and the values as A tiles of V^T in ``vt``: tile c row d holds (v[2r][16c + d], v[2r + 1][16c +
 * d]) for r < 16, which is the values' key pairs transposed. */
static void gather_tile_amx_into(const prefill_args *a, scratch *w, const int64_t *table, int64_t g, int64_t kb,
                                 int64_t nk, uint16_t *keys, uint32_t *vt) {
    const int64_t dim = a->head_dim;
    for (int64_t j = 0; j < KEY_TILE; j++) {
        uint16_t *kd = keys + j * dim, *vd = w->vb + j * dim;
        if (j >= nk) {
            memset(kd, 0, (size_t)dim * sizeof(uint16_t));
            memset(vd, 0, (size_t)dim * sizeof(uint16_t));
            continue;
        }
        const int64_t at = key_offset(a, table, g, kb + j);
        const uint16_t *ks = (const uint16_t *)a->k + at, *vs = (const uint16_t *)a->v + at;
        for (int64_t d = 0; d < dim; d += 32) { /* 64 bytes at a time: a call to memcpy per row was 7% of the samples */
            _mm512_storeu_si512(kd + d, _mm512_loadu_si512(ks + d));
            _mm512_storeu_si512(vd + d, _mm512_loadu_si512(vs + d));
        }
    }
    for (int64_t c = 0; c < dim / 16; c++) {
        for (int64_t r = 0; r < 16; r++) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w->vb + 2 * r * dim + 16 * c)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w->vb + (2 * r + 1) * dim + 16 * c)));
            _mm512_storeu_si512(w->pairs + r * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        ts_transpose16x16((const float *)w->pairs, 16, (float *)(vt + c * 256), 16);
    }
}

/* The tile of keys kb .. kb + nk - 1 for the products: from the call's packed keys and values when there
 * are, else gathered into the item's scratch. */
static void gather_tile_amx(const prefill_args *a, scratch *w, const int64_t *table, int64_t g, int64_t kb,
                            int64_t nk) {
    if (w->packed_k != NULL) {
        w->ktile = w->packed_k + kb * a->head_dim;
        w->vtile = w->packed_vt + (kb / KEY_TILE) * (a->head_dim / 16) * 256;
        return;
    }
    gather_tile_amx_into(a, w, table, g, kb, nk, w->kb, w->vt);
    w->ktile = w->kb;
    w->vtile = w->vt;
}

/* The probabilities of keys 0 .. nk - 1 (zero past them, up to the tile's 32) rounded to bfloat16 pairs of
 * keys: w->pb[qg][r][m] = (p[2r][16 qg + m], p[2r + 1][16 qg + m]). */
static void pack_probabilities_bf16(scratch *w, int64_t groups, int64_t nk) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_loadu_si512(interleave);
    for (int64_t qg = 0; qg < groups; qg++)
        for (int64_t r = 0; r < 16; r++) {
            const __m512 x = 2 * r < nk ? _mm512_loadu_ps(w->st + 2 * r * LANE_ROWS + 16 * qg) : _mm512_setzero_ps();
            const __m512 y = 2 * r + 1 < nk ? _mm512_loadu_ps(w->st + (2 * r + 1) * LANE_ROWS + 16 * qg) : _mm512_setzero_ps();
            _mm512_storeu_si512(w->pb + qg * 256 + r * 16,
                                _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(y, x)));
        }
}

#ifdef TS_HAVE_AVX512BF16
/* Where the vdpbf16ps form runs: as the AMX form (a bfloat16 cache, head_dim a multiple of 32), on
 * AVX-512 BF16 CPUs without AMX tiles: the same packed queries, keys, values and probabilities, each
 * product a vdpbf16ps of a broadcast key (or value) pair against 16 rows' pairs. Half the instructions of
 * the float32 form's multiply-adds, with the AMX form's rounding (docs/benchmarks.md). */
static int dpbf16_form(const prefill_args *a, int isa) {
    return isa >= TS_ISA_AVX512_BF16 && a->kv_dtype == TS_DTYPE_BF16 && a->head_dim % 32 == 0;
}

/* st[j][16 qg + m] = k[j] . q[16 qg + m] for the tile's keys (8 at a time; past nk they are zero rows), in
 * the layout scores_avx512 writes. */
static void scores_dpbf16(scratch *w, int64_t dim, int64_t groups, int64_t nk) {
    const int64_t half = dim / 2, ksteps = dim / 32;
    for (int64_t j0 = 0; j0 < nk; j0 += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t pr = 0; pr < half; pr++) {
            const int64_t at = (pr / 16) * 256 + (pr % 16) * 16;
            const __m512bh q0 = (__m512bh)_mm512_loadu_si512(w->qb + at);
            const __m512bh q1 = (__m512bh)_mm512_loadu_si512(w->qb + (groups > 1 ? ksteps * 256 : 0) + at);
            for (int i = 0; i < 8; i++) {
                int32_t pair;
                memcpy(&pair, w->ktile + (j0 + i) * dim + 2 * pr, sizeof pair);
                const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], q0, kp);
                if (groups > 1) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], q1, kp);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(w->st + (j0 + i) * LANE_ROWS, acc[i][0]);
            if (groups > 1) _mm512_storeu_ps(w->st + (j0 + i) * LANE_ROWS + 16, acc[i][1]);
        }
    }
}

/* As pv_avx512 over the probabilities rounded to bfloat16 pairs of keys (w->pb) and the values' key pairs
 * (w->vt), eight output columns of both row vectors at a time. */
static void pv_dpbf16(scratch *w, int64_t dim, int64_t groups, int64_t nk, __m512 alpha0, __m512 alpha1) {
    pack_probabilities_bf16(w, groups, nk);
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) {
            float *od = w->ot + (d0 + i) * LANE_ROWS;
            acc[i][0] = _mm512_mul_ps(_mm512_loadu_ps(od), alpha0);
            acc[i][1] = groups > 1 ? _mm512_mul_ps(_mm512_loadu_ps(od + 16), alpha1) : _mm512_setzero_ps();
        }
        const uint32_t *vt = w->vtile + (d0 / 16) * 256 + (d0 % 16) * 16; /* column d0 + i, key pair r: vt[16 i + r] */
        for (int64_t r = 0; r < pairs; r++) {
            const __m512bh p0 = (__m512bh)_mm512_loadu_si512(w->pb + r * 16);
            const __m512bh p1 = (__m512bh)_mm512_loadu_si512(w->pb + (groups > 1 ? 256 : 0) + r * 16);
            for (int i = 0; i < 8; i++) {
                const __m512bh vp = (__m512bh)_mm512_set1_epi32((int32_t)vt[16 * i + r]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p0, vp);
                if (groups > 1) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p1, vp);
            }
        }
        for (int i = 0; i < 8; i++) {
            float *od = w->ot + (d0 + i) * LANE_ROWS;
            _mm512_storeu_ps(od, acc[i][0]);
            if (groups > 1) _mm512_storeu_ps(od + 16, acc[i][1]);
        }
    }
}

#endif /* TS_HAVE_AVX512BF16 */
#endif /* TS_PREFILL_PAIRS */

#ifdef TS_HAVE_AMX
/* Where the AMX form runs: bfloat16 caches (rounding the queries and probabilities to bfloat16 adds an
 * error of the cache's own size; a float32 cache keeps the AVX-512 form's float32 arithmetic, and an fp8
 * cache too: widening its codes to bfloat16 cost what the tiles saved, measured), head_dim a multiple of a
 * tile row's 32 values. */
static int amx_form(const prefill_args *a, int isa) {
    return isa >= TS_ISA_AMX && a->kv_dtype == TS_DTYPE_BF16 && a->head_dim % 32 == 0;
}

/* st[j][16 qg + m] = k[j] . q[16 qg + m] for the tile's keys, 16 keys by 16 rows per tile product (tiles 0:
 * keys, 1-2: queries, 4-5: scores), in the layout scores_avx512 writes. */
static void scores_amx(scratch *w, int64_t dim, int64_t groups, int64_t nk) {
    const int64_t ksteps = dim / 32;
    for (int64_t kg = 0; kg * 16 < nk; kg++) {
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            _tile_loadd(0, w->ktile + kg * 16 * dim + 32 * ks, dim * (int64_t)sizeof(uint16_t));
            _tile_loadd(1, w->qb + ks * 256, 64);
            _tile_dpbf16ps(4, 0, 1);
            if (groups > 1) {
                _tile_loadd(2, w->qb + (ksteps + ks) * 256, 64);
                _tile_dpbf16ps(5, 0, 2);
            }
        }
        _tile_stored(4, w->st + kg * 16 * LANE_ROWS, LANE_ROWS * (int64_t)sizeof(float));
        if (groups > 1) _tile_stored(5, w->st + kg * 16 * LANE_ROWS + 16, LANE_ROWS * (int64_t)sizeof(float));
    }
}

/* As pv_avx512: ot = ot * alpha + V^T P^T over the tile's keys (tiles 3: V^T, 6-7: probabilities, 4-5: ot),
 * the probabilities of keys 0 .. nk - 1 (zero past them) rounded to bfloat16 pairs of keys. */
static void pv_amx(scratch *w, int64_t dim, int64_t groups, int64_t nk, __m512 alpha0, __m512 alpha1) {
    pack_probabilities_bf16(w, groups, nk);
    const __m512 one = _mm512_set1_ps(1.0f);
    if (_mm512_cmp_ps_mask(alpha0, one, _CMP_NEQ_UQ) || (groups > 1 && _mm512_cmp_ps_mask(alpha1, one, _CMP_NEQ_UQ)))
        for (int64_t d = 0; d < dim; d++) {
            float *od = w->ot + d * LANE_ROWS;
            _mm512_storeu_ps(od, _mm512_mul_ps(_mm512_loadu_ps(od), alpha0));
            if (groups > 1) _mm512_storeu_ps(od + 16, _mm512_mul_ps(_mm512_loadu_ps(od + 16), alpha1));
        }
    _tile_loadd(6, w->pb, 64);
    if (groups > 1) _tile_loadd(7, w->pb + 256, 64);
    const int64_t stride = LANE_ROWS * (int64_t)sizeof(float);
    for (int64_t c = 0; c < dim / 16; c++) {
        float *oc = w->ot + 16 * c * LANE_ROWS;
        _tile_loadd(3, w->vtile + c * 256, 64);
        _tile_loadd(4, oc, stride);
        _tile_dpbf16ps(4, 3, 6);
        _tile_stored(4, oc, stride);
        if (groups > 1) {
            _tile_loadd(5, oc + 16, stride);
            _tile_dpbf16ps(5, 3, 7);
            _tile_stored(5, oc + 16, stride);
        }
    }
}
#endif /* TS_HAVE_AMX */

#ifdef TS_PREFILL_PAIRS
/* Which form an item takes: 2 the AMX tiles, 1 vdpbf16ps, 0 the float32 form. */
static int pairs_form(const prefill_args *a, int isa) {
#ifdef TS_HAVE_AMX
    if (amx_form(a, isa)) return 2;
#endif
#ifdef TS_HAVE_AVX512BF16
    if (dpbf16_form(a, isa)) return 1;
#endif
    (void)a;
    (void)isa;
    return 0;
}
#endif

/* Rows r0 .. r0 + n - 1 (n <= LANE_ROWS) of the item of run_item, row r being token r / group of the item
 * and head r % group of KV head g; lanes n .. LANE_ROWS stay empty (zero queries, no key visible). */
static void run_rows_avx512(const prefill_args *a, int isa, scratch *w, int64_t span, int64_t g, int64_t first,
                            int64_t r0, int64_t n) {
    const int64_t dim = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t row0 = a->query_start[span] + first, pos0 = a->computed[span] + first;
    const int blocks16 = dim % 16 == 0; /* transpose 16 x 16 blocks in registers, else element by element */
#ifdef TS_PREFILL_PAIRS
    const int paired = pairs_form(a, isa);
    const int64_t groups = (n + 15) / 16; /* 16-row query tiles in use */
#endif
    int32_t sees[LANE_ROWS]; /* the last key position each lane's row attends; -1 for an empty lane */
    int32_t from[LANE_ROWS]; /* the first one (its sliding window's) */
    memset(w->ot, 0, (size_t)(dim * LANE_ROWS) * sizeof(float));
    for (int64_t i = 0; i < LANE_ROWS; i++) {
        float *qi = w->rows + i * dim;
        if (i >= n) {
            sees[i] = -1;
            from[i] = 0;
            memset(qi, 0, (size_t)dim * sizeof(float));
        } else {
            const int64_t r = r0 + i, t = r / group, h = r % group;
            sees[i] = (int32_t)(pos0 + t);
            from[i] = (int32_t)attn_window_first(pos0 + t, a->window);
            widen(isa, a->q, a->q_dtype, (row0 + t) * a->q_stride + (g * group + h) * dim, qi, dim);
            for (int64_t d = 0; d < dim; d++) qi[d] *= a->scale;
        }
        if (!blocks16)
            for (int64_t d = 0; d < dim; d++) w->qt[d * LANE_ROWS + i] = qi[d];
    }
#ifdef TS_PREFILL_PAIRS
    if (paired)
        pack_queries_amx(w, dim, groups);
    else
#endif
    if (blocks16)
        for (int64_t rb = 0; rb < LANE_ROWS; rb += 16)
            for (int64_t c = 0; c < dim; c += 16)
                ts_transpose16x16(w->rows + rb * dim + c, dim, w->qt + c * LANE_ROWS + rb, LANE_ROWS);
    const __m512i sees0 = _mm512_loadu_si512(sees), sees1 = _mm512_loadu_si512(sees + 16);
    const __m512i from0 = _mm512_loadu_si512(from), from1 = _mm512_loadu_si512(from + 16);
    /* a finite floor, so an empty lane's alpha is exp(0) rather than exp(-inf - -inf) */
    __m512 m0 = _mm512_set1_ps(-FLT_MAX), m1 = m0, l0 = _mm512_setzero_ps(), l1 = l0;
    const int64_t *table = a->tables + span * a->table_width;
    const int64_t last = pos0 + (r0 + n - 1) / group; /* the last key the last row sees */
    const int64_t from_key = attn_window_first(pos0 + r0 / group, a->window); /* the first key the first row sees */
    for (int64_t kb = from_key / KEY_TILE * KEY_TILE; kb <= last; kb += KEY_TILE) {
        const int64_t nk = last - kb + 1 < KEY_TILE ? last - kb + 1 : KEY_TILE;
#ifdef TS_PREFILL_PAIRS
        if (paired) {
            gather_tile_amx(a, w, table, g, kb, nk);
#ifdef TS_HAVE_AMX
            if (paired == 2) scores_amx(w, dim, groups, nk);
#endif
#ifdef TS_HAVE_AVX512BF16
            if (paired == 1) scores_dpbf16(w, dim, groups, nk);
#endif
        } else
#endif
        {
            point_tile_rows(a, isa, w, table, g, kb, nk);
            for (int64_t j = nk; j < nk + KEY_BLOCK; j++) w->krow[j] = w->krow[0];
            scores_avx512(w->qt, dim, w->krow, nk, w->st);
        }
        if (a->softcap > 0.0f)
            for (int64_t j = 0; j < nk; j++) attn_softcap(w->st + j * LANE_ROWS, LANE_ROWS, a->softcap);
        __mmask16 see0[KEY_TILE], see1[KEY_TILE];
        __m512 mx0 = m0, mx1 = m1;
        for (int64_t j = 0; j < nk; j++) {
            const __m512i p = _mm512_set1_epi32((int32_t)(kb + j));
            see0[j] = _mm512_cmpge_epi32_mask(sees0, p) & _mm512_cmple_epi32_mask(from0, p);
            see1[j] = _mm512_cmpge_epi32_mask(sees1, p) & _mm512_cmple_epi32_mask(from1, p);
            mx0 = _mm512_mask_max_ps(mx0, see0[j], mx0, _mm512_loadu_ps(w->st + j * LANE_ROWS));
            mx1 = _mm512_mask_max_ps(mx1, see1[j], mx1, _mm512_loadu_ps(w->st + j * LANE_ROWS + 16));
        }
        const __m512 alpha0 = ts_exp512(_mm512_sub_ps(m0, mx0)), alpha1 = ts_exp512(_mm512_sub_ps(m1, mx1));
        for (int64_t j = 0; j < nk; j++) {
            float *sj = w->st + j * LANE_ROWS;
            _mm512_storeu_ps(sj, _mm512_maskz_mov_ps(see0[j], ts_exp512(_mm512_sub_ps(_mm512_loadu_ps(sj), mx0))));
            _mm512_storeu_ps(sj + 16, _mm512_maskz_mov_ps(see1[j], ts_exp512(_mm512_sub_ps(_mm512_loadu_ps(sj + 16), mx1))));
        }
        for (int64_t j = nk; j < KEY_TILE; j++) memset(w->st + j * LANE_ROWS, 0, LANE_ROWS * sizeof(float));
        /* the tile's sum by attn_rows.h's tree, which decode's dpbf16 form shares */
        l0 = _mm512_add_ps(_mm512_mul_ps(l0, alpha0), attn_tile_sum_rows512(w->st, LANE_ROWS));
        l1 = _mm512_add_ps(_mm512_mul_ps(l1, alpha1), attn_tile_sum_rows512(w->st + 16, LANE_ROWS));
        m0 = mx0;
        m1 = mx1;
#ifdef TS_HAVE_AMX
        if (paired == 2)
            pv_amx(w, dim, groups, nk, alpha0, alpha1);
        else
#endif
#ifdef TS_HAVE_AVX512BF16
        if (paired == 1)
            pv_dpbf16(w, dim, groups, nk, alpha0, alpha1);
        else
#endif
            pv_avx512(w->st, nk, dim, w->vrow, alpha0, alpha1, w->ot);
    }
    /* normalise (an empty lane's 1 / 0 is never written out), then back to one row per query */
    const __m512 inv0 = _mm512_div_ps(_mm512_set1_ps(1.0f), l0), inv1 = _mm512_div_ps(_mm512_set1_ps(1.0f), l1);
    for (int64_t d = 0; d < dim; d++) {
        _mm512_storeu_ps(w->ot + d * LANE_ROWS, _mm512_mul_ps(_mm512_loadu_ps(w->ot + d * LANE_ROWS), inv0));
        _mm512_storeu_ps(w->ot + d * LANE_ROWS + 16, _mm512_mul_ps(_mm512_loadu_ps(w->ot + d * LANE_ROWS + 16), inv1));
    }
    if (blocks16)
        for (int64_t rb = 0; rb < n; rb += 16)
            for (int64_t c = 0; c < dim; c += 16)
                ts_transpose16x16(w->ot + c * LANE_ROWS + rb, LANE_ROWS, w->rows + rb * dim + c, dim);
    else
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < dim; d++) w->rows[i * dim + d] = w->ot[d * LANE_ROWS + i];
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = r0 + i, t = r / group, h = r % group;
        const int64_t at = (row0 + t) * a->out_stride + (g * group + h) * dim;
        const float *src = w->rows + i * dim;
        if (a->out_dtype == TS_DTYPE_F32) {
            memcpy((float *)a->out + at, src, (size_t)dim * sizeof(float));
        } else {
            narrow_row_avx512(src, (uint16_t *)a->out + at, TS_DTYPE_BF16, dim);
        }
    }
}
#endif /* TS_HAVE_AVX512 */

/* An empty current part for the item's rows. */
static void start_part(scratch *w, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, (size_t)(rows * dim) * sizeof(float));
}

/* The current part folded into the parts before it, row by row (attn_rows.h). */
static void fold_part(scratch *w, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++)
        attn_fold_part(w->pm + r, w->pl + r, w->po + r * dim, w->m[r], w->l[r], w->o + r * dim, dim);
}

/* Query tokens first .. first + count of span `span`, heads of KV head `g`: rows (token, grouped head). The
 * float32 form of attn_rows.h (scalar, AVX2) below; from AVX-512 up, run_rows_avx512. */
static void run_item(const prefill_args *a, int isa, scratch *w, int64_t span, int64_t g, int64_t first,
                     int64_t count) {
    const int64_t dim = a->head_dim, group = a->num_heads / a->num_kv_heads, rows = count * group;
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512) {
        for (int64_t r0 = 0; r0 < rows; r0 += LANE_ROWS)
            run_rows_avx512(a, isa, w, span, g, first, r0, rows - r0 < LANE_ROWS ? rows - r0 : LANE_ROWS);
        return;
    }
#endif
    const int64_t row0 = a->query_start[span] + first, pos0 = a->computed[span] + first;
    for (int64_t t = 0; t < count; t++)
        for (int64_t h = 0; h < group; h++) {
            float *dst = w->q + (t * group + h) * dim;
            widen(isa, a->q, a->q_dtype, (row0 + t) * a->q_stride + (g * group + h) * dim, dst, dim);
            for (int64_t d = 0; d < dim; d++) dst[d] *= a->scale;
        }
    for (int64_t r = 0; r < rows; r++) w->pl[r] = 0.0f;
    start_part(w, rows, dim);
    const int64_t *table = a->tables + span * a->table_width;
    const int64_t last = pos0 + count - 1; /* the last key the item's last token sees */
    const int64_t from_key = attn_window_first(pos0, a->window); /* the first key its first token sees */
    const int vec = attn_vec_rows(isa, dim);
    for (int64_t kb = from_key / KEY_TILE * KEY_TILE; kb <= last; kb += KEY_TILE) {
        if (kb > 0 && kb % ATTN_PART_KEYS == 0) {
            fold_part(w, rows, dim);
            start_part(w, rows, dim);
        }
        const int64_t nk = last - kb + 1 < KEY_TILE ? last - kb + 1 : KEY_TILE;
        point_tile_rows(a, isa, w, table, g, kb, nk);
        const int64_t nk4 = (nk + 3) & ~(int64_t)3;
        for (int64_t j = nk; j < nk4; j++) {
            w->krow[j] = w->krow[0];
            w->vrow[j] = w->vrow[0];
        }
#ifdef TS_HAVE_AVX2
        if (vec)
            scores_avx2(w->q, rows, dim, w->krow, nk4, w->s);
        else
#endif
            scores_scalar(w->q, rows, dim, w->krow, nk4, w->s);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t seen = pos0 + r / group - kb + 1; /* keys of this tile at or before the row's token */
            const int64_t n = seen < 0 ? 0 : (seen < nk ? seen : nk);
            const int64_t lo = attn_window_first(pos0 + r / group, a->window) - kb; /* keys of it before the window */
            float *sr = w->s + r * KEY_TILE;
            if (n == 0 || lo >= n) {
                w->valid[r] = 0;
                memset(sr, 0, KEY_TILE * sizeof(float));
                continue;
            }
            w->valid[r] = n;
            attn_softcap(sr, n, a->softcap);
            attn_softmax_tile(vec, sr, lo > 0 ? lo : 0, n, w->m + r, w->l + r, w->o + r * dim, dim);
        }
#ifdef TS_HAVE_AVX2
        if (vec)
            pv_avx2(w->s, w->valid, rows, dim, w->vrow, w->o);
        else
#endif
            pv_scalar(w->s, w->valid, rows, dim, w->vrow, w->o);
    }
    fold_part(w, rows, dim);
    for (int64_t t = 0; t < count; t++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t r = t * group + h;
            const float inv = 1.0f / w->pl[r];
            const int64_t at = (row0 + t) * a->out_stride + (g * group + h) * dim;
            const float *src = w->po + r * dim;
            if (a->out_dtype == TS_DTYPE_F32) {
                float *dst = (float *)a->out + at;
                for (int64_t d = 0; d < dim; d++) dst[d] = src[d] * inv;
            } else {
                uint16_t *dst = (uint16_t *)a->out + at;
                for (int64_t d = 0; d < dim; d++) dst[d] = ts_f32_to_bf16(src[d] * inv);
            }
        }
}

/* Up to this many bytes, the bfloat16 forms pack every span's keys and values once per call, before the
 * work items: each item otherwise gathered (and transposed) every key its rows see, so a prompt's keys were
 * gathered once per 32 rows of queries, a quarter of a long prompt's attention time (perf). Past it (very
 * long contexts), items gather their own. */
#define TS_PREFILL_PACK_MAX_BYTES ((int64_t)64 << 20)
static int64_t ts_pack_limit = TS_PREFILL_PACK_MAX_BYTES; /* tests lower it to take the items' own gathers */
static int64_t ts_packed_calls = 0;                       /* calls that packed, since the library loaded */

int64_t ts_paged_prefill_set_pack_limit(int64_t bytes) {
    const int64_t previous = ts_pack_limit;
    ts_pack_limit = bytes < 0 ? TS_PREFILL_PACK_MAX_BYTES : bytes;
    return previous;
}

int64_t ts_paged_prefill_packed_calls(void) { return __atomic_load_n(&ts_packed_calls, __ATOMIC_RELAXED); }

/* Keys a span's packed keys and values hold: every key its queries see, in whole tiles. */
static inline int64_t packed_keys(const prefill_args *a, int64_t s) {
    return (a->computed[s] + a->query_lens[s] + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
}

int ts_paged_prefill_tiles(int kv_dtype, int64_t head_dim) {
#ifdef TS_PREFILL_PAIRS
    const prefill_args probe = {.kv_dtype = kv_dtype, .head_dim = head_dim};
    return head_dim > 0 ? pairs_form(&probe, ts_attn_isa_level(kv_dtype, head_dim)) : 0;
#else
    (void)kv_dtype;
    (void)head_dim;
    return 0;
#endif
}

static int known_dtype(int code, int allow_fp8) {
    return code == TS_DTYPE_F32 || code == TS_DTYPE_BF16 || (allow_fp8 && code == TS_DTYPE_FP8);
}

int ts_paged_prefill(const void *q, int64_t q_stride, int q_dtype, const void *k, const void *v, int kv_dtype,
                     int64_t kv_stride, const int64_t *tables, int64_t table_width, int64_t block_size,
                     const int64_t *query_start, const int64_t *query_lens, const int64_t *computed, int64_t num_spans,
                     void *out, int64_t out_stride, int out_dtype, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int num_threads) {
    return ts_paged_prefill_window(q, q_stride, q_dtype, k, v, kv_dtype, kv_stride, tables, table_width, block_size,
                                   query_start, query_lens, computed, num_spans, out, out_stride, out_dtype, num_heads,
                                   num_kv_heads, head_dim, scale, 0, 0.0f, num_threads);
}

int ts_paged_prefill_window(const void *q, int64_t q_stride, int q_dtype, const void *k, const void *v, int kv_dtype,
                            int64_t kv_stride, const int64_t *tables, int64_t table_width, int64_t block_size,
                            const int64_t *query_start, const int64_t *query_lens, const int64_t *computed,
                            int64_t num_spans, void *out, int64_t out_stride, int out_dtype, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float softcap,
                            int num_threads) {
    if (!known_dtype(q_dtype, 0) || !known_dtype(out_dtype, 0) || !known_dtype(kv_dtype, 1) || num_kv_heads <= 0 ||
        num_heads % num_kv_heads || head_dim <= 0 || block_size <= 0 || window < 0 || !(softcap >= 0.0f))
        return 1;
    if (num_spans <= 0) return 0;
    const prefill_args a = {q, q_stride, q_dtype, k, v, kv_dtype, kv_stride, tables, table_width, block_size,
                            query_start, query_lens, computed, out, out_stride, out_dtype, num_heads,
                            num_kv_heads, head_dim, scale, window, softcap};
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tokens_per_item = group >= ROWS_PER_ITEM ? 1 : ROWS_PER_ITEM / group;
    /* Work items: (span, KV head, token tile), counted per span so a flat index finds its span. */
    int64_t *items_before = malloc((size_t)(num_spans + 1) * sizeof(int64_t));
    if (!items_before) return 1;
    items_before[0] = 0;
    for (int64_t s = 0; s < num_spans; s++) {
        const int64_t len = query_lens[s];
        items_before[s + 1] = items_before[s] + num_kv_heads * ((len + tokens_per_item - 1) / tokens_per_item);
    }
    const int64_t total = items_before[num_spans];
    const int isa = ts_attn_isa_level(kv_dtype, head_dim);
    const int64_t rows = tokens_per_item * group;
    int failed = 0;
    /* The bfloat16 forms: every span's keys and values packed once per call (TS_PREFILL_PACK_MAX_BYTES). */
    int64_t *packed_before = NULL, *pack_tiles_before = NULL;
    uint16_t *packed = NULL;
#ifdef TS_PREFILL_PAIRS
    if (pairs_form(&a, isa)) {
        packed_before = malloc((size_t)(num_spans + 1) * sizeof(int64_t));
        pack_tiles_before = malloc((size_t)(num_spans + 1) * sizeof(int64_t));
        if (packed_before != NULL && pack_tiles_before != NULL) {
            packed_before[0] = pack_tiles_before[0] = 0;
            for (int64_t s = 0; s < num_spans; s++) {
                const int64_t padded = packed_keys(&a, s);
                packed_before[s + 1] = packed_before[s] + num_kv_heads * 2 * padded * head_dim;
                pack_tiles_before[s + 1] = pack_tiles_before[s] + num_kv_heads * (padded / KEY_TILE);
            }
            const int64_t bytes = packed_before[num_spans] * (int64_t)sizeof(uint16_t);
            if (bytes > 0 && bytes <= ts_pack_limit) packed = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
            if (packed != NULL) __atomic_fetch_add(&ts_packed_calls, 1, __ATOMIC_RELAXED);
        }
    }
#endif
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch w;
        float *buf = malloc((size_t)(3 * rows * head_dim + rows * KEY_TILE + 4 * rows + 2 * KEY_TILE * head_dim +
                                     3 * head_dim * LANE_ROWS + (KEY_TILE + KEY_BLOCK) * LANE_ROWS) *
                            sizeof(float));
        int64_t *valid = malloc((size_t)rows * sizeof(int64_t));
        uint8_t *tiles = NULL; /* the bfloat16 forms' buffers, 64-byte aligned */
        int amx = 0;
#ifdef TS_PREFILL_PAIRS
        const int paired = pairs_form(&a, isa);
        amx = paired == 2;
        const int64_t pair_cols = head_dim / 2 > 16 ? head_dim / 2 : 16;
        const size_t tile_bytes = sizeof(uint16_t) * (size_t)(2 * KEY_TILE * head_dim) +
                                  sizeof(uint32_t) * (size_t)((LANE_ROWS / 16) * (head_dim / 32) * 256 +
                                                              (head_dim / 16) * 256 + (LANE_ROWS / 16) * 256 +
                                                              16 * pair_cols);
        if (paired) tiles = aligned_alloc(64, (tile_bytes + 63) / 64 * 64);
        if (paired && tiles) {
            w.kb = (uint16_t *)tiles;
            w.vb = w.kb + KEY_TILE * head_dim;
            w.qb = (uint32_t *)(w.vb + KEY_TILE * head_dim);
            w.vt = w.qb + (LANE_ROWS / 16) * (head_dim / 32) * 256;
            w.pb = w.vt + (head_dim / 16) * 256;
            w.pairs = w.pb + (LANE_ROWS / 16) * 256;
#ifdef TS_HAVE_AMX
            if (amx) {
                const ts_tilecfg cfg = ts_tilecfg_16x64(8);
                _tile_loadconfig(&cfg);
            }
#endif
        }
        if (paired && !tiles) failed = 1;
#endif
        if (!buf || !valid) {
            failed = 1;
        } else {
            w.q = buf;
            w.o = w.q + rows * head_dim;
            w.s = w.o + rows * head_dim;
            w.m = w.s + rows * KEY_TILE;
            w.l = w.m + rows;
            w.po = w.l + rows;
            w.pm = w.po + rows * head_dim;
            w.pl = w.pm + rows;
            w.kw = w.pl + rows;
            w.vw = w.kw + KEY_TILE * head_dim;
            w.qt = w.vw + KEY_TILE * head_dim;
            w.ot = w.qt + head_dim * LANE_ROWS;
            w.st = w.ot + head_dim * LANE_ROWS;
            w.rows = w.st + (KEY_TILE + KEY_BLOCK) * LANE_ROWS;
            w.valid = valid;
        }
        w.packed_k = NULL;
        w.packed_vt = NULL;
#ifdef TS_PREFILL_PAIRS
        if (packed != NULL) {
            const int64_t tasks = pack_tiles_before[num_spans];
#pragma omp for schedule(dynamic, 4)
            for (int64_t t = 0; t < tasks; t++) {
                if (failed) continue;
                int64_t s = 0;
                while (pack_tiles_before[s + 1] <= t) s++;
                const int64_t padded = packed_keys(&a, s), keys = computed[s] + query_lens[s];
                const int64_t local = t - pack_tiles_before[s], per_head = padded / KEY_TILE;
                const int64_t g = local / per_head, kb = (local % per_head) * KEY_TILE;
                uint16_t *at = packed + packed_before[s] + g * 2 * padded * head_dim;
                gather_tile_amx_into(&a, &w, tables + s * table_width, g, kb, keys - kb < KEY_TILE ? keys - kb : KEY_TILE,
                                     at + kb * head_dim, (uint32_t *)(at + padded * head_dim) + (kb / KEY_TILE) * (head_dim / 16) * 256);
            }
        }
#endif
        /* The last token tiles of a span see the most keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < total; i++) {
            if (failed) continue;
            int64_t s = 0;
            while (items_before[s + 1] <= i) s++;
            const int64_t len = query_lens[s];
            const int64_t tiles = (len + tokens_per_item - 1) / tokens_per_item;
            const int64_t local = i - items_before[s];
            const int64_t tile = tiles - 1 - local / num_kv_heads, g = local % num_kv_heads;
            const int64_t first = tile * tokens_per_item;
            const int64_t count = len - first < tokens_per_item ? len - first : tokens_per_item;
#ifdef TS_PREFILL_PAIRS
            if (packed != NULL) {
                const uint16_t *at = packed + packed_before[s] + g * 2 * packed_keys(&a, s) * head_dim;
                w.packed_k = at;
                w.packed_vt = (const uint32_t *)(at + packed_keys(&a, s) * head_dim);
            }
#endif
            run_item(&a, isa, &w, s, g, first, count);
        }
#ifdef TS_HAVE_AMX
        if (tiles && amx) _tile_release();
#endif
        (void)amx;
        free(tiles);
        free(buf);
        free(valid);
    }
    free(items_before);
    free(packed_before);
    free(pack_tiles_before);
    free(packed);
    return failed;
}
