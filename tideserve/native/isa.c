/* Which kernel path runs: the instruction sets this build was compiled with (-march=native, so those of the
 * CPU that built it), confirmed at run time with __builtin_cpu_supports / cpuid, and capped on request.
 *
 * Why both checks: the library is cached per CPU (tideserve/native/__init__.py keys it on /proc/cpuinfo's
 * flags), but a hypervisor may advertise a flag whose register state the OS does not enable, and a
 * compiler may know an extension the CPU lacks; running an instruction the CPU cannot run kills the
 * process with SIGILL, so nothing is assumed. The cap (ts_set_isa_level, TIDESERVE_ISA) lets tests run
 * every path this machine has against the scalar reference, and lets a user rule a path out.
 *
 * AMX: Linux hands out the tile registers' 8 KiB of state only to processes that ask first
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel 5.16+); a tile instruction before that is
 * SIGILL. Detection asks once, and reports the AMX level only when the kernel said yes.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "tideserve_native.h"
#include "ts_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define TS_X86 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TS_ARCH_REQ_XCOMP_PERM 0x1023
#define TS_XFEATURE_XTILEDATA 18

static int ts_detected;        /* 0 until ts_detect has filled the two below */
static uint32_t ts_features;   /* TS_CPU_* this CPU has and this build can use */
static int ts_best;            /* the best TS_ISA_* they allow */
static int ts_cap = -1;        /* the requested ceiling, -1 for none */
static int ts_attn_inv = 0;    /* attention keeps one arithmetic for every cut of a step (ts_set_attn_invariant) */

#ifdef TS_HAVE_AMX
static int ts_request_amx(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, TS_ARCH_REQ_XCOMP_PERM, TS_XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}
#endif

static void ts_detect(void) {
    if (__atomic_load_n(&ts_detected, __ATOMIC_ACQUIRE)) return;
    uint32_t f = 0;
#ifdef TS_X86
    __builtin_cpu_init();
#ifdef TS_HAVE_AVX2
    if (__builtin_cpu_supports("avx2")) f |= TS_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) f |= TS_CPU_FMA;
    if (__builtin_cpu_supports("f16c")) f |= TS_CPU_F16C;
#endif
#ifdef TS_HAVE_AVX512
    if (__builtin_cpu_supports("avx512f")) f |= TS_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= TS_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= TS_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= TS_CPU_AVX512DQ;
#endif
#ifdef TS_HAVE_AVX512BF16
    if (__builtin_cpu_supports("avx512bf16")) f |= TS_CPU_AVX512_BF16;
#endif
#ifdef TS_HAVE_AVX512VNNI
    if (__builtin_cpu_supports("avx512vnni")) f |= TS_CPU_AVX512_VNNI;
#endif
    if (__builtin_cpu_is("intel")) f |= TS_CPU_VENDOR_INTEL;
#ifdef TS_HAVE_AMX
    {
        unsigned a, b, c, d;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) { /* EDX bits 22, 24, 25: AMX-BF16, -TILE, -INT8 */
            if (d & (1u << 24)) f |= TS_CPU_AMX_TILE;
            if (d & (1u << 22)) f |= TS_CPU_AMX_BF16;
            if (d & (1u << 25)) f |= TS_CPU_AMX_INT8;
        }
        if ((f & TS_CPU_AMX_TILE) && ts_request_amx()) f |= TS_CPU_AMX_PERMITTED;
    }
#endif
#endif /* TS_X86 */
    int best = TS_ISA_SCALAR;
    const uint32_t avx2 = TS_CPU_AVX2 | TS_CPU_FMA | TS_CPU_F16C;
    const uint32_t avx512 = avx2 | TS_CPU_AVX512F | TS_CPU_AVX512BW | TS_CPU_AVX512VL | TS_CPU_AVX512DQ;
    const uint32_t amx = TS_CPU_AMX_TILE | TS_CPU_AMX_BF16 | TS_CPU_AMX_INT8 | TS_CPU_AMX_PERMITTED;
    if ((f & avx2) == avx2) best = TS_ISA_AVX2;
    if ((f & avx512) == avx512) best = TS_ISA_AVX512;
    if (best == TS_ISA_AVX512 && (f & TS_CPU_AVX512_BF16)) best = TS_ISA_AVX512_BF16;
    if (best == TS_ISA_AVX512_BF16 && (f & amx) == amx) best = TS_ISA_AMX;
    ts_features = f;
    ts_best = best;
    __atomic_store_n(&ts_detected, 1, __ATOMIC_RELEASE);
}

int ts_isa_best(void) {
    ts_detect();
    return ts_best;
}

int ts_isa_level(void) {
    ts_detect();
    const int cap = __atomic_load_n(&ts_cap, __ATOMIC_RELAXED);
    return cap >= 0 && cap < ts_best ? cap : ts_best;
}

int ts_set_isa_level(int level) {
    __atomic_store_n(&ts_cap, level < 0 ? -1 : level, __ATOMIC_RELAXED);
    return ts_isa_level();
}

int ts_attn_invariant(void) { return __atomic_load_n(&ts_attn_inv, __ATOMIC_RELAXED); }

int ts_set_attn_invariant(int on) {
    return __atomic_exchange_n(&ts_attn_inv, on != 0, __ATOMIC_RELAXED);
}

int ts_attn_isa_level(int kv_dtype, int64_t head_dim) {
    const int level = ts_isa_level();
    if (!ts_attn_invariant()) return level;
    if (level >= TS_ISA_AVX512_BF16 && kv_dtype == TS_DTYPE_BF16 && head_dim % 32 == 0) return TS_ISA_AVX512_BF16;
    return level < TS_ISA_AVX2 ? level : TS_ISA_AVX2;
}

uint32_t ts_cpu_features(void) {
    ts_detect();
    return ts_features;
}

int ts_amx_probe(void) {
#ifdef TS_HAVE_AMX
    if (ts_isa_best() < TS_ISA_AMX) return 0;
    /* C[16][16] = A[16][32] . B[32][16] in bf16 tiles; B is stored as AMX wants it, pairs of rows
     * interleaved (B2[k / 2][n][k % 2]). Small integers, so the product is exact. */
    const ts_tilecfg cfg = ts_tilecfg_16x64(3);
    uint16_t a[16][32], b2[16][16][2];
    float c[16][16];
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < 32; k++) a[m][k] = ts_f32_to_bf16((float)((m + k) % 5 - 2));
    for (int k = 0; k < 32; k++)
        for (int n = 0; n < 16; n++) b2[k / 2][n][k % 2] = ts_f32_to_bf16((float)((k * n) % 7 - 3));
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b2, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float want = 0.0f;
            for (int k = 0; k < 32; k++) want += (float)((m + k) % 5 - 2) * (float)((k * n) % 7 - 3);
            if (c[m][n] != want) return 0;
        }
    return 1;
#else
    return 0;
#endif
}
