/* Decode attention's softmax over one query head's scores, on one vector level (ts_vec.h; compiled per level
 * through ts_vec_each.h): in place over s[0..n), s[t] = exp(s[t] - max); *max_out = max, *sum_out = the sum
 * of the new s. The maximum and the sum run over vectors of lanes, then across the lanes, then (AVX2) over
 * the last n % 8 scores in scalar code, with the scalar exp. */
static void V_FN(softmax)(float *s, int64_t n, float *max_out, float *sum_out) {
    V(t) vm = V(set1)(-INFINITY);
    int64_t t = 0;
    for (; V(step)(t, n, V(LANES)); t += V(LANES)) vm = V(max_part)(vm, V(load_part)(s + t, n - t), n - t);
    float m = V(hmax)(vm);
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    const V(t) bm = V(set1)(m);
    V(t) vs = V(zero)();
    for (t = 0; V(step)(t, n, V(LANES)); t += V(LANES)) {
        const V(t) e = V(exp)(V(sub)(V(load_part)(s + t, n - t), bm));
        V(store_part)(s + t, e, n - t);
        vs = V(add_part)(vs, e, n - t);
    }
    float sum = V(hsum)(vs);
    for (; t < n; t++) {
        const float e = ts_exp(s[t] - m);
        s[t] = e;
        sum += e;
    }
    *max_out = m;
    *sum_out = sum;
}
