/* Every decoder layer of a Llama-family model for one decode step, in one call.
 *
 * Why: at batch 1 a step's arithmetic is a few milliseconds of weight streaming, and each layer's dozen
 * Python-level calls (norms, projections, rotary, attention, residuals) cost tens of microseconds each
 * once the weights have pushed the interpreter's own data out of the CPU caches. Here the layer loop runs
 * in C over the same kernels the Python path calls (rows.c, qgemm.c, rope_store.c, paged_decode.c), in
 * the same order, so both paths give the same numbers. Layers with q/k norms (Qwen3) normalise the q and
 * k heads in place between the qkv projection and rotary, with the kernel the Python path calls there.
 * Partial rotary (Phi-4-mini) rotates the first rotary_dim values of each head, as the Python path does.
 *
 * Scope: float32 activations, block-quantized projections (GGUF formats, qgemm.c), a float32 or bfloat16
 * paged cache, and a batch of single-token queries (decodes) only; callers take the Python path otherwise.
 *
 * Phase times: a profiler sees this call as one opaque function, so where a step's time goes inside it
 * (products, attention, norms, rotary) is told by the call itself when asked: ``phase_seconds`` (NULL: not
 * timed) accumulates wall seconds per TS_PHASE_* (tideserve_native.h), read by benchmarks/profile_decode.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "tideserve_native.h" /* every kernel this calls, and ts_decoder_layer */

static int project(const ts_qmat *w, const float *x, int64_t tokens, int act, float *out, int threads) {
    return ts_qmatmul_f32(w, x, act ? 2 * w->k : w->k, tokens, act, out, w->n, threads);
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Adds the time since *mark to phase_seconds[phase] and moves the mark; nothing when not timed. */
static void lap(double *phase_seconds, int phase, double *mark) {
    if (phase_seconds == NULL) return;
    const double now = seconds_now();
    phase_seconds[phase] += now - *mark;
    *mark = now;
}

/* hidden [tokens, hidden_size]: the embeddings in, the final-normed hidden states out. Returns 0, or -1
 * when a kernel could not get its scratch memory (hidden is then undefined; the step must be redone). */
int ts_decode_forward_f32(const ts_decoder_layer *layers, void *const *k_caches, void *const *v_caches,
                          int64_t num_layers, float *hidden, const float *final_norm, int64_t tokens,
                          int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t rotary_dim, int64_t intermediate, float eps, const float *cos, const float *sin, const int64_t *slots,
                          const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                          int64_t block_size, int kv_dtype, float scale, int num_threads, double *phase_seconds) {
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t q_width = num_heads * head_dim;
    float *residual = malloc(sizeof(float) * (size_t)(tokens * hidden_size));
    float *normed = malloc(sizeof(float) * (size_t)(tokens * hidden_size));
    float *qkv = malloc(sizeof(float) * (size_t)(tokens * qkv_width));
    float *attn = malloc(sizeof(float) * (size_t)(tokens * q_width));
    float *gate_up = malloc(sizeof(float) * (size_t)(tokens * 2 * intermediate));
    int failed = residual == NULL || normed == NULL || qkv == NULL || attn == NULL || gate_up == NULL;
    double mark = phase_seconds != NULL ? seconds_now() : 0.0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const ts_decoder_layer *layer = layers + l;
        if (l == 0) { /* the first layer's residual stream is its input */
            for (int64_t i = 0; i < tokens * hidden_size; i++) residual[i] = hidden[i];
            ts_rms_norm_f32(hidden, layer->input_norm, normed, tokens, hidden_size, eps, num_threads);
        } else {
            ts_add_rms_norm_f32(hidden, residual, layer->input_norm, normed, tokens, hidden_size, eps, num_threads);
        }
        lap(phase_seconds, TS_PHASE_NORMS, &mark);
        failed |= project(&layer->qkv, normed, tokens, 0, qkv, num_threads);
        lap(phase_seconds, TS_PHASE_QKV, &mark);
        if (layer->q_norm != NULL) { /* Qwen3: each q and k head normalised before rotary */
            ts_rms_norm_heads_f32(qkv, qkv_width, tokens, num_heads, head_dim, layer->q_norm, eps, num_threads);
            ts_rms_norm_heads_f32(qkv + q_width, qkv_width, tokens, num_kv_heads, head_dim, layer->k_norm, eps,
                                  num_threads);
            lap(phase_seconds, TS_PHASE_NORMS, &mark);
        }
        ts_rope_store_f32(qkv, qkv_width, tokens, num_heads, num_kv_heads, head_dim, rotary_dim, cos, sin, slots,
                          k_caches[l], v_caches[l], kv_dtype, num_threads);
        lap(phase_seconds, TS_PHASE_ROPE_STORE, &mark);
        failed |= ts_paged_decode(qkv, qkv_width, TS_DTYPE_F32, k_caches[l], v_caches[l], kv_dtype, block_tables,
                                  table_width, context_lens, attn, q_width, TS_DTYPE_F32, tokens, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, num_threads);
        lap(phase_seconds, TS_PHASE_ATTENTION, &mark);
        failed |= project(&layer->o, attn, tokens, 0, hidden, num_threads);
        lap(phase_seconds, TS_PHASE_O, &mark);
        ts_add_rms_norm_f32(hidden, residual, layer->post_norm, normed, tokens, hidden_size, eps, num_threads);
        lap(phase_seconds, TS_PHASE_NORMS, &mark);
        failed |= project(&layer->gate_up, normed, tokens, 0, gate_up, num_threads);
        lap(phase_seconds, TS_PHASE_GATE_UP, &mark);
        failed |= project(&layer->down, gate_up, tokens, 1, hidden, num_threads);
        lap(phase_seconds, TS_PHASE_DOWN, &mark);
    }
    if (!failed) {
        ts_add_rms_norm_f32(hidden, residual, final_norm, normed, tokens, hidden_size, eps, num_threads);
        for (int64_t i = 0; i < tokens * hidden_size; i++) hidden[i] = normed[i];
        lap(phase_seconds, TS_PHASE_NORMS, &mark);
    }
    free(residual);
    free(normed);
    free(qkv);
    free(attn);
    free(gate_up);
    return failed ? -1 : 0;
}
