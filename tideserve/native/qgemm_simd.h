/* The SIMD row kernels of qgemm.c, written once and compiled twice: for AVX2 (vpmaddubsw byte products)
 * and for AVX-512 VNNI (vpdpbusd), each under its own target attribute so one library carries both and
 * qgemm.c picks at run time. Included with TS_SIMD(name) (the suffix) and TS_SIMD_VNNI (0 or 1) defined.
 *
 * Every kernel decodes a weight block to 32 byte codes exactly as ts_block_decode does (tested), takes
 * its integer dot products with up to TS_QGEMM_ROWS activation rows at once, and applies the block's
 * scales in float in the tiles' order of operations. A block is decoded once per group of rows, not once
 * per row.
 */

/* 32 bytes, 0xFF where bit i of bits is set (llama.cpp's bytes_from_bits_32). */
static inline __m256i TS_SIMD(bits_to_bytes)(uint32_t bits) {
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* 16 bytes of packed nibbles -> 32 codes: low nibbles first, then high ones. */
static inline __m256i TS_SIMD(nibbles)(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)p);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
}

/* A Q4_K / Q5_K unit's eight 6-bit scales and mins (unpacked with word masks, llama.cpp's trick) times
 * its d and -dmin: sub-block j's scale and offset in lane j. */
static inline __attribute__((always_inline)) void TS_SIMD(k4_unit_scales)(const uint8_t *u, __m256 *scale,
                                                                         __m256 *offset) {
    uint32_t w[4];
    memcpy(w, u + 4, 12);
    w[3] = ((w[2] >> 4) & 0x0f0f0f0f) | (((w[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_low = w[1] & 0x3f3f3f3f;
    w[1] = (w[2] & 0x0f0f0f0f) | (((w[0] >> 6) & 0x03030303) << 4);
    w[2] = mins_low;
    w[0] &= 0x3f3f3f3f; /* bytes of w[0..1]: scales 0-7; of w[2..3]: mins 0-7 */
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2))));
    *scale = _mm256_mul_ps(sc, _mm256_set1_ps(_cvtsh_ss(ts_load_u16(u))));
    *offset = _mm256_mul_ps(mn, _mm256_set1_ps(-_cvtsh_ss(ts_load_u16(u + 2))));
}

/* A Q6_K unit's sixteen 8-bit scales times its d: the scale of 16-value part k in lane k of lo (k < 8)
 * or hi (k - 8); each offset is -32 times its scale. */
static inline __attribute__((always_inline)) void TS_SIMD(q6k_unit_scales)(const uint8_t *u, __m256 *lo, __m256 *hi) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(ts_load_u16(u + 208)));
    const __m128i scales = _mm_loadu_si128((const __m128i *)(u + 192));
    *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales)));
    *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8))));
}

/* The IQ4 formats' codebook in both 128-bit lanes, for vpshufb: a nibble's byte becomes its int8 value. */
static inline __m256i TS_SIMD(iq4_table)(void) {
    const __m128i table = _mm_loadu_si128((const __m128i *)ts_iq4_values);
    return _mm256_set_m128i(table, table);
}

/* A Q2_K unit's sixteen scales d x (scales[k] & 15) and offsets -dmin x (scales[k] >> 4): part k in lane k. */
static inline __attribute__((always_inline)) void TS_SIMD(q2k_unit_scales)(const uint8_t *u, float scale[16],
                                                                         float offset[16]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(ts_load_u16(u + 80)));
    const __m256 neg_dmin = _mm256_set1_ps(-_cvtsh_ss(ts_load_u16(u + 82)));
    const __m128i packed = _mm_loadu_si128((const __m128i *)u), low4 = _mm_set1_epi8(0x0f);
    const __m128i sc = _mm_and_si128(packed, low4), mn = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    for (int i = 0; i < 2; i++) {
        const __m128i sc8 = i ? _mm_srli_si128(sc, 8) : sc, mn8 = i ? _mm_srli_si128(mn, 8) : mn;
        _mm256_storeu_ps(scale + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8))));
        _mm256_storeu_ps(offset + 8 * i, _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8))));
    }
}

/* Block b of a row: its 32 codes, and the scale and offset of each 16-value half. For K-quants the unit's
 * scales are decoded when b enters a new unit (sc, mn keep them between calls). */
static inline __attribute__((always_inline)) __m256i TS_SIMD(decode)(int type, const uint8_t *row, int64_t b,
                                                                   float s[2], float o[2], float *unit_s,
                                                                   float *unit_o) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    switch (type) {
    case TS_Q4_0:
    case TS_Q4_1: {
        const uint8_t *u = row + b * (type == TS_Q4_0 ? 18 : 20);
        const float d = _cvtsh_ss(ts_load_u16(u));
        s[0] = s[1] = d;
        o[0] = o[1] = type == TS_Q4_0 ? -8.0f * d : _cvtsh_ss(ts_load_u16(u + 2));
        return TS_SIMD(nibbles)(u + (type == TS_Q4_0 ? 2 : 4));
    }
    case TS_Q5_0:
    case TS_Q5_1: {
        const int off = type == TS_Q5_0 ? 2 : 4;
        const uint8_t *u = row + b * (type == TS_Q5_0 ? 22 : 24);
        const float d = _cvtsh_ss(ts_load_u16(u));
        s[0] = s[1] = d;
        o[0] = o[1] = type == TS_Q5_0 ? -16.0f * d : _cvtsh_ss(ts_load_u16(u + 2));
        uint32_t qh;
        memcpy(&qh, u + off, 4);
        const __m256i high = _mm256_and_si256(TS_SIMD(bits_to_bytes)(qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(TS_SIMD(nibbles)(u + off + 4), high);
    }
    case TS_Q8_0: {
        const uint8_t *u = row + b * 34;
        s[0] = s[1] = _cvtsh_ss(ts_load_u16(u));
        o[0] = o[1] = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(u + 2));
    }
    case TS_Q4_K:
    case TS_Q5_K: {
        const int64_t bytes = type == TS_Q4_K ? 144 : 176;
        const uint8_t *u = row + (b / 8) * bytes;
        const int j = (int)(b % 8);
        if (j == 0) { /* the unit's scales and offsets, kept for its other blocks */
            __m256 scale, offset;
            TS_SIMD(k4_unit_scales)(u, &scale, &offset);
            _mm256_storeu_ps(unit_s, scale);
            _mm256_storeu_ps(unit_o, offset);
        }
        s[0] = s[1] = unit_s[j];
        o[0] = o[1] = unit_o[j];
        const int qs_off = type == TS_Q5_K ? 48 : 16;
        __m256i q = _mm256_loadu_si256((const __m256i *)(u + qs_off + 32 * (j / 2)));
        q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
        if (type == TS_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(u + 16));
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        return q;
    }
    case TS_Q6_K: {
        const uint8_t *u = row + (b / 8) * 210;
        const int j = (int)(b % 8), half = j / 4, t = j % 4;
        if (j == 0) {
            __m256 lo, hi;
            TS_SIMD(q6k_unit_scales)(u, &lo, &hi);
            _mm256_storeu_ps(unit_s, lo);
            _mm256_storeu_ps(unit_s + 8, hi);
            _mm256_storeu_ps(unit_o, _mm256_mul_ps(lo, _mm256_set1_ps(-32.0f)));
            _mm256_storeu_ps(unit_o + 8, _mm256_mul_ps(hi, _mm256_set1_ps(-32.0f)));
        }
        s[0] = unit_s[2 * j];
        s[1] = unit_s[2 * j + 1];
        o[0] = unit_o[2 * j];
        o[1] = unit_o[2 * j + 1];
        __m256i low = _mm256_loadu_si256((const __m256i *)(u + 64 * half + 32 * (t & 1)));
        low = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (t >> 1))), low4);
        __m256i high = _mm256_loadu_si256((const __m256i *)(u + 128 + 32 * half));
        high = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    case TS_Q2_K:
    case TS_Q3_K: {
        const int q3 = type == TS_Q3_K;
        const uint8_t *u = row + (b / 8) * (q3 ? 110 : 84);
        const int j = (int)(b % 8);
        if (j == 0) {
            if (q3) { /* sixteen 6-bit scales, once a unit: scalar, as ts_block_decode */
                const float d = _cvtsh_ss(ts_load_u16(u + 108));
                for (int i = 0; i < 16; i++) {
                    unit_s[i] = d * (float)(ts_q3k_scale(u + 96, i) - 32);
                    unit_o[i] = -4.0f * unit_s[i];
                }
            } else {
                TS_SIMD(q2k_unit_scales)(u, unit_s, unit_o);
            }
        }
        s[0] = unit_s[2 * j];
        s[1] = unit_s[2 * j + 1];
        o[0] = unit_o[2 * j];
        o[1] = unit_o[2 * j + 1];
        __m256i q = _mm256_loadu_si256((const __m256i *)(u + (q3 ? 32 : 16) + 32 * (j / 4)));
        q = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4))), _mm256_set1_epi8(3));
        if (q3) { /* bit j of each hmask byte, moved to bit 2 */
            const __m256i hm = _mm256_loadu_si256((const __m256i *)u);
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 2));
        }
        return q;
    }
    case TS_IQ4_NL:
    case TS_IQ4_XS: {
        const uint8_t *u = type == TS_IQ4_NL ? row + b * 18 : row + (b / 8) * 136;
        const int j = (int)(b % 8);
        const float d = _cvtsh_ss(ts_load_u16(u));
        s[0] = s[1] = type == TS_IQ4_NL ? d : d * (float)(ts_iq4xs_scale(u, j) - 32);
        o[0] = o[1] = 0.0f;
        return _mm256_shuffle_epi8(TS_SIMD(iq4_table)(), TS_SIMD(nibbles)(type == TS_IQ4_NL ? u + 2 : u + 8 + 16 * j));
    }
    default:
        s[0] = s[1] = o[0] = o[1] = 0.0f;
        return _mm256_setzero_si256();
    }
}

/* Sums of 4 adjacent byte products u8 x s8, as 8 int32 lanes (lanes 0-3: bytes 0-15). */
static inline __m256i TS_SIMD(dot)(__m256i u, __m256i x) {
#if TS_SIMD_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)); /* |63*127*2| fits int16 */
#endif
}

/* The sum of int32 lanes lo .. lo + 3 (one 16-value half of a block's products: TS_SIMD(dot)'s lanes 0-3
 * hold bytes 0-15). */
static inline int32_t TS_SIMD(hsum4_epi32)(__m256i v, int hi) {
    __m128i t = hi ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* res[i] = dot(weight row, activation row i) for i < rows; see ts_act in qgemm.c for xq, xd, xs, qb.
 * The order of operations is the tiles' (qgemm_tiles.h), so that a row's result is the same bits whichever
 * kernel its batch size selects: per block (Q6_K: per 16-value half), the exact integer product, with an
 * offset that is a power of two times the scale taken into it from x's code sums; times x's scale; added
 * with the weight's scale by one FMA; a float offset (Q4_1, Q5_1, Q4_K, Q5_K) added by a second. */
static inline __attribute__((always_inline)) void TS_SIMD(dot_rows)(int type, const uint8_t *row, int64_t kb,
                                                                  const ts_act *a, int64_t r0, int rows,
                                                                  float *res) {
    const int shift = ts_tile_int_offset_shift(type, 0), halves = ts_qtype_halves(type), sgn = ts_qtype_signed(type);
    float acc[TS_QGEMM_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = 0.0f;
    float unit_s[16], unit_o[16];
    for (int64_t b = 0; b < kb; b++) {
        float s[2], o[2];
        const __m256i w = TS_SIMD(decode)(type, row, b, s, o, unit_s, unit_o);
        const __m256i w_abs = sgn ? _mm256_sign_epi8(w, w) : w;
        for (int i = 0; i < rows; i++) {
            const int64_t r = r0 + i, at = r * a->kb + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + r * a->k + b * TS_QBLOCK));
            if (sgn) x = _mm256_sign_epi8(x, w); /* |w| * (x with w's sign): u8 x s8 */
            const __m256i lanes = TS_SIMD(dot)(w_abs, x);
            int32_t dot[2] = {TS_SIMD(hsum4_epi32)(lanes, 0), TS_SIMD(hsum4_epi32)(lanes, 1)};
            if (shift) {
                const int32_t *qs = a->qb + 2 * at;
                dot[0] += qs[0] * (1 << shift);
                dot[1] += qs[1] * (1 << shift);
            }
            const float xd = a->d[at];
            const float *xs = a->s + 2 * at;
            for (int h = 0; h < halves; h++) {
                const int32_t whole = halves == 2 ? dot[h] : dot[0] + dot[1];
                const float scaled = (float)whole * xd; /* a product of its own, as the tiles' vmulps */
                acc[i] = fmaf(scaled, s[h], acc[i]);
                if (!shift && !sgn) acc[i] = fmaf(o[h], halves == 2 ? xs[h] : xs[0] + xs[1], acc[i]);
            }
        }
    }
    for (int i = 0; i < rows; i++) res[i] = acc[i];
}

/* One weight row against rows [r0, r0 + rows) of the activations, rows <= TS_QGEMM_ROWS, with the
 * format and row count as constants so each combination gets its own loop. */
static void TS_SIMD(dot_row_group)(int type, const uint8_t *row, int64_t kb, const ts_act *a, int64_t r0,
                                   int rows, float *res) {
#define TS_CASE(T)                                                                                  \
    case T:                                                                                         \
        switch (rows) {                                                                             \
        case 1: TS_SIMD(dot_rows)(T, row, kb, a, r0, 1, res); break;                                \
        case 2: TS_SIMD(dot_rows)(T, row, kb, a, r0, 2, res); break;                                \
        case 3: TS_SIMD(dot_rows)(T, row, kb, a, r0, 3, res); break;                                \
        default: TS_SIMD(dot_rows)(T, row, kb, a, r0, 4, res); break;                               \
        }                                                                                           \
        break;
    switch (type) {
        TS_FOR_EACH_QTYPE(TS_CASE)
    default: for (int i = 0; i < rows; i++) res[i] = 0.0f;
    }
#undef TS_CASE
}
