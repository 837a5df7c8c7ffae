/* Matrix-vector products (1 to TS_GEMV_ROWS rows of x: single-stream decode) over Q4_0, Q4_1 and Q8_0
 * weights in AVX2 instructions (qgemm.c includes this under its AVX2 target, after qgemm_tiles_avx2.h,
 * whose 8 x 8 transpose it uses).
 *
 * Why: at one row of x a decode step is bound by how fast the weights stream in, and the row kernels
 * spend about 27 instructions per 32-value block (two scalar fp16 conversions, a vector of scales built
 * per block, a dot product inside one vector finished by a horizontal sum per row). On a 2-core AVX2
 * EPYC that read the embedded model's ~100 MB at 8-12 GB/s, half of what the memory gives
 * (docs/benchmarks.md). Here 8 consecutive weight rows (contiguous in memory) are read together and
 * transposed in registers, 4 bytes at a time, before the nibbles are split: one vector then holds 4 codes
 * of each of the 8 rows, exactly the AVX2 tiles' order, so one broadcast of x's codes and one vpmaddubsw
 * give 8 rows' partial sums, and the 8 rows' fp16 scales convert in one instruction. That is about 7
 * instructions per row and block.
 *
 * The arithmetic is the row kernels' (x rounded to 8 bits per block of 32, exact integer block products,
 * each block's scale and offset in float); only the float summation order differs.
 */

#ifndef TS_GEMV_ROWS
#define TS_GEMV_ROWS 3 /* up to here the row kernels' other work is per row anyway (the tiles start at 4) */
#endif
#define TS_GEMV_GROUP 8 /* weight rows read together: one vector lane each */
#ifndef TS_GEMV_AHEAD
#define TS_GEMV_AHEAD 1 /* groups ahead of the one multiplied that are prefetched */
#endif

/* Whether a weight format has a matrix-vector kernel here. */
static inline int gemv_has_format(int64_t type) { return type == TS_Q4_0 || type == TS_Q4_1 || type == TS_Q8_0; }

/* res[r][c] = dot(x row r0 + r, weight row c of the 8 at ``rows``) for r < R. The next group's bytes
 * (the next_bytes at ``next``) are prefetched a few cache lines per block, so that the loads stay spread
 * over the group rather than queued at its start. */
static inline __attribute__((always_inline)) void gemv_group(const int type, const int R, const uint8_t *rows,
                                                             int64_t row_bytes, int64_t kb, const ts_act *a,
                                                             int64_t r0, const uint8_t *next, int64_t next_bytes,
                                                             float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    const int64_t lines = (next_bytes + 63) / 64;
    const int64_t block_bytes = ts_qunit_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[TS_GEMV_ROWS], acc_offset[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = acc_offset[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *block = rows + b * block_bytes;
        for (int64_t l = b * lines / kb; l < (b + 1) * lines / kb; l++) __builtin_prefetch(next + 64 * l, 0, 3);
        __m256 d, m;
        rows8_halves(block, row_bytes, &d, &m);
        __m256i dots[TS_GEMV_ROWS];
        if (type == TS_Q8_0) {
            __m256i w[8];
            for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(block + c * row_bytes + 2));
            tile_transpose8x8(w); /* w[g] lane c: codes 4g .. 4g + 3 of row c */
            for (int g = 0; g < 8; g++) {
                const __m256i w_abs = _mm256_abs_epi8(w[g]); /* -128 -> 0x80, read as the unsigned 128 */
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, a->q + (r0 + r) * a->k + b * TS_QBLOCK + 4 * g, 4);
                    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), w[g]); /* |w| * (x, w's sign) */
                    const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones); /* 2 x 128 x 127 */
                    dots[r] = g == 0 ? sum : _mm256_add_epi32(dots[r], sum);
                }
            }
        } else {
            __m256i q[4]; /* q[j] lane c: qs bytes 4j .. 4j + 3 of row c = codes 4j.. (low nibbles), 16 + 4j.. (high) */
            rows8_words4(block + (type == TS_Q4_1 ? 4 : 2), row_bytes, q);
            __m256i sums[TS_GEMV_ROWS];
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_and_si256(q[j], low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q[j], 4), low4);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = a->q + (r0 + r) * a->k + b * TS_QBLOCK;
                    int32_t x_lo, x_hi;
                    memcpy(&x_lo, x + 4 * j, 4);
                    memcpy(&x_hi, x + 16 + 4 * j, 4);
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x_lo)),
                                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x_hi)));
                    sums[r] = j == 0 ? p : _mm256_add_epi16(sums[r], p); /* 8 x 2 x 15 x 127 = 30,480 */
                }
            }
            for (int r = 0; r < R; r++) dots[r] = _mm256_madd_epi16(sums[r], ones);
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = (r0 + r) * a->kb + b;
            const __m256 xd = _mm256_set1_ps(a->d[at]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]), xd), d, acc[r]);
            if (type != TS_Q8_0) { /* the offset (Q4_1: m; Q4_0: -8d) times the sum of the block's x */
                const float *xs = a->s + 2 * at;
                const __m256 offset = type == TS_Q4_1 ? m : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
                acc_offset[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xs[0] + xs[1]), acc_offset[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], _mm256_add_ps(acc[r], acc_offset[r]));
}

/* gemv_group for a format and row count known at run time, each combination its own loop. */
static void gemv_group_any(int type, int rows_of_x, const uint8_t *rows, int64_t row_bytes, int64_t kb,
                           const ts_act *a, int64_t r0, const uint8_t *next, int64_t next_bytes,
                           float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
#define TS_GEMV_CASE(T)                                                         \
    case T:                                                                     \
        switch (rows_of_x) {                                                    \
        case 1: gemv_group(T, 1, rows, row_bytes, kb, a, r0, next, next_bytes, res); break;       \
        case 2: gemv_group(T, 2, rows, row_bytes, kb, a, r0, next, next_bytes, res); break;       \
        default: gemv_group(T, 3, rows, row_bytes, kb, a, r0, next, next_bytes, res); break;      \
        }                                                                       \
        break;
    switch (type) {
        TS_GEMV_CASE(TS_Q4_0)
        TS_GEMV_CASE(TS_Q4_1)
        TS_GEMV_CASE(TS_Q8_0)
    default: break; /* gemv_has_format was asked first */
    }
#undef TS_GEMV_CASE
}
