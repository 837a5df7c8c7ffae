/* The ABI of the tideserve kernel library: every exported function, in one place. Each C file includes
 * this header, so a definition that drifts from its declaration fails to compile; the ctypes argtypes in
 * tideserve/native/__init__.py are the Python side of the same list (tests/native/test_abi.py checks that
 * every function declared here has them, with as many arguments).
 *
 * Conventions: tensors are passed as a data pointer plus strides in elements; int64_t for sizes and
 * indices; ``num_threads`` is the OpenMP team size (torch's intra-op thread count). Functions that can
 * fail (scratch memory) return int: 0 on success.
 */
#ifndef TIDESERVE_NATIVE_H
#define TIDESERVE_NATIVE_H

#include <stdint.h>

/* ---------------------------------------------------------------- isa.c: which kernel path runs */

/* Instruction-set levels, ordered: a level implies the ones below it. Kernels whose code has no path of
 * their own for a level run the highest path they have below it (AMX is used by GEMMs only). */
#define TS_ISA_SCALAR 0
#define TS_ISA_AVX2 1       /* AVX2 + FMA + F16C */
#define TS_ISA_AVX512 2     /* AVX-512 F/BW/VL/DQ */
#define TS_ISA_AVX512_BF16 3 /* + AVX512_BF16 (vdpbf16ps, vcvtneps2bf16) */
#define TS_ISA_AMX 4        /* + AMX-TILE/BF16/INT8, with the kernel's permission granted */

/* CPU features, as reported by ts_cpu_features(): present on this CPU and compiled into this build. */
#define TS_CPU_AVX2 (1u << 0)
#define TS_CPU_FMA (1u << 1)
#define TS_CPU_F16C (1u << 2)
#define TS_CPU_AVX512F (1u << 3)
#define TS_CPU_AVX512BW (1u << 4)
#define TS_CPU_AVX512VL (1u << 5)
#define TS_CPU_AVX512DQ (1u << 6)
#define TS_CPU_AVX512_BF16 (1u << 7)
#define TS_CPU_AVX512_VNNI (1u << 8)
#define TS_CPU_AMX_TILE (1u << 9)
#define TS_CPU_AMX_BF16 (1u << 10)
#define TS_CPU_AMX_INT8 (1u << 11)
#define TS_CPU_AMX_PERMITTED (1u << 12) /* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded */
#define TS_CPU_VENDOR_INTEL (1u << 13) /* an Intel CPU: decode attention prefetches a batch's KV into L2 */

/* The best level this build and this CPU support (detected once). */
int ts_isa_best(void);
/* The level kernels use now: the best one, or lower when capped by ts_set_isa_level. */
int ts_isa_level(void);
/* Cap the level (a negative value removes the cap); returns the level now in use. Not for use while
 * kernels run on other threads: tests and start-up only. */
int ts_set_isa_level(int level);
/* Attention's invariant mode (batch invariance): decode and prefill give a query the same bits however its
 * step was cut. Two arithmetics are shared by both kernels: attn_rows.h's scalar and AVX2 forms, and the
 * vdpbf16ps form (bfloat16 caches, head_dim a multiple of 32, AVX-512 BF16: paged_decode_pairs.h and
 * paged_prefill.c's dpbf16 form); the other AVX-512 forms and AMX's tiles are not shared, so in this mode
 * attention never takes them. Off (the default of the library; engines turn it on): every form is free. */
int ts_set_attn_invariant(int on); /* returns the previous mode; start-up and tests only, as ts_set_isa_level */
int ts_attn_invariant(void);
/* The level attention runs at for a cache of kv_dtype and heads of head_dim: ts_isa_level, or in the
 * invariant mode the highest shared arithmetic at or below it. */
int ts_attn_isa_level(int kv_dtype, int64_t head_dim);
/* TS_CPU_* bits of this CPU that this build can use. */
uint32_t ts_cpu_features(void);
/* Runs one AMX bf16 tile product and checks it: 1 when AMX works in this process, 0 when it is not there. */
int ts_amx_probe(void);

/* ---------------------------------------------------------------- element types */
#define TS_DTYPE_F32 0
#define TS_DTYPE_BF16 1
#define TS_DTYPE_FP8 2 /* float8 e4m3 (fn), a KV cache element type only */

/* ---------------------------------------------------------------- paged_decode.c: decode attention */

/* out[i] = attention of q[i] ([num_heads, head_dim]) over request i's first context_lens[i] keys of the
 * paged cache ([num_blocks, block_size, num_kv_heads, head_dim]). q, out: float32 or bfloat16 (q_dtype,
 * out_dtype), rows q_stride / out_stride elements apart; caches: kv_dtype. Returns 0, or 1 when scratch
 * memory could not be had or a dtype code is unknown (out is then undefined: the caller falls back). */
int ts_paged_decode(const void *q, int64_t q_stride, int q_dtype, const void *k_cache, const void *v_cache,
                    int kv_dtype, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                    void *out, int64_t out_stride, int out_dtype, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads);
/* As ts_paged_decode, request i's query attending only its last ``window`` keys when window > 0 (a sliding-window
 * layer), its scores capped to softcap * tanh(s / softcap) when softcap > 0. */
int ts_paged_decode_window(const void *q, int64_t q_stride, int q_dtype, const void *k_cache, const void *v_cache,
                           int kv_dtype, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                           void *out, int64_t out_stride, int out_dtype, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                           float softcap, int num_threads);
/* float32 q and out over a float32 / bfloat16 cache, for callers that know the types at build time. */
int ts_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                        int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int num_threads);
int ts_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float *out,
                         int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int num_threads);

/* ---------------------------------------------------------------- paged_prefill.c: prefill attention */

/* Causal attention of prefill chunks ("spans"): query i < query_lens[s] of span s (row query_start[s] + i
 * of q and out, [num_heads, head_dim] each) attends keys 0 .. computed[s] + i, the key at position p
 * lying in slot tables[s * table_width + p / block_size] * block_size + p % block_size of k and v (slots
 * kv_stride elements apart, [num_kv_heads, head_dim] each, kv_dtype). q, out: float32 or bfloat16. Returns 0, or 1
 * when scratch memory could not be had or an argument is unknown (out is then undefined). */
int ts_paged_prefill(const void *q, int64_t q_stride, int q_dtype, const void *k, const void *v, int kv_dtype,
                     int64_t kv_stride, const int64_t *tables, int64_t table_width, int64_t block_size,
                     const int64_t *query_start, const int64_t *query_lens, const int64_t *computed, int64_t num_spans,
                     void *out, int64_t out_stride, int out_dtype, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int num_threads);
/* As ts_paged_prefill, query i of span s attending keys computed[s] + i - window + 1 .. computed[s] + i when
 * window > 0 (a sliding-window layer), its scores capped to softcap * tanh(s / softcap) when softcap > 0. */
int ts_paged_prefill_window(const void *q, int64_t q_stride, int q_dtype, const void *k, const void *v, int kv_dtype,
                            int64_t kv_stride, const int64_t *tables, int64_t table_width, int64_t block_size,
                            const int64_t *query_start, const int64_t *query_lens, const int64_t *computed,
                            int64_t num_spans, void *out, int64_t out_stride, int out_dtype, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float softcap,
                            int num_threads);

/* 1 when ts_paged_prefill, at the ISA level in use, computes over keys and values of ``kv_dtype`` with
 * AMX tiles (queries and probabilities rounded to bfloat16), 0 when in float32. */
int ts_paged_prefill_tiles(int kv_dtype, int64_t head_dim);
/* The most bytes a call of the bfloat16 forms packs its spans' keys and values into (negative: the
 * default); returns the previous limit. Past it, each work item gathers the keys it reads (tests). */
int64_t ts_paged_prefill_set_pack_limit(int64_t bytes);
/* Calls that packed their keys and values, since the library loaded. */
int64_t ts_paged_prefill_packed_calls(void);

/* ---------------------------------------------------------------- rows.c: row-wise kernels */

/* out = x / rms(x) * weight, rows of cols elements. */
void ts_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols, float eps,
                     int num_threads);
/* residual += x, then out = residual / rms(residual) * weight. */
void ts_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t cols, float eps, int num_threads);
/* The same over bfloat16 x, residual, weight and out; statistics and products in float32, each stored
 * value rounded once, as torch's bfloat16 operators do. */
void ts_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t cols,
                      float eps, int num_threads);
void ts_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                          int64_t rows, int64_t cols, float eps, int num_threads);
/* In place over tokens rows stride elements apart, each heads vectors of head_dim (the q or k heads of a
 * fused qkv row): each vector = vector / rms(vector) * weight [head_dim]. */
void ts_rms_norm_heads_f32(float *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim,
                           const float *weight, float eps, int num_threads);
void ts_rms_norm_heads_bf16(uint16_t *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim,
                            const uint16_t *weight, float eps, int num_threads);
/* The int8 GEMM's input rows and the scaling of its output (see rows.c). */
void ts_int8_rows_f32(const float *x, const float *inv_smooth, float *out, float *row_max, int64_t rows,
                      int64_t cols, int num_threads);
void ts_scale_rows_f32(const float *y, const float *row_max, const float *bias, float *out, int64_t rows,
                       int64_t cols, int num_threads);
/* out[r] = index of the first largest value of row r (torch's max(dim=-1).indices); -1 if a row has a NaN. */
int ts_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads);

/* ---------------------------------------------------------------- rope_store.c: rotary + KV store */

/* Rotate q and k of qkv [tokens, (num_heads + 2 num_kv_heads) head_dim] in place and store k, v at slots
 * of the caches, whose element type kv_dtype gives (TS_DTYPE_F32, _BF16 or _FP8). Only the first rotary_dim
 * (even, <= head_dim) values of each head rotate (partial rotary; the rest pass through). cos, sin:
 * [tokens, rotary_dim / 2]. */
void ts_rope_store_f32(float *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t rotary_dim, const float *cos, const float *sin, const int64_t *slots, void *k_cache,
                       void *v_cache, int kv_dtype, int num_threads);
/* The same with bfloat16 qkv, cos and sin, rounding as torch's bfloat16 operators do. */
void ts_rope_store_bf16(uint16_t *qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, const uint16_t *cos, const uint16_t *sin,
                        const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, int num_threads);

/* ---------------------------------------------------------------- qgemm.c: block-quantized linear layers */

/* ts_qmat (a weight in GGUF block formats, by segments) and the formats themselves. */
#include "qgemm_formats.h"

/* qgemm's paths: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX tiles; derived from isa.c's level. */
int ts_qgemm_isa(void);                      /* the best this CPU and build have */
int ts_qgemm_set_isa(int cap);               /* cap the path (tests); returns the previous cap */
int ts_qgemm_set_tile_min_rows(int rows);    /* rows from which tiles replace row kernels (0: per path); returns previous */
int ts_qgemm_set_gemv(int enabled);          /* AVX2 matrix-vector kernel below the tiles on/off; returns previous */
int ts_qgemm_set_amx_one_list(int on);       /* every AMX task starts in thread 0's list (tests); returns previous */
int64_t ts_qgemm_amx_tasks_taken(void);      /* AMX tasks taken from another thread's list, since load */
int64_t ts_qgemm_tile_chunk_bytes(void);     /* activation bytes per chunk of rows the integer tiles sweep */
int ts_qgemm_quantize_rows_f32(const float *x, int64_t m, int64_t k, int8_t *q, float *scale, float *sums); /* x's 8-bit blocks */
int64_t ts_qgemm_set_tile_chunk_bytes(int64_t bytes); /* override it (0: half the L2); returns previous */
int ts_qgemm_active_isa(void);               /* the path taken now */
int ts_qgemm_kernel_for(int64_t m, int64_t type); /* 0 row kernels, 1 AVX2 tiles, 2 AMX tiles: m rows, a format */
/* out[m, n] = act(x)[m, k] @ w^T (+ bias); act 1: x is [m, 2k] (gate | up) and silu(gate) * up is used.
 * Returns 0, or -1 for a shape or format it cannot take. */
int ts_qmatmul_f32(const ts_qmat *w, const float *x, int64_t x_stride, int64_t m, int act, float *out,
                   int64_t out_stride, int num_threads);
/* Rows ``ids`` of a [rows, k] weight in one format and layout, dequantized to float32 out [count, k]. */
int ts_qdequant_rows_f32(int64_t type, const uint8_t *data, int64_t rows, int64_t layout, int64_t k,
                         const int64_t *ids, int64_t count, float *out, int num_threads);
int ts_qgemm_x8_preferred(int64_t type); /* whether the path taken now reads format ``type`` interleaved */
/* dst = src's n rows interleaved (to_x8 1) or back as in the file (0); -1 for a format without the layout */
int ts_qgemm_relayout(int64_t type, const uint8_t *src, uint8_t *dst, int64_t n, int64_t k, int to_x8);

/* ---------------------------------------------------------------- decode_forward.c: one-call decode step */

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    ts_qmat qkv, o, gate_up, down;       /* gate_up: 2 * intermediate rows, gate first */
    const float *q_norm, *k_norm;        /* [head_dim], each q / k head's RMSNorm before rotary; NULL: none */
} ts_decoder_layer;

/* The phases ts_decode_forward_f32 times when given a phase_seconds array (TS_NUM_PHASES doubles). */
enum { TS_PHASE_NORMS, TS_PHASE_QKV, TS_PHASE_ROPE_STORE, TS_PHASE_ATTENTION, TS_PHASE_O, TS_PHASE_GATE_UP,
       TS_PHASE_DOWN, TS_NUM_PHASES };

int ts_decode_forward_f32(const ts_decoder_layer *layers, void *const *k_caches, void *const *v_caches,
                          int64_t num_layers, float *hidden, const float *final_norm, int64_t tokens,
                          int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t rotary_dim, int64_t intermediate, float eps, const float *cos, const float *sin, const int64_t *slots,
                          const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                          int64_t block_size, int kv_dtype, float scale, int num_threads, double *phase_seconds);

#endif /* TIDESERVE_NATIVE_H */
