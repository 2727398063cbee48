"""Weight formats kept in memory (`QWeight`), with slow, obvious reference (de)quantizers.

Formats (a weight is a matrix of `rows` x `cols`, one output neuron per row; K = cols):

- ``f32`` / ``f16`` / ``bf16``: ``qs`` is the plain ``(rows, cols)`` tensor; ``d``/``m`` are None.
- ``q8``: ``qs`` int8 ``(rows, Kp)``; ``d`` f16 ``(rows, Kp // 32)``; ``m`` f16 of the same shape
  or None.  value = d * q (+ m).  GGUF Q8_0 and Q5_0 repack into it losslessly, Q5_1/Q5_K with
  ``m``; Q6_K is re-quantized per 32 (8 bits for 6-bit data: near-lossless).
- ``q4``: ``qs`` uint8 ``(rows, Kp // 2)``; ``d`` and ``m`` f16 ``(rows, Kp // 32)``.
  value = d * q + m, q in 0..15.  Within a block of 32 values, byte j holds value j in its low
  nibble and value j + 16 in its high nibble (GGUF's Q4_0/Q4_1 order).  Q4_0/Q4_1 repack
  losslessly; Q4_K folds its 6-bit sub-block scales into f16 (d, m) per 32.

Kp is cols rounded up to a multiple of 32; padding values are zero (q = 0, d = m = 0), so
products over the padding add nothing.  Every row's bytes (and its scales) are contiguous,
so a kernel that skips an inactive neuron skips its bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANT_FORMATS = ("q8", "q4")
FORMATS = FLOAT_FORMATS + QUANT_FORMATS
_TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def padded(cols: int) -> int:
    return (cols + BLOCK - 1) // BLOCK * BLOCK


@dataclass
class QWeight:
    """A (rows, cols) weight matrix in one of `FORMATS`; see the module docstring."""

    fmt: str
    rows: int
    cols: int
    qs: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def row_bytes(self) -> int:
        """Bytes one neuron (row) occupies, scales included."""
        return self.nbytes // max(self.rows, 1)

    def dequantize(self) -> torch.Tensor:
        """Reference: the (rows, cols) float32 matrix."""
        return dequantize(self)

    def select_rows(self, idx: torch.Tensor) -> "QWeight":
        """A new QWeight holding rows `idx` in that order (used to reorder neurons by hotness)."""
        pick = lambda t: None if t is None else t.index_select(0, idx).contiguous()  # noqa: E731
        return QWeight(self.fmt, int(idx.numel()), self.cols, pick(self.qs), pick(self.d), pick(self.m))

    def to(self, device) -> "QWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QWeight(self.fmt, self.rows, self.cols, mv(self.qs), mv(self.d), mv(self.m))


def from_float(w: torch.Tensor, fmt: str) -> QWeight:
    """Quantize a float (rows, cols) matrix into `fmt` (reference quantizer, round-to-nearest)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    w = w.detach().float().cpu()
    rows, cols = w.shape
    if fmt in FLOAT_FORMATS:
        return QWeight(fmt, rows, cols, w.to(_TORCH_DTYPE[fmt]).contiguous())
    kp = padded(cols)
    wp = torch.zeros(rows, kp)
    wp[:, :cols] = w
    blocks = wp.view(rows, kp // BLOCK, BLOCK)
    if fmt == "q8":
        amax = blocks.abs().amax(-1)
        d = (amax / 127).to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(amax))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QWeight("q8", rows, cols, q.view(rows, kp).contiguous(), d.contiguous(), None)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(lo))
    q = torch.round((blocks - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QWeight("q4", rows, cols, pack_nibbles(q.view(rows, kp)), d.contiguous(), m.contiguous())


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(rows, Kp) values 0..15 -> (rows, Kp // 2) bytes in GGUF block order."""
    rows, kp = q.shape
    b = q.view(rows, kp // BLOCK, 2, BLOCK // 2).to(torch.uint8)
    return (b[:, :, 0, :] | (b[:, :, 1, :] << 4)).reshape(rows, kp // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(rows, Kp // 2) bytes -> (rows, Kp) values 0..15 (inverse of `pack_nibbles`)."""
    rows, half = qs.shape
    b = qs.view(rows, half * 2 // BLOCK, BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(rows, half * 2)


def dequantize(w: QWeight) -> torch.Tensor:
    if w.fmt in FLOAT_FORMATS:
        return w.qs.float()
    if w.fmt == "q8":
        q = w.qs.float()
    elif w.fmt == "q4":
        q = unpack_nibbles(w.qs).float()
    else:
        raise ValueError(f"unknown weight format {w.fmt!r}")
    rows, kp = q.shape
    q = q.view(rows, kp // BLOCK, BLOCK) * w.d.float()[..., None]
    if w.m is not None:
        q = q + w.m.float()[..., None]
    return q.view(rows, kp)[:, : w.cols].contiguous()
