"""GGUF reading: metadata as plain Python values, tensors as `QWeight`s (kept quantized).

The `gguf` package parses the container (header, key/values, tensor infos, mmap of the data);
this module validates it with clear errors and maps it onto our config and weight formats.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError

GGUF_MAGIC = b"GGUF"


def open_reader(path: str | os.PathLike):
    """Open a GGUF file with the `gguf` package, turning malformed input into ModelFormatError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF'); "
            "pass a .gguf file or a Hugging Face model folder"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises ValueError/IndexError/... on damage
        raise ModelFormatError(
            f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e}); re-download or re-convert it"
        ) from e
    _check_complete(path, reader)
    return reader


def _check_complete(path: Path, reader) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFormatError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end:,} "
                f"but the file has {size:,}; re-download it"
            )


def _field_value(field) -> Any:
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        inner = types[-1]
        if inner == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        arr = np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
        return arr.tolist()
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]]
    return v.tolist()[0] if hasattr(v, "tolist") else v


def read_metadata(reader) -> dict[str, Any]:
    """All key/value pairs of a GGUF file as Python values (str, int, float, bool, lists)."""
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


# ---------------------------------------------------------------------------------------------
# Tensors: GGML block types -> our QWeight formats (see sparseinfer/quant.py)
# ---------------------------------------------------------------------------------------------
# Why by hand: the gguf package only dequantizes to float; we keep the integer codes so the
# weights stay 4/8-bit in memory.  Each converter works on a (rows, n_blocks, block_bytes) view.

def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _q4_0(raw: np.ndarray):
    d = _f16(raw[..., 0:2])
    return "q4", raw[..., 2:18], d, (d.astype(np.float32) * -8).astype(np.float16)


def _q4_1(raw: np.ndarray):
    return "q4", raw[..., 4:20], _f16(raw[..., 0:2]), _f16(raw[..., 2:4])


def _q8_0(raw: np.ndarray):
    return "q8", raw[..., 2:34].view(np.int8), _f16(raw[..., 0:2]), None


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes: low nibbles + one high bit each from a 32-bit mask -> (..., 32) ints 0..31."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # (..., 32): bit j of the LE uint32
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return lo | (bits << 4)


def _q5_0(raw: np.ndarray):
    q = _five_bit(raw[..., 2:6], raw[..., 6:22]).astype(np.int16) - 16
    return "q8", q.astype(np.int8), _f16(raw[..., 0:2]), None


def _q5_1(raw: np.ndarray):
    q = _five_bit(raw[..., 4:8], raw[..., 8:24]).astype(np.int8)
    return "q8", q, _f16(raw[..., 0:2]), _f16(raw[..., 2:4])


def _k_scales(raw: np.ndarray):
    """Q4_K/Q5_K super-block header -> per-32 (d, m) as float32, shapes (..., 8)."""
    import gguf

    lead = raw.shape[:-1]
    d = _f16(raw[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(raw[..., 2:4]).astype(np.float32)[..., None]
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(*lead, 8).astype(np.float32)
    mn = mn.reshape(*lead, 8).astype(np.float32)
    return d * sc, -(dmin * mn)


def _nibble_block_order(q: np.ndarray) -> np.ndarray:
    """(..., 32) codes 0..15 -> (..., 16) bytes in our q4 order (j low, j + 16 high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _q4_k(raw: np.ndarray):
    lead = raw.shape[:-1]  # (rows, n_super)
    dd, mm = _k_scales(raw)
    qs = raw[..., 16:144].reshape(*lead, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (qs & 0x0F).reshape(*lead, 8, 32)
    return "q4", _nibble_block_order(q), dd.astype(np.float16), mm.astype(np.float16)


def _q5_k(raw: np.ndarray):
    lead = raw.shape[:-1]
    dd, mm = _k_scales(raw)
    ql = raw[..., 48:176].reshape(*lead, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(*lead, 8, 32)
    qh = raw[..., 16:48].reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = ql | ((qh & 1) << 4)
    return "q8", q.astype(np.int8), dd.astype(np.float16), mm.astype(np.float16)


_BLOCK_CONVERTERS = {
    "Q4_0": (32, _q4_0), "Q4_1": (32, _q4_1), "Q8_0": (32, _q8_0),
    "Q5_0": (32, _q5_0), "Q5_1": (32, _q5_1), "Q4_K": (256, _q4_k), "Q5_K": (256, _q5_k),
}
# Types with no exact repack into our formats: dequantized by the gguf package, then re-quantized
# to q8 per 32 (8 bits for <= 6-bit data: the added error is far below the type's own step).
_REQUANT_Q8 = ("Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = ("F32", "F16", "BF16") + tuple(_BLOCK_CONVERTERS) + _REQUANT_Q8


def tensor_to_qweight(t, keep_float: str | None = None):
    """A 2-D GGUF tensor (ReaderTensor) -> QWeight, without expanding quantized data to floats.

    `keep_float` forces float tensors (F32/F16/BF16) into that float format (e.g. "f32")."""
    import gguf
    import torch

    from ..quant import QWeight, from_float

    tname = t.tensor_type.name
    cols, rows = int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1
    if tname in ("F32", "F16", "BF16"):
        arr = np.asarray(t.data)
        if tname == "BF16":
            w = torch.from_numpy(arr.view(np.int16).astype(np.int16).reshape(rows, cols).copy()).view(torch.bfloat16)
        else:
            w = torch.from_numpy(np.array(arr).reshape(rows, cols))
        fmt = keep_float or {"F32": "f32", "F16": "f16", "BF16": "bf16"}[tname]
        return from_float(w.float(), fmt) if fmt != {"F32": "f32", "F16": "f16", "BF16": "bf16"}[tname] else QWeight(fmt, rows, cols, w.contiguous())
    if tname in _REQUANT_Q8:
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, cols)
        return from_float(torch.from_numpy(w), "q8")
    if tname not in _BLOCK_CONVERTERS:
        raise UnsupportedTensorType(t.name, tname)
    block, conv = _BLOCK_CONVERTERS[tname]
    if cols % block:
        raise ModelFormatError(f"tensor {t.name!r}: {cols} columns is not a multiple of the {tname} block size {block}")
    raw = np.asarray(t.data).reshape(rows, cols // block, -1)
    fmt, qs, d, m = conv(raw)
    nb = cols // 32
    qs = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, -1))
    d = torch.from_numpy(np.ascontiguousarray(d).reshape(rows, nb))
    m = None if m is None else torch.from_numpy(np.ascontiguousarray(m).reshape(rows, nb))
    return QWeight(fmt, rows, cols, qs, d, m)


def tensor_to_float(t):
    """A GGUF tensor of any supported type -> float32 torch tensor in its logical shape (rows first)."""
    import gguf
    import torch

    shape = tuple(int(s) for s in reversed(t.shape))
    if t.tensor_type.name not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(t.name, t.tensor_type.name)
    arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))


class UnsupportedTensorType(ModelFormatError):
    def __init__(self, name: str, tname: str):
        super().__init__(
            f"tensor {name!r} has GGML type {tname}, which sparseinfer does not support "
            f"(supported: {', '.join(SUPPORTED_TYPES)}); re-quantize the model to one of those"
        )
