/* Rows converted between float32 and a KV element type on one vector level (ts_vec.h; compiled per level
 * through ts_vec_each.h). Widening is exact; narrowing rounds as torch's cast does (bfloat16: to nearest
 * even, subnormals kept, on every level; e4m3: saturating at +-448), so every level and the scalar
 * conversions give the same values. Inline: a file may use one of the two. */

#ifndef CONVERT_VEC_REST
#define CONVERT_VEC_REST
/* Elements i .. n - 1 of widen_row one at a time (AVX2 leaves fewer than 8), out of the vector loop's way:
 * inlined, their registers made every call save and restore more. */
static __attribute__((noinline, cold, unused)) void convert_widen_rest(const void *src, int dtype, float *dst,
                                                                      int64_t i, int64_t n) {
    for (; i < n; i++)
        dst[i] = dtype == TS_DTYPE_BF16 ? ts_bf16_to_f32(((const uint16_t *)src)[i]) : ts_fp8_to_f32(((const uint8_t *)src)[i]);
}
#endif

/* dst[0..n) = the bfloat16 (dtype TS_DTYPE_BF16) or e4m3 (TS_DTYPE_FP8) values at src, as float32. */
static inline void V_FN(widen_row)(const void *src, int dtype, float *dst, int64_t n) {
    int64_t i = 0;
    if (dtype == TS_DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (; V(step)(i, n, V(LANES)); i += V(LANES)) V(store_part)(dst + i, V(load_bf16_part)(s + i, n - i), n - i);
    } else {
        const uint8_t *s = (const uint8_t *)src;
        for (; V(step)(i, n, V(LANES)); i += V(LANES)) V(store_part)(dst + i, V(load_fp8_part)(s + i, n - i), n - i);
    }
    if (i < n) convert_widen_rest(src, dtype, dst, i, n);
}

/* The n float32 values at src rounded into a bfloat16 (dtype TS_DTYPE_BF16) or e4m3 (TS_DTYPE_FP8) row. */
static inline void V_FN(narrow_row)(const float *src, void *dst, int dtype, int64_t n) {
    int64_t i = 0;
    if (dtype == TS_DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (; V(step)(i, n, V(LANES)); i += V(LANES)) V(store_bf16_part)(d + i, V(load_part)(src + i, n - i), n - i);
        for (; i < n; i++) d[i] = ts_f32_to_bf16(src[i]);
    } else {
        uint8_t *d = (uint8_t *)dst;
        for (; V(step)(i, n, V(LANES)); i += V(LANES)) V(store_fp8_part)(d + i, V(load_part)(src + i, n - i), n - i);
        for (; i < n; i++) d[i] = ts_f32_to_fp8(src[i]);
    }
}
