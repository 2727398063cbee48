#!/usr/bin/env bash
# Build the C core for AArch64 and run tests/c/arm_kernels.c under qemu-user on two emulated
# CPUs: one with the dotprod feature (qemu's `max`) and one without (Cortex-A57).  Also checks
# that the Python module's C file compiles for AArch64.
# Needs Debian's gcc-aarch64-linux-gnu and qemu-user (or $CC / $QEMU naming others).
set -euo pipefail
cd "$(dirname "$0")/../.."
CC=${CC:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-qemu-aarch64}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-O2 -std=gnu11 -fno-strict-aliasing -ffp-contract=off -Wall -Wno-unused-function -Werror)
core=()
for f in sparseinfer/csrc/*.c; do
  [ "$f" = sparseinfer/csrc/module.c ] || core+=("$f")
done
"$CC" "${flags[@]}" -static -pthread -o "$out/arm_kernels" tests/c/arm_kernels.c "${core[@]}" -lm
pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
"$CC" "${flags[@]}" -I"$pyinc" -fsyntax-only sparseinfer/csrc/module.c
echo "cpu max (dotprod):"
"$QEMU" -cpu max "$out/arm_kernels" 1
echo "cpu cortex-a57 (no dotprod):"
"$QEMU" -cpu cortex-a57 "$out/arm_kernels" 0
