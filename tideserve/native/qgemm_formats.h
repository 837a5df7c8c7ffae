/* GGUF block formats as tideserve's quantized kernels read them (shared by qgemm.c's scalar, AVX2,
 * AVX-512 and AMX paths), so each format is described once.
 *
 * A weight row of k values is k / U units, stored back to back exactly as in a GGUF file (ggml's
 * block_q4_0 etc.); U is 32 for the legacy formats and 256 for the K-quants. Every format decodes, per
 * 32 values, to unsigned 8-bit codes u and per-16-value scale s and offset o, value = s * u + o:
 *   Q4_0  (type 2,  18 B / 32): d fp16, qs[16]; u = nibble (value j: low nibble of qs[j], j+16: high), o = -8d
 *   Q4_1  (type 3,  20 B / 32): d, m fp16, qs[16] as Q4_0; o = m
 *   Q5_0  (type 6,  22 B / 32): d fp16, qh[4] (bit j = 5th bit of value j), qs[16]; o = -16d
 *   Q5_1  (type 7,  24 B / 32): d, m fp16, qh[4], qs[16]; o = m
 *   Q8_0  (type 8,  34 B / 32): d fp16, qs[32] int8: the one signed format, value = d * q (no offset)
 *   Q4_K  (type 12, 144 B / 256): d, dmin fp16, scales[12] (eight 6-bit scales and mins), qs[128];
 *         sub-block j of 32: u = nibble, s = d * sc[j], o = -dmin * mn[j]
 *   Q5_K  (type 13, 176 B / 256): as Q4_K plus qh[32] (bit j of qh[l] is the 5th bit of value l of sub-block j)
 *   Q6_K  (type 14, 210 B / 256): ql[128], qh[64], scales[16] int8, d fp16; 16 sub-blocks of 16 with
 *         s = d * scales[i], u in 0..63, o = -32 s
 * Activations are quantized per 32 values to int8 (x = xd * q), with the sums of q over each 16-value
 * half, so a unit's offsets cost one multiply-add per half instead of one per value.
 */
#ifndef TS_QGEMM_FORMATS_H
#define TS_QGEMM_FORMATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { TS_Q4_0 = 2, TS_Q4_1 = 3, TS_Q5_0 = 6, TS_Q5_1 = 7, TS_Q8_0 = 8, TS_Q4_K = 12, TS_Q5_K = 13, TS_Q6_K = 14 };

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
#define TS_FOR_EACH_QTYPE(X) X(TS_Q4_0) X(TS_Q4_1) X(TS_Q5_0) X(TS_Q5_1) X(TS_Q8_0) X(TS_Q4_K) X(TS_Q5_K) X(TS_Q6_K)

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
static inline int64_t ts_qunit(int64_t type) { return type >= TS_Q4_K ? 256 : 32; }
static inline int64_t ts_qunit_bytes(int64_t type) {
    switch (type) {
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

/* Scalar decode of the 32-value block b of a row: codes (uint8, or int8 for Q8_0), scale and offset of
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
    default:
        memset(codes, 0, 32);
        s[0] = s[1] = o[0] = o[1] = 0.0f;
    }
}

#endif
