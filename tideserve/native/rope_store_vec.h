/* Rotary embedding on one vector level (ts_vec.h; compiled per level through ts_vec_each.h; bfloat16 rounded
 * by the level's V_FTZ rounding). Elementwise: the columns a level's vectors leave (AVX2) go through the
 * scalar reference's helpers. */

#ifndef TSV_FTZ_PASS /* float32: nothing rounded to bfloat16 */
/* x[i], x[i + half] = x1 c - x2 s, x2 c + x1 s for i < half: float32, no fused multiply-adds. */
static void V_FN(rotate_f32)(float *x, const float *cos, const float *sin, int64_t half) {
    int64_t i = 0;
    for (; V(step)(i, half, V(LANES)); i += V(LANES)) {
        const int64_t left = half - i;
        const V(t) x1 = V(load_part)(x + i, left), x2 = V(load_part)(x + i + half, left);
        const V(t) c = V(load_part)(cos + i, left), s = V(load_part)(sin + i, left);
        V(store_part)(x + i, V(sub)(V(mul)(x1, c), V(mul)(x2, s)), left);
        V(store_part)(x + i + half, V(add)(V(mul)(x2, c), V(mul)(x1, s)), left);
    }
    for (; i < half; i++) rotate_f32_at(x, cos, sin, half, i);
}
#endif

/* The same in bfloat16, each product and the sum rounded to bfloat16 as torch's operators round them. */
static void V_FN(rotate_bf16)(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    int64_t i = 0;
    for (; V(step)(i, half, V(LANES)); i += V(LANES)) {
        const int64_t left = half - i;
        const V(t) x1 = V(load_bf16_part)(x + i, left), x2 = V(load_bf16_part)(x + i + half, left);
        const V(t) c = V(load_bf16_part)(cos + i, left), s = V(load_bf16_part)(sin + i, left);
        V_FTZ(store_bf16_part)(x + i, V(sub)(V_FTZ(round_bf16)(V(mul)(x1, c)), V_FTZ(round_bf16)(V(mul)(x2, s))), left);
        V_FTZ(store_bf16_part)(x + i + half,
                               V(add)(V_FTZ(round_bf16)(V(mul)(x2, c)), V_FTZ(round_bf16)(V(mul)(x1, s))), left);
    }
    for (; i < half; i++) rotate_bf16_at(x, cos, sin, half, i);
}
