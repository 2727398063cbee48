"""Kernels: `reference` (slow, obviously correct, torch) and `cpu` (C/SIMD, threaded; falls
back to `reference` when the extension is not built).  Both share one API: gemv, matmul,
gemv_rows, axpy_rows, sparse_ffn."""
