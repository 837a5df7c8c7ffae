/* Compiles the width-generic body TSV_BODY (a header name) once per vector level this build has, with
 * TSV_ISA and TSV_LEVEL naming the level (ts_vec.h); the includer defines TSV_BODY and undefines it after.
 * The avx512bf16 level is avx512's operations with its own rounding to bfloat16 (V_FTZ), so a body is
 * compiled for it only when the includer also defines TSV_BODY_FTZ, and then with TSV_FTZ_PASS defined:
 * the body keeps to the functions that round with V_FTZ, which TSV_CALL_FTZ calls; the rest run the
 * avx512 level's everywhere above it. No include guard: included once per body. */
#include "ts_vec.h"

#ifdef TS_HAVE_AVX2
#define TSV_ISA avx2
#define TSV_LEVEL avx2
#include TSV_BODY
#undef TSV_LEVEL
#undef TSV_ISA
#endif
#ifdef TS_HAVE_AVX512
#define TSV_ISA avx512
#define TSV_LEVEL avx512
#include TSV_BODY
#undef TSV_LEVEL
#undef TSV_ISA
#endif
#if defined(TS_HAVE_AVX512BF16) && defined(TSV_BODY_FTZ)
#define TSV_ISA avx512
#define TSV_LEVEL avx512bf16
#define TSV_FTZ_PASS 1
#include TSV_BODY
#undef TSV_FTZ_PASS
#undef TSV_LEVEL
#undef TSV_ISA
#endif
