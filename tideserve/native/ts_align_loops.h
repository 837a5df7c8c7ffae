/* Included first by the float kernels' files, before any other header: every loop head 32-byte aligned.
 * Their hot loops are 16 to 32 bytes; where one straddled a 64-byte boundary (GCC's default places loop
 * heads 16 bytes apart, so that depended on where the code around it happened to end), the same
 * instructions ran up to 20% slower on a Zen 3 core (RMSNorm over 256 rows, prefill attention). Aligned to
 * 32 bytes, such a loop never straddles one. Before any header, so that every function of the file,
 * intrinsics included, has the same options and inlines as it would without it. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("align-loops=32")
#endif
