"""Accelerator-side operators in plain torch ops, for any torch device.

Weights stay on the device in their `QWeight` format (the bytes the placement counted) and are
dequantized to float32 in row chunks of at most `CHUNK_ELEMS` values right before use, so the
transient memory is bounded whatever the matrix size.  The same code runs with torch-CPU
standing in for the accelerator, which is how the tests exercise it.

A Triton kernel (fused gather + dequantize + dot) would avoid the float32 round trip; it is not
here because it could not be measured or tested on a GPU yet.  The hooks are `rows_gemv` and
`rows_axpy`, the row products the hybrid FFN's device part hands to the one-token reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import BLOCK, QUANT_FORMATS, QWeight, dequantize
from .reference import activation_group

CHUNK_ELEMS = 1 << 20          # weights dequantized at a time (4 MiB of float32)
DEQUANT_BYTES_PER_ELEM = 12    # float32 result + unpacked bytes + float temporaries, rounded up
ALLOC_ROUND = 512              # the CUDA caching allocator's block granularity


def device_nbytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor takes on the device, allocator rounding included."""
    if t is None:
        return 0
    n = t.numel() * t.element_size()
    return -(-n // ALLOC_ROUND) * ALLOC_ROUND


def qweight_device_nbytes(w: QWeight) -> int:
    return sum(device_nbytes(t) for t in (w.qs, w.d, w.m))


def row_slice(w: QWeight, start: int, end: int) -> QWeight:
    """Rows [start, end) as a view (no copy)."""
    cut = lambda t: None if t is None else t[start:end]  # noqa: E731
    return QWeight(w.fmt, end - start, w.cols, cut(w.qs), cut(w.d), cut(w.m))


def copy_rows(w: QWeight, start: int, end: int, device: torch.device | str = "cpu") -> QWeight:
    """Rows [start, end) as their own contiguous tensors on `device` (the rest can be freed)."""
    cut = lambda t: None if t is None else t[start:end].contiguous().to(device)  # noqa: E731
    return QWeight(w.fmt, end - start, w.cols, cut(w.qs), cut(w.d), cut(w.m))


def dequant(w: QWeight) -> torch.Tensor:
    """(rows, cols) float32 on the weight's device, in place where possible (bounded temporaries)."""
    if w.fmt == "f32":
        return w.qs
    if w.fmt in ("f16", "bf16"):
        return w.qs.float()
    rows = w.rows
    if w.fmt in ("q6", "q4k"):  # bounded by the caller's row chunks (unpacking takes int64 temporaries)
        return dequantize(w)
    if w.fmt == "q8":
        q = w.qs.float()
    else:  # q4: byte j of a block holds value j (low nibble) and value j + 16 (high nibble)
        b = w.qs.view(rows, -1, BLOCK // 2)
        q = torch.empty(rows, b.shape[1], BLOCK, dtype=torch.float32, device=b.device)
        q[..., : BLOCK // 2] = b & 0x0F
        q[..., BLOCK // 2 :] = b >> 4
    q = q.view(rows, -1, BLOCK)
    q.mul_(w.d.float()[..., None])
    if w.m is not None:
        q.add_(w.m.float()[..., None])
    q = q.view(rows, -1)
    return q if q.shape[1] == w.cols else q[:, : w.cols]


def chunk_rows(w: QWeight) -> int:
    return max(1, CHUNK_ELEMS // max(w.cols, 1))


def _round8(xb: torch.Tensor) -> torch.Tensor:
    """One int8 term per block (the last dim; scale amax/127, ties to even), as a float."""
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv) * (amax / 127.0)


def fake_quant_x(x2: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """x rounded the way the CPU kernels round activations for integer formats in the current
    activation mode (`kernels.cpu.set_activation_mode`, `kernels.reference`); the kernels'
    mins term uses the block sums of this rounded x, so a plain product with the full
    dequantized weight is the same function.  The accelerator then computes what the CPU
    does, and predictors decide the same way on both.  `group`: values per int8 scale (32;
    256 for q4k, `reference.activation_group`)."""
    from . import cpu

    m, k = x2.shape
    xb = F.pad(x2, (0, (-k) % group)).view(m, -1, group)
    xq = _round8(xb)
    if cpu.activation_mode() == "precise":
        xq = xq + _round8(xb - xq)
    return xq.view(m, -1)[:, :k]


def matmul(w: QWeight, x2: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 -> (M, rows) = x2 W^T, W dequantized chunk by chunk."""
    if w.fmt == "f32":
        return x2 @ w.qs.T
    if w.fmt in ("f16", "bf16") and x2.device.type == "cuda":
        return (x2.to(w.qs.dtype) @ w.qs.T).float()  # tensor cores; inputs rounded to the weight type
    y = torch.empty(x2.shape[0], w.rows, dtype=torch.float32, device=x2.device)
    xq = fake_quant_x(x2, activation_group(w.fmt)) if w.fmt in QUANT_FORMATS else x2
    step = chunk_rows(w)
    for a in range(0, w.rows, step):
        b = min(w.rows, a + step)
        y[:, a:b] = xq @ dequant(row_slice(w, a, b)).T
    return y


def matmul_t(h: torch.Tensor, wt: QWeight) -> torch.Tensor:
    """(M, rows) @ Wt -> (M, cols): the down projection from its neuron-major transpose."""
    if wt.fmt == "f32":
        return h @ wt.qs
    y = torch.zeros(h.shape[0], wt.cols, dtype=torch.float32, device=h.device)
    step = chunk_rows(wt)
    for a in range(0, wt.rows, step):
        b = min(wt.rows, a + step)
        y.addmm_(h[:, a:b], dequant(row_slice(wt, a, b)))
    return y


def rows_gemv(w: QWeight, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y[j] = W[rows[j]] . x on w's device (`reference.sparse_ffn_token`'s row product)."""
    y = torch.empty(rows.numel(), dtype=torch.float32, device=x.device)
    step = chunk_rows(w)
    for a in range(0, rows.numel(), step):
        y[a: a + step] = matmul(w.select_rows(rows[a: a + step]), x[None])[0]
    return y


def rows_axpy(wt: QWeight, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y = sum_j h[j] Wt[rows[j]] on wt's device (`reference.sparse_ffn_token`'s down product)."""
    y = torch.zeros(wt.cols, dtype=torch.float32, device=h.device)
    step = chunk_rows(wt)
    for a in range(0, rows.numel(), step):
        y += matmul_t(h[None, a: a + step], wt.select_rows(rows[a: a + step]))[0]
    return y
