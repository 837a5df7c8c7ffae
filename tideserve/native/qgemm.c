/* Linear layers over block-quantized weights, y = x W^T (+ bias), with W kept in its GGUF block format
 * (qgemm_formats.h: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS).
 *
 * Why: a decode step multiplies each weight once per token, so at small batches its speed is the speed
 * at which weights stream from memory, and 4-6 bits per weight read a fifth to a seventh of float32's
 * bytes. Keeping the file's own blocks also means loading a GGUF costs its size in memory, not four times
 * that, and nothing is lost to a second rounding.
 *
 * Two ways to multiply, picked per call by the batch size and at run time by what the CPU has:
 * - row kernels (few rows: decode, short prefills): each call quantizes x to 8 bits per block of 32, so
 *   a block's dot product is 32 byte products summed in integers and one float multiply-add per
 *   16-value half. AVX2 (vpmaddubsw) or AVX-512 VNNI (vpdpbusd), from one source (qgemm_simd.h); a
 *   weight block is decoded once for up to TS_QGEMM_ROWS rows of x;
 * - tiles (AMX, from TS_AMX_MIN_ROWS rows: batched decode, prefill): each thread decodes a panel of 32
 *   weight rows once to bfloat16 and multiplies it with the whole batch through tdpbf16ps, 16x16 output
 *   tiles accumulated in float over all of K; the next panel's decode runs between the current one's
 *   tile products; threads start from an even share of the panels and take what another has left
 *   (amx_claimed_panels). The input is rounded to bfloat16 (8 bits of mantissa,
 *   like the row kernels' 8-bit codes, but with no block scale to share);
 * - integer tiles (from tile_min_rows rows, on AMX CPUs up to the AMX tiles'; qgemm_tiles.h): the row kernels' int8
 *   arithmetic, but a panel of 16 weight rows is decoded once for the whole batch, in an order where each
 *   vector lane is its own output column; compiled for AVX2 (vpmaddubsw) and for AVX-512 VNNI (vpdpbusd);
 * - a matrix-vector kernel (below the integer tiles, qgemm_gemv.h): 8 weight rows read and transposed
 *   together, for single streams; also compiled for both.
 * A scalar path computes the same arithmetic as the row kernels in plain C: the reference in tests and
 * the path on CPUs with neither. ts_qgemm_set_isa caps the choice so tests can run every path.
 *
 * On the AVX2 and AVX-512 VNNI paths the legacy formats and Q8_0 are interleaved by 8 rows at load
 * (qgemm_formats.h: TS_LAYOUT_X8), the order in which the matrix-vector kernel and the integer tiles read
 * them; every other path copies such rows back to the file's layout first. AMX CPUs keep the file's rows
 * (their tiles read those, and their AVX-512 kernels below the tiles read either layout).
 *
 * A layer may hold several segments of different formats (a fused q|k|v whose v rows are Q8_0 while q
 * and k are Q5_0, as llama.cpp's Q4_K_M mixes them); each writes its own range of output columns.
 */
#define _GNU_SOURCE /* sysconf(_SC_LEVEL2_CACHE_SIZE) under -std=c11 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tideserve_native.h" /* includes qgemm_formats.h */
#include "ts_simd.h"          /* ts_exp */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TS_QGEMM_X86 1
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define TS_QGEMM_HAVE_AMX 1
#endif
#endif

/* The paths (ts_qgemm_isa). */
enum { TS_QG_SCALAR = 0, TS_QG_AVX2 = 1, TS_QG_AVX512 = 2, TS_QG_AMX = 3 };

/* Below this many weight bytes read per call, a single thread beats waking the others. */
#define TS_QGEMM_PARALLEL_MIN 65536
/* Rows of x that share one decode of a weight row in the row kernels. */
#define TS_QGEMM_ROWS 4
/* From this many rows of x, the AMX tiles beat the AVX-512 plan an AMX CPU takes below them (the matrix-vector
 * kernel, then VNNI's integer tiles; measured over the legacy formats, Q8_0 and the K-quants,
 * docs/benchmarks.md); ts_qgemm_set_tile_min_rows overrides every path's threshold (tests, benchmarks). */
#define TS_AMX_MIN_ROWS 12
#define TS_AVX2_TILE_MIN_ROWS 4
/* A Q8_0 panel costs more to decode (codes and signs); below this many rows the row kernels read an LM
 * head faster. */
#define TS_AVX2_TILE_MIN_ROWS_Q8_0 12
/* Over the formats the matrix-vector kernel takes, up to how many rows it beats the tiles with the
 * weights streaming from DRAM, as a decode step's do, in the layout a loaded model keeps (interleaved for
 * the legacy formats and Q8_0; measured: docs/benchmarks.md). It decodes a block once per TS_GEMV_ROWS
 * rows of x and the tiles once per call, but the tiles also write and reread their panel; a Q8_0 panel
 * stores every code's sign too, and the tiles decode K-quant panels row by row. Q2_K, Q3_K, IQ4_NL and
 * IQ4_XS were measured on AVX2 only (a 2-core Zen 3, one thread, their own rows); on AVX-512 VNNI they take
 * the common threshold. */
static int gemv_max_rows(int isa, int64_t type) {
    if (isa >= TS_QG_AVX512) { /* VNNI's tiles gain more over AVX2's than its matrix-vector kernel does */
        switch (type) {
        case TS_Q8_0: return 11;
        case TS_Q4_K: return 9;
        case TS_Q6_K: return 15;
        default: return 7;
        }
    }
    switch (type) {
    case TS_Q8_0: return 23;
    case TS_Q2_K: return 15;
    case TS_Q4_K: case TS_IQ4_XS: return 11;
    case TS_Q6_K: return 15;
    case TS_Q3_K: case TS_IQ4_NL: return 7;
    default: return 12;
    }
}
static int ts_tile_min_rows_override = 0; /* 0: each path's own threshold */
static int ts_gemv_enabled = 1;           /* AVX2's matrix-vector kernel below the tiles (tests turn it off) */
static int ts_amx_one_list = 0;           /* every AMX task starts in thread 0's list (tests: the others only take) */
static int64_t ts_amx_taken = 0;          /* AMX tasks a thread took from another's list, since the library loaded */

/* The integer tiles sweep a batch's rows in chunks whose int8 activations (with their scales) stay in L2
 * while every panel of a thread passes over them, each panel decoded once per chunk. Half the core's L2
 * leaves the other half to the panels and the output rows. A fixed 128 KiB was measured best in 256-bit
 * tiles over whole 2,048-row steps (docs/benchmarks.md); with 512-bit tiles and 512-token
 * slabs, a chunk of 128 KiB cut a slab in four and each panel was decoded four times: half of a 1 MiB L2
 * made a Zen 5's prefill 3-6% faster. Without a figure from the C library, 128 KiB. */
#define TS_TILE_CHUNK_FALLBACK (128 * 1024)
#define TS_TILE_CHUNK_MIN (64 * 1024)
#define TS_TILE_CHUNK_MAX (2 * 1024 * 1024)
static int64_t ts_tile_chunk_override = 0; /* 0: from the L2 size */

static int64_t ts_tile_chunk_from_l2(void) {
    static int64_t chunk = 0; /* every thread computes the same value: a race here is benign */
    if (chunk == 0) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        int64_t bytes = l2 > 0 ? (int64_t)l2 / 2 : TS_TILE_CHUNK_FALLBACK;
        bytes = bytes < TS_TILE_CHUNK_MIN ? TS_TILE_CHUNK_MIN : bytes > TS_TILE_CHUNK_MAX ? TS_TILE_CHUNK_MAX : bytes;
        chunk = bytes;
    }
    return chunk;
}

/* Activation bytes per chunk of rows the integer tiles sweep (ts_qgemm_set_tile_chunk_bytes overrides it). */
int64_t ts_qgemm_tile_chunk_bytes(void) {
    return ts_tile_chunk_override > 0 ? ts_tile_chunk_override : ts_tile_chunk_from_l2();
}

/* Rows per chunk for activations of ``row_bytes`` each: the L2's share, but at least ``min_rows`` unless a
 * caller overrode the bytes (tests shrink chunks to reach the multi-chunk paths), in whole micro tiles.
 * The floor is there because a panel is decoded once per chunk: its decode costs in proportion to k and
 * so does every row's product, so what it adds is ~1 / rows whatever k is, while the L2 share alone gives
 * wide matrices few rows (46 at k = 8,192 under a 1 MiB L2: a down projection's panels decoded 7 times in a
 * 305-token prefill). On a Zen 5 EPYC a floor of 512 rows made k = 8,192 products 30-35% faster (Q4_K,
 * Q6_K, Q4_1, Q8_0) and k = 2,048 ones 3-6% faster at 2,048 rows, though the chunk then outgrows L2
 * (docs/benchmarks.md). */
static int64_t ts_qgemm_tile_chunk_rows(int64_t row_bytes, int64_t tile_rows, int64_t min_rows) {
    int64_t rows = ts_qgemm_tile_chunk_bytes() / row_bytes;
    if (ts_tile_chunk_override == 0 && rows < min_rows) rows = min_rows;
    rows = rows / tile_rows * tile_rows;
    return rows < tile_rows ? tile_rows : rows;
}

/* Overrides the chunk of rows the integer tiles sweep, in activation bytes; 0 restores the L2-sized default.
 * Returns the previous override (tests and benchmarks: results are the same for every chunk). */
int64_t ts_qgemm_set_tile_chunk_bytes(int64_t bytes) {
    const int64_t previous = ts_tile_chunk_override;
    ts_tile_chunk_override = bytes < 0 ? 0 : bytes;
    return previous;
}
/* How far ahead of the row being multiplied the weight stream is prefetched, in bytes. A row kernel does
 * a few dozen instructions per 32-value block, so with the hardware prefetchers alone only a handful of
 * cache lines are in flight and a decode step runs at the L3's latency, not its bandwidth (measured: a
 * decode step 22% faster with 2 KiB ahead; 1-8 KiB are within noise of each other). Prefetches never
 * fault, so reading past a segment's end is harmless. */
#define TS_QGEMM_PREFETCH 2048

/* Hints the cache lines of [p + TS_QGEMM_PREFETCH, + bytes) towards L1. */
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    const char *ahead = (const char *)p + TS_QGEMM_PREFETCH;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
}

/* The kernels a product can take (ts_qgemm_kernel_for; quant.py's KERNELS names them in this order). */
enum { TS_K_ROWS = 0, TS_K_AVX2_TILES = 1, TS_K_AMX_TILES = 2, TS_K_AVX2_GEMV = 3, TS_K_AVX512_TILES = 4,
       TS_K_AVX512_GEMV = 5 };

/* x quantized per block of 32: q int8 [m][k], d [m][kb] (x = d * q), s [m][kb][2] = d * (sum of q over
 * each 16-value half), for the offsets' terms.
 * The AVX-512 tiles read the same values regrouped TS_ACT_GROUP rows at a time (their micro tile's height;
 * NULL elsewhere): tq [m/G][kb][8 steps][G rows][4 codes], td [m/G][kb][G rows] (d) and ts [m/G][kb][3][G rows]
 * (s's two halves, then their sum as the tiles used to add it), and, for a weight with rows in a format
 * whose offset is a whole number of its scale (ts_tile_int_offset_shift), tb [m/G][kb][3][G rows]: minus
 * the sum of q over each 16-value half and over the block. AVX2's tiles read the same sums per row, qb
 * [m][kb][2] (the halves), where they need them. A micro tile then
 * finds every row's codes and scales at constant offsets from one pointer: with a pointer per row, the
 * registers ran out and the sums were added per tile. */
#define TS_ACT_GROUP 6

/* For a format whose offset is minus a power of two times its scale (value = s * (code - 2^shift)), the
 * shift; 0 for the formats with a float minimum. The integer tiles start such a format's integer sums from
 * the x codes' sum shifted instead of adding the offset in float. ``vnni``: the AVX-512 VNNI panels store
 * the signed formats' codes as w + 128; AVX2's keep them signed (no offset). */
static inline __attribute__((always_inline)) int ts_tile_int_offset_shift(const int type, const int vnni) {
    switch (type) {
    case TS_Q4_0: return 3;
    case TS_Q5_0: return 4;
    case TS_Q3_K: return 2; /* per 16-value half, as Q3_K's and Q6_K's scales are */
    case TS_Q6_K: return 5;
    case TS_Q8_0: case TS_IQ4_NL: case TS_IQ4_XS: return vnni ? 7 : 0; /* the signed formats */
    default: return 0;
    }
}

typedef struct {
    int8_t *q;
    float *d, *s;
    int64_t k, kb;
    int8_t *tq;
    float *td, *ts;
    int32_t *tb;
    int32_t *qb;
} ts_act;

/* Minus the sums of a block's 32 codes over each 16-value half (two plain loops: the compiler vectorizes
 * these; one loop indexing the two sums did not, and made the regrouping 4x slower). */
static inline void block_code_sums(const int8_t *q, int32_t out[2]) {
    int32_t first = 0, second = 0;
    for (int v = 0; v < 16; v++) first += q[v];
    for (int v = 16; v < TS_QBLOCK; v++) second += q[v];
    out[0] = -first;
    out[1] = -second;
}

/* Row i's qb: AVX2's tiles start an integer offset's sums from these. */
static void code_sums_row(ts_act *a, int64_t i) {
    for (int64_t b = 0; b < a->kb; b++) block_code_sums(a->q + i * a->k + b * TS_QBLOCK, a->qb + 2 * (i * a->kb + b));
}

/* Row i of a (quantized) into the tiles' groups of TS_ACT_GROUP rows. */
static void regroup_row(ts_act *a, int64_t i) {
    const int64_t kb = a->kb, group = i / TS_ACT_GROUP, r = i % TS_ACT_GROUP;
    const int8_t *q = a->q + i * a->k;
    for (int64_t b = 0; b < kb; b++) {
        int8_t *dst = a->tq + (group * kb + b) * (8 * 4 * TS_ACT_GROUP) + 4 * r;
        for (int g = 0; g < 8; g++) memcpy(dst + 4 * TS_ACT_GROUP * g, q + b * TS_QBLOCK + 4 * g, 4);
        const float *s = a->s + 2 * (i * kb + b);
        float *ts = a->ts + (group * kb + b) * (3 * TS_ACT_GROUP) + r;
        a->td[(group * kb + b) * TS_ACT_GROUP + r] = a->d[i * kb + b];
        int32_t *tb = a->tb != NULL ? a->tb + (group * kb + b) * (3 * TS_ACT_GROUP) + r : NULL;
        if (tb != NULL) {
            int32_t sums[2];
            block_code_sums(q + b * TS_QBLOCK, sums);
            tb[0] = sums[0];
            tb[TS_ACT_GROUP] = sums[1];
            tb[2 * TS_ACT_GROUP] = sums[0] + sums[1];
        }
        ts[0] = s[0];
        ts[TS_ACT_GROUP] = s[1];
        ts[2 * TS_ACT_GROUP] = s[0] + s[1];
    }
}

#ifdef TS_HAVE_AVX2
TS_ALWAYS_INLINE int hsum_epi32_256(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* quantize_row_q8 in vectors, bit for bit: the same products, rounded to nearest even by cvtps as
 * lrintf rounds them (a scalar lrintf per value was 1-1.5% of a prefill). */
static void quantize_row_q8_avx2(const float *x, int64_t k, int8_t *q, float *scale, float *sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / TS_QBLOCK; b++) {
        const float *xb = x + b * TS_QBLOCK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, magnitude), _mm256_and_ps(x1, magnitude)),
                                       _mm256_max_ps(_mm256_and_ps(x2, magnitude), _mm256_and_ps(x3, magnitude)));
        const float d = ts_hmax256(m) / 127.0f;
        const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
        /* packs interleave 128-bit lanes: bytes come out as i0[0:4] i1[0:4] i2[0:4] i3[0:4] | i0[4:8] ... */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + b * TS_QBLOCK), _mm256_permutevar8x32_epi32(bytes, order));
        scale[b] = d;
        sums[2 * b] = d * (float)hsum_epi32_256(_mm256_add_epi32(i0, i1));
        sums[2 * b + 1] = d * (float)hsum_epi32_256(_mm256_add_epi32(i2, i3));
    }
}
#endif

static void quantize_row_q8(const float *x, int64_t k, int8_t *q, float *scale, float *sums) {
#ifdef TS_HAVE_AVX2
    if (ts_isa_level() >= TS_ISA_AVX2) {
        quantize_row_q8_avx2(x, k, q, scale, sums);
        return;
    }
#endif
    for (int64_t b = 0; b < k / TS_QBLOCK; b++) {
        const float *xb = x + b * TS_QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < TS_QBLOCK; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax; /* not fmaxf: without -ffast-math that is a libm call per value */
        }
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        int total[2] = {0, 0};
        for (int i = 0; i < TS_QBLOCK; i++) {
            const int v = (int)lrintf(xb[i] * inv);
            q[b * TS_QBLOCK + i] = (int8_t)v;
            total[i >= 16] += v;
        }
        scale[b] = d;
        sums[2 * b] = d * (float)total[0];
        sums[2 * b + 1] = d * (float)total[1];
    }
}

/* Rows of x quantized as every matmul over block-quantized weights quantizes them (the tests compare the
 * ISA paths of quantize_row_q8 bit for bit): q [m, k] codes, scale [m, k / 32], sums [m, 2 k / 32] (each
 * 16-value half's code sum times the block's scale). Returns 0, or -1 when k is not a multiple of 32. */
int ts_qgemm_quantize_rows_f32(const float *x, int64_t m, int64_t k, int8_t *q, float *scale, float *sums) {
    if (k % TS_QBLOCK != 0 || m < 0) return -1;
    const int64_t kb = k / TS_QBLOCK;
    for (int64_t i = 0; i < m; i++) quantize_row_q8(x + i * k, k, q + i * k, scale + i * kb, sums + 2 * i * kb);
    return 0;
}

/* silu(gate) * up for one row whose first k values are the gate and next k the up projection. ts_exp's
 * polynomial (about 2 ulp) in vectors where the CPU has them: libm's expf, a call per value, was 5% of a
 * prefill, and a scalar loop with the polynomial's clamps branches on every value. */
static void swiglu_row(const float *x, int64_t k, float *out) {
    int64_t j = 0;
#ifdef TS_HAVE_AVX512
    if (ts_isa_level() >= TS_ISA_AVX512) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= k; j += 16) {
            const __m512 g = _mm512_loadu_ps(x + j);
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, ts_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_storeu_ps(out + j, _mm512_mul_ps(silu, _mm512_loadu_ps(x + k + j)));
        }
    }
#endif
#ifdef TS_HAVE_AVX2
    if (ts_isa_level() >= TS_ISA_AVX2) {
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; j + 8 <= k; j += 8) {
            const __m256 g = _mm256_loadu_ps(x + j);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, ts_exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(x + k + j)));
        }
    }
#endif
    for (; j < k; j++) {
        const float g = x[j];
        out[j] = g / (1.0f + ts_exp(-g)) * x[k + j];
    }
}

/* ------------------------------------------------------------------------------------------ scalar */
static void dot_row_group_scalar(int type, const uint8_t *row, int64_t kb, const ts_act *a, int64_t r0, int rows,
                                 float *res) {
    for (int i = 0; i < rows; i++) res[i] = 0.0f;
    for (int64_t b = 0; b < kb; b++) {
        uint8_t codes[32];
        float s[2], o[2];
        ts_block_decode(type, row, b, codes, s, o);
        for (int i = 0; i < rows; i++) {
            const int64_t r = r0 + i;
            const int8_t *x = a->q + r * a->k + b * TS_QBLOCK;
            int dot[2] = {0, 0};
            for (int j = 0; j < 32; j++) {
                const int w = ts_qtype_signed(type) ? (int)(int8_t)codes[j] : (int)codes[j];
                dot[j >= 16] += w * x[j];
            }
            const float xd = a->d[r * a->kb + b];
            const float *xs = a->s + 2 * (r * a->kb + b);
            res[i] += xd * (s[0] * (float)dot[0] + s[1] * (float)dot[1]) + o[0] * xs[0] + o[1] * xs[1];
        }
    }
}

#ifdef TS_QGEMM_X86
/* Panels of ``width`` weight rows over a layer's segments: a panel never spans two segments, so the last
 * one of each segment may be partly empty. */
static int64_t ts_panel_count(const ts_qmat *w, int64_t width) {
    int64_t panels = 0;
    for (int64_t s = 0; s < w->num_segs; s++) panels += (w->seg[s].n + width - 1) / width;
    return panels;
}

/* The segment, its first panel and first output column of panel p of a weight. */
static const ts_qseg *ts_panel_segment(const ts_qmat *w, int64_t p, int64_t width, int64_t *first, int64_t *col0) {
    int64_t s = 0;
    *col0 = 0;
    while (p >= (w->seg[s].n + width - 1) / width) {
        p -= (w->seg[s].n + width - 1) / width;
        *col0 += w->seg[s].n;
        s++;
    }
    *first = p;
    return w->seg + s;
}

/* --------------------------------------------------------------------------------- AVX2, AVX-512 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define TS_SIMD(name) name##_avx2
#define TS_SIMD_VNNI 0
#define TS_SIMD_TILE_ROWS 4 /* 16 vector registers: 4 rows of x per micro tile (2-5 measured, 4 best) */
#define TS_SIMD_TILE_PANELS 1 /* panels (16 weight rows each) per micro tile */
#define TS_SIMD_CHUNK_MIN_ROWS 0 /* the L2 share alone: 128 KiB measured best on an AVX2 EPYC */
#include "qgemm_simd.h"
#include "qgemm_tiles.h"
#include "qgemm_gemv.h"
#undef TS_SIMD
#undef TS_SIMD_VNNI
#undef TS_SIMD_TILE_ROWS
#undef TS_SIMD_TILE_PANELS
#undef TS_SIMD_CHUNK_MIN_ROWS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define TS_SIMD(name) name##_avx512
#define TS_SIMD_VNNI 1
#define TS_SIMD_TILE_ROWS TS_ACT_GROUP /* 6 rows of x by 2 panels (32 weight rows): see tile_rows */
#define TS_SIMD_TILE_PANELS 2
#define TS_SIMD_CHUNK_MIN_ROWS 512 /* ts_qgemm_tile_chunk_rows */
#include "qgemm_simd.h"
#include "qgemm_tiles.h"
#include "qgemm_gemv.h"
#undef TS_SIMD
#undef TS_SIMD_VNNI
#undef TS_SIMD_TILE_ROWS
#undef TS_SIMD_TILE_PANELS
#undef TS_SIMD_CHUNK_MIN_ROWS
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------------------------ AMX tiles */
#ifdef TS_QGEMM_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")

#define TS_PANEL 32 /* weight rows decoded together: two A tiles */

/* A panel decoded a few blocks at a time, row after row, so that the decode of a thread's next panel runs
 * between the tile instructions of its current one: the tiles and the vector units then work at once
 * (done one after the other, the decode took 58% of the time at 64 rows: docs/benchmarks.md). */
typedef struct {
    int type;
    const ts_qseg *seg;
    const uint8_t *row; /* the row being decoded: in the segment, or its copy back from the x8 layout */
    uint8_t *copy;      /* row_bytes of scratch for that copy (NULL when no segment is interleaved) */
    int64_t row_bytes, n, n0, k;
    uint16_t *panel;
    int64_t r, b; /* the next block to decode: row r of the panel, block b of that row */
    float unit_s[16], unit_o[16];
} ts_panel_decode;

static void panel_decode_start(ts_panel_decode *d, const ts_qseg *seg, int64_t n0, int64_t k, uint16_t *panel,
                               uint8_t *copy) {
    d->type = (int)seg->type;
    d->seg = seg;
    d->row = NULL;
    d->copy = copy;
    d->row_bytes = ts_qrow_bytes(seg->type, k);
    d->n = seg->n;
    d->n0 = n0;
    d->k = k;
    d->panel = panel;
    d->r = d->b = 0;
}

/* Formats whose 32 codes of a block share one scale and offset and stay below 32 (below 16: LUT16), decoded
 * through a table of the block's values instead of converting each code. */
#define TS_PANEL_LUT16(type) ((type) == TS_Q4_0 || (type) == TS_Q4_1 || (type) == TS_Q4_K)
#define TS_PANEL_LUT(type) (TS_PANEL_LUT16(type) || (type) == TS_Q5_0 || (type) == TS_Q5_1 || (type) == TS_Q5_K)

/* Decodes the next ``count`` blocks (a row past the segment, zeroed, counts as its k / 32 blocks). */
static inline __attribute__((always_inline)) void panel_decode_blocks(const int type, ts_panel_decode *d,
                                                                      int64_t count) {
    const int64_t k = d->k, kb = k / TS_QBLOCK, n = d->n, n0 = d->n0, row_bytes = d->row_bytes;
    const __m512 iota16 = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int64_t r = d->r, b = d->b;
    while (count > 0 && r < TS_PANEL) {
        uint16_t *dst = d->panel + r * k;
        if (n0 + r >= n) {
            memset(dst, 0, sizeof(uint16_t) * (size_t)k);
            r++;
            count -= kb;
            continue;
        }
        if (b == 0) {
            d->row = ts_x8_row(d->seg, n0 + r, row_bytes, d->copy);
            prefetch_ahead(d->row, row_bytes);
        }
        const uint8_t *row = d->row;
        for (; b < kb && count > 0; b++, count--) {
            float s[2], o[2];
            const __m256i codes = decode_avx512(type, row, b, s, o, d->unit_s, d->unit_o);
            if (TS_PANEL_LUT(type)) {
                /* codes below 32 with one scale and offset per block: the block's bfloat16 values of every
                 * code, computed (and rounded) as below, then looked up with one vpermw per 32 codes */
                const __m512 first = _mm512_fmadd_ps(iota16, _mm512_set1_ps(s[0]), _mm512_set1_ps(o[0]));
                const __m512i table =
                    TS_PANEL_LUT16(type)
                        ? _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(first))
                        : (__m512i)_mm512_cvtne2ps_pbh(
                              _mm512_fmadd_ps(_mm512_add_ps(iota16, _mm512_set1_ps(16.0f)), _mm512_set1_ps(s[0]),
                                              _mm512_set1_ps(o[0])),
                              first);
                _mm512_storeu_si512((void *)(dst + b * TS_QBLOCK),
                                    _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table));
                continue;
            }
            const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
            const __m512i lo32 = ts_qtype_signed(type) ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
            const __m512i hi32 = ts_qtype_signed(type) ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
            const __m512 vlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo32), _mm512_set1_ps(s[0]), _mm512_set1_ps(o[0]));
            const __m512 vhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi32), _mm512_set1_ps(s[1]), _mm512_set1_ps(o[1]));
            _mm512_storeu_si512((void *)(dst + b * TS_QBLOCK), (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo));
        }
        if (b == kb) {
            r++;
            b = 0;
        }
    }
    d->r = r;
    d->b = b;
}

static void panel_decode_some(ts_panel_decode *d, int64_t count) {
    if (d == NULL) return;
#define TS_CASE(T) case T: panel_decode_blocks(T, d, count); break;
    switch (d->type) {
        TS_FOR_EACH_QTYPE(TS_CASE)
    default:
        memset(d->panel, 0, sizeof(uint16_t) * (size_t)(TS_PANEL * d->k));
        d->r = TS_PANEL;
    }
#undef TS_CASE
}

/* 16 x 16 32-bit values transposed in registers: r[i] lane j becomes r[j] lane i. */
static inline __attribute__((always_inline)) void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: pairs of rows interleaved */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[4i + j] lane L: column 4L + j of rows 4i .. 4i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* the 4 x 4 transpose of 128-bit lanes among r[j], r[4 + j], r[8 + j], r[12 + j] */
        const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
        t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Up to 16 x rows (``valid`` of them; the rest of the tile is zero) -> bfloat16 in AMX B-tile order: tile
 * (mt, b) holds rows 16 mt.. and columns 32 b..; its row p is the pairs (x[m][32 b + 2p], x[m][32 b + 2p +
 * 1]) for the tile's 16 m. A whole tile at a time, transposed in registers: one row at a time cost 16
 * scattered 4-byte stores per 32 values (8% of a long prefill). */
static void pack_tile_bf16(const float *const rows[16], int64_t valid, int64_t mt, int64_t k, uint32_t *packed) {
    const int64_t kb = k / TS_QBLOCK;
    for (int64_t b = 0; b < kb; b++) {
        __m512i r[16];
        for (int c = 0; c < 16; c++) {
            r[c] = c < valid ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(rows[c] + b * 32 + 16),
                                                             _mm512_loadu_ps(rows[c] + b * 32))
                             : _mm512_setzero_si512();
        }
        transpose16x16_epi32(r);
        uint32_t *tile = packed + (mt * kb + b) * 256;
        for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(tile + p * 16), r[p]);
    }
}

/* Rows of x per pass over the weight's panels: their packed tiles (256 x k bfloat16, 295 KiB at k = 576)
 * stay in L2 while every panel is multiplied with them. Without the chunking a long prefill's packed x
 * (2048 rows: 2.4 MiB) streamed from L3 once per panel and the tiles waited on it (measured: prefill of the
 * embedded model 2.6x faster). */
#define TS_AMX_M_CHUNK 256
/* Up to this many bytes, a weight decoded to bfloat16 once per call is shared by every chunk of x; past it
 * (an LM head over thousands of rows) each chunk decodes its panels again. */
#define TS_AMX_SHARED_PANELS_MAX ((int64_t)16 << 20)

/* out rows of x tiles [mt_lo, mt_hi) (16 rows each, mt_lo even) times one decoded panel; ``next`` (or
 * NULL) is the panel to decode meanwhile, an even share of it after each group of tile products. */
static void amx_panel_tiles(const uint16_t *panel, const uint32_t *packed, int64_t kb, int64_t k, int64_t mt_lo,
                            int64_t mt_hi, const ts_qseg *seg, int64_t n0, int64_t col0, const float *bias, int64_t m,
                            float *out, int64_t out_stride, ts_panel_decode *next) {
    float tile_out[4][16 * 16];
    const int64_t pairs = (mt_hi - mt_lo + 1) / 2;
    const int64_t quota = (TS_PANEL + pairs - 1) / pairs; /* blocks of next per step of b: all of it, evenly */
    /* The panel serves every pair of x tiles; where it fits L1 beside the tiles in flight (40 KiB: k <= 640)
     * and serves 4 pairs or more, x's tiles are loaded with the streaming hint (tileloaddt1), so they pass
     * without evicting it. 256 rows at k = 576: 7-19% faster; 64 rows (2 pairs) and panels past L1 gained
     * nothing or lost a little (docs/benchmarks.md). */
    const int stream_x = pairs >= 4 && TS_PANEL * k * (int64_t)sizeof(uint16_t) <= (40 << 10);
    for (int64_t mt = mt_lo; mt < mt_hi; mt += 2) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t b = 0; b < kb; b++) {
            _tile_loadd(0, panel + b * 32, k * 2);
            _tile_loadd(1, panel + 16 * k + b * 32, k * 2);
            if (stream_x) {
                _tile_stream_loadd(2, packed + (mt * kb + b) * 256, 64);
                _tile_stream_loadd(3, packed + ((mt + 1) * kb + b) * 256, 64);
            } else {
                _tile_loadd(2, packed + (mt * kb + b) * 256, 64);
                _tile_loadd(3, packed + ((mt + 1) * kb + b) * 256, 64);
            }
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
            panel_decode_some(next, quota);
        }
        _tile_stored(4, tile_out[0], 64);
        _tile_stored(5, tile_out[1], 64);
        _tile_stored(6, tile_out[2], 64);
        _tile_stored(7, tile_out[3], 64);
        /* tile_out[t][r][c]: weight row n0 + 16 (t / 2) + r, x row 16 (mt + t % 2) + c; column c, gathered,
         * is x row c's 16 outputs */
        const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(16));
        for (int t = 0; t < 4; t++) {
            const int64_t nbase = n0 + 16 * (t / 2), mbase = 16 * (mt + t % 2);
            if (nbase >= seg->n || mbase >= m) continue;
            const int64_t nvalid = seg->n - nbase < 16 ? seg->n - nbase : 16;
            const int64_t mvalid = m - mbase < 16 ? m - mbase : 16;
            const __mmask16 keep = (__mmask16)((1u << nvalid) - 1);
            const __m512 add = bias != NULL ? _mm512_maskz_loadu_ps(keep, bias + col0 + nbase) : _mm512_setzero_ps();
            for (int64_t c = 0; c < mvalid; c++) {
                const __m512 row = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)c)), tile_out[t], 4);
                _mm512_mask_storeu_ps(out + (mbase + c) * out_stride + col0 + nbase, keep, _mm512_add_ps(row, add));
            }
        }
    }
}

/* A thread's list of amx_matmul tasks, [front, back) of it still unclaimed, in one word that the owner
 * takes from the front and other threads from the back (compare-and-swap), on a cache line of its own. */
typedef struct {
    uint64_t range; /* front in the low 32 bits, back in the high 32 */
    char pad[56];
} ts_task_list;

static inline uint64_t task_range(int64_t front, int64_t back) { return ((uint64_t)back << 32) | (uint64_t)front; }

/* The next unclaimed index of list l, from its front (the owner) or its back (another thread); -1 if none. */
static int64_t take_task(ts_task_list *l, int from_back) {
    uint64_t cur = __atomic_load_n(&l->range, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t front = (int64_t)(cur & 0xffffffffu), back = (int64_t)(cur >> 32);
        if (front >= back) return -1;
        const uint64_t want = from_back ? task_range(front, back - 1) : task_range(front + 1, back);
        if (__atomic_compare_exchange_n(&l->range, &cur, want, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return from_back ? back - 1 : front;
    }
}

/* One claimed task: chunk of x and panel. */
typedef struct {
    int64_t chunk, panel;
} ts_amx_task;

/* The panels [*lo, *lo + *count) thread tid's list starts with, for every chunk: the even split's share,
 * or (ts_qgemm_set_amx_one_list) all of them for thread 0 and none for the others. */
static void amx_share(int64_t tid, int64_t nth, int64_t panels, int64_t *lo, int64_t *count) {
    if (ts_amx_one_list) {
        *lo = 0;
        *count = tid == 0 ? panels : 0;
        return;
    }
    *lo = panels * tid / nth;
    *count = panels * (tid + 1) / nth - *lo;
}

/* Thread tid's next task: the front of its own list, else the back of another's. A list holds its
 * share's panels for every chunk, chunk-major; 0 when every list is empty. */
static int next_amx_task(ts_task_list *lists, int64_t nth, int64_t tid, int64_t panels, ts_amx_task *task) {
    for (int64_t d = 0; d < nth; d++) {
        const int64_t owner = (tid + d) % nth;
        const int64_t j = take_task(&lists[owner], d > 0);
        if (j < 0) continue;
        if (d > 0) __atomic_fetch_add(&ts_amx_taken, 1, __ATOMIC_RELAXED);
        int64_t lo, count;
        amx_share(owner, nth, panels, &lo, &count);
        task->chunk = j / count;
        task->panel = lo + j % count;
        return 1;
    }
    return 0;
}

/* One thread's share of amx_matmul: tasks, each a (chunk of x, panel) pair. Each thread starts from the
 * even split's share, chunk-major so that a chunk's packed rows stay in L2 while its panels pass, and once
 * that is done takes tasks from the back of another thread's: on a shared host the two cores' tile units
 * run at rates 2-3x apart for seconds at a time, each independently of the other (docs/benchmarks.md),
 * and an even split alone waits for the slower core at the end of every product.
 * (Tasks handed out one by one from a single counter balanced as well, but interleaved the threads'
 * weight rows: 4-14% slower than the even split on an LM head, 24 rows and 2,048 rows while the cores ran
 * alike.) A thread decodes the panel of its next task while it multiplies the current one, into the other
 * of its two buffers; or, when the decoded weight is ``shared`` by the chunks, into the panel's place there
 * during the first chunk, after which ``ready[p]`` is set, and a later chunk's task on panel p waits for it. */
static void amx_claimed_panels(const ts_qmat *w, const uint32_t *packed, int64_t kb, int64_t k, int64_t mp, int64_t m,
                               int64_t panels, uint16_t *shared, int *ready, uint16_t *panel, uint8_t *copy,
                               float *out, int64_t out_stride, ts_task_list *lists, int64_t nth, int64_t tid) {
    const int64_t panel_values = TS_PANEL * k, chunk_tiles = TS_AMX_M_CHUNK / 16;
    ts_panel_decode decoder;
    int64_t first, col0, slot = 0;
    ts_amx_task task, following;
    int have = next_amx_task(lists, nth, tid, panels, &task);
    /* whether the thread that claims a task decodes its panel */
#define TS_DECODES(t) (shared == NULL || (t).chunk == 0)
#define TS_DECODE_INTO(t, buffer) (shared != NULL ? shared + (t).panel * panel_values : panel + (buffer) * panel_values)
    if (have && TS_DECODES(task)) {
        const ts_qseg *seg = ts_panel_segment(w, task.panel, TS_PANEL, &first, &col0);
        panel_decode_start(&decoder, seg, first * TS_PANEL, k, TS_DECODE_INTO(task, 0), copy);
        panel_decode_some(&decoder, INT64_MAX);
        if (shared != NULL) __atomic_store_n(&ready[task.panel], 1, __ATOMIC_RELEASE);
    }
    while (have) {
        const int64_t mt_lo = task.chunk * chunk_tiles;
        const int64_t mt_hi = mp / 16 < mt_lo + chunk_tiles ? mp / 16 : mt_lo + chunk_tiles;
        const ts_qseg *seg = ts_panel_segment(w, task.panel, TS_PANEL, &first, &col0);
        const int more = next_amx_task(lists, nth, tid, panels, &following);
        ts_panel_decode *next = NULL;
        if (more && TS_DECODES(following)) {
            int64_t next_first, next_col0;
            const ts_qseg *next_seg = ts_panel_segment(w, following.panel, TS_PANEL, &next_first, &next_col0);
            panel_decode_start(&decoder, next_seg, next_first * TS_PANEL, k, TS_DECODE_INTO(following, 1 - slot), copy);
            next = &decoder;
        }
        if (shared != NULL && !__atomic_load_n(&ready[task.panel], __ATOMIC_ACQUIRE)) {
            /* Decoded by whichever thread took the panel's first chunk. Finish the panel this thread took
             * to decode first: two threads each waiting for the panel the other would decode next would
             * otherwise wait for ever. A thread that waits then holds no undecoded panel, and the panel
             * waited for is claimed (by a thread that only waits likewise) or at the front of a list whose
             * owner is not waiting. */
            if (next != NULL) {
                panel_decode_some(next, INT64_MAX);
                __atomic_store_n(&ready[following.panel], 1, __ATOMIC_RELEASE);
                next = NULL;
            }
            /* spins a little, then yields: with more threads than cores the decoding thread may be waiting
             * for this one's core */
            for (int spins = 0; !__atomic_load_n(&ready[task.panel], __ATOMIC_ACQUIRE); spins++) {
                if (spins < 4096) _mm_pause();
                else sched_yield();
            }
        }
        amx_panel_tiles(shared != NULL ? shared + task.panel * panel_values : panel + slot * panel_values, packed, kb,
                        k, mt_lo, mt_hi, seg, first * TS_PANEL, col0, w->bias, m, out, out_stride, next);
        panel_decode_some(next, INT64_MAX); /* whatever the tiles left */
        if (next != NULL && shared != NULL) __atomic_store_n(&ready[following.panel], 1, __ATOMIC_RELEASE);
        task = following;
        have = more;
        slot = 1 - slot;
    }
#undef TS_DECODES
#undef TS_DECODE_INTO
}

static int amx_matmul(const ts_qmat *w, const float *x, int64_t x_stride, int64_t m, int act, float *out,
                      int64_t out_stride, int num_threads) {
    const int64_t k = w->k, kb = k / TS_QBLOCK, mp = (m + 31) / 32 * 32;
    uint32_t *packed = aligned_alloc(64, sizeof(uint32_t) * (size_t)(mp * k / 2));
    if (packed == NULL) return -1;
    const int64_t panels = ts_panel_count(w, TS_PANEL);
    const int64_t chunks = (mp + TS_AMX_M_CHUNK - 1) / TS_AMX_M_CHUNK;
    const int64_t panel_values = TS_PANEL * k;
    uint16_t *shared = NULL; /* every panel decoded once, when x comes in several chunks */
    if (chunks > 1 && panels * panel_values * (int64_t)sizeof(uint16_t) <= TS_AMX_SHARED_PANELS_MAX)
        shared = aligned_alloc(64, sizeof(uint16_t) * (size_t)(panels * panel_values));
    int64_t copy_bytes = 0; /* an interleaved segment's rows are decoded from a copy in the file's order */
    for (int64_t s = 0; s < w->num_segs; s++)
        if (w->seg[s].layout == TS_LAYOUT_X8 && ts_qrow_bytes(w->seg[s].type, k) > copy_bytes)
            copy_bytes = ts_qrow_bytes(w->seg[s].type, k);
    int failed = 0;
    ts_task_list *lists = aligned_alloc(64, sizeof(ts_task_list) * (size_t)(num_threads > 1 ? num_threads : 1));
    if (lists == NULL) {
        free(shared);
        free(packed);
        return -1;
    }
    int *ready = shared != NULL ? calloc((size_t)panels, sizeof(int)) : NULL; /* panel p of shared is decoded */
    if (shared != NULL && ready == NULL) {
        free(shared);
        shared = NULL;
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *activated = act ? malloc(sizeof(float) * (size_t)(16 * k)) : NULL; /* a tile's SwiGLU rows */
        uint8_t *copy = copy_bytes > 0 ? malloc((size_t)copy_bytes) : NULL; /* a row of an x8 segment, back in order */
        /* two panels: the one multiplied, and the next one being decoded meanwhile */
        uint16_t *panel = shared != NULL ? NULL : aligned_alloc(64, sizeof(uint16_t) * (size_t)(2 * panel_values));
        if ((act && activated == NULL) || (shared == NULL && panel == NULL) || (copy_bytes > 0 && copy == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
        { /* this thread's share of the tasks (amx_claimed_panels); the loop's barrier publishes it */
            int64_t lo, count;
            amx_share(omp_get_thread_num(), omp_get_num_threads(), panels, &lo, &count);
            __atomic_store_n(&lists[omp_get_thread_num()].range, task_range(0, chunks * count), __ATOMIC_RELAXED);
        }
#pragma omp for schedule(static)
        for (int64_t mt = 0; mt < mp / 16; mt++) { /* every tile of the padded rows: those past m are zero */
            const int64_t r0 = mt * 16, valid = m - r0 >= 16 ? 16 : (m > r0 ? m - r0 : 0);
            const float *rows[16];
            for (int64_t c = 0; c < valid; c++) {
                rows[c] = x + (r0 + c) * x_stride;
                if (act && activated != NULL) {
                    swiglu_row(rows[c], k, activated + c * k);
                    rows[c] = activated + c * k;
                }
            }
            if (!act || activated != NULL) pack_tile_bf16(rows, valid, mt, k, packed);
        }
        if (!failed) {
            const ts_tilecfg cfg = ts_tilecfg_16x64(8);
            _tile_loadconfig(&cfg);
            amx_claimed_panels(w, packed, kb, k, mp, m, panels, shared, ready, panel, copy, out, out_stride, lists,
                               omp_get_num_threads(), omp_get_thread_num());
            _tile_release();
        }
        free(activated);
        free(copy);
        free(panel);
    }
    free(lists);
    free(ready);
    free(shared);
    free(packed);
    return failed ? -1 : 0;
}
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------------------------- dispatch */
static int ts_isa_detected = -1;
static int ts_isa_cap = TS_QG_AMX;

/* qgemm's paths from isa.c's level (one detection for every kernel, one cap: TIDESERVE_ISA): the AVX-512
 * row kernels need VNNI (vpdpbusd) besides AVX-512 F/BW/VL/DQ, the tiles need the AMX level. */
static int qgemm_path(int level) {
#ifdef TS_QGEMM_HAVE_AMX
    if (level >= TS_ISA_AMX) return TS_QG_AMX;
#endif
    if (level >= TS_ISA_AVX512 && (ts_cpu_features() & TS_CPU_AVX512_VNNI)) return TS_QG_AVX512;
    if (level >= TS_ISA_AVX2) return TS_QG_AVX2;
    return TS_QG_SCALAR;
}

static int detect_isa(void) { return qgemm_path(ts_isa_best()); }

/* The best path this CPU (and this build) has: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX. */
int ts_qgemm_isa(void) {
    if (ts_isa_detected < 0) ts_isa_detected = detect_isa();
    return ts_isa_detected;
}

/* Use at most path ``cap`` from now on (tests run each path this way); returns the previous cap. */
int ts_qgemm_set_isa(int cap) {
    const int previous = ts_isa_cap;
    ts_isa_cap = cap < 0 ? TS_QG_AMX : cap;
    return previous;
}

/* Row count from which the tiles (AMX, or AVX2's) are used instead of the row kernels, for every path;
 * 0 restores each path's own threshold. Returns the previous override. */
int ts_qgemm_set_tile_min_rows(int rows) {
    const int previous = ts_tile_min_rows_override;
    ts_tile_min_rows_override = rows < 0 ? 0 : rows;
    return previous;
}

/* Whether every AMX task starts in thread 0's list (1) or each thread starts from an even share (0, the
 * default): tests make the other threads take all their work from thread 0's list. Returns the previous
 * setting. */
int ts_qgemm_set_amx_one_list(int on) {
    const int previous = ts_amx_one_list;
    ts_amx_one_list = on != 0;
    return previous;
}

/* AMX tasks threads took from another thread's list since the library loaded (tests: the taking ran). */
int64_t ts_qgemm_amx_tasks_taken(void) { return __atomic_load_n(&ts_amx_taken, __ATOMIC_RELAXED); }

/* Whether the matrix-vector kernel (qgemm_gemv.h) takes the products below the tiles' threshold
 * over the formats it has (1, the default) or the row kernels do (0: tests compare the two). Returns the
 * previous setting. */
int ts_qgemm_set_gemv(int enabled) {
    const int previous = ts_gemv_enabled;
    ts_gemv_enabled = enabled != 0;
    return previous;
}

/* Whether the matrix-vector kernel (AVX2's, or its VNNI twin) takes a format's products below the tiles, on
 * path isa (AMX CPUs run the VNNI one below the AMX tiles). */
static int gemv_for(int isa, int64_t type) {
#ifdef TS_QGEMM_X86
    return isa >= TS_QG_AVX2 && ts_gemv_enabled && gemv_has_format_avx2(type);
#else
    (void)isa;
    (void)type;
    return 0;
#endif
}

/* type: the weight's format, or -1 for "any format" (the threshold of the common formats). */
static int tile_min_rows(int isa, int64_t type) {
    if (ts_tile_min_rows_override > 0) return ts_tile_min_rows_override;
    if (isa >= TS_QG_AMX) return TS_AMX_MIN_ROWS;
    if (gemv_for(isa, type)) return gemv_max_rows(isa, type) + 1;
    return type == TS_Q8_0 ? TS_AVX2_TILE_MIN_ROWS_Q8_0 : TS_AVX2_TILE_MIN_ROWS;
}

/* The path the kernels take now: the CPU's best, capped by isa.c's level and by ts_qgemm_set_isa. */
int ts_qgemm_active_isa(void) {
    const int level = qgemm_path(ts_isa_level());
    return level < ts_isa_cap ? level : ts_isa_cap;
}

/* Which kernel (TS_K_*) a product of m rows over a weight in format ``type`` takes now. */
int ts_qgemm_kernel_for(int64_t m, int64_t type) {
    int isa = ts_qgemm_active_isa();
#ifdef TS_QGEMM_HAVE_AMX
    if (isa >= TS_QG_AMX && m >= tile_min_rows(isa, type)) return TS_K_AMX_TILES;
#endif
    if (isa > TS_QG_AVX512) isa = TS_QG_AVX512; /* below its threshold an AMX CPU takes the AVX-512 VNNI plan */
#ifdef TS_QGEMM_X86
    if (isa == TS_QG_AVX2 && m >= tile_min_rows(isa, type)) return TS_K_AVX2_TILES;
    if (isa == TS_QG_AVX512 && m >= tile_min_rows(isa, type)) return TS_K_AVX512_TILES;
#endif
    if (!gemv_for(isa, type)) return TS_K_ROWS;
    return isa == TS_QG_AVX512 ? TS_K_AVX512_GEMV : TS_K_AVX2_GEMV;
}

static int is_tiles(int kernel) {
    return kernel == TS_K_AVX2_TILES || kernel == TS_K_AMX_TILES || kernel == TS_K_AVX512_TILES;
}

/* A layer's tiles (TS_K_*_TILES) when every segment is past its format's threshold, else TS_K_ROWS: below
 * it, each segment takes the matrix-vector kernel or the row kernels by its own format (rows_matmul). */
static int kernel_for_weight(const ts_qmat *w, int64_t m) {
    int kernel = TS_K_ROWS;
    for (int64_t s = 0; s < w->num_segs; s++) {
        const int k = ts_qgemm_kernel_for(m, w->seg[s].type);
        if (!is_tiles(k)) return TS_K_ROWS;
        kernel = k;
    }
    return kernel;
}

typedef void (*ts_row_kernel)(int, const uint8_t *, int64_t, const ts_act *, int64_t, int, float *);

/* x quantized to 8 bits per block (SwiGLU applied first for act 1), then multiplied by the row kernel
 * ``kernel`` or, with ``tiles`` (AVX2 builds only), by the AVX2 tiles; on the AVX2 path, the segments in a
 * format qgemm_gemv_avx2.h takes go 8 weight rows at a time through its kernel. The row kernels read an
 * interleaved group's rows through a per-thread copy in the file's layout (only tests and capped paths
 * take them over such a segment). */
static int rows_matmul(const ts_qmat *w, const float *x, int64_t x_stride, int64_t m, int act, float *out,
                       int64_t out_stride, int num_threads, int isa, int tiles) {
    ts_row_kernel kernel = dot_row_group_scalar;
#ifdef TS_QGEMM_X86
    if (isa == TS_QG_AVX2) kernel = dot_row_group_avx2;
    if (isa == TS_QG_AVX512) kernel = dot_row_group_avx512;
#endif
    const int64_t k = w->k, kb = k / TS_QBLOCK;
    const int regroup = tiles && isa == TS_QG_AVX512;
    const int64_t grouped_rows = (m + TS_ACT_GROUP - 1) / TS_ACT_GROUP * TS_ACT_GROUP;
    int int_offsets = 0, code_offsets = 0; /* tb, qb: the integer offsets' x sums, only where a segment needs them */
    for (int64_t s = 0; s < w->num_segs; s++) {
        int_offsets |= ts_tile_int_offset_shift((int)w->seg[s].type, isa == TS_QG_AVX512) != 0;
        code_offsets |= ts_tile_int_offset_shift((int)w->seg[s].type, 0) != 0;
    }
    /* qb, per row: AVX2's tiles, and every matrix-vector and SIMD row kernel, take the same integer offsets */
    const int row_sums = isa != TS_QG_SCALAR && (regroup ? 0 : (tiles ? int_offsets : code_offsets));
    ts_act a = {malloc((size_t)(m * k)), malloc(sizeof(float) * (size_t)(m * kb)),
                malloc(sizeof(float) * (size_t)(2 * m * kb)), k, kb,
                regroup ? malloc((size_t)(grouped_rows * k)) : NULL,
                regroup ? malloc(sizeof(float) * (size_t)(grouped_rows * kb)) : NULL,
                regroup ? malloc(sizeof(float) * (size_t)(3 * grouped_rows * kb)) : NULL,
                regroup && int_offsets ? malloc(sizeof(int32_t) * (size_t)(3 * grouped_rows * kb)) : NULL,
                row_sums ? malloc(sizeof(int32_t) * (size_t)(2 * m * kb)) : NULL};
    float *activated = act ? malloc(sizeof(float) * (size_t)(m * k)) : NULL;
    /* per thread, one row in the file's layout: the row kernels' copy of an interleaved group's row */
    int64_t scratch_bytes = 0;
    for (int64_t s = 0; !tiles && s < w->num_segs; s++) {
        const int64_t bytes = ts_qrow_bytes(w->seg[s].type, k);
        if (w->seg[s].layout == TS_LAYOUT_X8 && bytes > scratch_bytes) scratch_bytes = bytes;
    }
    uint8_t *scratch_rows = scratch_bytes ? malloc((size_t)(scratch_bytes * (num_threads > 1 ? num_threads : 1))) : NULL;
    if (a.q == NULL || a.d == NULL || a.s == NULL || (act && activated == NULL) || (scratch_bytes && scratch_rows == NULL) ||
        (regroup && (a.tq == NULL || a.td == NULL || a.ts == NULL || (int_offsets && a.tb == NULL))) ||
        (row_sums && a.qb == NULL)) {
        free(a.q);
        free(a.d);
        free(a.s);
        free(a.tq);
        free(a.td);
        free(a.ts);
        free(a.tb);
        free(a.qb);
        free(activated);
        free(scratch_rows);
        return -1;
    }
    int64_t bytes = 0;
    for (int64_t s = 0; s < w->num_segs; s++) bytes += w->seg[s].n * ts_qrow_bytes(w->seg[s].type, k);
    const int parallel = bytes * (m < 8 ? 1 : m / 8) >= TS_QGEMM_PARALLEL_MIN && num_threads > 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const float *row = x + i * x_stride;
            if (act) {
                swiglu_row(row, k, activated + i * k);
                row = activated + i * k;
            }
            quantize_row_q8(row, k, a.q + i * k, a.d + i * kb, a.s + 2 * i * kb);
            if (regroup) regroup_row(&a, i);
            if (row_sums) code_sums_row(&a, i);
        }
#ifdef TS_QGEMM_X86
        if (tiles && (isa == TS_QG_AVX512 ? tiles_matmul_share_avx512 : tiles_matmul_share_avx2)(w, &a, m, out,
                                                                                                 out_stride) != 0) {
#pragma omp atomic write
            failed = 1;
        }
#endif
        uint8_t *scratch = scratch_rows + omp_get_thread_num() * scratch_bytes;
        for (int64_t s = 0; !tiles && s < w->num_segs; s++) {
            const ts_qseg *seg = w->seg + s;
            int64_t col0 = 0;
            for (int64_t t = 0; t < s; t++) col0 += w->seg[t].n;
            const int64_t row_bytes = ts_qrow_bytes(seg->type, k);
            int64_t groups = 0;
#ifdef TS_QGEMM_X86
            if (gemv_for(isa, seg->type)) groups = seg->n / TS_GEMV_GROUP;
            const int64_t group_bytes = TS_GEMV_GROUP * row_bytes;
            const int x8 = seg->layout == TS_LAYOUT_X8;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *rows = seg->data + g * group_bytes;
                for (int64_t i0 = 0; i0 < m; i0 += TS_GEMV_ROWS) {
                    const int n_rows = (int)(m - i0 < TS_GEMV_ROWS ? m - i0 : TS_GEMV_ROWS);
                    float res[TS_GEMV_ROWS][TS_GEMV_GROUP];
                    (isa == TS_QG_AVX512 ? gemv_group_any_avx512 : gemv_group_any_avx2)(
                        (int)seg->type, x8, n_rows, rows, row_bytes, kb, &a, i0, rows + TS_GEMV_AHEAD * group_bytes,
                        i0 == 0 ? group_bytes : 0, res);
                    for (int i = 0; i < n_rows; i++)
                        for (int c = 0; c < TS_GEMV_GROUP; c++) {
                            const int64_t col = col0 + g * TS_GEMV_GROUP + c;
                            out[(i0 + i) * out_stride + col] = res[i][c] + (w->bias != NULL ? w->bias[col] : 0.0f);
                        }
                }
            }
#endif
#pragma omp for schedule(static) nowait
            for (int64_t c = groups * TS_GEMV_GROUP; c < seg->n; c++) {
                float res[TS_QGEMM_ROWS];
                const float add = w->bias != NULL ? w->bias[col0 + c] : 0.0f;
                prefetch_ahead(seg->data + c * row_bytes, row_bytes);
                const uint8_t *weight_row = ts_x8_row(seg, c, row_bytes, scratch);
                for (int64_t i0 = 0; i0 < m; i0 += TS_QGEMM_ROWS) {
                    const int rows = (int)(m - i0 < TS_QGEMM_ROWS ? m - i0 : TS_QGEMM_ROWS);
                    kernel((int)seg->type, weight_row, kb, &a, i0, rows, res);
                    for (int i = 0; i < rows; i++) out[(i0 + i) * out_stride + col0 + c] = res[i] + add;
                }
            }
        }
    }
    free(a.q);
    free(a.d);
    free(a.s);
    free(a.tq);
    free(a.td);
    free(a.ts);
    free(a.tb);
    free(a.qb);
    free(activated);
    free(scratch_rows);
    return failed ? -1 : 0;
}

/* out[i, c] = sum_j a(x)[i, j] * W[c, j] (+ bias[c]) for i < m, c < w->n. act 0: a(x) = x, rows of k values;
 * act 1 (SwiGLU, the MLP's down projection): rows of 2k values, a(x) = silu(first half) * second half, so
 * the gate/up product never goes through memory as a tensor. Returns 0, or -1 when the weight is not one
 * the kernels take (k not a multiple of the formats' units, an unknown format) or scratch memory cannot
 * be had (out untouched). */
int ts_qmatmul_f32(const ts_qmat *w, const float *x, int64_t x_stride, int64_t m, int act, float *out,
                   int64_t out_stride, int num_threads) {
    if (m <= 0 || w->n <= 0 || w->num_segs < 1 || w->num_segs > TS_QMAT_SEGS || (act != 0 && act != 1)) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < w->num_segs; s++) {
        if (!ts_qtype_known(w->seg[s].type) || w->k % ts_qunit(w->seg[s].type) != 0 || w->seg[s].n <= 0) return -1;
        n += w->seg[s].n;
    }
    if (n != w->n) return -1;
    const int isa = ts_qgemm_active_isa(), kernel = kernel_for_weight(w, m);
#ifdef TS_QGEMM_HAVE_AMX
    /* the AMX panels read an interleaved (x8) weight through copies of its rows; the loader interleaves for
     * AVX2 and AVX-512 only, so that happens only when the ISA is capped and lifted between load and use */
    if (kernel == TS_K_AMX_TILES) return amx_matmul(w, x, x_stride, m, act, out, out_stride, num_threads);
#endif
#ifdef TS_QGEMM_X86
    if (isa >= TS_QG_AVX512) /* AMX's CPUs below its threshold take these too */
        return rows_matmul(w, x, x_stride, m, act, out, out_stride, num_threads, TS_QG_AVX512,
                           kernel == TS_K_AVX512_TILES);
    if (isa >= TS_QG_AVX2)
        return rows_matmul(w, x, x_stride, m, act, out, out_stride, num_threads, TS_QG_AVX2,
                           kernel == TS_K_AVX2_TILES);
#endif
    return rows_matmul(w, x, x_stride, m, act, out, out_stride, num_threads, TS_QG_SCALAR, 0);
}

/* out[i] = the dequantized row ids[i] of a [rows, k] weight in format ``type`` and ``layout`` (embedding
 * lookups on a quantized table, rows the table's). Returns 0, or -1 for a format, k or layout the kernels do
 * not take. */
int ts_qdequant_rows_f32(int64_t type, const uint8_t *data, int64_t rows, int64_t layout, int64_t k,
                         const int64_t *ids, int64_t count, float *out, int num_threads) {
    if (!ts_qtype_known(type) || k % ts_qunit(type) != 0) return -1;
    if (layout != TS_LAYOUT_ROWS && !(layout == TS_LAYOUT_X8 && ts_x8_supported(type))) return -1;
    const int64_t row_bytes = ts_qrow_bytes(type, k), kb = k / TS_QBLOCK;
    const ts_qseg seg = {type, data, rows, layout};
    const int threads = num_threads > 1 ? num_threads : 1;
    uint8_t *scratch_rows = layout == TS_LAYOUT_X8 ? malloc((size_t)(row_bytes * threads)) : NULL;
    if (layout == TS_LAYOUT_X8 && scratch_rows == NULL) return -1;
#pragma omp parallel num_threads(threads) if (count * k >= 65536 && threads > 1)
    {
    uint8_t *scratch = scratch_rows == NULL ? NULL : scratch_rows + omp_get_thread_num() * row_bytes;
#pragma omp for
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = ts_x8_row(&seg, ids[i], row_bytes, scratch);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t codes[32];
            float s[2], o[2];
            ts_block_decode(type, row, b, codes, s, o);
            float *dst = out + i * k + b * TS_QBLOCK;
            for (int j = 0; j < 32; j++) {
                const float c = ts_qtype_signed(type) ? (float)(int8_t)codes[j] : (float)codes[j];
                dst[j] = s[j >= 16] * c + o[j >= 16];
            }
        }
    }
    }
    free(scratch_rows);
    return 0;
}

/* Whether weights in format ``type`` should be interleaved (TS_LAYOUT_X8) on the path taken now: AVX2's
 * matrix-vector kernel and tiles read that layout directly; the other paths would only copy it back. */
int ts_qgemm_x8_preferred(int64_t type) {
#ifdef TS_QGEMM_X86
    const int isa = ts_qgemm_active_isa();
    return (isa == TS_QG_AVX2 || isa == TS_QG_AVX512) && ts_x8_supported(type);
#else
    (void)type;
    return 0;
#endif
}

/* dst = the n rows of k values at src in format ``type``, interleaved (to_x8 1) or back in the file's
 * layout (to_x8 0). src and dst are n x row_bytes and must not overlap. Returns 0, or -1 for a format the
 * interleaved layout does not have. */
int ts_qgemm_relayout(int64_t type, const uint8_t *src, uint8_t *dst, int64_t n, int64_t k, int to_x8) {
    if (!ts_x8_supported(type) || k % ts_qunit(type) != 0) return -1;
    const int64_t row_bytes = ts_qrow_bytes(type, k), unit_bytes = ts_qunit_bytes(type), blocks = row_bytes / unit_bytes;
    const int64_t grouped = n / 8 * 8;
    /* groups in parallel: a 1.7B Q4_K_M model's ~1 GB took 0.7 s on one core at load */
#pragma omp parallel for schedule(static) if (grouped * row_bytes >= ((int64_t)1 << 20))
    for (int64_t g = 0; g < grouped; g += 8) {
        for (int64_t c = 0; c < 8; c++) {
            const int64_t group_at = g * row_bytes, row_at = (g + c) * row_bytes;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t block_at = row_at + b * unit_bytes;
                if (to_x8) ts_x8_block_copy(type, src + block_at, dst + group_at, c, b, 1);
                else ts_x8_block_copy(type, src + group_at, dst + block_at, c, b, 0);
            }
        }
    }
    memcpy(dst + grouped * row_bytes, src + grouped * row_bytes, (size_t)((n - grouped) * row_bytes));
    return 0;
}
