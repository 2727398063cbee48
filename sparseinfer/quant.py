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
- ``q6``: ``qs`` uint8 ``(rows, Kp * 3 // 4)``; ``d`` f16 ``(rows, Kp // 16)``, one scale per
  16 values; no ``m``.  value = d * (q - 32), q in 0..63.  GGUF Q6_K repacks into it with its
  per-16 scale folded into f16 (super-block d times int8 sub-scale, rounded once: 7 bits per
  weight against Q6_K's 6.56 and q8's 8.5).  Byte layout (`pack_q6`): the
  row's blocks of 32 in groups of 4 (96 bytes: the 4 blocks' low nibbles in q4 order, 64
  bytes, then 32 bytes of 2-bit high parts), then the blocks after the last full group, 24
  bytes each (16 bytes of nibbles in q4 order, 8 of high parts).  High parts, group: the
  value at nibble position p (0..63, low nibbles) sits in byte p % 32, bits 2 * (p // 32);
  the one at high-nibble position p in byte p % 32, bits 2 * (2 + p // 32).  Tail block:
  value j in byte j % 8, bits 2 * (j // 8).  So one load of a group's 64 nibble bytes lines
  up with the q4 activation layout, and its high parts come from one 32-byte load.

- ``q4k``: GGUF Q4_K super-blocks exactly as a file stores them: ``qs`` uint8
  ``(rows, cols // 256 * 144)``, ``d``/``m`` None; cols a multiple of 256.  Each super-block of
  256 values: f16 ``d``, f16 ``dmin``, 12 bytes of 6-bit scales ``sc[8]`` and mins ``mn[8]`` (one
  per 32 values, GGUF's packing), 128 bytes of nibbles (bytes 32c..32c+31: values 64c.. in the
  low nibbles, 64c+32.. in the high ones).  value = d * sc * q - dmin * mn (`q4k_affine`).
  4.5 bits per weight; the kernels multiply it with activations quantized per 256 values.

- ``tq4``: q4's values with 16 rows interleaved (`to_tiles` / `from_tiles`; the CPU kernels'
  layout for dense products, csrc/tiles.c): ``qs`` uint8 ``(T, G * 320)``, T = ceil(rows / 16)
  tiles, G = Kp // 32 blocks, ``d``/``m`` None.  Tile t, block b: four lines of 64 bytes, then
  the f16 d of its 16 rows, then their f16 m; in line l, byte ``4 i + c`` holds row
  ``16 t + i``, input ``32 b + 8 l + c`` in its low nibble and input ``32 b + 8 l + 4 + c`` in
  its high nibble.  Padding rows and columns are zero (codes and scales).  5 bits per weight,
  as q4.  Rows are not addressable: row-sparse kernels take the q4 (`row_major`).
- ``tq6``: q6's values in the same tiles, 448 bytes per tile and block: the four lines of low
  nibbles as tq4's, then two lines of high parts (line h, byte ``4 i + c``: the 2-bit high
  parts of inputs ``32 b + 16 h + c``, ``+ 4``, ``+ 8``, ``+ 12`` in bits 0-1, 2-3, 4-5, 6-7),
  then the 16 rows' f16 d of inputs 0..15 and of inputs 16..31.  7 bits per weight, as q6.
- ``tq4k``: q4k's values (and bytes, rearranged) in tiles of 16 rows: ``qs`` uint8 ``(T, ns *
  2304)``, ns = cols // 256 super-blocks.  Tile t, super-block s: its 8 sub-blocks' codes as
  tq4's four lines each (256 bytes per sub-block j, inputs 256 s + 32 j ..), then the 16 rows'
  6-bit scales as two planes: 64 bytes of low nibbles (byte ``16 p + i``: row i's sub-blocks
  2p in the low nibble and 2p + 1 in the high one) and, after the mins' 64 (same order), 32
  bytes of high parts (byte ``16 h + i``, bits ``2 k``: bits 4-5 of row i's sub-block 4h + k),
  then the mins' 32; then the 16 rows' f16 d and their f16 dmin.  4.5 bits per weight, as
  q4k; value = d * sc * q - dmin * mn.

Kp is cols rounded up to a multiple of 32; padding values are zero (q = 0, d = m = 0), so
products over the padding add nothing.  Every row's bytes (and its scales) are contiguous,
so a kernel that skips an inactive neuron skips its bytes.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BLOCK = 32
FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANT_FORMATS = ("q8", "q4", "q6", "q4k")
TILE_FORMATS = ("tq4", "tq6", "tq4k")  # CPU-only layouts of q4's / q6's / q4k's values, made from them (`to_tiles`)
Q4K_BLOCK, Q4K_BYTES = 256, 144  # values and bytes of one q4k super-block
FORMATS = FLOAT_FORMATS + QUANT_FORMATS
_TORCH_DTYPE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def padded(cols: int) -> int:
    return (cols + BLOCK - 1) // BLOCK * BLOCK


@dataclass
class QWeight:
    """A (rows, cols) weight matrix in one of `FORMATS` or `TILE_FORMATS`; see the module
    docstring."""

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
        """A new QWeight holding rows `idx` in that order (used to reorder neurons by hotness);
        row-major (tq4 gives q4, tq6 q6, tq4k q4k)."""
        if self.fmt in TILE_FORMATS:
            return from_tiles(self).select_rows(idx)
        pick = lambda t: None if t is None else t.index_select(0, idx).contiguous()  # noqa: E731
        return QWeight(self.fmt, int(idx.numel()), self.cols, pick(self.qs), pick(self.d), pick(self.m))

    def to(self, device) -> "QWeight":
        """On `device`; tq4 / tq6 / tq4k (CPU kernels' layouts) move as q4 / q6 / q4k."""
        if self.fmt in TILE_FORMATS and torch.device(device).type != "cpu":
            return from_tiles(self).to(device)
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QWeight(self.fmt, self.rows, self.cols, mv(self.qs), mv(self.d), mv(self.m))


def qweights(module) -> Iterator[QWeight]:
    """Every distinct `QWeight` held by a torch module tree (tied or viewed weights, which
    share their `qs` storage tensor, once)."""
    seen = set()
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, QWeight) and id(v.qs) not in seen:
                seen.add(id(v.qs))
                yield v


def qweight_nbytes(module) -> int:
    """The weight bytes of a module tree as loaded: each distinct `QWeight` once."""
    return sum(w.nbytes for w in qweights(module))


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
    if fmt == "q4k":
        return _q4k_from_float(w)
    if fmt == "q6":
        sub = wp.view(rows, kp // 16, 16)
        d = (sub.abs().amax(-1) / 31).to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        q = torch.round(sub * inv[..., None]).clamp(-32, 31) + 32
        return QWeight("q6", rows, cols, pack_q6(q.view(rows, kp).to(torch.uint8)), d.contiguous(), None)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(lo))
    q = torch.round((blocks - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QWeight("q4", rows, cols, pack_nibbles(q.view(rows, kp)), d.contiguous(), m.contiguous())


def _q4k_from_float(w: torch.Tensor) -> QWeight:
    """Round-to-nearest Q4_K (reference quantizer; llama.cpp's own searches for better scales):
    per 32 values a scale (max + mn) / 15 and a min mn = max(0, -min), both quantized to 6 bits
    against the super-block's f16 d = max scale / 63 and dmin = max min / 63."""
    rows, cols = w.shape
    if cols % Q4K_BLOCK:
        raise ValueError(f"q4k needs a multiple of {Q4K_BLOCK} columns, got {cols}")
    ns = cols // Q4K_BLOCK
    x = w.view(rows, ns, 8, BLOCK)
    mn_f = (-x.amin(-1)).clamp(min=0)
    sc_f = (x.amax(-1) + mn_f).clamp(min=0) / 15
    d = (sc_f.amax(-1) / 63).to(torch.float16)
    dmin = (mn_f.amax(-1) / 63).to(torch.float16)
    inv = lambda v: torch.where(v > 0, 1.0 / v, torch.zeros_like(v))  # noqa: E731
    sc = torch.round(sc_f * inv(d.float())[..., None]).clamp(0, 63)
    mn = torch.round(mn_f * inv(dmin.float())[..., None]).clamp(0, 63)
    step = d.float()[..., None] * sc
    q = torch.round((x + (dmin.float()[..., None] * mn)[..., None]) * inv(step)[..., None]).clamp(0, 15).to(torch.uint8)
    return _q4k_pack(q.view(rows, cols), d, dmin, sc.to(torch.uint8), mn.to(torch.uint8))


def _q4k_pack(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> QWeight:
    """A q4k weight from its fields: codes (rows, cols) 0..15, f16 d and dmin (rows, ns), 6-bit
    sub-block scales and mins (rows, ns, 8); GGUF's byte layout (module doc)."""
    rows, cols = q.shape
    ns = cols // Q4K_BLOCK
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    s12 = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                     (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], dim=-1)
    qc = q.to(torch.uint8).view(rows, ns, 4, 2, BLOCK)
    nib = qc[:, :, :, 0] | (qc[:, :, :, 1] << 4)  # chunk c: values 64c+l and 64c+32+l
    head = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], -1).view(torch.uint8).view(rows, ns, 4)
    qs = torch.cat([head, s12, nib.reshape(rows, ns, 128)], dim=-1).reshape(rows, ns * Q4K_BYTES)
    return QWeight("q4k", rows, cols, qs.contiguous())


def q4k_fields(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q4k weight's fields: (codes uint8 (rows, cols), d f16 (rows, ns), dmin f16 (rows, ns),
    sc (rows, ns, 8), mn (rows, ns, 8) as int64 0..63); ns = cols // 256."""
    ns = w.cols // Q4K_BLOCK
    b = w.qs.reshape(w.rows, ns, Q4K_BYTES)
    hd = b[..., :4].contiguous().view(torch.float16)  # (rows, ns, 2): d, dmin
    s = b[..., 4:16].long()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    nib = b[..., 16:].reshape(w.rows, ns, 4, 1, BLOCK)
    q = torch.cat([nib & 15, nib >> 4], dim=3).reshape(w.rows, w.cols)
    return q, hd[..., 0], hd[..., 1], sc, mn


def q4k_affine(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q4k weight as (codes uint8 (rows, cols), step f32 (rows, cols // 32), offset f32
    (rows, cols // 32)): value = step * code + offset per block of 32, step = d * sc and
    offset = -dmin * mn, each product rounded once to f32 (as the kernels form them)."""
    q, d, dmin, sc, mn = q4k_fields(w)
    ns = w.cols // Q4K_BLOCK
    step = (d.float()[..., None] * sc.float()).reshape(w.rows, ns * 8)
    off = -(dmin.float()[..., None] * mn.float()).reshape(w.rows, ns * 8)
    return q, step, off


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


@functools.lru_cache(maxsize=16)
def _q6_positions(kp: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each value k of a q6 row of kp values: the byte of its nibble, the nibble's shift
    (0 or 4), the byte of its 2-bit high part and that part's shift (see the module doc)."""
    k = torch.arange(kp, device=device)
    b, j = k // BLOCK, k % BLOCK
    ng = (kp // BLOCK) // 4
    g, i = b // 4, b % 4
    low = j < 16
    p = i * 16 + j % 16  # nibble position within a group
    nib_byte = torch.where(b < 4 * ng, g * 96 + p, 96 * ng + (b - 4 * ng) * 24 + j % 16)
    nib_shift = torch.where(low, 0, 4)
    hi_byte = torch.where(b < 4 * ng, g * 96 + 64 + p % 32, 96 * ng + (b - 4 * ng) * 24 + 16 + j % 8)
    hi_shift = torch.where(b < 4 * ng, 2 * (p // 32 + torch.where(low, 0, 2)), 2 * (j // 8))
    return nib_byte, nib_shift, hi_byte, hi_shift


def pack_q6_reference(q: torch.Tensor) -> torch.Tensor:
    """Slow, obvious `pack_q6`: every value scattered to its byte positions (int64 temporaries
    of ~30 bytes per value; tests only)."""
    rows, kp = q.shape
    nb_, ns, hb, hs = _q6_positions(kp, q.device)
    q = q.to(torch.int64)
    out = torch.zeros(rows, kp * 3 // 4, dtype=torch.int64, device=q.device)
    out.index_add_(1, nb_, (q & 15) << ns)
    out.index_add_(1, hb, (q >> 4) << hs)
    return out.to(torch.uint8)


def unpack_q6_reference(qs: torch.Tensor) -> torch.Tensor:
    """Slow, obvious `unpack_q6` (tests only)."""
    rows, nbytes = qs.shape
    nb_, ns, hb, hs = _q6_positions(nbytes * 4 // 3, qs.device)
    b = qs.to(torch.int64)
    return (((b[:, nb_] >> ns) & 15) | (((b[:, hb] >> hs) & 3) << 4)).to(torch.uint8)


# Rows per slice in pack_q6 / unpack_q6: bounds their uint8 temporaries to a few times the
# slice (whole-tensor int64 temporaries for a vocabulary-sized q6 head take many times its
# size in memory, and the load slows down with them).
_Q6_SLICE_ROWS = 8192


def pack_q6(q: torch.Tensor) -> torch.Tensor:
    """(rows, Kp) codes 0..63 -> (rows, Kp * 3 // 4) bytes in the q6 layout (see the module doc;
    `pack_q6_reference` is the same by scattering)."""
    rows, kp = q.shape
    nb = kp // BLOCK
    ng, tail = nb // 4, nb % 4
    out = torch.empty(rows, kp * 3 // 4, dtype=torch.uint8, device=q.device)
    for r0 in range(0, rows, _Q6_SLICE_ROWS):
        qq = q[r0:r0 + _Q6_SLICE_ROWS].to(torch.uint8)
        n = qq.shape[0]
        if ng:
            # group of 4 blocks: (block i, half h, l) = value 32 i + 16 h + l
            g = qq[:, : ng * 128].reshape(n, ng, 4, 2, 16)
            nib = (g[:, :, :, 0] & 15) | ((g[:, :, :, 1] & 15) << 4)  # byte 16 i + l
            h = g >> 4
            # byte 64 + 16 m + l: blocks m and m + 2, low and high halves, at shifts 0/2/4/6
            hb = h[:, :, 0:2, 0] | (h[:, :, 2:4, 0] << 2) | (h[:, :, 0:2, 1] << 4) | (h[:, :, 2:4, 1] << 6)
            out[r0:r0 + n, : ng * 96] = torch.cat([nib.reshape(n, ng, 64), hb.reshape(n, ng, 32)], dim=2).reshape(n, -1)
        if tail:
            t = qq[:, ng * 128:].reshape(n, tail, 32)
            nib = (t[:, :, :16] & 15) | ((t[:, :, 16:] & 15) << 4)  # byte l
            h = (t >> 4).reshape(n, tail, 4, 8)  # value 8 s + k -> byte 16 + k, shift 2 s
            hb = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
            out[r0:r0 + n, ng * 96:] = torch.cat([nib, hb], dim=2).reshape(n, -1)
    return out


def unpack_q6(qs: torch.Tensor) -> torch.Tensor:
    """(rows, Kp * 3 // 4) bytes -> (rows, Kp) codes 0..63 (inverse of `pack_q6`)."""
    rows, nbytes = qs.shape
    kp = nbytes * 4 // 3
    nb = kp // BLOCK
    ng, tail = nb // 4, nb % 4
    out = torch.empty(rows, kp, dtype=torch.uint8, device=qs.device)
    sh = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device)
    for r0 in range(0, rows, _Q6_SLICE_ROWS):
        b = qs[r0:r0 + _Q6_SLICE_ROWS]
        n = b.shape[0]
        if ng:
            g = b[:, : ng * 96].reshape(n, ng, 96)
            nib = g[:, :, :64].reshape(n, ng, 4, 16)
            hb = g[:, :, 64:].reshape(n, ng, 1, 2, 16) >> sh.view(1, 1, 4, 1, 1)  # shift s: (i // 2, half) = (s % 2, s // 2)
            hb = (hb & 3).reshape(n, ng, 2, 2, 2, 16)  # (half, i // 2, i % 2, l)
            lo = (nib & 15) | (hb[:, :, 0].reshape(n, ng, 4, 16) << 4)
            hi = (nib >> 4) | (hb[:, :, 1].reshape(n, ng, 4, 16) << 4)
            out[r0:r0 + n, : ng * 128] = torch.stack([lo, hi], dim=3).reshape(n, -1)
        if tail:
            t = b[:, ng * 96:].reshape(n, tail, 24)
            nib = t[:, :, :16]
            hb = ((t[:, :, 16:].unsqueeze(2) >> sh.view(1, 1, 4, 1)) & 3).reshape(n, tail, 32)  # value 8 s + k
            v = torch.cat([nib & 15, nib >> 4], dim=2) | (hb << 4)
            out[r0:r0 + n, ng * 96 * 4 // 3:] = v.reshape(n, -1)
    return out


@dataclass
class ColWeight:
    """A (rows, cols) weight grouped by input channel (column) for input-sparse products: the
    weights of one input are contiguous, so a kernel that skips an input skips its bytes.

    Format ``cq4`` holds exactly the values of a row-major ``q4`` weight: value(r, j) =
    d[g, r] * q + m[g, r] with g = j // 32, q in 0..15.  ``qs`` is uint8 ``(G * 32, Np // 2)``
    (row j of qs is column j of W; G = ceil(cols / 32), Np = rows rounded up to 64); ``d``
    and ``m`` are f16 ``(G, Np)``.  Within a column, rows go in blocks of 128 (64 bytes; the
    last block is 64 rows, 32 bytes, when Np is not a multiple of 128); in a block of R rows
    with L = R // 32 lanes, byte ``16 l + 4 k + i`` holds row ``4 L k + 4 l + i`` in its low
    nibble and row ``R // 2 + 4 L k + 4 l + i`` in its high nibble (`col_byte_positions`; the
    C kernels' dword order, csrc/cols.c).  Padding rows are zero (codes and scales); padding
    columns have zero codes and are never read."""

    rows: int
    cols: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    fmt: str = "cq4"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def np(self) -> int:
        return (self.rows + 63) // 64 * 64

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def dequantize(self) -> torch.Tensor:
        """Reference: the (rows, cols) float32 matrix."""
        byte, hi = col_byte_positions(self.np)
        v = self.qs[:, byte].long()
        q = torch.where(hi, v >> 4, v & 15).float()              # (G*32, Np): q[j, r]
        g = q.shape[0] // BLOCK
        w = q.view(g, BLOCK, -1) * self.d.float()[:, None, :] + self.m.float()[:, None, :]
        return w.reshape(g * BLOCK, -1)[: self.cols, : self.rows].t().contiguous()


@functools.lru_cache(maxsize=8)
def col_byte_positions(np_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row r < np_rows of a `ColWeight` column: the byte (within the column) holding it
    and whether it is the high nibble."""
    byte, hi = torch.empty(np_rows, dtype=torch.long), torch.empty(np_rows, dtype=torch.bool)
    for b0 in range(0, np_rows, 128):
        R = 128 if np_rows - b0 >= 128 else 64
        L = R // 32
        for rho in range(R):
            k, rem = divmod(rho % (R // 2), 4 * L)
            byte[b0 + rho] = b0 // 2 + (rem // 4) * 16 + 4 * k + rem % 4
            hi[b0 + rho] = rho >= R // 2
    return byte, hi


def to_cols(w: QWeight) -> ColWeight:
    """The `ColWeight` of a row-major q4 weight: the same values, grouped by input channel."""
    if w.fmt != "q4":
        raise ValueError(f"column-grouped weights are made from q4 weights, not {w.fmt}")
    np_rows = (w.rows + 63) // 64 * 64
    q = torch.zeros(np_rows, padded(w.cols), dtype=torch.uint8)
    q[: w.rows] = unpack_nibbles(w.qs[:, : padded(w.cols) // 2])
    qt = q.t()                                                   # (Kp, Np): column j's rows
    byte, hi = col_byte_positions(np_rows)
    qs = torch.zeros(qt.shape[0], np_rows // 2, dtype=torch.uint8)
    qs[:, byte[~hi]] = qt[:, ~hi]
    qs[:, byte[hi]] |= qt[:, hi] << 4
    scales = lambda t: torch.nn.functional.pad(t[:, : padded(w.cols) // BLOCK].float().t(),  # noqa: E731
                                               (0, np_rows - w.rows)).to(torch.float16).contiguous()
    return ColWeight(w.rows, w.cols, qs, scales(w.d), scales(w.m))


TILE_ROWS = 16          # rows interleaved in one tq4 tile
TILE_BLOCK_BYTES = 320  # one tq4 tile's block of 32 inputs: 256 bytes of codes, then d and m (f16)
TILE6_BLOCK_BYTES = 448  # one tq6 tile's block: 256 bytes of low nibbles, 128 of high parts, 2 d (f16)
TILE4K_BLOCK_BYTES = 2304  # one tq4k tile's super-block of 256 inputs: 8 x 256 bytes of codes, 192 of scales, d, dmin
_TILE_BLOCK = {"tq4": (BLOCK, TILE_BLOCK_BYTES), "tq6": (BLOCK, TILE6_BLOCK_BYTES), "tq4k": (Q4K_BLOCK, TILE4K_BLOCK_BYTES)}


def _tile_codes(lines: torch.Tensor) -> torch.Tensor:
    """Tiles' code lines (t, g, 256 bytes: 4 lines of 64 per block of 32 inputs) as (t * 16,
    g * 32) 4-bit codes in row order."""
    t, g = lines.shape[:2]
    codes = lines.reshape(t, g, 4, TILE_ROWS, 4)                              # [t, b, l, i, c]
    q = torch.stack([codes & 15, codes >> 4], dim=-2)                         # [t, b, l, i, half, c]
    return q.permute(0, 3, 1, 2, 4, 5).reshape(t * TILE_ROWS, g * BLOCK)


def _code_lines(q: torch.Tensor) -> torch.Tensor:
    """(t * 16, g * 32) codes (their low nibbles) -> (t, g, 256) tile lines (inverse of `_tile_codes`)."""
    t, g = q.shape[0] // TILE_ROWS, q.shape[1] // BLOCK
    nib = (q & 15).view(t, TILE_ROWS, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [t, b, l, i, c, half]
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(t, g, 256)


def _tile_parts(w: QWeight):
    """A tiled weight's row-major parts: tq4 (codes (rows, Kp), d, m (rows, nb) f16); tq6
    (codes 0..63 (rows, Kp), d (rows, Kp // 16) f16, None); tq4k (codes (rows, cols), d, dmin
    (rows, ns) f16, sc, mn (rows, ns, 8) int64), ns = cols // 256."""
    t = (w.rows + TILE_ROWS - 1) // TILE_ROWS
    if w.fmt == "tq4k":
        ns = w.cols // Q4K_BLOCK
        qs = w.qs.reshape(t, ns, TILE4K_BLOCK_BYTES)
        q = _tile_codes(qs[:, :, :2048].reshape(t, ns * 8, 256))[: w.rows]
        row = lambda v: v.permute(0, 2, 1, *range(3, v.dim())).reshape(t * TILE_ROWS, ns, *v.shape[3:])[: w.rows]  # noqa: E731
        fields = []
        for lo, hi in ((2048, 2176), (2112, 2208)):  # sc, then mn: low nibble plane, high 2-bit plane
            lo4 = qs[:, :, lo: lo + 64].reshape(t, ns, 4, TILE_ROWS).long()     # [t, s, p, i]: sub-blocks 2p, 2p + 1
            hi2 = qs[:, :, hi: hi + 32].reshape(t, ns, 2, TILE_ROWS).long()     # [t, s, h, i]: bits 2k: sub-block 4h + k
            low = torch.stack([lo4 & 15, lo4 >> 4], dim=3).reshape(t, ns, 8, TILE_ROWS)
            high = torch.stack([(hi2 >> (2 * k)) & 3 for k in range(4)], dim=3).reshape(t, ns, 8, TILE_ROWS)
            fields.append(row((low | (high << 4)).permute(0, 1, 3, 2)))  # -> [t, s, i, j] -> (rows, ns, 8)
        dd = qs[:, :, 2240:].contiguous().view(torch.float16).view(t, ns, 2, TILE_ROWS)
        return q.contiguous(), row(dd[:, :, 0]).contiguous(), row(dd[:, :, 1]).contiguous(), *fields
    g = padded(w.cols) // BLOCK
    bb = _TILE_BLOCK[w.fmt][1]
    qs = w.qs.reshape(t, g, bb)
    q = _tile_codes(qs[:, :, :256])[: w.rows]
    if w.fmt == "tq6":
        hb = qs[:, :, 256:384].reshape(t, g, 2, TILE_ROWS, 4)                 # [t, b, h, i, c]
        hp = torch.stack([(hb >> (2 * k)) & 3 for k in range(4)], dim=-2)    # [t, b, h, i, k, c]: input 16h + 4k + c
        hp = hp.permute(0, 3, 1, 2, 4, 5).reshape(t * TILE_ROWS, g * BLOCK)[: w.rows]
        sc = qs[:, :, 384:].contiguous().view(torch.float16).view(t, g, 2, TILE_ROWS)
        d = sc.permute(0, 3, 1, 2).reshape(t * TILE_ROWS, 2 * g)[: w.rows]
        return (q | (hp << 4)).contiguous(), d.contiguous(), None
    sc = qs[:, :, 256:].contiguous().view(torch.float16)                     # [t, b, 32]
    d = sc[..., :TILE_ROWS].permute(0, 2, 1).reshape(t * TILE_ROWS, g)[: w.rows]
    m = sc[..., TILE_ROWS:].permute(0, 2, 1).reshape(t * TILE_ROWS, g)[: w.rows]
    return q.contiguous(), d.contiguous(), m.contiguous()


def _tile_q4k(w: QWeight, r0: int, r1: int, nt: int) -> torch.Tensor:
    """Rows [r0, r1) of a q4k weight as `nt` tq4k tiles (nt, ns, TILE4K_BLOCK_BYTES)."""
    ns = w.cols // Q4K_BLOCK
    q, d, dmin, sc, mn = q4k_fields(QWeight("q4k", r1 - r0, w.cols, w.qs[r0:r1]))
    pad = lambda v: torch.cat([v, v.new_zeros(nt * TILE_ROWS - (r1 - r0), *v.shape[1:])])  # noqa: E731
    q, d, dmin, sc, mn = (pad(v) for v in (q, d, dmin, sc, mn))
    o = torch.empty(nt, ns, TILE4K_BLOCK_BYTES, dtype=torch.uint8)
    o[:, :, :2048] = _code_lines(q).view(nt, ns, 2048)
    for lo, hi, v in ((2048, 2176, sc), (2112, 2208, mn)):
        v = v.view(nt, TILE_ROWS, ns, 8).permute(0, 2, 3, 1)                  # [t, s, j, i]
        o[:, :, lo: lo + 64] = ((v[:, :, 0::2] & 15) | ((v[:, :, 1::2] & 15) << 4)).to(torch.uint8).reshape(nt, ns, 64)
        h = (v >> 4).reshape(nt, ns, 2, 4, TILE_ROWS)                           # [t, s, h, k, i]
        o[:, :, hi: hi + 32] = (h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4)
                                | (h[:, :, :, 3] << 6)).to(torch.uint8).reshape(nt, ns, 32)
    for k, v in enumerate((d, dmin)):
        o[:, :, 2240 + 32 * k: 2272 + 32 * k] = v.view(nt, TILE_ROWS, ns).permute(0, 2, 1).contiguous().view(torch.uint8)
    return o


def to_tiles(w: QWeight, out: torch.Tensor | None = None) -> QWeight:
    """The row tiles of a row-major q4 (tq4), q6 (tq6) or q4k (tq4k) weight: the same values,
    16 rows interleaved (written into `out`, uint8 of `tiles_shape`, when given: e.g. a buffer
    on huge pages).  The reference of the compiled conversion (`kernels.cpu.tile`)."""
    if "t" + w.fmt not in TILE_FORMATS or (w.fmt == "q4" and w.m is None):
        raise ValueError(f"row-tiled weights are made from q4, q6 or q4k weights, not {w.fmt}")
    fmt = "t" + w.fmt
    group, bb = _TILE_BLOCK[fmt]
    g = (w.cols + group - 1) // group
    t = (w.rows + TILE_ROWS - 1) // TILE_ROWS
    shape = tiles_shape(w.rows, w.cols, fmt)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    if tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"tile buffer must be contiguous uint8 {shape}")
    o = out.view(t, g, bb)
    step = max(1, 4096 // TILE_ROWS)  # tiles at a time: bounded temporaries for large matrices
    for a in range(0, t, step):
        b = min(t, a + step)
        r0, r1 = a * TILE_ROWS, min(w.rows, b * TILE_ROWS)
        if fmt == "tq4k":
            o[a:b] = _tile_q4k(w, r0, r1, b - a)
            continue
        q = torch.zeros((b - a) * TILE_ROWS, g * BLOCK, dtype=torch.uint8)
        q[: r1 - r0] = unpack_q6(w.qs[r0:r1]) if fmt == "tq6" else unpack_nibbles(w.qs[r0:r1, : g * BLOCK // 2])
        o[a:b, :, :256] = _code_lines(q)
        if fmt == "tq6":
            hp = (q >> 4).view(b - a, TILE_ROWS, g, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [t, b, h, i, c, k]
            hb = hp[..., 0] | (hp[..., 1] << 2) | (hp[..., 2] << 4) | (hp[..., 3] << 6)
            o[a:b, :, 256:384] = hb.reshape(b - a, g, 128)
            v = torch.zeros((b - a) * TILE_ROWS, 2 * g, dtype=torch.float16)
            v[: r1 - r0] = w.d[r0:r1, : 2 * g].to(torch.float16)
            o[a:b, :, 384:] = v.view(b - a, TILE_ROWS, g, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(b - a, g, 64)
            continue
        for k, x in enumerate((w.d, w.m)):
            v = torch.zeros((b - a) * TILE_ROWS, g, dtype=torch.float16)
            v[: r1 - r0] = x[r0:r1, :g].to(torch.float16)
            o[a:b, :, 256 + 32 * k: 288 + 32 * k] = v.view(b - a, TILE_ROWS, g).permute(0, 2, 1).contiguous().view(torch.uint8)
    return QWeight(fmt, w.rows, w.cols, out)


def tiles_shape(rows: int, cols: int, fmt: str = "tq4") -> tuple[int, int]:
    """The shape of a tq4, tq6 or tq4k weight's qs: (tiles, blocks * block bytes)."""
    group, bb = _TILE_BLOCK[fmt]
    return ((rows + TILE_ROWS - 1) // TILE_ROWS, (cols + group - 1) // group * bb)


def from_tiles(w: QWeight) -> QWeight:
    """The row-major q4 / q6 / q4k weight of a tq4 / tq6 / tq4k weight (exactly the same
    values; for tq4k also the same bytes as the q4k it was made from)."""
    parts = _tile_parts(w)
    if w.fmt == "tq4k":
        return _q4k_pack(*parts)
    q, d, m = parts
    if w.fmt == "tq6":
        return QWeight("q6", w.rows, w.cols, pack_q6(q), d, None)
    return QWeight("q4", w.rows, w.cols, pack_nibbles(q), d, m)


def row_major(w: QWeight) -> QWeight:
    """`w` with addressable rows: tq4 / tq6 / tq4k as q4 / q6 / q4k, every other format as it is."""
    return from_tiles(w) if w.fmt in TILE_FORMATS else w


def dequantize(w: QWeight) -> torch.Tensor:
    if w.fmt in FLOAT_FORMATS:
        return w.qs.float()
    if w.fmt == "q6":
        q = unpack_q6(w.qs).float() - 32
        rows, kp = q.shape
        q = q.view(rows, kp // 16, 16) * w.d.float()[..., None]
        return q.view(rows, kp)[:, : w.cols].contiguous()
    if w.fmt == "q4k":
        q, step, off = q4k_affine(w)
        return (q.float().view(w.rows, -1, BLOCK) * step[..., None] + off[..., None]).view(w.rows, w.cols)
    if w.fmt in TILE_FORMATS:
        return dequantize(from_tiles(w))
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
