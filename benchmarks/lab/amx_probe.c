/* What an AMX core does per bfloat16 tile product on this machine, now, and how that moves over time.
 *
 * The batched step's matrix products run on AMX tiles (tideserve/native/qgemm.c): per 32 values of k, two
 * weight tiles and two activation tiles are loaded and four 16 x 16 x 32 products issued. This probe times
 * that loop three ways, once per interval for a number of seconds:
 *   - "products": tdpbf16ps alone, operands already in tiles (the unit's own rate);
 *   - "with loads": the same products with four tile loads from L1 per four products;
 *   - "model footprint": the kernel's loop over a 32-row panel at k = 576 and 64 rows of activations (the
 *     embedded model's decode step shape), 36 KiB and 72 KiB, from L1 and L2;
 *   - "overlap": whether vector work runs while the tiles multiply, as the kernel needs for the decode of its
 *     next weight panel: four products, then 64 register-only vpermw (the panel decode's table look-up, in
 *     eight independent chains); reported as the share of the vector work's own time that the pair adds
 *     to the products alone (0: fully hidden, 1: none of it overlaps).
 * On a shared host the rates move together by a factor of 2-3 when a neighbour takes the core's AMX unit:
 * timings of the engine taken minutes apart compare two different machines, so figures are compared within
 * one interleaved run.
 *
 *     mkdir -p build && cc -O2 -march=native benchmarks/lab/amx_probe.c -o build/amx_probe && build/amx_probe 30
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define K 576
#define KB (K / 32)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static uint16_t panel[32 * K] __attribute__((aligned(64)));
static uint32_t packed[64 * K / 2] __attribute__((aligned(64)));
static uint16_t small[16 * 1024] __attribute__((aligned(64)));
static float sink[4 * 256] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ns per tile product: operands already in tiles, or (``reload``) with four tile loads from L1 (16 KiB) per
 * four products; the branch is the same every iteration, so it costs nothing beside the products */
static double products(long n, int reload) {
    _tile_loadd(0, small, 64);
    _tile_loadd(1, small + 512, 64);
    _tile_loadd(2, small + 1024, 64);
    _tile_loadd(3, small + 1536, 64);
    const double t = now();
    for (long i = 0; i < n; i++) {
        if (reload) {
            const int64_t o = (i & 3) * 2048;
            _tile_loadd(0, small + o, 64);
            _tile_loadd(1, small + o + 512, 64);
            _tile_loadd(2, small + o + 1024, 64);
            _tile_loadd(3, small + o + 1536, 64);
        }
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, sink, 64);
    return (now() - t) / (4.0 * n) * 1e9;
}

/* ns per iteration of four tile products (``tiles``) and/or ``VECTOR_OPS`` register-only vpermw (``vector``) */
#define VECTOR_CHAINS 8
#define VECTOR_OPS 64
static double products_and_vector(long n, int tiles, int vector) {
    __m512i chain[VECTOR_CHAINS];
    for (int j = 0; j < VECTOR_CHAINS; j++) chain[j] = _mm512_set1_epi32(j + 1);
    const __m512i index = _mm512_set1_epi16(3);
    const double t = now();
    for (long i = 0; i < n; i++) {
        if (tiles) {
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        if (vector)
            for (int g = 0; g < VECTOR_OPS / VECTOR_CHAINS; g++) {
                for (int j = 0; j < VECTOR_CHAINS; j++) chain[j] = _mm512_permutexvar_epi16(chain[j], index);
                __asm__ volatile("" ::: "memory"); /* keeps the groups in program order after the products */
            }
    }
    const double elapsed = now() - t;
    for (int j = 1; j < VECTOR_CHAINS; j++) chain[0] = _mm512_xor_si512(chain[0], chain[j]);
    _mm512_store_si512((void *)sink, chain[0]);
    _tile_stored(4, sink + 256, 64);
    return elapsed / n * 1e9;
}

/* ns per tile product in the kernel's loop: a 32-row panel (row-major, k = 576) times 64 rows of x */
static double model_footprint(long panels) {
    const double t = now();
    for (long p = 0; p < panels; p++) {
        for (int mt = 0; mt < 4; mt += 2) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int b = 0; b < KB; b++) {
                _tile_loadd(0, panel + b * 32, K * 2);
                _tile_loadd(1, panel + 16 * K + b * 32, K * 2);
                _tile_loadd(2, packed + (mt * KB + b) * 256, 64);
                _tile_loadd(3, packed + ((mt + 1) * KB + b) * 256, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
            _tile_stored(4, sink, 64);
            _tile_stored(5, sink + 256, 64);
            _tile_stored(6, sink + 512, 64);
            _tile_stored(7, sink + 768, 64);
        }
    }
    return (now() - t) / (panels * 2.0 * KB * 4) * 1e9;
}

int main(int argc, char **argv) {
    const int seconds = argc > 1 ? atoi(argv[1]) : 10;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        fprintf(stderr, "this kernel does not grant AMX tile data (or the CPU has no AMX)\n");
        return 1;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    /* small finite bfloat16 values (1.0), so no product meets a denormal or an infinity */
    for (size_t i = 0; i < sizeof panel / 2; i++) panel[i] = 0x3f80;
    for (size_t i = 0; i < sizeof packed / 4; i++) packed[i] = 0x3f803f80u;
    for (size_t i = 0; i < sizeof small / 2; i++) small[i] = 0x3f80;
    const double flop = 16.0 * 16 * 32 * 2; /* one tile product */
    printf("second  products ns (GFLOPS)   with loads ns (GFLOPS)   model footprint ns (GFLOPS)   overlap: vector ns,"
           " both ns, added share, one core\n");
    for (int s = 0; s < seconds; s++) {
        const double start = now();
        const double a = products(200000, 0), b = products(200000, 1), c = model_footprint(2000);
        _tile_loadd(0, small, 64); /* products() left tiles 0-3 holding the same finite values */
        const double v = products_and_vector(100000, 0, 1), both = products_and_vector(100000, 1, 1);
        const double alone = products_and_vector(100000, 1, 0);
        printf("%6d  %8.2f (%6.0f)        %8.2f (%6.0f)          %8.2f (%6.0f)          %6.1f %6.1f %5.2f\n", s, a,
               flop / a, b, flop / b, c, flop / c, v, both, (both - alone) / v);
        fflush(stdout);
        const double spent = now() - start;
        if (spent < 1.0) usleep((useconds_t)((1.0 - spent) * 1e6));
    }
    _tile_release();
    return 0;
}
