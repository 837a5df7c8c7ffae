#!/usr/bin/env bash
# Runs a command as tideserve would run on an AVX2-only CPU (an AMD EPYC of the Zen 2/3 kind), on a CPU that
# has more (AVX-512, AMX). TIDESERVE_ISA=avx2 alone is a weaker proxy: it picks the AVX2 kernels, but they are
# still compiled with -march=native, so they may use AVX-512VL's 32 vector registers where an AVX2-only
# build has 16, and the compiler allocates and schedules them differently (the tiles ran 10% slower that way).
# Here the native library is built with -march=znver3 instead ($TIDESERVE_AVX2_MARCH: haswell suits any AVX2
# CPU), so it has no AVX-512 paths and the AVX2 ones are chosen as on such a machine; it goes in its own cache
# ($TIDESERVE_AVX2_EMULATION_DIR), and torch's oneDNN and ATen dispatch are capped at AVX2. Limits: the cores
# are still this CPU's (their widths, ports and caches), and fbgemm and MKL are not capped; a measurement
# here says how the AVX2 code behaves, not what an AVX2-only machine would measure.
#
#   benchmarks/avx2_emulation.sh .venv/bin/python benchmarks/native_kernels.py --rounds 3
#   benchmarks/avx2_emulation.sh .venv/bin/python benchmarks/compare.py ... --llama-server <an AVX2 build>
#
# A peer built the same way: llama.cpp's CMake with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF (docs/benchmarks.md, "AVX2 only").
set -euo pipefail
wrapper_dir=${TIDESERVE_AVX2_EMULATION_DIR:-${TMPDIR:-/tmp}/tideserve-avx2-emulation}
mkdir -p "$wrapper_dir"
cc=${CC:-$(command -v cc || command -v gcc)}
march=${TIDESERVE_AVX2_MARCH:-znver3}
cat > "$wrapper_dir/cc" <<EOF
#!/bin/sh
# $cc, building for an AVX2-only CPU ($march) wherever it was asked to build for this one
for a in "\$@"; do
  shift
  if [ "\$a" = "-march=native" ]; then set -- "\$@" -march=$march; else set -- "\$@" "\$a"; fi
done
exec "$cc" "\$@"
EOF
chmod +x "$wrapper_dir/cc"
export CC="$wrapper_dir/cc" TIDESERVE_CACHE_DIR="$wrapper_dir/cache" ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
exec "$@"
