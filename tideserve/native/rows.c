/* Row-wise kernels that torch runs as four to seven separate operators each: RMSNorm (with the residual
 * add before it), in float32 and bfloat16, and the per-token scaling around an int8 GEMM. Each one is a
 * single pass over the rows here, which matters most for small batches, where every torch operator costs
 * more in dispatch and thread wake-ups than in arithmetic. Rows are contiguous (but for the per-head norms,
 * which walk heads inside wider rows); threads split the rows of large inputs.
 *
 * RMSNorm has a scalar reference and one body (rows_vec.h) compiled per vector level (ts_vec.h: AVX2,
 * AVX-512, chosen by ts_isa_level); in bfloat16 the AVX-512 BF16 level rounds with vcvtneps2bf16. Every
 * path computes out = (x * inv_rms) * weight with the sum of squares in float32, and in bfloat16 rounds
 * each stored value once, as torch's operators do: the residual sum (like ``residual.add_(x)``) and the
 * output (like F.rms_norm). Only the order of the float32 sum of squares differs between paths. The int8
 * helpers are plain loops the compiler vectorizes for the build's instruction set: there is nothing for
 * hand-written paths to add.
 */
#include "ts_align_loops.h" /* first: see there */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"
#include "ts_vec.h"

/* Below this many elements a single thread beats waking the others. */
#define TS_PARALLEL_MIN 32768

/* ---------------------------------------------------------------- float32 RMSNorm */

static void rms_row_f32_scalar(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; c++) sum += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) out[c] = (x[c] * inv) * weight[c];
}

/* ---------------------------------------------------------------- bfloat16 RMSNorm */

/* Column c of the row to normalise: res[c], or with ``x`` non-NULL res[c] = bf16(res[c] + x[c]) first. */
static inline float rms_bf16_input(const uint16_t *x, uint16_t *res, int64_t c) {
    float v = ts_bf16_to_f32(res[c]);
    if (x != NULL) {
        const uint16_t h = ts_f32_to_bf16(v + ts_bf16_to_f32(x[c]));
        res[c] = h;
        v = ts_bf16_to_f32(h);
    }
    return v;
}

static inline uint16_t rms_bf16_output(const uint16_t *res, const uint16_t *weight, int64_t c, float inv) {
    return ts_f32_to_bf16((ts_bf16_to_f32(res[c]) * inv) * ts_bf16_to_f32(weight[c]));
}

/* One row: with ``x`` non-NULL, first res = bf16(res + x) (res is then the row to normalise); out =
 * bf16((res * inv) * weight). */
static void rms_row_bf16_scalar(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out,
                                int64_t cols, float eps) {
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        const float v = rms_bf16_input(x, res, c);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++) out[c] = rms_bf16_output(res, weight, c, inv);
}

/* ---------------------------------------------------------------- vector levels (rows_vec.h) and dispatch */

#define TSV_BODY "rows_vec.h"
#define TSV_BODY_FTZ
#include "ts_vec_each.h"
#undef TSV_BODY_FTZ
#undef TSV_BODY

static void rms_row_f32(int isa, const float *x, const float *weight, float *out, int64_t cols, float eps) {
    TSV_CALL(isa, rms_row_f32, x, weight, out, cols, eps);
}

static void rms_row_bf16(int isa, const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out, int64_t cols,
                         float eps) {
    TSV_CALL_FTZ(isa, rms_row_bf16, x, res, weight, out, cols, eps);
}

/* ---------------------------------------------------------------- exports */

/* residual += x (one row). */
static void add_row_f32(float *res, const float *x, int64_t cols) {
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) res[c] += x[c];
}

void ts_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
                     int num_threads) {
    const int isa = ts_isa_level();
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) rms_row_f32(isa, x + r * cols, weight, out + r * cols, cols, eps);
}

void ts_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t cols, float eps, int num_threads) {
    const int isa = ts_isa_level();
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        add_row_f32(residual + r * cols, x + r * cols, cols);
        rms_row_f32(isa, residual + r * cols, weight, out + r * cols, cols, eps);
    }
}

void ts_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t cols,
                      float eps, int num_threads) {
    const int isa = ts_isa_level();
    /* Without a residual the row is only read: the cast drops const for the shared row function. */
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        rms_row_bf16(isa, NULL, (uint16_t *)(x + r * cols), weight, out + r * cols, cols, eps);
}

void ts_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                          int64_t rows, int64_t cols, float eps, int num_threads) {
    const int isa = ts_isa_level();
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        rms_row_bf16(isa, x + r * cols, residual + r * cols, weight, out + r * cols, cols, eps);
}

/* ---------------------------------------------------------------- per-head RMSNorm, in place */

/* Qwen3's q and k norms: every head_dim-wide head of the q (or k) part of the fused qkv output is normalised
 * on its own, before rotary. Those heads lie inside rows of the whole qkv width, so the row kernels above
 * (contiguous rows) would need a copy in and out; these walk the strided heads in place with the same row
 * functions, so they give what ts_rms_norm_* gives over such a copy. */
void ts_rms_norm_heads_f32(float *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim,
                           const float *weight, float eps, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t rows = tokens * heads;
#pragma omp parallel for num_threads(num_threads) if (rows * head_dim >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *head = x + (r / heads) * stride + (r % heads) * head_dim;
        rms_row_f32(isa, head, weight, head, head_dim, eps); /* reads the whole head before writing it */
    }
}

void ts_rms_norm_heads_bf16(uint16_t *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim,
                            const uint16_t *weight, float eps, int num_threads) {
    const int isa = ts_isa_level();
    const int64_t rows = tokens * heads;
#pragma omp parallel for num_threads(num_threads) if (rows * head_dim >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *head = x + (r / heads) * stride + (r % heads) * head_dim;
        rms_row_bf16(isa, NULL, head, weight, head, head_dim, eps);
    }
}

/* ---------------------------------------------------------------- int8 GEMM helpers (float32) */

/* The int8 GEMM's input: out[r] = x[r] * inv_smooth / m[r], with m[r] = max |x[r] * inv_smooth| (at least
 * 1e-12) stored in row_max[r]; then one more row, out[rows] = (+1, 0, ..., 0, -1), which pins the GEMM's
 * per-call quantization range to [-1, 1] so every row keeps its own scale. inv_smooth may be NULL. */
void ts_int8_rows_f32(const float *x, const float *inv_smooth, float *out, float *row_max, int64_t rows,
                      int64_t cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *o = out + r * cols;
        float m = 0.0f;
        if (inv_smooth != NULL) {
#pragma omp simd reduction(max : m)
            for (int64_t c = 0; c < cols; c++) {
                o[c] = xr[c] * inv_smooth[c];
                m = fmaxf(m, fabsf(o[c]));
            }
        } else {
#pragma omp simd reduction(max : m)
            for (int64_t c = 0; c < cols; c++) {
                o[c] = xr[c];
                m = fmaxf(m, fabsf(xr[c]));
            }
        }
        m = m > 1e-12f ? m : 1e-12f;
        row_max[r] = m;
        const float inv = 1.0f / m;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) o[c] *= inv;
    }
    float *last = out + rows * cols;
    memset(last, 0, sizeof(float) * cols);
    last[0] = 1.0f;
    last[cols - 1] = -1.0f;
}

/* out[r] = y[r] * row_max[r] (+ bias), undoing ts_int8_rows_f32's scaling on the GEMM's output. */
void ts_scale_rows_f32(const float *y, const float *row_max, const float *bias, float *out, int64_t rows,
                       int64_t cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *yr = y + r * cols;
        float *o = out + r * cols;
        const float m = row_max[r];
        if (bias != NULL) {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = yr[c] * m + bias[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = yr[c] * m;
        }
    }
}

/* ---------------------------------------------------------------- greedy sampling */

/* out[r] = the index of the first largest value of row r (rows ``stride`` floats apart), which is what
 * torch's max(dim=-1).indices gives: a greedy batch's whole sampling step. torch took 2 ms for 64 rows of a
 * 49,152-token vocabulary (2 threads); one pass with a running maximum and index per lane reads the logits
 * once. A row with a NaN makes the call return -1 (out undefined) so the caller can let torch decide. */
int ts_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
    int saw_nan = 0;
    const int isa = ts_isa_level();
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1) \
    reduction(| : saw_nan)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float best = -INFINITY;
        int64_t at = 0, c = 0;
        int nan = 0;
#ifdef TS_HAVE_AVX512
        if (isa >= TS_ISA_AVX512 && cols >= 16 && cols < INT32_MAX) {
            __m512 lane_best = _mm512_set1_ps(-INFINITY);
            __m512i lane_at = _mm512_setzero_si512();
            __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            const __m512i sixteen = _mm512_set1_epi32(16);
            __mmask16 unordered = 0;
            for (; c + 16 <= cols; c += 16) {
                const __m512 v = _mm512_loadu_ps(xr + c);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                const __mmask16 above = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ); /* strict: first wins */
                lane_best = _mm512_mask_mov_ps(lane_best, above, v);
                lane_at = _mm512_mask_mov_epi32(lane_at, above, index);
                index = _mm512_add_epi32(index, sixteen);
            }
            best = _mm512_reduce_max_ps(lane_best);
            const __mmask16 tied = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
            at = _mm512_mask_reduce_min_epi32(tied, lane_at); /* the earliest of the lanes' maxima */
            nan = unordered != 0;
        }
#endif
        for (; c < cols; c++) {
            const float v = xr[c];
            nan |= v != v;
            if (v > best) {
                best = v;
                at = c;
            }
        }
        out[r] = at;
        saw_nan |= nan;
    }
    (void)isa;
    return saw_nan ? -1 : 0;
}
