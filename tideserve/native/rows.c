/* Row-wise kernels that torch runs as four to seven separate operators each: RMSNorm (with the residual
 * add before it), in float32 and bfloat16, and the per-token scaling around an int8 GEMM. Each one is a
 * single pass over the rows here, which matters most for small batches, where every torch operator costs
 * more in dispatch and thread wake-ups than in arithmetic. Rows are contiguous; threads split the rows of
 * large inputs.
 *
 * RMSNorm has a scalar reference, an AVX2 and an AVX-512 path (ts_isa_level); in bfloat16 the AVX-512 BF16
 * level rounds with vcvtneps2bf16. Every path computes out = (x * inv_rms) * weight with the sum of squares
 * in float32, and in bfloat16 rounds each stored value once, as torch's operators do: the residual sum
 * (like ``residual.add_(x)``) and the output (like F.rms_norm). Only the order of the float32 sum of
 * squares differs between paths. The int8 helpers are plain loops the compiler vectorizes for the build's
 * instruction set: there is nothing for hand-written paths to add.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tideserve_native.h"
#include "ts_simd.h"

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

#ifdef TS_HAVE_AVX2
static void rms_row_f32_avx2(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    float sum = ts_hsum256(_mm256_add_ps(s0, s1));
    for (; c < cols; c++) sum += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (c = 0; c + 8 <= cols; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), vinv), _mm256_loadu_ps(weight + c)));
    for (; c < cols; c++) out[c] = (x[c] * inv) * weight[c];
}
#endif

#ifdef TS_HAVE_AVX512
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static void rms_row_f32_avx512(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
        s0 = _mm512_fmadd_ps(a, a, s0);
        s1 = _mm512_fmadd_ps(b, b, s1);
    }
    for (; c < cols; c += 16) {
        const __m512 a = _mm512_maskz_loadu_ps(tail_mask(cols - c), x + c);
        s0 = _mm512_fmadd_ps(a, a, s0);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / (float)cols + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (c = 0; c < cols; c += 16) {
        const __mmask16 m = tail_mask(cols - c);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vinv),
                                       _mm512_maskz_loadu_ps(m, weight + c));
        _mm512_mask_storeu_ps(out + c, m, y);
    }
}
#endif

static void rms_row_f32(int isa, const float *x, const float *weight, float *out, int64_t cols, float eps) {
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512) {
        rms_row_f32_avx512(x, weight, out, cols, eps);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2) {
        rms_row_f32_avx2(x, weight, out, cols, eps);
        return;
    }
#endif
    (void)isa;
    rms_row_f32_scalar(x, weight, out, cols, eps);
}

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

/* ---------------------------------------------------------------- bfloat16 RMSNorm */

/* One row: with ``x`` non-NULL, first res = bf16(res + x) (res is then the row to normalise); out =
 * bf16((res * inv) * weight). */
static void rms_row_bf16_scalar(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out,
                                int64_t cols, float eps) {
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        float v = ts_bf16_to_f32(res[c]);
        if (x != NULL) {
            const uint16_t h = ts_f32_to_bf16(v + ts_bf16_to_f32(x[c]));
            res[c] = h;
            v = ts_bf16_to_f32(h);
        }
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++) out[c] = ts_f32_to_bf16((ts_bf16_to_f32(res[c]) * inv) * ts_bf16_to_f32(weight[c]));
}

#ifdef TS_HAVE_AVX2
static void rms_row_bf16_avx2(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out, int64_t cols,
                              float eps) {
    __m256 s0 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 v = ts_load_bf16x8(res + c);
        if (x != NULL) {
            v = ts_round_bf16_256(_mm256_add_ps(v, ts_load_bf16x8(x + c)));
            ts_store_bf16x8(res + c, v); /* exact: v is already a bfloat16 value */
        }
        s0 = _mm256_fmadd_ps(v, v, s0);
    }
    float sum = ts_hsum256(s0);
    for (; c < cols; c++) {
        float v = ts_bf16_to_f32(res[c]);
        if (x != NULL) {
            const uint16_t h = ts_f32_to_bf16(v + ts_bf16_to_f32(x[c]));
            res[c] = h;
            v = ts_bf16_to_f32(h);
        }
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (c = 0; c + 8 <= cols; c += 8)
        ts_store_bf16x8(out + c, _mm256_mul_ps(_mm256_mul_ps(ts_load_bf16x8(res + c), vinv), ts_load_bf16x8(weight + c)));
    for (; c < cols; c++) out[c] = ts_f32_to_bf16((ts_bf16_to_f32(res[c]) * inv) * ts_bf16_to_f32(weight[c]));
}
#endif

#ifdef TS_HAVE_AVX512
/* ``cvt``: round with vcvtneps2bf16 (AVX-512 BF16) instead of integer arithmetic; a constant per caller. */
TS_ALWAYS_INLINE void rms_row_bf16_avx512_impl(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out,
                                               int64_t cols, float eps, const int cvt) {
    __m512 s0 = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = tail_mask(cols - c);
        __m512 v = ts_maskz_load_bf16x16(m, res + c);
        if (x != NULL) {
            v = _mm512_add_ps(v, ts_maskz_load_bf16x16(m, x + c));
#ifdef TS_HAVE_AVX512BF16
            if (cvt) {
                v = ts_round_bf16_512_bf16(v);
                ts_mask_store_bf16x16_bf16(res + c, m, v);
            } else
#endif
            {
                v = ts_round_bf16_512(v);
                ts_mask_store_bf16x16(res + c, m, v);
            }
        }
        s0 = _mm512_fmadd_ps(v, v, s0);
    }
    const __m512 vinv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(s0) / (float)cols + eps));
    for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = tail_mask(cols - c);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(ts_maskz_load_bf16x16(m, res + c), vinv),
                                       ts_maskz_load_bf16x16(m, weight + c));
#ifdef TS_HAVE_AVX512BF16
        if (cvt) {
            ts_mask_store_bf16x16_bf16(out + c, m, y);
            continue;
        }
#endif
        ts_mask_store_bf16x16(out + c, m, y);
    }
    (void)cvt;
}
#endif

static void rms_row_bf16(int isa, const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out, int64_t cols,
                         float eps) {
#ifdef TS_HAVE_AVX512BF16
    if (isa >= TS_ISA_AVX512_BF16) {
        rms_row_bf16_avx512_impl(x, res, weight, out, cols, eps, 1);
        return;
    }
#endif
#ifdef TS_HAVE_AVX512
    if (isa >= TS_ISA_AVX512) {
        rms_row_bf16_avx512_impl(x, res, weight, out, cols, eps, 0);
        return;
    }
#endif
#ifdef TS_HAVE_AVX2
    if (isa >= TS_ISA_AVX2) {
        rms_row_bf16_avx2(x, res, weight, out, cols, eps);
        return;
    }
#endif
    (void)isa;
    rms_row_bf16_scalar(x, res, weight, out, cols, eps);
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
