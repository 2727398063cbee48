"""Build of the C kernel core `sparseinfer._cpu` (metadata lives in pyproject.toml).

One extension, plain C11 + pthreads, no torch at build time.  The SIMD files pick their
instruction sets with `#pragma GCC target`, and the library chooses AVX-512 (VNNI) / AVX2 /
scalar (x86-64) or NEON with or without SDOT (AArch64) at run time, so the compile flags stay
generic and the .so runs on any CPU of its architecture (others get the scalar kernels).  If the compiler is missing or fails, the
install still succeeds (`optional=True`) and `sparseinfer.kernels.cpu` falls back to the
reference kernels with a warning.

SPARSEINFER_SANITIZE=1 builds a test copy with AddressSanitizer and UBSan instead (`.ci/sanitize`
builds it into a folder of its own and runs tests against it); that build must not fail quietly.
"""
import os
import sys

from setuptools import Extension, setup

SOURCES = [
    "sparseinfer/csrc/module.c",
    "sparseinfer/csrc/runtime.c",
    "sparseinfer/csrc/quant.c",
    "sparseinfer/csrc/dense.c",
    "sparseinfer/csrc/sparse.c",
    "sparseinfer/csrc/cols.c",
    "sparseinfer/csrc/tiles.c",
    "sparseinfer/csrc/norm_attn.c",
    "sparseinfer/csrc/probe.c",
    "sparseinfer/csrc/decode.c",
    "sparseinfer/csrc/pool.c",
    "sparseinfer/csrc/kern_scalar.c",
    "sparseinfer/csrc/kern_avx2.c",
    "sparseinfer/csrc/kern_avx512.c",
    "sparseinfer/csrc/kern_avx512vnni.c",
    "sparseinfer/csrc/kern_amx.c",
    "sparseinfer/csrc/kern_neon.c",
    "sparseinfer/csrc/kern_neon_dotprod.c",
    "sparseinfer/csrc/repack.c",
]

compile_args = [] if sys.platform == "win32" else ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]
link_args = [] if sys.platform == "win32" else ["-pthread", "-lm"]
SANITIZE = os.environ.get("SPARSEINFER_SANITIZE") == "1"
if SANITIZE:
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    compile_args = [a for a in compile_args if not a.startswith("-O")] + ["-O1", "-g"] + san
    link_args = link_args + san

setup(
    ext_modules=[
        Extension(
            "sparseinfer._cpu",
            sources=SOURCES,
            depends=["sparseinfer/csrc/common.h", "sparseinfer/csrc/ops.h", "sparseinfer/csrc/ops_internal.h",
                     "sparseinfer/csrc/pool.h",
                     "sparseinfer/csrc/kern_avx512_impl.h", "sparseinfer/csrc/attend_impl.h",
                     "sparseinfer/csrc/kern_neon_impl.h"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=not SANITIZE,
        )
    ],
)
