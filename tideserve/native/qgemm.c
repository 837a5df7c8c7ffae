/* Linear layers over block-quantized weights: y = x W^T (+ bias) with W stored in blocks of 32 values.
 *
 * Why: a single decode stream multiplies each weight once per token, so its speed is the speed at which
 * weights stream from memory. Four bits per weight (plus two fp16 numbers per block) read about a
 * quarter of float32's bytes and half of int8's. Each call first quantizes x to 8 bits per block of 32
 * (one float scale per block), so a block's dot product is 32 byte products summed in integers
 * (AVX2's vpmaddubsw) and one float multiply-add, instead of 32 float conversions.
 *
 * Formats, for W [n, k] with k a multiple of 32, block b of row r covering columns 32b .. 32b+31:
 *   q4: qs  uint8 [n, k/2]: byte j of a block holds value j in its low nibble and value j+16 in its high
 *                           nibble (GGUF's Q4_1 layout); value = d * q + m, q in 0..15;
 *       d, m fp16 [n, k/32].
 *   q8: qs  int8  [n, k]:   value = d * q, q in -127..127;
 *       d    fp16 [n, k/32].
 * x and out are float32 rows (with strides); threads split the output columns.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TS_QGEMM_AVX2 1
#endif

#define TS_QBLOCK 32
/* Below this many weight bytes read per call, a single thread beats waking the others. */
#define TS_QGEMM_PARALLEL_MIN 65536
/* Rows of x that share one pass over a weight row. */
#define TS_QGEMM_ROWS 4

static inline float fp16_to_float(uint16_t h) {
#ifdef TS_QGEMM_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f;
    const uint32_t mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) {
        value = ldexpf((float)mantissa, -24); /* zero or subnormal */
    } else if (exponent == 31) {
        value = mantissa ? NAN : INFINITY;
    } else {
        value = ldexpf((float)(mantissa | 0x400), (int)exponent - 25);
    }
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits |= sign;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

/* Row r of x -> q[k] int8, scale[k/32] (value = scale * q) and sum[k/32] = scale * (sum of the block's q). */
static void quantize_row_q8(const float *x, int64_t k, int8_t *q, float *scale, float *sum) {
    for (int64_t b = 0; b < k / TS_QBLOCK; b++) {
        const float *xb = x + b * TS_QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < TS_QBLOCK; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax; /* not fmaxf: without -ffast-math that is a libm call per value */
        }
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        int total = 0;
        for (int i = 0; i < TS_QBLOCK; i++) {
            const int v = (int)lrintf(xb[i] * inv);
            q[b * TS_QBLOCK + i] = (int8_t)v;
            total += v;
        }
        scale[b] = d;
        sum[b] = d * (float)total;
    }
}

#ifdef TS_QGEMM_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned 4-bit values of a q4 block, in column order, one per byte. */
static inline __m256i load_q4(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)p);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(hi, lo);
}
#endif

/* out[i][col] for the rows i < rows (at most TS_QGEMM_ROWS) of quantized x, one q4 weight row. Inlined
 * into callers that pass a constant ``rows``, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_q4(const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t nblocks, const int8_t *xq,
                   const float *xd, const float *xs, int64_t kx, int64_t kb, int rows, float *acc_out) {
#ifdef TS_QGEMM_AVX2
    __m256 acc[TS_QGEMM_ROWS];
    float min_term[TS_QGEMM_ROWS];
    for (int i = 0; i < rows; i++) {
        acc[i] = _mm256_setzero_ps();
        min_term[i] = 0.0f;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nblocks; b++) {
        const __m256i w = load_q4(wq + b * (TS_QBLOCK / 2));
        const float d = _cvtsh_ss(wd[b]);
        const float m = _cvtsh_ss(wm[b]);
        for (int i = 0; i < rows; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * kx + b * TS_QBLOCK));
            const __m256i pairs = _mm256_maddubs_epi16(w, x); /* |15 * 127 * 2| fits int16 */
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[i] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d * xd[i * kb + b]), acc[i]);
            min_term[i] += m * xs[i * kb + b];
        }
    }
    for (int i = 0; i < rows; i++) acc_out[i] = hsum(acc[i]) + min_term[i];
#else
    for (int i = 0; i < rows; i++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *qb = wq + b * (TS_QBLOCK / 2);
            const int8_t *x = xq + i * kx + b * TS_QBLOCK;
            int dot = 0;
            for (int j = 0; j < TS_QBLOCK / 2; j++) dot += (qb[j] & 0x0f) * x[j] + (qb[j] >> 4) * x[j + 16];
            total += fp16_to_float(wd[b]) * xd[i * kb + b] * (float)dot + fp16_to_float(wm[b]) * xs[i * kb + b];
        }
        acc_out[i] = total;
    }
#endif
}

/* As dot_q4, for one q8 weight row. */
static inline __attribute__((always_inline)) void dot_q8(const int8_t *wq, const uint16_t *wd, int64_t nblocks, const int8_t *xq, const float *xd,
                   int64_t kx, int64_t kb, int rows, float *acc_out) {
#ifdef TS_QGEMM_AVX2
    __m256 acc[TS_QGEMM_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nblocks; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * TS_QBLOCK));
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        const float d = _cvtsh_ss(wd[b]);
        for (int i = 0; i < rows; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * kx + b * TS_QBLOCK));
            /* |w| * (x with w's sign): unsigned times signed, as vpmaddubsw needs; 127 * 127 * 2 fits int16 */
            const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[i] = _mm256_fmadd_ps(sums, _mm256_set1_ps(d * xd[i * kb + b]), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) acc_out[i] = hsum(acc[i]);
#else
    for (int i = 0; i < rows; i++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nblocks; b++) {
            const int8_t *qb = wq + b * TS_QBLOCK;
            const int8_t *x = xq + i * kx + b * TS_QBLOCK;
            int dot = 0;
            for (int j = 0; j < TS_QBLOCK; j++) dot += qb[j] * x[j];
            total += fp16_to_float(wd[b]) * xd[i * kb + b] * (float)dot;
        }
        acc_out[i] = total;
    }
#endif
}

/* silu(gate) * up for one row whose first k values are the gate and next k the up projection. */
static void swiglu_row(const float *x, int64_t k, float *out) {
    for (int64_t j = 0; j < k; j++) {
        const float g = x[j];
        out[j] = g / (1.0f + expf(-g)) * x[k + j];
    }
}

/* out[i, c] = sum_j a(x)[i, j] * W[c, j] (+ bias[c]) for i < m, c < n; format 4 (q4: wq, wd, wm) or 8 (q8: wq,
 * wd). act 0: a(x) = x, rows of k values; act 1 (SwiGLU, the MLP's down projection): rows of 2k values, and
 * a(x) = silu(first half) * second half, so the gate/up product never goes through memory as a tensor.
 * Returns 0, or -1 when k is not a multiple of 32 or scratch memory cannot be had (out untouched). */
int ts_qlinear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, int format, int act, const void *wq,
                   const uint16_t *wd, const uint16_t *wm, const float *bias, int64_t n, float *out,
                   int64_t out_stride, int num_threads) {
    if (k % TS_QBLOCK != 0 || (format != 4 && format != 8) || (act != 0 && act != 1) || m <= 0 || n <= 0)
        return -1;
    const int64_t kb = k / TS_QBLOCK;
    int8_t *xq = malloc((size_t)(m * k));
    float *xd = malloc(sizeof(float) * (size_t)(m * kb));
    float *xs = malloc(sizeof(float) * (size_t)(m * kb));
    float *activated = act ? malloc(sizeof(float) * (size_t)(m * k)) : NULL;
    if (xq == NULL || xd == NULL || xs == NULL || (act && activated == NULL)) {
        free(xq);
        free(xd);
        free(xs);
        free(activated);
        return -1;
    }
    const int64_t row_bytes = format == 4 ? k / 2 : k;
    const int parallel = n * row_bytes * (m < 8 ? 1 : m / 8) >= TS_QGEMM_PARALLEL_MIN && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const float *row = x + i * x_stride;
            if (act) {
                swiglu_row(row, k, activated + i * k);
                row = activated + i * k;
            }
            quantize_row_q8(row, k, xq + i * k, xd + i * kb, xs + i * kb);
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c++) {
            float acc[TS_QGEMM_ROWS];
            for (int64_t i0 = 0; i0 < m; i0 += TS_QGEMM_ROWS) {
                const int rows = (int)(m - i0 < TS_QGEMM_ROWS ? m - i0 : TS_QGEMM_ROWS);
                if (format == 4) {
                    const uint8_t *w = (const uint8_t *)wq + c * row_bytes;
#define TS_DOT_Q4(R) dot_q4(w, wd + c * kb, wm + c * kb, kb, xq + i0 * k, xd + i0 * kb, xs + i0 * kb, k, kb, R, acc)
                    switch (rows) {
                    case 1: TS_DOT_Q4(1); break;
                    case 2: TS_DOT_Q4(2); break;
                    case 3: TS_DOT_Q4(3); break;
                    default: TS_DOT_Q4(4); break;
                    }
#undef TS_DOT_Q4
                } else {
                    const int8_t *w = (const int8_t *)wq + c * row_bytes;
#define TS_DOT_Q8(R) dot_q8(w, wd + c * kb, kb, xq + i0 * k, xd + i0 * kb, k, kb, R, acc)
                    switch (rows) {
                    case 1: TS_DOT_Q8(1); break;
                    case 2: TS_DOT_Q8(2); break;
                    case 3: TS_DOT_Q8(3); break;
                    default: TS_DOT_Q8(4); break;
                    }
#undef TS_DOT_Q8
                }
                const float add = bias != NULL ? bias[c] : 0.0f;
                for (int i = 0; i < rows; i++) out[(i0 + i) * out_stride + c] = acc[i] + add;
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
    free(activated);
    return 0;
}
