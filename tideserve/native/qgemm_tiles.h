/* Integer tiles for batched rows on CPUs without AMX, written once and compiled twice like qgemm_simd.h
 * (whose decode they use): under AVX2 (TS_SIMD_VNNI 0) and under AVX-512 VNNI (TS_SIMD_VNNI 1), where
 * vpdpbusd adds each lane's four byte products straight into int32, so there is no int16 chain to widen;
 * on a 2-core AVX-512 EPYC that made 64-row products 1.5-1.7x faster than the AVX2 build's
 * (docs/benchmarks.md).
 *
 * Why: the row kernels decode each weight block once per TS_QGEMM_ROWS rows of x, and their dot product
 * lives inside one vector, so every block and row ends in a horizontal reduction. At 64 rows that ran at
 * 60 GFLOPS on a 2-core AVX2 EPYC, half of torch's float32 GEMM (docs/benchmarks.md). Here a thread
 * decodes a panel of 16 weight rows once for the whole batch into an interleaved order: a vector holds 4
 * consecutive codes of 8 output columns, so one broadcast of 4 of x's int8 codes and one vpmaddubsw give 8
 * columns' partial dot products at once, and no lane is ever summed across.
 *
 * The arithmetic is the row kernels' (x rounded to 8 bits per block of 32, exact integer products, each
 * block's scales in float); only the float summation order differs. In the AVX2 build vpmaddubsw's int16
 * pair sums are added in int16 for as many steps as the format's largest code allows without overflow
 * (tile_chain), then widened once: a Q4 block needs one widening, not eight.
 */

#ifndef TS_TILES_SHARED /* the types and sizes, once for both compilations */
#define TS_TILES_SHARED
#define TS_TILE_COLS 16 /* weight rows (output columns) per panel: two vectors of 8 */
#define TS_TILE_ROWS_MAX 8 /* the most rows of x a micro tile holds (TS_SIMD_TILE_ROWS per build) */
#define TS_TILE_PANELS_MAX 2 /* the most panels a micro tile multiplies at once (TS_SIMD_TILE_PANELS per build) */
#define TS_TILE_RES_COLS (TS_TILE_PANELS_MAX * TS_TILE_COLS) /* a micro tile's result row */
/* r rows, or the build's micro tile if fewer: a remainder case a build with smaller tiles never reaches */
#define TS_TILE_MIN(r) ((r) < TS_SIMD_TILE_ROWS ? (r) : TS_SIMD_TILE_ROWS)

/* One panel, decoded. Block b, step g (values 4g .. 4g + 3 of the block), column half h: 32 bytes whose
 * 4c + i is that value's code in output column 8h + c. */
typedef struct {
    uint8_t *codes;  /* [kb][8][2][32]; |code| for the signed formats (Q8_0, IQ4) on AVX2 */
    int8_t *signs;   /* signed formats on AVX2: the codes in the same order (vpmaddubsw multiplies u8 by s8) */
    float *scale;    /* [kb][halves][16]: per block (per 16-value half for Q6_K: tile_halves), per column */
    float *offset;   /* [kb][halves][16] */
    uint8_t *copies; /* [16][row_bytes] where a layer has interleaved rows: them in the file's layout */
} ts_tile_panel;

/* The weight bytes of the panels a thread decodes next, brought towards L2 a slice per micro tile during
 * the last tiles before them: issued all at once they came in while the chunk's activations streamed
 * through L2 and were evicted before the decode (which then waited on memory at every row's load). */
typedef struct {
    const char *at[TS_TILE_PANELS_MAX];
    int64_t bytes[TS_TILE_PANELS_MAX];
    int count, current;
    int64_t done;
} ts_tile_prefetch;

/* Activation bytes the last tiles before a decode may stream: the next panels are fetched over them. */
#define TS_TILE_PREFETCH_TAIL_BYTES (192 * 1024)
#endif

/* Steps of 4 values whose vpmaddubsw results (each at most 2 x largest code x 127) add up in int16. */
static inline int TS_SIMD(tile_chain)(int type) {
    switch (type) {
    case TS_Q4_0: case TS_Q4_1: case TS_Q4_K: return 8; /* 8 x 2 x 15 x 127 = 30,480 */
    case TS_Q5_0: case TS_Q5_1: case TS_Q5_K: return 4; /* 4 x 2 x 31 x 127 = 31,496 */
    case TS_Q6_K: return 2;                              /* 2 x 2 x 63 x 127 = 32,004 */
    case TS_Q2_K: case TS_Q3_K: return 4; /* a 16-value half's 4 steps: 4 x 2 x 7 x 127 = 7,112 */
    default: return 1;                    /* Q8_0: 2 x 128 x 127 = 32,512; IQ4: 2 x 127 x 127 */
    }
}

/* Scales per block: Q2_K, Q3_K and Q6_K have one per 16 values, every other format one per 32. */
static inline int TS_SIMD(tile_halves)(int type) { return ts_qtype_halves(type); }

/* r[c] lane g becomes r[g] lane c (8 x 8 32-bit values). */
static inline __attribute__((always_inline)) void TS_SIMD(tile_transpose8x8)(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* v[j] lane c = 32-bit word j of the 16 bytes at p + c * stride, for rows c < 8 and words j < 4. */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_words4)(const uint8_t *p, int64_t stride, __m256i v[4]) {
    __m256i a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + i * stride))),
                                       _mm_loadu_si128((const __m128i *)(p + (i + 4) * stride)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2);
    v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3);
    v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* The two fp16 values at the start of each of 8 rows' blocks (p + c * stride), as 8 floats each: first[c]
 * is bytes 0-1 of row c (the scale d), second[c] bytes 2-3 (Q4_1's offset m). */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_halves)(const uint8_t *p, int64_t stride, __m256 *first,
                                                              __m256 *second) {
    __m256i v[4];
    TS_SIMD(rows8_words4)(p, stride, v); /* only v[0] is used: the compiler drops the rest */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v[0], split), 0xd8);
    *first = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *second = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* rows8_halves over an interleaved block (TS_LAYOUT_X8): the 8 rows' fp16 fields lie side by side. */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_halves_x8)(const uint8_t *p, __m256 *first, __m256 *second) {
    *first = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *second = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
}

/* v shifted left by ``bits`` (right by -bits) in 32-bit lanes; bits is a constant after inlining. */
static inline __attribute__((always_inline)) __m256i TS_SIMD(rows8_shift)(__m256i v, int bits) {
    if (bits > 0) return _mm256_slli_epi32(v, bits);
    if (bits < 0) return _mm256_srli_epi32(v, -bits);
    return v;
}

/* The legacy 32-value formats with packed nibbles (Q4_0, Q4_1, Q5_0, Q5_1). */
static inline int TS_SIMD(rows8_nibble_format)(int type) {
    return type == TS_Q4_0 || type == TS_Q4_1 || type == TS_Q5_0 || type == TS_Q5_1;
}

/* The codes of block ``block`` of 8 rows (``stride`` bytes apart, or one interleaved block with x8) in a
 * nibble format: lo[j] lane c holds values 4j .. 4j + 3 of row c, hi[j] values 16 + 4j .. 16 + 4j + 3 (steps
 * j and 4 + j of the tiles' order). Q5's fifth bits (bit v of the 32-bit qh is value v's) are gathered the
 * same way, then spread to bytes by a broadcast of their byte and a per-byte bit test. */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_nibble_codes)(const int type, const int x8, const uint8_t *block,
                                                                     int64_t stride, __m256i lo[4], __m256i hi[4]) {
    const int five = type == TS_Q5_0 || type == TS_Q5_1;
    const int scales = type == TS_Q4_0 || type == TS_Q5_0 ? 2 : 4; /* d, or d and m */
    const int codes_at = scales + (five ? 4 : 0);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i q[4];
    if (x8) {
        for (int j = 0; j < 4; j++) q[j] = _mm256_loadu_si256((const __m256i *)(block + 8 * codes_at + 32 * j));
    } else {
        TS_SIMD(rows8_words4)(block + codes_at, stride, q);
    }
    if (five && x8) { /* the fifth bits as ts_x8_qh orders them: a shift and a mask per 4 codes */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 8 * scales)), bit4 = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 4; j++) {
            lo[j] = _mm256_or_si256(_mm256_and_si256(q[j], low4), _mm256_and_si256(TS_SIMD(rows8_shift)(qh, 4 - 2 * j), bit4));
            hi[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q[j], 4), low4),
                                    _mm256_and_si256(TS_SIMD(rows8_shift)(qh, 3 - 2 * j), bit4));
        }
        return;
    }
    __m256i qh = _mm256_setzero_si256();
    if (five) {
        __m256i h[4];
        TS_SIMD(rows8_words4)(block + scales, stride, h); /* only h[0], each row's qh, is used */
        qh = h[0];
    }
    for (int j = 0; j < 4; j++) {
        lo[j] = _mm256_and_si256(q[j], low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(q[j], 4), low4);
        if (five) {
            for (int half = 0; half < 2; half++) { /* values 4j + i (qh byte j / 2), 16 + 4j + i (byte 2 + j / 2) */
                const char at = (char)(2 * half + j / 2);
                const __m256i spread = _mm256_setr_epi8(at, at, at, at, 4 + at, 4 + at, 4 + at, 4 + at, 8 + at, 8 + at,
                                                        8 + at, 8 + at, 12 + at, 12 + at, 12 + at, 12 + at, at, at, at,
                                                        at, 4 + at, 4 + at, 4 + at, 4 + at, 8 + at, 8 + at, 8 + at,
                                                        8 + at, 12 + at, 12 + at, 12 + at, 12 + at);
                const __m256i bit = _mm256_set1_epi32(j % 2 ? (int)0x80402010u : 0x08040201);
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit);
                const __m256i fifth = _mm256_and_si256(set, _mm256_set1_epi8(0x10));
                if (half == 0) lo[j] = _mm256_or_si256(lo[j], fifth);
                else hi[j] = _mm256_or_si256(hi[j], fifth);
            }
        }
    }
}

/* The signed codes of Q8_0 block ``block`` of 8 rows (``stride`` bytes apart, or one interleaved block with
 * x8): w[g] lane c holds codes 4g .. 4g + 3 of row c, the order both the tiles and the matrix-vector kernel
 * read them in. */
/* v[j] lane c = 32-bit word j of the 32 bytes at p + c * stride, for rows c < 8 and words j < 8. */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_words8)(const uint8_t *p, int64_t stride, __m256i v[8]) {
    for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(p + c * stride));
    TS_SIMD(tile_transpose8x8)(v);
}

/* 8 rows' Q4_K scale and min bytes from their 12 packed bytes (w[i] lane c: row c's word i), unpacked with
 * the scalar decoder's word masks lane by lane: bytes of words[0..1] are scales 0-7, of words[2..3] mins 0-7. */
static inline __attribute__((always_inline)) void TS_SIMD(k4_scale_words)(const __m256i w[3], __m256i words[4]) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4 = _mm256_set1_epi32(0x0f0f0f0f),
                  m2 = _mm256_set1_epi32(0x03030303);
    words[0] = _mm256_and_si256(w[0], m6);
    words[1] = _mm256_or_si256(_mm256_and_si256(w[2], m4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w[0], 6), m2), 4));
    words[2] = _mm256_and_si256(w[1], m6);
    words[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w[2], 4), m4),
                               _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w[1], 6), m2), 4));
}

/* A Q4_K unit's header for its 8 rows (gathered, or loaded where interleaved): d, minus dmin, and the 6-bit
 * scales and mins as words (k4_scale_words: words[0..1] scales, words[2..3] mins, byte j % 4 of word j / 4). */
static inline __attribute__((always_inline)) void TS_SIMD(k4_unit_header)(const uint8_t *unit, const int x8,
                                                                 int64_t row_bytes, __m256 *d, __m256 *neg_dmin,
                                                                 __m256i words[4]) {
    __m256 dmin;
    __m256i w[4]; /* the 12 scale bytes as words w[0..2] */
    if (x8) {
        TS_SIMD(rows8_halves_x8)(unit, d, &dmin);
        for (int i = 0; i < 3; i++) w[i] = _mm256_loadu_si256((const __m256i *)(unit + 32 + 32 * i));
    } else {
        TS_SIMD(rows8_halves)(unit, row_bytes, d, &dmin);
        TS_SIMD(rows8_words4)(unit + 4, row_bytes, w);
    }
    *neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), dmin);
    TS_SIMD(k4_scale_words)(w, words);
}

/* A Q6_K unit's d and int8 scales for its 8 rows: scales[i] lane c holds row c's scales 4i .. 4i + 3. */
static inline __attribute__((always_inline)) __m256 TS_SIMD(q6k_unit_header)(const uint8_t *unit, const int x8,
                                                                    int64_t row_bytes, __m256i scales[4]) {
    if (x8) { /* the fields at 8 x their offsets: codes' low nibbles, high bits, scales, d */
        for (int i = 0; i < 4; i++) scales[i] = _mm256_loadu_si256((const __m256i *)(unit + 1536 + 32 * i));
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 1664)));
    }
    __m256i tail[4];
    TS_SIMD(rows8_words4)(unit + 194, row_bytes, tail); /* tail[3]: bytes 206-209, d in the upper half */
    const __m256i d16 = _mm256_packus_epi32(_mm256_srli_epi32(tail[3], 16), _mm256_setzero_si256());
    TS_SIMD(rows8_words4)(unit + 192, row_bytes, scales);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(d16, 0x08)));
}

/* Int8 scale s (0 .. 15) of a Q6_K unit's 8 rows, sign-extended to 32 bits. */
static inline __attribute__((always_inline)) __m256i TS_SIMD(q6k_scale)(const __m256i scales[4], int s) {
    return _mm256_srai_epi32(_mm256_sll_epi32(scales[s / 4], _mm_cvtsi32_si128(24 - 8 * (s % 4))), 24);
}

/* An interleaved Q4_K unit's scales and offsets for 8 rows: sc[j] lane c = d x scale j of row c, mn[j] lane c =
 * -dmin x min j, the values k4_unit_scales gives per row (the same word masks, lane by lane). */
static inline __attribute__((always_inline)) void TS_SIMD(k4_x8_unit_scales)(const uint8_t *unit, __m256 sc[8],
                                                                    __m256 mn[8]) {
    __m256 d, dmin; /* dmin negated */
    __m256i words[4];
    TS_SIMD(k4_unit_header)(unit, 1, 0, &d, &dmin, words);
    const __m256i byte = _mm256_set1_epi32(0xff);
    for (int j = 0; j < 8; j++) {
        const __m128i shift = _mm_cvtsi32_si128(8 * (j % 4));
        sc[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(words[j / 4], shift), byte)), d);
        mn[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(words[2 + j / 4], shift), byte)), dmin);
    }
}

/* An interleaved Q6_K unit's scales for 8 rows: lo[k] lane c = d x int8 scale k of row c (k < 8), hi[k] scale
 * 8 + k, the values q6k_unit_scales gives per row. */
static inline __attribute__((always_inline)) void TS_SIMD(q6k_x8_unit_scales)(const uint8_t *unit, __m256 lo[8],
                                                                     __m256 hi[8]) {
    __m256i scales[4];
    const __m256 d = TS_SIMD(q6k_unit_header)(unit, 1, 0, scales);
    for (int k = 0; k < 16; k++)
        (k < 8 ? lo : hi)[k % 8] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(TS_SIMD(q6k_scale)(scales, k)));
}

static inline __attribute__((always_inline)) void TS_SIMD(rows8_q8_codes)(const int x8, const uint8_t *block,
                                                                 int64_t stride, __m256i w[8]) {
    if (x8) {
        for (int g = 0; g < 8; g++) w[g] = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * g));
    } else {
        TS_SIMD(rows8_words8)(block + 2, stride, w);
    }
}

/* The signed codes of 8 rows' 16 bytes of IQ4 nibbles at p + c * stride (IQ4_NL's block past its d, or one of
 * IQ4_XS's sub-blocks): w[g] lane c holds codes 4g .. 4g + 3 of row c, each nibble looked up in the codebook. */
static inline __attribute__((always_inline)) void TS_SIMD(rows8_iq4_codes)(const uint8_t *p, int64_t stride,
                                                                         __m256i w[8]) {
    const __m256i table = TS_SIMD(iq4_table)(), low4 = _mm256_set1_epi8(0x0f);
    __m256i q[4];
    TS_SIMD(rows8_words4)(p, stride, q);
    for (int j = 0; j < 4; j++) {
        w[j] = _mm256_shuffle_epi8(table, _mm256_and_si256(q[j], low4));
        w[4 + j] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q[j], 4), low4));
    }
}

/* The fp16 values in the low (high 0) or high (high 1) 16 bits of v's 8 lanes, as 8 floats. */
static inline __attribute__((always_inline)) __m256 TS_SIMD(rows8_f16)(__m256i v, const int high) {
    const __m256i h16 = high ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    const __m256i packed = _mm256_packus_epi32(h16, _mm256_setzero_si256()); /* lanes 0-3 | 4-7 per 128 bits */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

/* Each row's offset o (value = s * code + o) from its scale d and Q4_1 / Q5_1's m. */
static inline __attribute__((always_inline)) __m256 TS_SIMD(rows8_offsets)(const int type, __m256 d, __m256 m) {
    switch (type) {
    case TS_Q4_0: return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    case TS_Q5_0: return _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    case TS_Q4_1: case TS_Q5_1: return m;
    default: return _mm256_setzero_ps();
    }
}

/* A signed format's codes w (Q8_0, IQ4: 32 bytes at panel offset ``at``) as the micro tile reads them. AVX2's
 * maddubs sums byte pairs into int16, so w is split into |w| and its sign (|w| * (x, w's sign) = w * x,
 * at most 2 x 128 x 127). VNNI sums four products straight into int32, so w + 128 is stored, an unsigned
 * code like the other formats', and the panel's offset -128 d takes the 128 back out through the
 * block's x sum: no sign operations, and the 6-row tile's registers suffice. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_store_q8)(ts_tile_panel *p, int64_t at, __m256i w) {
#if TS_SIMD_VNNI
    _mm256_storeu_si256((__m256i *)(p->codes + at), _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)));
#else
    _mm256_storeu_si256((__m256i *)(p->signs + at), w);
    _mm256_storeu_si256((__m256i *)(p->codes + at), _mm256_abs_epi8(w)); /* -128 -> 0x80, read as 128 */
#endif
}

/* Rows [n0, n0 + 16), all present, of a nibble format, Q8_0 or IQ4_NL: 8 rows' blocks are gathered and transposed
 * as stored, before the nibbles are split (rows8_nibble_codes), which costs a third of decoding each row's
 * block on its own and transposing the codes; interleaved rows (x8) are read in that order already. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_decode_panel_gathered)(const int type, const int x8,
                                                                             const uint8_t *rows, int64_t row_bytes,
                                                                             int64_t kb, ts_tile_panel *p) {
    const int64_t block_bytes = ts_qunit_bytes(type);
    for (int64_t b = 0; b < kb; b++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *block = rows + 8 * h * row_bytes + b * block_bytes * (x8 ? 8 : 1);
            __m256 d, m;
            if (x8) TS_SIMD(rows8_halves_x8)(block, &d, &m);
            else TS_SIMD(rows8_halves)(block, row_bytes, &d, &m);
            _mm256_storeu_ps(p->scale + b * TS_TILE_COLS + 8 * h, d);
            _mm256_storeu_ps(p->offset + b * TS_TILE_COLS + 8 * h,
                             ts_qtype_signed(type) && TS_SIMD_VNNI ? _mm256_mul_ps(d, _mm256_set1_ps(-128.0f))
                                                                   : TS_SIMD(rows8_offsets)(type, d, m));
            if (ts_qtype_signed(type)) {
                __m256i w[8];
                if (type == TS_Q8_0) TS_SIMD(rows8_q8_codes)(x8, block, row_bytes, w);
                else TS_SIMD(rows8_iq4_codes)(block + 2, row_bytes, w); /* IQ4_NL: no interleaved layout */
                for (int g = 0; g < 8; g++) {
                    const int64_t at = ((b * 8 + g) * 2 + h) * 32;
                    TS_SIMD(tile_store_q8)(p, at, w[g]);
                }
            } else {
                __m256i lo[4], hi[4];
                TS_SIMD(rows8_nibble_codes)(type, x8, block, row_bytes, lo, hi);
                for (int j = 0; j < 4; j++) {
                    _mm256_storeu_si256((__m256i *)(p->codes + ((b * 8 + j) * 2 + h) * 32), lo[j]);
                    _mm256_storeu_si256((__m256i *)(p->codes + ((b * 8 + 4 + j) * 2 + h) * 32), hi[j]);
                }
            }
        }
    }
}

/* Weight rows [n0, n0 + 16), all present, of a K-quant as stored (``stride`` bytes a row): 8 rows' 32-byte
 * runs of packed codes are loaded together and transposed as 32-bit words once for every two sub-blocks
 * (Q4_K, Q5_K: a run holds sub-block 2p in its low nibbles, 2p + 1 in its high ones; Q6_K: two runs of
 * low bits and one of high bits make four sub-blocks), and each row's unit scales are transposed into the
 * panel's [block][column] order 8 at a time. Decoding block by block and row by row, then transposing the
 * codes, loaded and transposed every run twice (four times for Q6_K's high bits) and stored each scale on
 * its own: it was 11% of a 1.7B Q4_K_M model's prefill. Same codes and scales, bit for bit. Interleaved
 * Q4_K and Q6_K (x8) hold those runs and scales transposed already: plain loads. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_decode_panel_k)(const int type, const int x8,
                                                                      const uint8_t *rows, int64_t row_bytes,
                                                                      int64_t kb, ts_tile_panel *p) {
    const int64_t unit_bytes = ts_qunit_bytes(type), units = kb / 8;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(0x01);
    for (int64_t un = 0; un < units; un++) {
        for (int h = 0; h < 2; h++) {
            /* as stored, row c's unit is at unit + c * row_bytes; interleaved, the 8 rows' units are one block */
            const uint8_t *unit = rows + 8 * h * row_bytes + un * unit_bytes * (x8 ? 8 : 1);
#define TS_CODES_AT(block, g) (p->codes + ((((block)) * 8 + (g)) * 2 + h) * 32)
            if (type == TS_Q6_K) {
                __m256 lo[8], hi[8];
                if (x8) {
                    TS_SIMD(q6k_x8_unit_scales)(unit, lo, hi);
                } else {
                    for (int c = 0; c < 8; c++) TS_SIMD(q6k_unit_scales)(unit + c * row_bytes, &lo[c], &hi[c]);
                    TS_SIMD(tile_transpose8x8)((__m256i *)lo);
                    TS_SIMD(tile_transpose8x8)((__m256i *)hi);
                }
                for (int k = 0; k < 8; k++) { /* 16-value part k of the unit: block 8 un + k / 2, half k % 2 */
                    float *at = p->scale + (16 * un + k) * TS_TILE_COLS + 8 * h;
                    _mm256_storeu_ps(at, lo[k]);
                    _mm256_storeu_ps(at + 8 * TS_TILE_COLS, hi[k]);
                    float *off = p->offset + (16 * un + k) * TS_TILE_COLS + 8 * h;
                    _mm256_storeu_ps(off, _mm256_mul_ps(lo[k], _mm256_set1_ps(-32.0f)));
                    _mm256_storeu_ps(off + 8 * TS_TILE_COLS, _mm256_mul_ps(hi[k], _mm256_set1_ps(-32.0f)));
                }
                for (int half = 0; half < 2; half++) { /* sub-blocks 4 half + t, t < 4 */
                    __m256i a[8], b[8], v[8];
                    if (x8) {
                        for (int g = 0; g < 8; g++) {
                            a[g] = _mm256_loadu_si256((const __m256i *)(unit + 32 * (16 * half + g)));
                            b[g] = _mm256_loadu_si256((const __m256i *)(unit + 32 * (16 * half + 8 + g)));
                            v[g] = _mm256_loadu_si256((const __m256i *)(unit + 1024 + 32 * (8 * half + g)));
                        }
                    } else {
                        TS_SIMD(rows8_words8)(unit + 64 * half, row_bytes, a);
                        TS_SIMD(rows8_words8)(unit + 64 * half + 32, row_bytes, b);
                        TS_SIMD(rows8_words8)(unit + 128 + 32 * half, row_bytes, v);
                    }
                    for (int g = 0; g < 8; g++) {
                        const __m256i high = v[g];
                        const int64_t block = 8 * un + 4 * half;
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(block, g),
                                            _mm256_or_si256(_mm256_and_si256(a[g], low4),
                                                            _mm256_slli_epi16(_mm256_and_si256(high, low2), 4)));
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(block + 1, g),
                                            _mm256_or_si256(_mm256_and_si256(b[g], low4),
                                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), low2), 4)));
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(block + 2, g),
                                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a[g], 4), low4),
                                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), low2), 4)));
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(block + 3, g),
                                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b[g], 4), low4),
                                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), low2), 4)));
                    }
                }
            } else { /* Q4_K, Q5_K */
                __m256 sc[8], mn[8];
                if (x8) { /* only Q4_K is interleaved */
                    TS_SIMD(k4_x8_unit_scales)(unit, sc, mn);
                } else {
                    for (int c = 0; c < 8; c++) TS_SIMD(k4_unit_scales)(unit + c * row_bytes, &sc[c], &mn[c]);
                    TS_SIMD(tile_transpose8x8)((__m256i *)sc);
                    TS_SIMD(tile_transpose8x8)((__m256i *)mn);
                }
                for (int j = 0; j < 8; j++) {
                    _mm256_storeu_ps(p->scale + (8 * un + j) * TS_TILE_COLS + 8 * h, sc[j]);
                    _mm256_storeu_ps(p->offset + (8 * un + j) * TS_TILE_COLS + 8 * h, mn[j]);
                }
                const int five = type == TS_Q5_K, qs_at = five ? 48 : 16;
                __m256i fifth[8], v[8];
                if (five) TS_SIMD(rows8_words8)(unit + 16, row_bytes, fifth); /* bit j of byte v: value v's fifth bit in sub-block j */
                for (int pair = 0; pair < 4; pair++) {
                    if (x8) {
                        for (int g = 0; g < 8; g++) v[g] = _mm256_loadu_si256((const __m256i *)(unit + 128 + 256 * pair + 32 * g));
                    } else {
                        TS_SIMD(rows8_words8)(unit + qs_at + 32 * pair, row_bytes, v);
                    }
                    for (int g = 0; g < 8; g++) {
                        __m256i lo = _mm256_and_si256(v[g], low4), hi = _mm256_and_si256(_mm256_srli_epi16(v[g], 4), low4);
                        if (five) {
                            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(fifth[g], 2 * pair), one), 4));
                            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(fifth[g], 2 * pair + 1), one), 4));
                        }
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(8 * un + 2 * pair, g), lo);
                        _mm256_storeu_si256((__m256i *)TS_CODES_AT(8 * un + 2 * pair + 1, g), hi);
                    }
                }
            }
#undef TS_CODES_AT
        }
    }
}

/* A Q2_K unit's header for its 8 rows as stored: d, minus dmin, and sc[i] lane c = row c's packed scale bytes
 * 4i .. 4i + 3 (4-bit scale | 4-bit min << 4). The 16 bytes at 68 end where the unit does (d, dmin at 80). */
static inline __attribute__((always_inline)) void TS_SIMD(q2k_unit_header)(const uint8_t *unit, int64_t row_bytes,
                                                                         __m256 *d, __m256 *neg_dmin,
                                                                         __m256i sc[4]) {
    __m256i tail[4];
    TS_SIMD(rows8_words4)(unit + 68, row_bytes, tail);
    *d = TS_SIMD(rows8_f16)(tail[3], 0);
    *neg_dmin = _mm256_xor_ps(TS_SIMD(rows8_f16)(tail[3], 1), _mm256_set1_ps(-0.0f)); /* exact negation */
    TS_SIMD(rows8_words4)(unit, row_bytes, sc);
}

/* A Q3_K unit's header for its 8 rows as stored: d, and sc[i] lane c = row c's 6-bit scales 4i .. 4i + 3 (before
 * the -32), one a byte, unpacked from the 12 bytes at 96 with ts_q3k_scale's rule lane by lane. The 16 bytes
 * read start at 94 so that they end where the unit does (d at 108); words are realigned by shifts. */
static inline __attribute__((always_inline)) void TS_SIMD(q3k_unit_header)(const uint8_t *unit, int64_t row_bytes,
                                                                         __m256 *d, __m256i sc[4]) {
    __m256i v[4], w[3]; /* w[i]: scale bytes 4i .. 4i + 3 */
    TS_SIMD(rows8_words4)(unit + 94, row_bytes, v);
    for (int i = 0; i < 3; i++) w[i] = _mm256_or_si256(_mm256_srli_epi32(v[i], 16), _mm256_slli_epi32(v[i + 1], 16));
    *d = TS_SIMD(rows8_f16)(v[3], 1);
    const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x03030303);
    for (int i = 0; i < 4; i++) { /* scales 4i ..: low nibbles of w[i % 2] (i < 2) or high ones, bits 2i of w[2] */
        const __m256i low = i < 2 ? w[i % 2] : _mm256_srli_epi32(w[i % 2], 4);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(w[2], 2 * i), m2);
        sc[i] = _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_slli_epi32(high, 4));
    }
}

/* A Q2_K or Q3_K unit's header for 8 rows: scale d, sub-block scales sc, and the float minimum -dmin (Q2_K) or
 * the third bits hm (Q3_K; -dmin stays 0). */
static inline __attribute__((always_inline)) void TS_SIMD(k23_unit_header)(const int q3, const uint8_t *unit,
                                                                          int64_t row_bytes, __m256 *d,
                                                                          __m256 *neg_dmin, __m256i sc[4],
                                                                          __m256i hm[8]) {
    *neg_dmin = _mm256_setzero_ps();
    if (q3) {
        TS_SIMD(q3k_unit_header)(unit, row_bytes, d, sc);
        TS_SIMD(rows8_words8)(unit, row_bytes, hm);
    } else {
        TS_SIMD(q2k_unit_header)(unit, row_bytes, d, neg_dmin, sc);
    }
}

/* Sub-block j of a Q2_K or Q3_K unit for 8 rows (the 2-bit run t of its half, transposed; Q3_K's third bits
 * hm, transposed): codes[g] lane c = codes 4g .. 4g + 3 of row c, bits 2s of the run (s = j % 4), Q3_K's bit j
 * of hm moved to bit 2 (a 32-bit shift by at most 5 keeps every byte's bit within its byte). */
static inline __attribute__((always_inline)) void TS_SIMD(k2_codes)(const int q3, const __m256i t[8], const __m256i hm[8],
                                                                  int s, int j, __m256i codes[8]) {
    const __m256i low2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
    for (int g = 0; g < 8; g++) {
        codes[g] = _mm256_and_si256(_mm256_srli_epi16(t[g], 2 * s), low2);
        if (q3) codes[g] = _mm256_or_si256(codes[g], _mm256_and_si256(TS_SIMD(rows8_shift)(hm[g], 2 - j), bit2));
    }
}

/* The scale and offset of 16-value part k (0 .. 15) of a Q2_K or Q3_K unit's 8 rows, from its header: the
 * values ts_block_decode gives, by the same float operations (Q3_K's offset: -4 x the scale). */
static inline __attribute__((always_inline)) void TS_SIMD(k2_part_scale)(const int q3, __m256 d, __m256 neg_dmin,
                                                                       const __m256i sc[4], int k, __m256 *scale,
                                                                       __m256 *offset) {
    const __m256i sk = _mm256_and_si256(_mm256_srl_epi32(sc[k / 4], _mm_cvtsi32_si128(8 * (k % 4))),
                                        _mm256_set1_epi32(0xff));
    if (q3) {
        *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(sk, _mm256_set1_epi32(32))));
        *offset = _mm256_mul_ps(*scale, _mm256_set1_ps(-4.0f));
    } else {
        *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sk, _mm256_set1_epi32(15))));
        *offset = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sk, 4)));
    }
}

/* The scale d x (ls - 32) of sub-block j of an IQ4_XS unit's 8 rows, from its first two words (head[0] lane c:
 * row c's d | scales_h << 16, head[1]: its scales_l): ls is 4 bits of scales_l and 2 of scales_h. */
static inline __attribute__((always_inline)) __m256 TS_SIMD(iq4xs_scale)(__m256 d, const __m256i head[2], int j) {
    const __m256i low = _mm256_and_si256(_mm256_srl_epi32(head[1], _mm_cvtsi32_si128(4 * j)), _mm256_set1_epi32(15));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi32(head[0], _mm_cvtsi32_si128(16 + 2 * j)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
}

/* Weight rows [n0, n0 + 16), all present, of Q2_K, Q3_K or IQ4_XS (as stored: no interleaved layout): per unit
 * and 8 rows, the headers are gathered once and each run of codes transposed once (a Q2_K or Q3_K run serves
 * four sub-blocks), as the matrix-vector kernel reads them; the same codes, scales and offsets as decoding
 * each row's blocks and transposing (the generic path below), bit for bit, at a fraction of its shuffles. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_decode_panel_low)(const int type, const uint8_t *rows,
                                                                               int64_t row_bytes, int64_t kb,
                                                                               ts_tile_panel *p) {
    const int q3 = type == TS_Q3_K;
    const int64_t unit_bytes = ts_qunit_bytes(type);
    for (int64_t un = 0; un < kb / 8; un++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *unit = rows + 8 * h * row_bytes + un * unit_bytes;
            if (type == TS_IQ4_XS) {
                __m256i head[4];
                TS_SIMD(rows8_words4)(unit, row_bytes, head);
                const __m256 d = TS_SIMD(rows8_f16)(head[0], 0);
                for (int j = 0; j < 8; j++) {
                    const int64_t b = 8 * un + j;
                    const __m256 scale = TS_SIMD(iq4xs_scale)(d, head, j);
                    _mm256_storeu_ps(p->scale + b * TS_TILE_COLS + 8 * h, scale);
                    _mm256_storeu_ps(p->offset + b * TS_TILE_COLS + 8 * h, /* VNNI stores w + 128 */
                                     TS_SIMD_VNNI ? _mm256_mul_ps(scale, _mm256_set1_ps(-128.0f)) : _mm256_setzero_ps());
                    __m256i w[8];
                    TS_SIMD(rows8_iq4_codes)(unit + 8 + 16 * j, row_bytes, w);
                    for (int g = 0; g < 8; g++) TS_SIMD(tile_store_q8)(p, ((b * 8 + g) * 2 + h) * 32, w[g]);
                }
                continue;
            }
            __m256 d, neg_dmin;
            __m256i sc[4], hm[8];
            TS_SIMD(k23_unit_header)(q3, unit, row_bytes, &d, &neg_dmin, sc, hm);
            for (int n = 0; n < 2; n++) {
                __m256i t[8];
                TS_SIMD(rows8_words8)(unit + (q3 ? 32 : 16) + 32 * n, row_bytes, t);
                for (int s = 0; s < 4; s++) {
                    const int j = 4 * n + s;
                    const int64_t b = 8 * un + j;
                    __m256i codes[8];
                    TS_SIMD(k2_codes)(q3, t, hm, s, j, codes);
                    for (int g = 0; g < 8; g++) _mm256_storeu_si256((__m256i *)(p->codes + ((b * 8 + g) * 2 + h) * 32), codes[g]);
                    for (int half = 0; half < 2; half++) {
                        __m256 scale, offset;
                        TS_SIMD(k2_part_scale)(q3, d, neg_dmin, sc, 2 * j + half, &scale, &offset);
                        _mm256_storeu_ps(p->scale + (b * 2 + half) * TS_TILE_COLS + 8 * h, scale);
                        _mm256_storeu_ps(p->offset + (b * 2 + half) * TS_TILE_COLS + 8 * h, offset);
                    }
                }
            }
        }
    }
}

/* Weight rows [n0, n0 + 16) of a segment (rows past its end decode to zeros) into a panel. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_decode_panel)(const int type, const ts_qseg *seg, int64_t n0,
                                                                    int64_t k, ts_tile_panel *p) {
    const int64_t kb = k / TS_QBLOCK, row_bytes = ts_qrow_bytes(type, k);
    const int64_t valid = seg->n - n0 < TS_TILE_COLS ? seg->n - n0 : TS_TILE_COLS;
    if (valid == TS_TILE_COLS && (TS_SIMD(rows8_nibble_format)(type) || type == TS_Q8_0 || type == TS_IQ4_NL)) {
        TS_SIMD(tile_decode_panel_gathered)(type, seg->layout == TS_LAYOUT_X8, seg->data + n0 * row_bytes, row_bytes, kb, p);
        return;
    }
    if (valid == TS_TILE_COLS && (type == TS_Q4_K || type == TS_Q5_K || type == TS_Q6_K)) {
        TS_SIMD(tile_decode_panel_k)(type, seg->layout == TS_LAYOUT_X8, seg->data + n0 * row_bytes, row_bytes, kb, p);
        return;
    }
    if (valid == TS_TILE_COLS && (type == TS_Q2_K || type == TS_Q3_K || type == TS_IQ4_XS)) {
        TS_SIMD(tile_decode_panel_low)(type, seg->data + n0 * row_bytes, row_bytes, kb, p);
        return;
    }
    /* Each row as stored; an interleaved group's rows are copied back to the file's layout first (a panel
     * that is not whole, so at most 8 such rows and only at a segment's end). */
    const uint8_t *row_at[TS_TILE_COLS];
    for (int64_t c = 0; c < valid; c++)
        row_at[c] = ts_x8_row(seg, n0 + c, row_bytes, p->copies != NULL ? p->copies + c * row_bytes : NULL);
    const int halves = TS_SIMD(tile_halves)(type);
    float unit_s[TS_TILE_COLS][16], unit_o[TS_TILE_COLS][16];
    for (int64_t b = 0; b < kb; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i v[8];
            for (int c = 0; c < 8; c++) {
                const int col = 8 * h + c;
                float s[2] = {0.0f, 0.0f}, o[2] = {0.0f, 0.0f};
                v[c] = col < valid ? TS_SIMD(decode)(type, row_at[col], b, s, o, unit_s[col], unit_o[col])
                                   : _mm256_setzero_si256();
                if (ts_qtype_signed(type) && TS_SIMD_VNNI) o[0] = -128.0f * s[0]; /* codes stored as w + 128 */
                for (int half = 0; half < halves; half++) {
                    p->scale[(b * halves + half) * TS_TILE_COLS + col] = s[half];
                    p->offset[(b * halves + half) * TS_TILE_COLS + col] = o[half];
                }
            }
            TS_SIMD(tile_transpose8x8)(v);
            for (int g = 0; g < 8; g++) {
                const int64_t at = ((b * 8 + g) * 2 + h) * 32;
                if (ts_qtype_signed(type)) TS_SIMD(tile_store_q8)(p, at, v[g]);
                else _mm256_storeu_si256((__m256i *)(p->codes + at), v[g]);
            }
        }
    }
}

#if TS_SIMD_VNNI
/* res[r][16 j + c] = dot(x row r0 + r, column c of panel p[j]) for r < R, j < P, in 512-bit vectors: a
 * step's 64 bytes of a panel (4 codes of all 16 columns) are one vector, so each row takes one vpdpbusd
 * per panel and step. Rows r0 .. r0 + R - 1 lie in one TS_ACT_GROUP (r0 is a multiple of it).
 *
 * Why 6 rows by 2 panels: a tile of 8 rows by one panel loads 9 vectors (one of weights, 8 broadcasts of x)
 * for 8 vpdpbusd, and a Zen 5 core loads two 512-bit vectors a cycle while it retires two vpdpbusd: in a
 * micro-benchmark of the loop alone that tile reached 1.45 TOPS on 2 cores, against 2.1 for 6 rows by 2
 * panels (8 loads for 12 vpdpbusd), the core's vpdpbusd peak; with each block's float epilogue, 1.17
 * against 1.53 (docs/benchmarks.md). 12 integer and 12 float accumulators, two
 * weight vectors and a broadcast fit the 32 registers. CPUs that split 512-bit operations in two (Zen 4)
 * are bound by the vpdpbusd themselves either way. The arithmetic and float order are the 256-bit form's. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_rows)(const int type, const int R, const int P,
                                                            const ts_tile_panel *const *p, int64_t kb,
                                                            const ts_act *a, int64_t r0,
                                                            float res[TS_TILE_ROWS_MAX][TS_TILE_RES_COLS]) {
    enum { G = TS_SIMD_TILE_ROWS }; /* the activations' group (TS_ACT_GROUP) */
    const int halves = TS_SIMD(tile_halves)(type);
    __m512 acc[TS_TILE_ROWS_MAX][TS_TILE_PANELS_MAX];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t group = r0 / G;
    const int8_t *xq = a->tq + group * kb * (8 * 4 * G);
    const float *xd = a->td + group * kb * G, *xs = a->ts + group * kb * (3 * G);
    const int32_t *xb = a->tb != NULL ? a->tb + group * kb * (3 * G) : NULL; /* set where such a format is */
    /* An offset that is minus a power of two times the scale (Q4_0, Q5_0, the signed formats' 128, Q3_K, Q6_K:
     * ts_tile_int_offset_shift) enters as an integer: the sums of a block (Q3_K, Q6_K: of a half) start from x's codes' sum there, shifted,
     * and the float epilogue has no offset term (3 vector operations a block, row and panel instead of 4;
     * with the vpdpbusd, the epilogue is what bounds the tiles). */
    const int shift = ts_tile_int_offset_shift(type, 1), integer_offset = shift != 0;
    for (int64_t b = 0; b < kb; b++) {
#pragma GCC unroll 2
        for (int half = 0; half < halves; half++) {
            const int g_lo = half * 8 / halves, g_hi = (half + 1) * 8 / halves;
            __m512i wide[TS_TILE_ROWS_MAX][TS_TILE_PANELS_MAX];
            for (int r = 0; r < R; r++) {
                const __m512i start = integer_offset
                    ? _mm512_slli_epi32(_mm512_set1_epi32(xb[b * (3 * G) + (halves == 2 ? half : 2) * G + r]), shift)
                    : _mm512_setzero_si512();
                for (int j = 0; j < P; j++) wide[r][j] = start;
            }
#pragma GCC unroll 8
            for (int g = g_lo; g < g_hi; g++) {
                __m512i w[TS_TILE_PANELS_MAX];
                for (int j = 0; j < P; j++) w[j] = _mm512_loadu_si512((const void *)(p[j]->codes + (b * 8 + g) * 64));
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, xq + b * (8 * 4 * G) + 4 * G * g + 4 * r, 4);
                    const __m512i x4 = _mm512_set1_epi32(four);
                    for (int j = 0; j < P; j++) wide[r][j] = _mm512_dpbusd_epi32(wide[r][j], w[j], x4);
                }
            }
            const float *sums = xs + b * (3 * G) + (halves == 2 ? half : 2) * G; /* a half's sum, or the block's */
            for (int j = 0; j < P; j++) {
                const __m512 scale = _mm512_loadu_ps(p[j]->scale + (b * halves + half) * TS_TILE_COLS);
                const __m512 offset = _mm512_loadu_ps(p[j]->offset + (b * halves + half) * TS_TILE_COLS);
                for (int r = 0; r < R; r++) {
                    const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(wide[r][j]), _mm512_set1_ps(xd[b * G + r]));
                    acc[r][j] = _mm512_fmadd_ps(dots, scale, acc[r][j]);
                    if (!integer_offset) acc[r][j] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r]), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P; j++) _mm512_storeu_ps(res[r] + TS_TILE_COLS * j, acc[r][j]);
}
#else
/* res[r][c] = dot(x row r0 + r, panel column c) for r < R. */
static inline __attribute__((always_inline)) void TS_SIMD(tile_rows)(const int type, const int R, const int P,
                                                            const ts_tile_panel *const *panels, int64_t kb,
                                                            const ts_act *a, int64_t r0,
                                                            float res[TS_TILE_ROWS_MAX][TS_TILE_RES_COLS]) {
    (void)P; /* one panel a tile (TS_SIMD_TILE_PANELS) */
    const ts_tile_panel *p = panels[0];
    const int halves = TS_SIMD(tile_halves)(type);
    const int chain = TS_SIMD_VNNI ? 8 / halves : TS_SIMD(tile_chain)(type); /* VNNI: no int16 steps */
    const int signed_codes = ts_qtype_signed(type) && !TS_SIMD_VNNI, has_offset = !ts_qtype_signed(type) || TS_SIMD_VNNI;
    /* Q4_0's, Q5_0's and Q6_K's offsets (minus a power of two times the scale) join the integer sums, shifted
     * from x's code sums (a->qb), as in the 512-bit form: no offset FMA in the epilogue. */
    const int shift = ts_tile_int_offset_shift(type, TS_SIMD_VNNI);
#if !TS_SIMD_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[TS_TILE_ROWS_MAX][2];
    const int8_t *xq[TS_TILE_ROWS_MAX];
    for (int r = 0; r < R; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        xq[r] = a->q + (r0 + r) * a->k;
    }
    for (int64_t b = 0; b < kb; b++) {
        for (int half = 0; half < halves; half++) {
            const int g_lo = half * 8 / halves, g_hi = (half + 1) * 8 / halves;
            __m256i wide[TS_TILE_ROWS_MAX][2] = {{_mm256_setzero_si256()}}; /* all zero (VNNI adds into them) */
            for (int g0 = g_lo; g0 < g_hi; g0 += chain) {
#if !TS_SIMD_VNNI
                __m256i sums[TS_TILE_ROWS_MAX][2];
#endif
                for (int g = g0; g < g0 + chain; g++) {
                    const int64_t at = (b * 8 + g) * 64;
                    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p->codes + at));
                    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p->codes + at + 32));
                    for (int r = 0; r < R; r++) {
                        __m256i x0, x1;
                        if (signed_codes || type == TS_Q5_0 || type == TS_Q5_1) {
                            /* x broadcast straight from memory (one load): GCC otherwise routes it through an
                             * integer register (three instructions, two on the vector ports that Q8_0's vpsignb
                             * needs too). Q8_0 gained 30% from it, Q5_0 and Q5_1 3-5%; Q4_0, Q4_1 and the
                             * K-quants measured as fast or faster with the register (an AVX2-only Zen 3 build). */
                            x0 = x1 = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(xq[r] + b * TS_QBLOCK + 4 * g)));
                        } else {
                            int32_t four;
                            memcpy(&four, xq[r] + b * TS_QBLOCK + 4 * g, 4);
                            x0 = x1 = _mm256_set1_epi32(four);
                        }
                        if (signed_codes) { /* |w| * (x with w's sign) = w * x */
                            x0 = _mm256_sign_epi8(x0, _mm256_loadu_si256((const __m256i *)(p->signs + at)));
                            x1 = _mm256_sign_epi8(x1, _mm256_loadu_si256((const __m256i *)(p->signs + at + 32)));
                        }
#if TS_SIMD_VNNI /* vpdpbusd adds the four products straight into int32: no int16 chain to widen */
                        wide[r][0] = _mm256_dpbusd_epi32(wide[r][0], w0, x0);
                        wide[r][1] = _mm256_dpbusd_epi32(wide[r][1], w1, x1);
#else
                        const __m256i p0 = _mm256_maddubs_epi16(w0, x0), p1 = _mm256_maddubs_epi16(w1, x1);
                        sums[r][0] = g == g0 ? p0 : _mm256_add_epi16(sums[r][0], p0);
                        sums[r][1] = g == g0 ? p1 : _mm256_add_epi16(sums[r][1], p1);
#endif
                    }
                }
#if !TS_SIMD_VNNI
                for (int r = 0; r < R; r++) {
                    for (int h = 0; h < 2; h++) {
                        const __m256i w32 = _mm256_madd_epi16(sums[r][h], ones);
                        wide[r][h] = g0 == g_lo ? w32 : _mm256_add_epi32(wide[r][h], w32);
                    }
                }
#endif
            }
            const float *scale = p->scale + (b * halves + half) * TS_TILE_COLS;
            const float *offset = p->offset + (b * halves + half) * TS_TILE_COLS;
            for (int r = 0; r < R; r++) {
                const int64_t at = (r0 + r) * a->kb + b;
                const __m256 xd = _mm256_set1_ps(a->d[at]);
                const float *xs = a->s + 2 * at;
                const __m256 xsum = _mm256_set1_ps(halves == 2 ? xs[half] : xs[0] + xs[1]);
                __m256i start = _mm256_setzero_si256();
                if (shift) {
                    const int32_t *qs = a->qb + 2 * at;
                    start = _mm256_slli_epi32(_mm256_set1_epi32(halves == 2 ? qs[half] : qs[0] + qs[1]), shift);
                }
                for (int h = 0; h < 2; h++) {
                    const __m256i whole = shift ? _mm256_add_epi32(wide[r][h], start) : wide[r][h];
                    const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(whole), xd);
                    acc[r][h] = _mm256_fmadd_ps(dots, _mm256_loadu_ps(scale + 8 * h), acc[r][h]);
                    if (has_offset && !shift)
                        acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(offset + 8 * h), xsum, acc[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(res[r], acc[r][0]);
        _mm256_storeu_ps(res[r] + 8, acc[r][1]);
    }
}
#endif

static void TS_SIMD(tile_decode_panel_any)(const ts_qseg *seg, int64_t n0, int64_t k, ts_tile_panel *p) {
#define TS_CASE(T) case T: TS_SIMD(tile_decode_panel)(T, seg, n0, k, p); break;
    switch ((int)seg->type) {
        TS_FOR_EACH_QTYPE(TS_CASE)
    default: break; /* ts_qmatmul_f32 declined unknown formats before any thread got here */
    }
#undef TS_CASE
}

/* The micro tile for format ``type``, ``rows`` (1 .. TS_SIMD_TILE_ROWS) rows and ``count`` panels (1 or
 * TS_SIMD_TILE_PANELS), each combination its own loop. */
static void TS_SIMD(tile_rows_any)(int type, int rows, int count, const ts_tile_panel *const *p, int64_t kb,
                                   const ts_act *a, int64_t r0, float res[TS_TILE_ROWS_MAX][TS_TILE_RES_COLS]) {
#define TS_ROWS(T, P)                                                                   \
    switch (rows) {                                                                     \
    case 1: TS_SIMD(tile_rows)(T, 1, P, p, kb, a, r0, res); break;                      \
    case 2: TS_SIMD(tile_rows)(T, 2, P, p, kb, a, r0, res); break;                      \
    case 3: TS_SIMD(tile_rows)(T, 3, P, p, kb, a, r0, res); break;                      \
    case 4: TS_SIMD(tile_rows)(T, TS_TILE_MIN(4), P, p, kb, a, r0, res); break;         \
    case 5: TS_SIMD(tile_rows)(T, TS_TILE_MIN(5), P, p, kb, a, r0, res); break;         \
    case 6: TS_SIMD(tile_rows)(T, TS_TILE_MIN(6), P, p, kb, a, r0, res); break;         \
    case 7: TS_SIMD(tile_rows)(T, TS_TILE_MIN(7), P, p, kb, a, r0, res); break;         \
    default: TS_SIMD(tile_rows)(T, TS_SIMD_TILE_ROWS, P, p, kb, a, r0, res); break;     \
    }
#define TS_CASE(T)                                                  \
    case T:                                                         \
        if (count == TS_SIMD_TILE_PANELS) { TS_ROWS(T, TS_SIMD_TILE_PANELS) } else { TS_ROWS(T, 1) } \
        break;
    switch (type) {
        TS_FOR_EACH_QTYPE(TS_CASE)
    default: break;
    }
#undef TS_CASE
#undef TS_ROWS
}

/* Plans panels [i, i + count) (those below hi) for prefetching. */
static inline void TS_SIMD(tile_prefetch_plan)(const ts_qmat *w, int64_t i, int count, int64_t hi, ts_tile_prefetch *f) {
    f->count = f->current = 0;
    f->done = 0;
    for (int j = 0; j < count && i + j < hi; j++) {
        int64_t first, col0;
        const ts_qseg *seg = ts_panel_segment(w, i + j, TS_TILE_COLS, &first, &col0);
        const int64_t bytes = ts_qrow_bytes(seg->type, w->k);
        const int64_t rows = seg->n - first * TS_TILE_COLS < TS_TILE_COLS ? seg->n - first * TS_TILE_COLS : TS_TILE_COLS;
        f->at[f->count] = (const char *)seg->data + first * TS_TILE_COLS * bytes;
        f->bytes[f->count++] = rows * bytes;
    }
}

/* Prefetches the plan's next ``budget`` bytes (all that is left with budget < 0). */
static inline void TS_SIMD(tile_prefetch_some)(ts_tile_prefetch *f, int64_t budget) {
    while (f->current < f->count && budget != 0) {
        const int64_t left = f->bytes[f->current] - f->done;
        const int64_t take = budget < 0 || budget > left ? left : budget;
        for (int64_t off = 0; off < take; off += 64) __builtin_prefetch(f->at[f->current] + f->done + off, 0, 2);
        f->done += take;
        if (budget > 0) budget -= take;
        if (f->done >= f->bytes[f->current]) {
            f->current++;
            f->done = 0;
        }
    }
}

/* This thread's share of out = x W^T (+ bias) through the tiles, x already quantized into ``a``. Called by
 * every thread of the team (each takes a static, contiguous range of panels, up to TS_SIMD_TILE_PANELS of
 * them at a time where they share a format); returns -1 when its scratch memory cannot be had. */
static int TS_SIMD(tiles_matmul_share)(const ts_qmat *w, const ts_act *a, int64_t m, float *out, int64_t out_stride) {
    const int64_t k = w->k, kb = k / TS_QBLOCK;
    const int64_t panels = ts_panel_count(w, TS_TILE_COLS);
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t lo = panels * tid / nth, hi = panels * (tid + 1) / nth;
    if (lo >= hi) return 0;
    int64_t copy_bytes = 0;
    for (int64_t s = 0; s < w->num_segs; s++) {
        const int64_t bytes = ts_qrow_bytes(w->seg[s].type, k);
        if (w->seg[s].layout == TS_LAYOUT_X8 && bytes > copy_bytes) copy_bytes = bytes;
    }
    ts_tile_panel p[TS_SIMD_TILE_PANELS];
    const ts_tile_panel *group[TS_SIMD_TILE_PANELS];
    int ok = 1;
    for (int j = 0; j < TS_SIMD_TILE_PANELS; j++) {
        p[j].codes = malloc((size_t)(kb * 512));
        p[j].signs = TS_SIMD_VNNI ? NULL : malloc((size_t)(kb * 512)); /* signed codes' signs: AVX2 only (tile_store_q8) */
        p[j].scale = malloc(sizeof(float) * (size_t)(kb * 2 * TS_TILE_COLS));
        p[j].offset = malloc(sizeof(float) * (size_t)(kb * 2 * TS_TILE_COLS));
        p[j].copies = copy_bytes ? malloc((size_t)(TS_TILE_COLS * copy_bytes)) : NULL;
        ok = ok && p[j].codes != NULL && (TS_SIMD_VNNI || p[j].signs != NULL) && p[j].scale != NULL &&
             p[j].offset != NULL && (copy_bytes == 0 || p[j].copies != NULL);
        group[j] = &p[j];
    }
    /* Rows go in chunks whose int8 activations and scales stay in L2 while every panel of this thread
     * sweeps them; a panel is decoded once per chunk. One sweep over 2048 rows of 576 values (1.6 MB)
     * spilled L2 and ran the prefill's products at 0.6-0.7 of the rate a 256-row batch reaches; the VNNI
     * build keeps at least 512 rows a chunk so that wide matrices do not decode their panels over and over
     * (ts_qgemm_tile_chunk_rows). */
    const int64_t row_bytes = k + 12 * kb; /* codes, d, and the two sums per block */
    const int64_t chunk = ts_qgemm_tile_chunk_rows(row_bytes, TS_SIMD_TILE_ROWS, TS_SIMD_CHUNK_MIN_ROWS);
    for (int64_t m0 = 0; ok && m0 < m; m0 += chunk) {
        const int64_t m1 = m - m0 < chunk ? m : m0 + chunk;
        for (int64_t i = lo; ok && i < hi;) {
            /* Up to TS_SIMD_TILE_PANELS consecutive panels of one format, decoded side by side. */
            int count = 0, type = -1;
            int64_t dst_col[TS_SIMD_TILE_PANELS], valid[TS_SIMD_TILE_PANELS];
            float add[TS_SIMD_TILE_PANELS][TS_TILE_COLS];
            while (count < TS_SIMD_TILE_PANELS && i < hi) {
                int64_t first, col0;
                const ts_qseg *seg = ts_panel_segment(w, i, TS_TILE_COLS, &first, &col0);
                if (count > 0 && (int)seg->type != type) break;
                type = (int)seg->type;
                const int64_t n0 = first * TS_TILE_COLS;
                TS_SIMD(tile_decode_panel_any)(seg, n0, k, &p[count]);
                dst_col[count] = col0 + n0;
                valid[count] = seg->n - n0 < TS_TILE_COLS ? seg->n - n0 : TS_TILE_COLS;
                for (int64_t c = 0; c < valid[count]; c++)
                    add[count][c] = w->bias != NULL ? w->bias[col0 + n0 + c] : 0.0f;
                count++;
                i++;
            }
            /* The panels decoded next (this chunk's, or the next chunk's first), fetched over the last
             * tiles: a slice each, so that they arrive after most of the chunk's activations went by. */
            ts_tile_prefetch next;
            TS_SIMD(tile_prefetch_plan)(w, i < hi ? i : lo, TS_SIMD_TILE_PANELS, i < hi || m1 < m ? hi : lo, &next);
            int64_t next_bytes = 0;
            for (int j = 0; j < next.count; j++) next_bytes += next.bytes[j];
            int64_t tail_tiles = TS_TILE_PREFETCH_TAIL_BYTES / (row_bytes * TS_SIMD_TILE_ROWS);
            tail_tiles = tail_tiles < 1 ? 1 : tail_tiles;
            const int64_t tiles = (m1 - m0 + TS_SIMD_TILE_ROWS - 1) / TS_SIMD_TILE_ROWS;
            const int64_t first_tail = tiles > tail_tiles ? tiles - tail_tiles : 0;
            const int64_t slice = (next_bytes / (tiles - first_tail) + 63) / 64 * 64 + 64;
            for (int64_t r0 = m0, t = 0; r0 < m1; r0 += TS_SIMD_TILE_ROWS, t++) {
                const int rows = (int)(m1 - r0 < TS_SIMD_TILE_ROWS ? m1 - r0 : TS_SIMD_TILE_ROWS);
                float res[TS_TILE_ROWS_MAX][TS_TILE_RES_COLS];
                if (t >= first_tail) TS_SIMD(tile_prefetch_some)(&next, slice);
                TS_SIMD(tile_rows_any)(type, rows, count, group, kb, a, r0, res);
                for (int j = 0; j < count; j++)
                    for (int r = 0; r < rows; r++) {
                        float *dst = out + (r0 + r) * out_stride + dst_col[j];
                        for (int64_t c = 0; c < valid[j]; c++) dst[c] = res[r][TS_TILE_COLS * j + c] + add[j][c];
                    }
            }
        }
    }
    for (int j = 0; j < TS_SIMD_TILE_PANELS; j++) {
        free(p[j].codes);
        free(p[j].signs);
        free(p[j].scale);
        free(p[j].offset);
        free(p[j].copies);
    }
    return ok ? 0 : -1;
}
