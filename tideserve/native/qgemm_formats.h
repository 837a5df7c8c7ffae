/* GGUF block formats as tideserve's quantized kernels read them (shared by qgemm.c's scalar, AVX2,
 * AVX-512 and AMX paths), so each format is described once.
 *
 * A weight row of k values is k / U units, stored back to back exactly as in a GGUF file (ggml's
 * block_q4_0 etc.); U is 32 for the legacy formats and IQ4_NL, 256 for the K-quants and IQ4_XS. Every format
 * decodes, per 32 values, to 8-bit codes u (unsigned, or signed: ts_qtype_signed) and per-16-value scale s and
 * offset o, value = s * u + o:
 *   Q4_0  (type 2,  18 B / 32): d fp16, qs[16]; u = nibble (value j: low nibble of qs[j], j+16: high), o = -8d
 *   Q4_1  (type 3,  20 B / 32): d, m fp16, qs[16] as Q4_0; o = m
 *   Q5_0  (type 6,  22 B / 32): d fp16, qh[4] (bit j = 5th bit of value j), qs[16]; o = -16d
 *   Q5_1  (type 7,  24 B / 32): d, m fp16, qh[4], qs[16]; o = m
 *   Q8_0  (type 8,  34 B / 32): d fp16, qs[32] int8: signed codes, value = d * q (no offset)
 *   Q4_K  (type 12, 144 B / 256): d, dmin fp16, scales[12] (eight 6-bit scales and mins), qs[128];
 *         sub-block j of 32: u = nibble, s = d * sc[j], o = -dmin * mn[j]
 *   Q5_K  (type 13, 176 B / 256): as Q4_K plus qh[32] (bit j of qh[l] is the 5th bit of value l of sub-block j)
 *   Q6_K  (type 14, 210 B / 256): ql[128], qh[64], scales[16] int8, d fp16; 16 sub-blocks of 16 with
 *         s = d * scales[i], u in 0..63, o = -32 s
 *   Q2_K  (type 10, 84 B / 256): scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin fp16; 16 sub-blocks
 *         of 16: u = 2 bits, s = d * (scales[i] & 15), o = -dmin * (scales[i] >> 4)
 *   Q3_K  (type 11, 110 B / 256): hmask[32], qs[64], scales[12] (sixteen 6-bit scales), d fp16; 16 sub-blocks
 *         of 16: u = 2 low bits | hmask bit << 2 (0..7), s = d * (scale - 32), o = -4 s
 *   IQ4_NL (type 20, 18 B / 32): d fp16, qs[16] as Q4_0, but a nibble indexes a 16-entry table of int8
 *         values (ts_iq4_values): signed codes like Q8_0's, value = d * code
 *   IQ4_XS (type 23, 136 B / 256): d fp16, scales_h u16, scales_l[4], qs[128]; 8 sub-blocks of 32 with a
 *         6-bit scale ls (low 4 bits in scales_l, high 2 in scales_h), s = d * (ls - 32), codes as IQ4_NL's
 * The signed formats (Q8_0, IQ4_NL, IQ4_XS: ts_qtype_signed) have no offset; a format has a scale per
 * 16-value half where ts_qtype_halves says 2 (Q2_K, Q3_K, Q6_K), one per 32 values otherwise.
 * Activations are quantized per 32 values to int8 (x = xd * q), with the sums of q over each 16-value
 * half, so a unit's offsets cost one multiply-add per half instead of one per value.
 */
#ifndef TS_QGEMM_FORMATS_H
#define TS_QGEMM_FORMATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum {
    TS_Q4_0 = 2, TS_Q4_1 = 3, TS_Q5_0 = 6, TS_Q5_1 = 7, TS_Q8_0 = 8, TS_Q2_K = 10, TS_Q3_K = 11, TS_Q4_K = 12,
    TS_Q5_K = 13, TS_Q6_K = 14, TS_IQ4_NL = 20, TS_IQ4_XS = 23
};

/* The IQ4 formats' non-linear codebook: a nibble's int8 value (ggml's kvalues_iq4nl). */
static const int8_t ts_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#define TS_QBLOCK 32

/* One segment of a layer's weight: n rows of k values in one format, stored as in a GGUF file
 * (TS_LAYOUT_ROWS) or with each whole group of 8 rows interleaved (TS_LAYOUT_X8, below). */
typedef struct {
    int64_t type;
    const uint8_t *data;
    int64_t n;
    int64_t layout;
} ts_qseg;

enum { TS_LAYOUT_ROWS = 0, TS_LAYOUT_X8 = 1 };

#define TS_QMAT_SEGS 4
typedef struct {
    ts_qseg seg[TS_QMAT_SEGS];
    int64_t num_segs;
    const float *bias; /* [n] or NULL */
    int64_t n, k;      /* n = the segments' rows together */
} ts_qmat;


/* Every format the kernels take, for switches that dispatch to a template per format: X(TS_Q4_0) ... */
#define TS_FOR_EACH_QTYPE(X)                                                                                  \
    X(TS_Q4_0) X(TS_Q4_1) X(TS_Q5_0) X(TS_Q5_1) X(TS_Q8_0) X(TS_Q2_K) X(TS_Q3_K) X(TS_Q4_K) X(TS_Q5_K) X(TS_Q6_K) \
    X(TS_IQ4_NL) X(TS_IQ4_XS)

static inline int ts_qtype_known(int64_t type) {
    switch (type) {
#define TS_KNOWN(T) case T:
    TS_FOR_EACH_QTYPE(TS_KNOWN)
#undef TS_KNOWN
        return 1;
    default:
        return 0;
    }
}

/* Values per storage unit, and bytes per unit. */
static inline int64_t ts_qunit(int64_t type) {
    switch (type) {
    case TS_Q2_K: case TS_Q3_K: case TS_Q4_K: case TS_Q5_K: case TS_Q6_K: case TS_IQ4_XS: return 256;
    default: return 32;
    }
}
static inline int64_t ts_qunit_bytes(int64_t type) {
    switch (type) {
    case TS_Q2_K: return 84;
    case TS_Q3_K: return 110;
    case TS_IQ4_NL: return 18;
    case TS_IQ4_XS: return 136;
    case TS_Q4_0: return 18;
    case TS_Q4_1: return 20;
    case TS_Q5_0: return 22;
    case TS_Q5_1: return 24;
    case TS_Q8_0: return 34;
    case TS_Q4_K: return 144;
    case TS_Q5_K: return 176;
    case TS_Q6_K: return 210;
    default: return 0;
    }
}
/* Whether a format's codes are signed int8 (value = s * code, no offset) rather than unsigned. */
static inline int ts_qtype_signed(int64_t type) { return type == TS_Q8_0 || type == TS_IQ4_NL || type == TS_IQ4_XS; }

/* Scales per 32-value block: 2 for the formats with one per 16 values. */
static inline int ts_qtype_halves(int64_t type) { return type == TS_Q2_K || type == TS_Q3_K || type == TS_Q6_K ? 2 : 1; }

static inline int64_t ts_qrow_bytes(int64_t type, int64_t k) { return k / ts_qunit(type) * ts_qunit_bytes(type); }

static inline float ts_fp16(uint16_t h) {
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
}

static inline uint16_t ts_load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The interleaved layout (TS_LAYOUT_X8) of the legacy formats, Q8_0, Q4_K and Q6_K.
 *
 * Why: AVX2's matrix-vector kernel and tiles read 8 weight rows at once, one vector lane per row, and
 * gathering those lanes from 8 rows as stored costs about a third of their instructions (loads, inserts,
 * unpacks) and spreads the reads over 8 streams. Interleaved once at load, the same vectors are single
 * loads from one stream. Each whole group of 8 rows keeps its bytes (8 x row_bytes) and only reorders
 * them: block b of the group is 8 x unit_bytes at b * 8 * unit_bytes, and within it each field of the
 * block (at offset o in the file's block) starts at 8 * o and holds the 8 rows' copies of it, row c's
 * 4-byte word i at 8 * o + 32 * i + 4 * c (an fp16 field: row c's at 8 * o + 2 * c). Q5's 32 fifth bits
 * are reordered too (ts_x8_qh), so that a shift and a mask put them next to each group of 4 codes. Rows past
 * the last whole group stay as in the file. Every other reader goes through ts_x8_row.
 *
 * The K-quants' block here is their unit of 256 values. Stored as rows, Q4_K's and Q6_K's 32-byte runs of
 * codes were transposed 8 rows at a time (three shuffles a vector) by every reader: that was a fifth of the
 * Q4_K matrix-vector kernel's instructions, which then ran below what one core's memory gives (Zen 5, one
 * core, weights in cache: Q4_K 26 -> 36 GB/s, Q6_K 25 -> 32 GB/s interleaved; docs/benchmarks.md). Q5_K has
 * no matrix-vector kernel and stays as stored. */
static inline int ts_x8_fields(int64_t type, int offsets[4], int sizes[4]) {
    switch (type) {
    case TS_Q4_0: offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 16; return 2;
    case TS_Q4_1: offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 2; offsets[2] = 4; sizes[2] = 16; return 3;
    case TS_Q5_0: offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 4; offsets[2] = 6; sizes[2] = 16; return 3;
    case TS_Q5_1:
        offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 2; offsets[2] = 4; sizes[2] = 4;
        offsets[3] = 8; sizes[3] = 16;
        return 4;
    case TS_Q8_0: offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 32; return 2;
    case TS_Q4_K: /* d, dmin, the 12 bytes of 6-bit scales and mins, 128 bytes of codes */
        offsets[0] = 0; sizes[0] = 2; offsets[1] = 2; sizes[1] = 2; offsets[2] = 4; sizes[2] = 12;
        offsets[3] = 16; sizes[3] = 128;
        return 4;
    case TS_Q6_K: /* low nibbles, high bits, 16 int8 scales, d */
        offsets[0] = 0; sizes[0] = 128; offsets[1] = 128; sizes[1] = 64; offsets[2] = 192; sizes[2] = 16;
        offsets[3] = 208; sizes[3] = 2;
        return 4;
    default: return 0;
    }
}

static inline int ts_x8_supported(int64_t type) {
    int offsets[4], sizes[4];
    return ts_x8_fields(type, offsets, sizes) > 0;
}

/* Q5's fifth bits in the interleaved layout: bit v of the file's qh is value v's; here bit 2j of byte i is
 * value 4j + i's and bit 2j + 1 value 16 + 4j + i's, so (word << (4 - 2j)) & 0x10 per byte gives the fifth
 * bits of codes 4j .. 4j + 3 in place (and 3 - 2j those of 16 + 4j ..). to_x8 0 undoes it. */
static inline uint32_t ts_x8_qh(uint32_t bits, int to_x8) {
    uint32_t out = 0;
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++) {
            for (int high = 0; high < 2; high++) {
                const int file_bit = 16 * high + 4 * j + i, x8_bit = 8 * i + 2 * j + high;
                const int from = to_x8 ? file_bit : x8_bit, to = to_x8 ? x8_bit : file_bit;
                out |= ((bits >> from) & 1u) << to;
            }
        }
    }
    return out;
}

/* Copies block b of row c between an interleaved group and a block in the file's layout: from the group
 * at ``src`` to the file's block at ``dst`` (to_x8 0), or from the file's block at ``src`` into the group
 * at ``dst`` (to_x8 1). */
static inline void ts_x8_block_copy(int64_t type, const uint8_t *src, uint8_t *dst, int64_t c, int64_t b, int to_x8) {
    int offsets[4], sizes[4];
    const int fields = ts_x8_fields(type, offsets, sizes);
    const int64_t group_at = b * 8 * ts_qunit_bytes(type);
    for (int f = 0; f < fields; f++) {
        const int granule = sizes[f] == 2 ? 2 : 4;
        for (int i = 0; i < sizes[f] / granule; i++) {
            const int64_t x8_at = group_at + 8 * offsets[f] + 8 * granule * i + granule * c;
            const int64_t file_at = offsets[f] + granule * i;
            const uint8_t *from = src + (to_x8 ? file_at : x8_at);
            uint8_t *to = dst + (to_x8 ? x8_at : file_at);
            if ((type == TS_Q5_0 || type == TS_Q5_1) && sizes[f] == 4) { /* qh */
                uint32_t bits;
                memcpy(&bits, from, 4);
                bits = ts_x8_qh(bits, to_x8);
                memcpy(to, &bits, 4);
            } else {
                memcpy(to, from, (size_t)granule);
            }
        }
    }
}

/* Row ``row`` of a segment in the file's layout: a pointer into the segment, or, for a row of an
 * interleaved group, ``scratch`` (row_bytes) filled with it. */
static inline const uint8_t *ts_x8_row(const ts_qseg *seg, int64_t row, int64_t row_bytes, uint8_t *scratch) {
    if (seg->layout != TS_LAYOUT_X8 || row >= seg->n / 8 * 8) return seg->data + row * row_bytes;
    const int64_t unit_bytes = ts_qunit_bytes(seg->type), blocks = row_bytes / unit_bytes;
    const uint8_t *group = seg->data + row / 8 * 8 * row_bytes;
    for (int64_t b = 0; b < blocks; b++) ts_x8_block_copy(seg->type, group, scratch + b * unit_bytes, row % 8, b, 0);
    return scratch;
}

/* The K-quants' packed 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void ts_k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q3_K's 6-bit scale i (0 .. 15) from its 12 packed bytes, before the -32: the low 4 bits are nibble i / 8 of
 * byte i % 8, the high 2 bits are bits 2 (i / 4) of byte 8 + i % 4. */
static inline int ts_q3k_scale(const uint8_t *q, int i) {
    return ((q[i % 8] >> (4 * (i / 8))) & 0xF) | (((q[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

/* IQ4_XS's 6-bit scale of sub-block j (0 .. 7), before the -32: low 4 bits from scales_l, high 2 from scales_h. */
static inline int ts_iq4xs_scale(const uint8_t *u, int j) {
    return ((u[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((ts_load_u16(u + 2) >> (2 * j)) & 3) << 4);
}

/* Scalar decode of the 32-value block b of a row: codes (uint8, or int8 for ts_qtype_signed), scale and offset of
 * each 16-value half. The reference every SIMD path is tested against. */
static inline void ts_block_decode(int64_t type, const uint8_t *row, int64_t b, uint8_t codes[32], float s[2],
                                   float o[2]) {
    const int64_t unit = ts_qunit(type);
    const uint8_t *u = row + (b * 32 / unit) * ts_qunit_bytes(type);
    const int j = (int)(b % (unit / 32)); /* sub-block within a K-quant unit */
    switch (type) {
    case TS_Q4_0:
    case TS_Q4_1: {
        const uint8_t *qs = u + (type == TS_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            codes[i] = qs[i] & 0x0F;
            codes[i + 16] = qs[i] >> 4;
        }
        const float d = ts_fp16(ts_load_u16(u));
        s[0] = s[1] = d;
        o[0] = o[1] = type == TS_Q4_0 ? -8.0f * d : ts_fp16(ts_load_u16(u + 2));
        break;
    }
    case TS_Q5_0:
    case TS_Q5_1: {
        const int off = type == TS_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, u + off, 4);
        const uint8_t *qs = u + off + 4;
        for (int i = 0; i < 16; i++) {
            codes[i] = (uint8_t)((qs[i] & 0x0F) | (((qh >> i) & 1) << 4));
            codes[i + 16] = (uint8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        const float d = ts_fp16(ts_load_u16(u));
        s[0] = s[1] = d;
        o[0] = o[1] = type == TS_Q5_0 ? -16.0f * d : ts_fp16(ts_load_u16(u + 2));
        break;
    }
    case TS_Q8_0: {
        memcpy(codes, u + 2, 32);
        s[0] = s[1] = ts_fp16(ts_load_u16(u));
        o[0] = o[1] = 0.0f;
        break;
    }
    case TS_Q4_K:
    case TS_Q5_K: {
        const float d = ts_fp16(ts_load_u16(u)), dmin = ts_fp16(ts_load_u16(u + 2));
        uint8_t sc, mn;
        ts_k_scale_min(j, u + 4, &sc, &mn);
        const uint8_t *qs = u + 16 + (type == TS_Q5_K ? 32 : 0) + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int i = 0; i < 32; i++) codes[i] = (qs[i] >> shift) & 0x0F;
        if (type == TS_Q5_K) {
            const uint8_t *qh = u + 16;
            for (int i = 0; i < 32; i++) codes[i] |= (uint8_t)(((qh[i] >> j) & 1) << 4);
        }
        s[0] = s[1] = d * (float)sc;
        o[0] = o[1] = -dmin * (float)mn;
        break;
    }
    case TS_Q6_K: {
        const uint8_t *ql = u, *qh = u + 128;
        const int8_t *scales = (const int8_t *)(u + 192);
        const float d = ts_fp16(ts_load_u16(u + 208));
        const int half = j / 4, t = j % 4; /* 128-value half, and which of its four 32-value groups */
        for (int i = 0; i < 32; i++) {
            const uint8_t low = (ql[64 * half + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 0x0F;
            const uint8_t high = (qh[32 * half + i] >> (2 * t)) & 3;
            codes[i] = (uint8_t)(low | (high << 4));
        }
        for (int h = 0; h < 2; h++) {
            s[h] = d * (float)scales[2 * j + h];
            o[h] = -32.0f * s[h];
        }
        break;
    }
    case TS_Q2_K: { /* sub-block j: bits 2 (j % 4) of qs[32 (j / 4) ..], scales 2j and 2j + 1 */
        const uint8_t *qs = u + 16 + 32 * (j / 4);
        for (int i = 0; i < 32; i++) codes[i] = (qs[i] >> (2 * (j % 4))) & 3;
        const float d = ts_fp16(ts_load_u16(u + 80)), dmin = ts_fp16(ts_load_u16(u + 82));
        for (int h = 0; h < 2; h++) {
            s[h] = d * (float)(u[2 * j + h] & 0xF);
            o[h] = -dmin * (float)(u[2 * j + h] >> 4);
        }
        break;
    }
    case TS_Q3_K: { /* as Q2_K's low bits (qs at 32), bit j of hmask[i] the third bit of value i */
        const uint8_t *qs = u + 32 + 32 * (j / 4);
        for (int i = 0; i < 32; i++)
            codes[i] = (uint8_t)(((qs[i] >> (2 * (j % 4))) & 3) | (((u[i] >> j) & 1) << 2));
        const float d = ts_fp16(ts_load_u16(u + 108));
        for (int h = 0; h < 2; h++) {
            s[h] = d * (float)(ts_q3k_scale(u + 96, 2 * j + h) - 32);
            o[h] = -4.0f * s[h];
        }
        break;
    }
    case TS_IQ4_NL:
    case TS_IQ4_XS: {
        const uint8_t *qs = type == TS_IQ4_NL ? u + 2 : u + 8 + 16 * j;
        for (int i = 0; i < 16; i++) {
            codes[i] = (uint8_t)ts_iq4_values[qs[i] & 0x0F];
            codes[i + 16] = (uint8_t)ts_iq4_values[qs[i] >> 4];
        }
        const float d = ts_fp16(ts_load_u16(u));
        s[0] = s[1] = type == TS_IQ4_NL ? d : d * (float)(ts_iq4xs_scale(u, j) - 32);
        o[0] = o[1] = 0.0f;
        break;
    }
    default:
        memset(codes, 0, 32);
        s[0] = s[1] = o[0] = o[1] = 0.0f;
    }
}

#endif
