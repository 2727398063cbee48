"""Kernels: `reference` (slow, obviously correct, torch), `cpu` (C/SIMD, threaded; falls back to
`reference` when the extension is not built), `torch_device` (plain torch on any device, for
accelerators), `decode_plan` (the C decode steps' plans).  `matmul` picks among them."""
from __future__ import annotations

import torch

from ..quant import QWeight

# Rows of X (tokens) from which a CPU product runs as torch's float32 GEMM on weights
# dequantized slice by slice instead of our integer kernels, per activation mode and format:
# the integer kernels win for few tokens, the GEMM for many once activations are rounded with
# two terms ("precise"); on a tile level (AMX, "int8") the integer kernels win at every size.
# q4k's boundaries are q4's (measured alike on an AVX2 CPU; no tile level has q4k kernels).
_F32_GEMM_MIN_ROWS = {
    "int8": {"q4": 1 << 62, "q4k": 1 << 62, "q8": 256, "q6": 512, "f16": 64, "bf16": 64, "f32": 64},
    "precise": {"q4": 128, "q4k": 128, "q8": 64, "q6": 128, "f16": 64, "bf16": 64, "f32": 64},
    "tiles": {"q4": 1 << 62, "q4k": 1 << 62, "q8": 1 << 62, "q6": 1 << 62, "f16": 64, "bf16": 64, "f32": 64},
}


# Rows of X from which, on CPUs that multiply bfloat16 in hardware (`cpu.bf16_gemm_native`), a
# product in the int8 activation mode runs as torch's bfloat16 GEMM on rows dequantized slice
# by slice (`cpu.matmul_bf16`): where it outran the integer kernels on an AMD EPYC (Zen 4) with
# AVX512_BF16 (`python benchmarks/kernels.py`); q4 stays on its integer kernels at every size.
# Not on a tile level: its integer tiles are faster still.
_BF16_GEMM_MIN_ROWS = {"q4k": 128, "q6": 512}


def _gemm_min_rows(cpu) -> dict:
    mode = cpu.activation_mode()
    return _F32_GEMM_MIN_ROWS["tiles" if mode == "int8" and cpu.simd_level() in cpu.TILE_LEVELS else mode]


def matmul(w: QWeight, x2: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 -> (M, N) = x2 W^T through the fastest kernel for the weight's format and
    device: the C kernels (or torch's GEMM for many tokens) on the CPU, torch elsewhere."""
    if x2.device.type == "cpu":
        from . import cpu

        m = x2.shape[0]
        if m > 1 and cpu.available():
            if (m >= _BF16_GEMM_MIN_ROWS.get(w.fmt, 1 << 62) and cpu.bf16_gemm_native()
                    and cpu.activation_mode() == "int8" and cpu.simd_level() not in cpu.TILE_LEVELS):
                return cpu.matmul_bf16(w, x2)
            if m >= _gemm_min_rows(cpu).get(w.fmt, 1 << 62):
                return cpu.matmul_f32(w, x2)
        return cpu.matmul(w, x2)
    from .torch_device import matmul as device_matmul

    return device_matmul(w, x2)
