/* Matrix-vector products (1 to TS_GEMV_ROWS rows of x: single-stream decode) over Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, IQ4_NL and IQ4_XS (every format but Q5_K). qgemm.c compiles this twice,
 * after qgemm_tiles.h (whose 8-row gathers and 8 x 8 transpose it uses): under AVX2 and under AVX-512 VNNI
 * (TS_SIMD_VNNI 1: vpdpbusd instead of vpmaddubsw and its int16 chains, and 512-bit vectors for Q4_K and Q6_K;
 * the other formats keep 256-bit vectors there).
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
 * The arithmetic is the tiles' to the bit (qgemm_tiles.h, "one order of operations"): per block, the exact
 * integer product (with an offset that is a power of two times the scale taken into it), times x's scale,
 * then the weight's scale added in by one FMA and a float offset by a second, into one accumulator per row
 * and column. So a row's result does not depend on whether this kernel or the tiles took its batch.
 */

#ifndef TS_GEMV_ROWS
#define TS_GEMV_ROWS 3 /* up to here the row kernels' other work is per row anyway (the tiles start at 4) */
#endif
#define TS_GEMV_GROUP 8 /* weight rows read together: one vector lane each */
#define TS_GEMV_AHEAD 1 /* groups ahead of the one multiplied that are prefetched (1-3: within noise) */

/* Whether a weight format has a matrix-vector kernel here. */
static inline int TS_SIMD(gemv_has_format)(int64_t type) {
    return TS_SIMD(rows8_nibble_format)((int)type) || ts_qtype_signed(type) || type == TS_Q2_K || type == TS_Q3_K ||
           type == TS_Q4_K || type == TS_Q6_K;
}

/* dots[r] lane c = the exact integer product of 32 signed codes w (w[g] lane c: codes 4g .. 4g + 3 of weight
 * row c) with block b of x row r0 + r: |w| times x carrying w's sign, the u8 x s8 the byte products take. On
 * AVX2 each step is widened at once (2 x 128 x 127 leaves no room for a second step in int16). */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_signed_dots)(const int R, const __m256i w[8],
                                                                          const ts_act *a, int64_t r0, int64_t b,
                                                                          __m256i dots[TS_GEMV_ROWS]) {
#if !TS_SIMD_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int g = 0; g < 8; g++) {
        const __m256i w_abs = _mm256_abs_epi8(w[g]); /* -128 -> 0x80, read as the unsigned 128 */
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, a->q + (r0 + r) * a->k + b * TS_QBLOCK + 4 * g, 4);
            const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), w[g]);
#if TS_SIMD_VNNI
            dots[r] = _mm256_dpbusd_epi32(g == 0 ? _mm256_setzero_si256() : dots[r], w_abs, x);
#else
            const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones);
            dots[r] = g == 0 ? sum : _mm256_add_epi32(dots[r], sum);
#endif
        }
    }
}

/* res[r][c] = dot(x row r0 + r, weight row c of the 8 at ``rows``) for r < R; with x8 the 8 rows are one
 * interleaved group (TS_LAYOUT_X8), read with plain loads. The next group's bytes (the next_bytes at
 * ``next``) are prefetched a few cache lines per block, so that the loads stay spread over the group rather
 * than queued at its start. */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group)(const int type, const int x8, const int R,
                                                             const uint8_t *rows, int64_t row_bytes, int64_t kb,
                                                             const ts_act *a, int64_t r0, const uint8_t *next,
                                                             int64_t next_bytes, float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    const int64_t lines = (next_bytes + 63) / 64;
    const int64_t block_bytes = ts_qunit_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones; /* unused where VNNI adds in int32 */
    const int shift = ts_tile_int_offset_shift(type, 0); /* Q4_0, Q5_0: the offset in the integer sums */
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *block = rows + b * block_bytes * (x8 ? 8 : 1);
        for (int64_t l = b * lines / kb; l < (b + 1) * lines / kb; l++) __builtin_prefetch(next + 64 * l, 0, 3);
        __m256 d, m;
        if (x8) TS_SIMD(rows8_halves_x8)(block, &d, &m);
        else TS_SIMD(rows8_halves)(block, row_bytes, &d, &m);
        __m256i dots[TS_GEMV_ROWS];
        if (ts_qtype_signed(type)) {
            __m256i w[8]; /* w[g] lane c: codes 4g .. 4g + 3 of row c */
            if (type == TS_Q8_0) TS_SIMD(rows8_q8_codes)(x8, block, row_bytes, w);
            else TS_SIMD(rows8_iq4_codes)(block + 2, row_bytes, w); /* IQ4_NL, stored as in the file */
            TS_SIMD(gemv_signed_dots)(R, w, a, r0, b, dots);
        } else {
            __m256i lo[4], hi[4]; /* lane c: 4 codes of row c, values 4j.. and 16 + 4j.. */
            TS_SIMD(rows8_nibble_codes)(type, x8, block, row_bytes, lo, hi);
            /* Each step adds two vpmaddubsw results (at most 2 x largest code x 127 each) in int16, for 4 steps
             * over Q4 (8 x 2 x 15 x 127 = 30,480) and 2 over Q5 (4 x 2 x 31 x 127 = 31,496) before widening. */
            const int chain = TS_SIMD_VNNI || !(type == TS_Q5_0 || type == TS_Q5_1) ? 4 : 2;
            for (int j0 = 0; j0 < 4; j0 += chain) {
                __m256i sums[TS_GEMV_ROWS];
                for (int j = j0; j < j0 + chain; j++) {
                    for (int r = 0; r < R; r++) {
                        const int8_t *x = a->q + (r0 + r) * a->k + b * TS_QBLOCK;
                        int32_t x_lo, x_hi;
                        memcpy(&x_lo, x + 4 * j, 4);
                        memcpy(&x_hi, x + 16 + 4 * j, 4);
#if TS_SIMD_VNNI /* vpdpbusd adds into int32 directly */
                        (void)sums;
                        const __m256i d0 = j == 0 ? _mm256_setzero_si256() : dots[r];
                        dots[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(d0, lo[j], _mm256_set1_epi32(x_lo)), hi[j],
                                                      _mm256_set1_epi32(x_hi));
#else
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(x_lo)),
                                                           _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(x_hi)));
                        sums[r] = j == j0 ? p : _mm256_add_epi16(sums[r], p);
#endif
                    }
                }
#if !TS_SIMD_VNNI
                for (int r = 0; r < R; r++) {
                    const __m256i wide = _mm256_madd_epi16(sums[r], ones);
                    dots[r] = j0 == 0 ? wide : _mm256_add_epi32(dots[r], wide);
                }
#endif
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = (r0 + r) * a->kb + b;
            const __m256 xd = _mm256_set1_ps(a->d[at]);
            __m256i whole = dots[r];
            if (shift) {
                const int32_t *qs = a->qb + 2 * at;
                whole = _mm256_add_epi32(whole, _mm256_slli_epi32(_mm256_set1_epi32(qs[0] + qs[1]), shift));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(whole), xd), d, acc[r]);
            if (!shift && !ts_qtype_signed(type)) { /* Q4_1, Q5_1: the minimum times the sum of the block's x */
                const float *xs = a->s + 2 * at;
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[0] + xs[1]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

/* gemv_group over Q2_K and Q3_K (stored as in the file). Per half of a unit, the 8 rows' 32-byte run of 2-bit
 * codes is transposed once and serves its four sub-blocks of 32 (bits 2t of each byte); Q3_K's 32 bytes of
 * third bits once per unit (bit j of byte v: value v of sub-block j). Each 16 values have their own scale, so
 * the integer sums and the epilogue are per half, the tiles' order: Q2_K's offset -dmin x min is added in
 * float, Q3_K's -4 x scale starts the integer sum from x's codes' sum. */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_k2)(const int type, const int x8, const int R,
                                                                       const uint8_t *rows, int64_t row_bytes,
                                                                       int64_t kb, const ts_act *a, int64_t r0,
                                                                       const uint8_t *next, int64_t next_bytes,
                                                                       float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)x8; /* no interleaved layout */
    const int q3 = type == TS_Q3_K;
    const int64_t unit_bytes = q3 ? 110 : 84, halves = kb / 4, lines = (next_bytes + 63) / 64;
#if !TS_SIMD_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * unit_bytes;
        __m256 d, neg_dmin;
        __m256i sc[4], hm[8];
        TS_SIMD(k23_unit_header)(q3, unit, row_bytes, &d, &neg_dmin, sc, hm);
        for (int n = 0; n < 2; n++) {
            const int64_t half = u * 2 + n;
            for (int64_t l = half * lines / halves; l < (half + 1) * lines / halves; l++)
                __builtin_prefetch(next + 64 * l, 0, 3);
            __m256i t[8]; /* t[g] lane c: bytes 4g .. 4g + 3 of row c's run */
            TS_SIMD(rows8_words8)(unit + (q3 ? 32 : 16) + 32 * n, row_bytes, t);
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) { /* sub-block j = 4n + s: bits 2s of the run */
                const int j = 4 * n + s;
                __m256i codes[8];
                TS_SIMD(k2_codes)(q3, t, hm, s, j, codes);
                __m256 scale[2], offset[2]; /* values 0-15 and 16-31: parts 2j and 2j + 1 */
                for (int h = 0; h < 2; h++) TS_SIMD(k2_part_scale)(q3, d, neg_dmin, sc, 2 * j + h, &scale[h], &offset[h]);
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * a->kb + u * 8 + j;
                    const int8_t *x = a->q + (r0 + r) * a->k + (u * 8 + j) * TS_QBLOCK;
                    const __m256 xd = _mm256_set1_ps(a->d[at]);
                    for (int h = 0; h < 2; h++) {
                        __m256i dot = q3 ? _mm256_slli_epi32(_mm256_set1_epi32(a->qb[2 * at + h]), 2)
                                         : _mm256_setzero_si256();
#if TS_SIMD_VNNI
                        for (int g = 4 * h; g < 4 * h + 4; g++) {
                            int32_t four;
                            memcpy(&four, x + 4 * g, 4);
                            dot = _mm256_dpbusd_epi32(dot, codes[g], _mm256_set1_epi32(four));
                        }
#else
                        __m256i sums = _mm256_setzero_si256(); /* 4 x 2 x 7 x 127 = 7,112 in int16 */
                        for (int g = 4 * h; g < 4 * h + 4; g++) {
                            int32_t four;
                            memcpy(&four, x + 4 * g, 4);
                            sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(codes[g], _mm256_set1_epi32(four)));
                        }
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(sums, ones));
#endif
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), xd), scale[h], acc[r]);
                        if (!q3) acc[r] = _mm256_fmadd_ps(offset[h], _mm256_set1_ps(a->s[2 * at + h]), acc[r]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

/* gemv_group over IQ4_XS (stored as in the file). Per unit the 8 rows' d, scales_h and scales_l are gathered
 * once; each sub-block of 32 has its 6-bit scale and its 16 bytes of nibbles, looked up in the codebook to
 * signed codes whose products are Q8_0's (gemv_signed_dots). */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_iq4xs)(const int type, const int x8, const int R,
                                                                          const uint8_t *rows, int64_t row_bytes,
                                                                          int64_t kb, const ts_act *a, int64_t r0,
                                                                          const uint8_t *next, int64_t next_bytes,
                                                                          float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)type; /* IQ4_XS */
    (void)x8;   /* no interleaved layout */
    const int64_t lines = (next_bytes + 63) / 64;
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * 136;
        __m256i head[4]; /* head[0] lane c: row c's d | scales_h << 16; head[1]: its scales_l */
        TS_SIMD(rows8_words4)(unit, row_bytes, head);
        const __m256 d = TS_SIMD(rows8_f16)(head[0], 0);
        for (int j = 0; j < 8; j++) {
            const int64_t b = u * 8 + j;
            for (int64_t l = b * lines / kb; l < (b + 1) * lines / kb; l++) __builtin_prefetch(next + 64 * l, 0, 3);
            const __m256 scale = TS_SIMD(iq4xs_scale)(d, head, j);
            __m256i w[8], dots[TS_GEMV_ROWS];
            TS_SIMD(rows8_iq4_codes)(unit + 8 + 16 * j, row_bytes, w);
            TS_SIMD(gemv_signed_dots)(R, w, a, r0, b, dots);
            for (int r = 0; r < R; r++) {
                const __m256 xd = _mm256_set1_ps(a->d[(r0 + r) * a->kb + b]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dots[r]), xd), scale, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

#if !TS_SIMD_VNNI /* AVX2; VNNI's Q4_K and Q6_K kernels use 512-bit vectors (below) */
/* gemv_group over Q4_K. Per unit of 256 values, the 8 rows' d and dmin and 6-bit scales and mins are
 * gathered (or, interleaved, loaded) and unpacked with the scalar decoder's word masks, lane by lane; the
 * codes of sub-blocks 2p and 2p + 1 are the low and high nibbles of the same 32 bytes per row, so one 8 x 8
 * transpose serves both, and the interleaved layout (x8) stores them transposed already. */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_q4k)(const int type, const int x8, const int R,
                                                                 const uint8_t *rows,
                                                                 int64_t row_bytes, int64_t kb, const ts_act *a,
                                                                 int64_t r0, const uint8_t *next, int64_t next_bytes,
                                                                 float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)type; /* Q4_K: the argument keeps gemv_group's signature */
    const int64_t pairs = kb / 2, lines = (next_bytes + 63) / 64;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f), byte = _mm256_set1_epi32(0xff);
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * 144 * (x8 ? 8 : 1);
        __m256 d, dmin; /* dmin negated */
        __m256i words[4];
        TS_SIMD(k4_unit_header)(unit, x8, row_bytes, &d, &dmin, words);
        const __m256i *sc = words, *mn = words + 2;
        for (int p = 0; p < 4; p++) {
            const int64_t pair = u * 4 + p;
            for (int64_t l = pair * lines / pairs; l < (pair + 1) * lines / pairs; l++)
                __builtin_prefetch(next + 64 * l, 0, 3);
            __m256i t[8]; /* t[g] lane c: bytes 4g .. 4g + 3 of row c's 32 */
            if (x8) {
                for (int g = 0; g < 8; g++) t[g] = _mm256_loadu_si256((const __m256i *)(unit + 128 + 256 * p + 32 * g));
            } else {
                TS_SIMD(rows8_words8)(unit + 16 + 32 * p, row_bytes, t);
            }
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h; /* the sub-block: scale byte j % 4 of sc[j / 4] */
                const __m128i shift = _mm_cvtsi32_si128(8 * (j % 4));
                const __m256 scale = _mm256_mul_ps(
                    d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(sc[j / 4], shift), byte)));
                const __m256 offset = _mm256_mul_ps(
                    dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(mn[j / 4], shift), byte)));
                __m256i codes[8];
                for (int g = 0; g < 8; g++)
                    codes[g] = _mm256_and_si256(h ? _mm256_srli_epi16(t[g], 4) : t[g], low4);
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * a->kb + u * 8 + j;
                    const int8_t *x = a->q + (r0 + r) * a->k + (u * 8 + j) * TS_QBLOCK;
                    __m256i sums = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g++) { /* 8 x 2 x 15 x 127 = 30,480: one int16 chain */
                        int32_t four;
                        memcpy(&four, x + 4 * g, 4);
                        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(codes[g], _mm256_set1_epi32(four)));
                    }
                    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dots, _mm256_set1_ps(a->d[at])), scale, acc[r]);
                    const float *xs = a->s + 2 * at;
                    acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xs[0] + xs[1]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

/* gemv_group over Q6_K. Per half of a 256-value unit, the 8 rows' 32-byte runs of low nibbles (two) and of
 * high bits (one) are each transposed once and serve its four sub-blocks. A code is its nibble and its two
 * high bits moved to bits 4-5 by one shift (or none) and a mask each. Each 16 values' integer sum starts
 * from x's codes' sum times -32 (the code's offset) and takes its scale d x sc in float, as the tiles do. */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_q6k)(const int type, const int x8, const int R,
                                                                 const uint8_t *rows,
                                                                 int64_t row_bytes, int64_t kb, const ts_act *a,
                                                                 int64_t r0, const uint8_t *next, int64_t next_bytes,
                                                                 float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)type; /* Q6_K */
    const int64_t halves = kb / 4, lines = (next_bytes + 63) / 64;
    const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * 210 * (x8 ? 8 : 1);
        __m256i scales[4]; /* scales[i] lane c: row c's int8 scales 4i .. 4i + 3 */
        const __m256 d = TS_SIMD(q6k_unit_header)(unit, x8, row_bytes, scales);
        for (int n = 0; n < 2; n++) {
            const int64_t half = u * 2 + n;
            for (int64_t l = half * lines / halves; l < (half + 1) * lines / halves; l++)
                __builtin_prefetch(next + 64 * l, 0, 3);
            __m256i ql[2][8], qh[8]; /* [g] lane c: bytes 4g .. 4g + 3 of row c's runs */
            if (x8) {
                for (int g = 0; g < 8; g++) {
                    ql[0][g] = _mm256_loadu_si256((const __m256i *)(unit + 32 * (16 * n + g)));
                    ql[1][g] = _mm256_loadu_si256((const __m256i *)(unit + 32 * (16 * n + 8 + g)));
                    qh[g] = _mm256_loadu_si256((const __m256i *)(unit + 1024 + 32 * (8 * n + g)));
                }
            } else {
                TS_SIMD(rows8_words8)(unit + 64 * n, row_bytes, ql[0]);
                TS_SIMD(rows8_words8)(unit + 64 * n + 32, row_bytes, ql[1]);
                TS_SIMD(rows8_words8)(unit + 128 + 32 * n, row_bytes, qh);
            }
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) { /* sub-block j = 4n + t: ql run t % 2, nibble t / 2, qh bits 2t */
                const int j = 4 * n + t;
                __m256i codes[8];
                for (int g = 0; g < 8; g++) {
                    const __m256i low = t < 2 ? ql[t][g] : _mm256_srli_epi16(ql[t - 2][g], 4);
                    const __m256i high = t == 0   ? _mm256_slli_epi16(qh[g], 4)
                                         : t == 1 ? _mm256_slli_epi16(qh[g], 2)
                                         : t == 2 ? qh[g]
                                                  : _mm256_srli_epi16(qh[g], 2);
                    codes[g] = _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_and_si256(high, bits45));
                }
                __m256 scale[2]; /* values 0-15 and 16-31: d x int8 scales 2j and 2j + 1 */
                for (int i = 0; i < 2; i++)
                    scale[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(TS_SIMD(q6k_scale)(scales, 2 * j + i)));
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * a->kb + u * 8 + j;
                    const int8_t *x = a->q + (r0 + r) * a->k + (u * 8 + j) * TS_QBLOCK;
                    const int32_t *qs = a->qb + 2 * at;
                    const __m256 xd = _mm256_set1_ps(a->d[at]);
                    for (int i = 0; i < 2; i++) { /* each 16 values: -32 x (x's codes' sum) + codes . x */
                        __m256i dot = _mm256_slli_epi32(_mm256_set1_epi32(qs[i]), 5);
                        for (int g = 4 * i; g < 4 * i + 4; g += 2) { /* 2 x 2 x 63 x 127 = 32,004 in int16 */
                            int32_t x0, x1;
                            memcpy(&x0, x + 4 * g, 4);
                            memcpy(&x1, x + 4 * g + 4, 4);
                            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(codes[g], _mm256_set1_epi32(x0)),
                                                                  _mm256_maddubs_epi16(codes[g + 1], _mm256_set1_epi32(x1)));
                            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pair, ones));
                        }
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), xd), scale[i], acc[r]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

#else
/* One 512-bit vector of two 256-bit ones: lo in lanes 0-7, hi in lanes 8-15. */
static inline __attribute__((always_inline)) __m512i TS_SIMD(zmm_pair)(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The vpermd indices that put x's 4-code words 2q and 2q + 1 in the two halves of a vector. */
static inline __attribute__((always_inline)) void TS_SIMD(zmm_step_pairs)(__m512i idx[4]) {
    for (int q = 0; q < 4; q++) idx[q] = TS_SIMD(zmm_pair)(_mm256_set1_epi32(2 * q), _mm256_set1_epi32(2 * q + 1));
}

/* The integer sums of a vector's two halves: the 8 rows' products over both steps of each pair, exact. */
static inline __attribute__((always_inline)) __m256i TS_SIMD(zmm_halves_sum_epi32)(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* gemv_group_q4k in 512-bit vectors: one vector holds two consecutive 4-code steps of the 8 rows (steps 2q
 * and 2q + 1 of a pair's 32 bytes: lanes 0-7 and 8-15) and x's matching codes are permuted into place: half
 * the instructions of 256-bit vectors per weight (Q4_K in cache on one Zen 5 core 36 -> 51 GB/s, more than
 * one core's memory gives, docs/benchmarks.md). The two halves' integer sums are added before the float
 * epilogue, which is then the tiles' (one accumulator of 8 rows, the scale's FMA then the offset's). */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_q4k)(const int type, const int x8, const int R,
                                                                     const uint8_t *rows, int64_t row_bytes, int64_t kb,
                                                                     const ts_act *a, int64_t r0, const uint8_t *next,
                                                                     int64_t next_bytes,
                                                                     float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)type; /* Q4_K */
    const int64_t pairs = kb / 2, lines = (next_bytes + 63) / 64;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m256i bytey = _mm256_set1_epi32(0xff);
    __m512i idx[4];
    TS_SIMD(zmm_step_pairs)(idx);
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * 144 * (x8 ? 8 : 1);
        __m256 d, dmin; /* dmin negated */
        __m256i words[4];
        TS_SIMD(k4_unit_header)(unit, x8, row_bytes, &d, &dmin, words);
        const __m256i *sc = words, *mn = words + 2;
        for (int p = 0; p < 4; p++) {
            const int64_t pair = u * 4 + p;
            for (int64_t l = pair * lines / pairs; l < (pair + 1) * lines / pairs; l++)
                __builtin_prefetch(next + 64 * l, 0, 3);
            __m512i t[4]; /* t[q]: steps 2q (lanes 0-7) and 2q + 1 (lanes 8-15), lane c of each: row c */
            if (x8) {
                for (int q = 0; q < 4; q++) t[q] = _mm512_loadu_si512((const void *)(unit + 128 + 256 * p + 64 * q));
            } else {
                __m256i v[8];
                TS_SIMD(rows8_words8)(unit + 16 + 32 * p, row_bytes, v);
                for (int q = 0; q < 4; q++) t[q] = TS_SIMD(zmm_pair)(v[2 * q], v[2 * q + 1]);
            }
            for (int h = 0; h < 2; h++) {
                const int j = 2 * p + h;
                const __m128i shift = _mm_cvtsi32_si128(8 * (j % 4));
                const __m256 scale = _mm256_mul_ps(
                    d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(sc[j / 4], shift), bytey)));
                const __m256 offset = _mm256_mul_ps(
                    dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(mn[j / 4], shift), bytey)));
                __m512i codes[4];
                for (int q = 0; q < 4; q++) codes[q] = _mm512_and_si512(h ? _mm512_srli_epi16(t[q], 4) : t[q], low4);
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * a->kb + u * 8 + j;
                    const __m512i x = _mm512_castsi256_si512(
                        _mm256_loadu_si256((const __m256i *)(a->q + (r0 + r) * a->k + (u * 8 + j) * TS_QBLOCK)));
                    __m512i sums = _mm512_setzero_si512();
                    for (int q = 0; q < 4; q++) sums = _mm512_dpbusd_epi32(sums, codes[q], _mm512_permutexvar_epi32(idx[q], x));
                    const __m256 dots = _mm256_cvtepi32_ps(TS_SIMD(zmm_halves_sum_epi32)(sums));
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dots, _mm256_set1_ps(a->d[at])), scale, acc[r]);
                    const float *xs = a->s + 2 * at;
                    acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xs[0] + xs[1]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}

/* gemv_group_q6k in 512-bit vectors, as gemv_group_q4k's: two 4-code steps of the 8 rows a vector, the two
 * halves' integer sums added (with -32 x x's codes' sum, the code's offset) before the tiles' float epilogue. */
static inline __attribute__((always_inline)) void TS_SIMD(gemv_group_q6k)(const int type, const int x8, const int R,
                                                                     const uint8_t *rows, int64_t row_bytes, int64_t kb,
                                                                     const ts_act *a, int64_t r0, const uint8_t *next,
                                                                     int64_t next_bytes,
                                                                     float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
    (void)type; /* Q6_K */
    const int64_t halves = kb / 4, lines = (next_bytes + 63) / 64;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    __m512i idx[4];
    TS_SIMD(zmm_step_pairs)(idx);
    __m256 acc[TS_GEMV_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < kb / 8; u++) {
        const uint8_t *unit = rows + u * 210 * (x8 ? 8 : 1);
        __m256i scales[4]; /* scales[i] lane c: row c's int8 scales 4i .. 4i + 3 */
        const __m256 d = TS_SIMD(q6k_unit_header)(unit, x8, row_bytes, scales);
        for (int n = 0; n < 2; n++) {
            const int64_t half = u * 2 + n;
            for (int64_t l = half * lines / halves; l < (half + 1) * lines / halves; l++)
                __builtin_prefetch(next + 64 * l, 0, 3);
            __m512i ql[2][4], qh[4]; /* [q]: steps 2q and 2q + 1 of the runs, lanes 0-7 and 8-15 */
            if (x8) {
                for (int q = 0; q < 4; q++) {
                    ql[0][q] = _mm512_loadu_si512((const void *)(unit + 512 * n + 64 * q));
                    ql[1][q] = _mm512_loadu_si512((const void *)(unit + 512 * n + 256 + 64 * q));
                    qh[q] = _mm512_loadu_si512((const void *)(unit + 1024 + 256 * n + 64 * q));
                }
            } else {
                __m256i v[3][8];
                TS_SIMD(rows8_words8)(unit + 64 * n, row_bytes, v[0]);
                TS_SIMD(rows8_words8)(unit + 64 * n + 32, row_bytes, v[1]);
                TS_SIMD(rows8_words8)(unit + 128 + 32 * n, row_bytes, v[2]);
                for (int q = 0; q < 4; q++) {
                    ql[0][q] = TS_SIMD(zmm_pair)(v[0][2 * q], v[0][2 * q + 1]);
                    ql[1][q] = TS_SIMD(zmm_pair)(v[1][2 * q], v[1][2 * q + 1]);
                    qh[q] = TS_SIMD(zmm_pair)(v[2][2 * q], v[2][2 * q + 1]);
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) { /* sub-block j = 4n + t: ql run t % 2, nibble t / 2, qh bits 2t */
                const int j = 4 * n + t;
                __m512i codes[4];
                for (int q = 0; q < 4; q++) { /* the nibble, and the high bits moved to bits 4-5 and masked */
                    const __m512i low = t < 2 ? ql[t][q] : _mm512_srli_epi16(ql[t - 2][q], 4);
                    const __m512i high = t == 0   ? _mm512_slli_epi16(qh[q], 4)
                                         : t == 1 ? _mm512_slli_epi16(qh[q], 2)
                                         : t == 2 ? qh[q]
                                                  : _mm512_srli_epi16(qh[q], 2);
                    /* 0xe4: bits where low4 is set from low, the others from the masked high bits */
                    codes[q] = _mm512_ternarylogic_epi32(low, _mm512_and_si512(high, bits45), low4, 0xe4);
                }
                __m256 scale[2]; /* values 0-15 and 16-31: d x int8 scales 2j and 2j + 1 */
                for (int i = 0; i < 2; i++)
                    scale[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(TS_SIMD(q6k_scale)(scales, 2 * j + i)));
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * a->kb + u * 8 + j;
                    const __m512i x = _mm512_castsi256_si512(
                        _mm256_loadu_si256((const __m256i *)(a->q + (r0 + r) * a->k + (u * 8 + j) * TS_QBLOCK)));
                    const __m256 xd = _mm256_set1_ps(a->d[at]);
                    const int32_t *qs = a->qb + 2 * at;
                    for (int i = 0; i < 2; i++) {
                        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[2 * i],
                                                          _mm512_permutexvar_epi32(idx[2 * i], x));
                        dot = _mm512_dpbusd_epi32(dot, codes[2 * i + 1], _mm512_permutexvar_epi32(idx[2 * i + 1], x));
                        const __m256i whole = _mm256_add_epi32(TS_SIMD(zmm_halves_sum_epi32)(dot),
                                                               _mm256_slli_epi32(_mm256_set1_epi32(qs[i]), 5));
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(whole), xd), scale[i], acc[r]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res[r], acc[r]);
}
#endif

/* gemv_group for a format, layout and row count known at run time, each combination its own loop (x8 only
 * for the formats ts_x8_supported takes). */
static void TS_SIMD(gemv_group_any)(int type, int x8, int rows_of_x, const uint8_t *rows, int64_t row_bytes, int64_t kb,
                           const ts_act *a, int64_t r0, const uint8_t *next, int64_t next_bytes,
                           float res[TS_GEMV_ROWS][TS_GEMV_GROUP]) {
#define TS_GEMV_ROWS_OF_X(KERNEL, ...)                                                          \
    switch (rows_of_x) {                                                                       \
    case 1: KERNEL(__VA_ARGS__, 1, rows, row_bytes, kb, a, r0, next, next_bytes, res); break; \
    case 2: KERNEL(__VA_ARGS__, 2, rows, row_bytes, kb, a, r0, next, next_bytes, res); break; \
    default: KERNEL(__VA_ARGS__, 3, rows, row_bytes, kb, a, r0, next, next_bytes, res); break;\
    }
#define TS_GEMV_FORMAT(T, KERNEL)                                   \
    case T:                                                         \
        if (x8) { TS_GEMV_ROWS_OF_X(KERNEL, T, 1) }                 \
        else { TS_GEMV_ROWS_OF_X(KERNEL, T, 0) }                    \
        break;
#define TS_GEMV_FORMAT_ROWS(T, KERNEL) /* a format without an interleaved layout */ \
    case T: TS_GEMV_ROWS_OF_X(KERNEL, T, 0) break;
    switch (type) {
        TS_GEMV_FORMAT(TS_Q4_0, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT(TS_Q4_1, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT(TS_Q5_0, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT(TS_Q5_1, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT(TS_Q8_0, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT(TS_Q4_K, TS_SIMD(gemv_group_q4k))
        TS_GEMV_FORMAT(TS_Q6_K, TS_SIMD(gemv_group_q6k))
        TS_GEMV_FORMAT_ROWS(TS_IQ4_NL, TS_SIMD(gemv_group))
        TS_GEMV_FORMAT_ROWS(TS_Q2_K, TS_SIMD(gemv_group_k2))
        TS_GEMV_FORMAT_ROWS(TS_Q3_K, TS_SIMD(gemv_group_k2))
        TS_GEMV_FORMAT_ROWS(TS_IQ4_XS, TS_SIMD(gemv_group_iq4xs))
    default: break; /* gemv_has_format was asked first */
    }
#undef TS_GEMV_FORMAT_ROWS
#undef TS_GEMV_FORMAT
#undef TS_GEMV_ROWS_OF_X
}
