/* RMSNorm rows on one vector level (ts_vec.h; compiled per level through ts_vec_each.h; bfloat16 rounded by
 * the level's V_FTZ rounding). The sum of squares runs over vectors of lanes, then across the lanes, then
 * (AVX2) over the last columns in scalar code; the products are elementwise. rms_row_bf16_scalar's
 * helpers serve the scalar columns. */

#ifndef TSV_FTZ_PASS /* float32: nothing rounded to bfloat16 */
/* out = (x * inv_rms) * weight, one row of cols floats. */
static void V_FN(rms_row_f32)(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    V(t) s0 = V(zero)(), s1 = s0;
    int64_t c = 0;
    for (; c + 2 * V(LANES) <= cols; c += 2 * V(LANES)) {
        const V(t) a = V(load)(x + c), b = V(load)(x + c + V(LANES));
        s0 = V(fma)(a, a, s0);
        s1 = V(fma)(b, b, s1);
    }
    for (; V(MASKS) && c < cols; c += V(LANES)) { /* the rest as masked parts; AVX2: in scalar, after the sum */
        const V(t) a = V(load_part)(x + c, cols - c);
        s0 = V(fma)(a, a, s0);
    }
    float sum = V(hsum)(V(add)(s0, s1));
    for (; c < cols; c++) sum += x[c] * x[c];
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    const V(t) vinv = V(set1)(inv);
    for (c = 0; V(step)(c, cols, V(LANES)); c += V(LANES))
        V(store_part)(out + c, V(mul)(V(mul)(V(load_part)(x + c, cols - c), vinv), V(load_part)(weight + c, cols - c)),
                      cols - c);
    for (; c < cols; c++) out[c] = (x[c] * inv) * weight[c];
}
#endif

/* One bfloat16 row: with ``x`` non-NULL, first res = bf16(res + x) (res is then the row to normalise); out =
 * bf16((res * inv_rms) * weight). */
static void V_FN(rms_row_bf16)(const uint16_t *x, uint16_t *res, const uint16_t *weight, uint16_t *out, int64_t cols,
                               float eps) {
    V(t) s0 = V(zero)();
    int64_t c = 0;
    for (; V(step)(c, cols, V(LANES)); c += V(LANES)) {
        V(t) v = V(load_bf16_part)(res + c, cols - c);
        if (x != NULL) {
            v = V_FTZ(round_bf16)(V(add)(v, V(load_bf16_part)(x + c, cols - c)));
            V_FTZ(store_bf16_part)(res + c, v, cols - c); /* exact: v is already a bfloat16 value */
        }
        s0 = V(fma)(v, v, s0);
    }
    float sum = V(hsum)(s0);
    for (; c < cols; c++) {
        const float v = rms_bf16_input(x, res, c);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
    const V(t) vinv = V(set1)(inv);
    for (c = 0; V(step)(c, cols, V(LANES)); c += V(LANES))
        V_FTZ(store_bf16_part)(out + c, V(mul)(V(mul)(V(load_bf16_part)(res + c, cols - c), vinv),
                                               V(load_bf16_part)(weight + c, cols - c)), cols - c);
    for (; c < cols; c++) out[c] = rms_bf16_output(res, weight, c, inv);
}
