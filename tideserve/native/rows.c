/* Row-wise float32 kernels that torch runs as four to seven separate operators each: RMSNorm (with the
 * residual add before it), and the per-token scaling around an int8 GEMM. Each one is a single pass over
 * the rows here, which matters most for small batches, where every torch operator costs more in dispatch
 * and thread wake-ups than in arithmetic. Rows are contiguous; threads split the rows of large inputs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements a single thread beats waking the others. */
#define TS_PARALLEL_MIN 32768

static inline void rms_row(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; c++) sum += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) out[c] = (x[c] * inv) * weight[c];
}

/* out = x / rms(x) * weight. */
void ts_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * cols, weight, out + r * cols, cols, eps);
}

/* residual += x, then out = residual / rms(residual) * weight. */
void ts_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= TS_PARALLEL_MIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * cols;
        const float *xr = x + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) res[c] += xr[c];
        rms_row(res, weight, out + r * cols, cols, eps);
    }
}

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
