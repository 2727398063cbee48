"""GGUF reading: metadata as plain Python values, tensors as `QWeight`s (kept quantized).

The `gguf` package parses the container (header, key/values, tensor infos, mmap of the data);
this module validates it with clear errors and maps it onto our config and weight formats.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
# PowerInfer's variant (its converters write a GGUF file, then overwrite the magic): the same
# container, read the same way; `GGUFFile.powerinfer` tells them apart (see io/powerinfer.py)
POWERINFER_MAGIC = b"PWRI"
MAGICS = (GGUF_MAGIC, POWERINFER_MAGIC)


# Why a parser of our own: gguf.GGUFReader builds a numpy view per key and per vocabulary entry,
# which is slow for a 150k-token vocabulary on every load, and it trusts the counts a header
# claims (an array of 2**40 empty strings in a sparse file keeps it reading for minutes).  This
# reads the same container (spec: header, key/values, tensor infos, aligned data) with struct
# in tight loops, checks every count, length and offset against the file before acting on it,
# and maps tensor data lazily.  The gguf package is still used for its type tables and
# dequantizers.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Fewest bytes one value of each type takes: a string its 8-byte length, an array its 4-byte
# element type and 8-byte count.  A count times this must fit in the bytes left.
_MIN_BYTES = {t: struct.calcsize(f) for t, f in _SCALARS.items()} | {_STRING: 8, _ARRAY: 12}

# What a header may claim.  Counts are checked against the bytes left before anything is
# allocated; these caps also bound what a sparse file (whose holes read as zeros, so every
# count "fits") can make the parser build.  Real models stay far below them: a few thousand
# tensors, vocabularies of a few hundred thousand entries.
MAX_DIMS = 4                # GGML tensors have at most 4 dimensions
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 20
MAX_VALUES = 1 << 23        # metadata values in all: strings and array elements
MAX_NESTING = 3             # arrays of arrays
MAX_STRING = 1 << 30
MAX_ELEMENTS = (1 << 63) - 1  # elements of one tensor (ggml counts them in int64)
DEFAULT_ALIGNMENT = 32

_DAMAGED = "the file is damaged or truncated; re-download or re-convert it"

# The value each metadata key that sparseinfer reads must hold (the model's sizes are checked by
# `config.config_from_gguf`): a key of another type is a damaged file, not a crash later.
_IS = {
    "a string": lambda v: isinstance(v, str),
    "an integer": lambda v: type(v) is int,
    "a boolean": lambda v: type(v) in (bool, int),
    "a number": lambda v: type(v) in (int, float),
}
_PLURAL = {"a string": "strings", "an integer": "integers", "a number": "numbers"}
KEY_TYPES = {
    "general.architecture": ("a string", None), "general.alignment": ("an integer", None),
    "tokenizer.ggml.model": ("a string", None), "tokenizer.ggml.pre": ("a string", None),
    "tokenizer.ggml.tokens": ("array", "a string"), "tokenizer.ggml.merges": ("array", "a string"),
    "tokenizer.ggml.token_type": ("array", "an integer"), "tokenizer.ggml.scores": ("array", "a number"),
    "tokenizer.ggml.add_bos_token": ("a boolean", None), "tokenizer.ggml.add_eos_token": ("a boolean", None),
    "tokenizer.ggml.add_space_prefix": ("a boolean", None), "tokenizer.chat_template": ("a string", None),
    **{f"tokenizer.ggml.{t}_token_id": ("an integer", None)
       for t in ("bos", "eos", "unknown", "eot", "eom", "padding", "seperator", "separator", "mask")},
}


def _kind(v) -> str:
    if isinstance(v, list):
        return f"an array of {len(v):,} values"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(v), type(v).__name__)


def release_pages(mm: np.memmap, offset: int = 0, n: int | None = None) -> None:
    """madvise(DONTNEED) the whole pages of bytes [offset, offset + n) of a read-only file
    mapping (all of it by default); a no-op where the OS has no madvise."""
    import mmap

    m = getattr(mm, "_mmap", None)
    if m is None or not hasattr(m, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    end = len(mm) if n is None else min(len(mm), offset + n)
    start = -(-offset // page) * page
    stop = end // page * page if end < len(mm) else len(m)
    if stop > start:
        m.madvise(mmap.MADV_DONTNEED, start, stop - start)


_READ_BELOW = 1 << 16  # bytes: smaller tensors are read, not mapped (see `GGUFTensor.data`)


class GGUFTensor:
    """One tensor's info and a lazy view of its bytes (like gguf's ReaderTensor, minus the cost)."""

    def __init__(self, name: str, shape: list[int], qtype, offset: int, mm: np.memmap, n_bytes: int):
        self.name, self.tensor_type, self.data_offset = name, qtype, offset
        self.shape = np.array(shape, dtype=np.uint64)  # ggml order: shape[0] = columns
        self.n_elements = math.prod(shape)
        self.n_bytes = n_bytes
        self._mm = mm

    def release(self) -> None:
        """Drop this process's mapping of the tensor's whole pages (the bytes stay in the OS
        page cache; a later read maps them again): once converted, the file's copy of a tensor
        no longer counts in the process's memory."""
        release_pages(self._mm, self.data_offset, self.n_bytes)

    def release_rows(self, r0: int, r1: int) -> None:
        """`release` for rows [r0, r1) only (row-chunked conversion frees the file behind it)."""
        row = self.n_bytes // max(1, self.n_elements // max(1, int(self.shape[0])))
        release_pages(self._mm, self.data_offset + r0 * row, (r1 - r0) * row)

    @property
    def data(self) -> np.ndarray:
        """Float types as (rows, cols) floats; block types as (rows, bytes_per_row) uint8.

        A small tensor (norms, biases) is read into a private buffer instead: touching a
        mapping can map a whole large page of the file around it (several MB across a
        model's norms) that a per-tensor `release` cannot give back, as the tensor covers
        no whole page of it."""
        if self.n_bytes <= _READ_BELOW:
            with open(self._mm.filename, "rb") as f:
                f.seek(self.data_offset)
                raw = np.frombuffer(bytearray(f.read(self.n_bytes)), dtype=np.uint8)
            if raw.size != self.n_bytes:
                raise ModelFormatError(f"{self._mm.filename}: tensor {self.name!r} ends past the end of the file; "
                                       "the file changed while it was being read")
        else:
            raw = self._mm[self.data_offset : self.data_offset + self.n_bytes]
        cols = int(self.shape[0])
        rows = self.n_elements // max(cols, 1)
        name = self.tensor_type.name
        if name == "F32":
            return raw.view(np.float32).reshape(rows, cols) if len(self.shape) > 1 else raw.view(np.float32)
        if name == "F16":
            return raw.view(np.float16).reshape(rows, cols) if len(self.shape) > 1 else raw.view(np.float16)
        return raw.reshape(rows, -1)


def _powerinfer_types() -> dict:
    import gguf

    T = gguf.GGMLQuantizationType
    return {16: T.I8, 17: T.I16, 18: T.I32}


# PowerInfer's ggml (older than the gguf package's table) numbers the integer types 16, 17, 18,
# ids that later ggml gave to IQ2_XXS, IQ2_XS, IQ3_XXS; it has no type above 18
_POWERINFER_TYPES = _powerinfer_types()


class GGUFFile:
    """A parsed GGUF file: `metadata` (dict of Python values) and `tensors` (list of GGUFTensor).

    Every claim of the header is checked before it is used (`ModelFormatError` otherwise):
    counts and lengths against the bytes left and the caps above, keys and tensor names unique,
    1 to 4 dimensions each > 0 whose product fits in int64, a known type whose block divides the
    first dimension, offsets aligned, inside the file and not overlapping."""

    def __init__(self, path: Path):
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self._mm)
        self._buf, self._pos, self._end = buf, 0, len(buf)
        self._where, self._values = "the header", 0
        magic = bytes(buf[:4])
        if magic not in MAGICS:
            raise ModelFormatError(f"{path}: not a GGUF file")
        self.powerinfer = magic == POWERINFER_MAGIC  # PowerInfer's variant
        self._pos = 4
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            raise ModelFormatError(f"{path}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self._check_count(n_kv, _MIN_BYTES[_STRING] + 4 + 1, MAX_KEYS, "keys")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            self._where = f"key #{i}"
            key = self._name("key")
            if key in self.metadata:
                self._fail(f"key {key!r} appears twice")
            self._where = f"key {key!r}"
            self.metadata[key] = self._value(self._scalar(4), 0)
        self._where = "the tensor infos"
        self._check_count(n_tensors, _MIN_BYTES[_STRING] + 1 + 4 + 8 + 4 + 8, MAX_TENSORS, "tensors")
        infos, names = [], set()
        for i in range(n_tensors):
            self._where = f"tensor #{i}"
            name = self._name("tensor name")
            if name in names:
                self._fail(f"tensor {name!r} appears twice")
            names.add(name)
            self._where = f"tensor {name!r}"
            infos.append((name, *self._tensor_info(name)))
        self._check_key_types()
        self.alignment = self._alignment()
        start = -(-self._pos // self.alignment) * self.alignment
        self.data_start = start
        self.tensors = [GGUFTensor(name, shape, qtype, start + off, self._mm, n_bytes)
                        for name, shape, qtype, off, n_bytes in infos]
        self._check_layout()
        del self._buf
        release_pages(self._mm, 0, self.data_start)  # the header is parsed: its pages can go

    # -- errors and bounds
    def _fail(self, what: str, advice: str = _DAMAGED):
        raise ModelFormatError(f"{self.path}: {what}; {advice}")

    def _left(self) -> int:
        return self._end - self._pos

    def _check_count(self, n: int, min_bytes: int, cap: int, what: str) -> None:
        """n items of at least `min_bytes` each must fit in the bytes left, and n <= cap."""
        if n > cap:
            self._fail(f"{self._where} claims {n:,} {what}, more than the {cap:,} sparseinfer accepts")
        if n * min_bytes > self._left():
            self._fail(f"{self._where} claims {n:,} {what} (at least {n * min_bytes:,} bytes) "
                       f"but only {self._left():,} bytes are left")

    def _take(self, n: int) -> memoryview:
        if n > self._left():
            self._fail(f"truncated GGUF header: {self._where} needs {n:,} bytes but only {self._left():,} are left")
        b = self._buf[self._pos : self._pos + n]
        self._pos += n
        return b

    def _scalar(self, t: int):
        fmt = _SCALARS[t]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    # -- key/values
    def _string(self) -> str:
        n = self._scalar(10)
        if n > MAX_STRING:
            self._fail(f"{self._where} has a string of {n:,} bytes, more than the {MAX_STRING:,} sparseinfer accepts")
        self._count_values(1)
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _name(self, what: str) -> str:
        s = self._string()
        if not s:
            self._fail(f"{self._where} has an empty {what}")
        return s

    def _count_values(self, n: int) -> None:
        self._values += n
        if self._values > MAX_VALUES:
            self._fail(f"{self._where}: the metadata holds more than {MAX_VALUES:,} values, "
                       "more than sparseinfer accepts")

    def _strings(self, n: int) -> list[str]:
        """n strings in a row (vocabularies, merges: ~150k each): one tight loop, same checks
        as `_string` (much faster than calling it per string)."""
        buf, pos, end = self._buf, self._pos, self._end
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                self._pos = pos
                self._take(8)
            k = unpack(buf, pos)[0]
            pos += 8
            if k > end - pos:
                self._pos = pos
                self._take(k)
            append(str(buf[pos:pos + k], "utf-8", "replace"))
            pos += k
        self._pos = pos
        return out

    def _value(self, t: int, depth: int):
        if t == _STRING:
            return self._string()
        if t == _ARRAY:
            it, n = self._scalar(4), self._scalar(10)
            if it not in _MIN_BYTES:
                self._fail(f"{self._where} is an array of unknown GGUF value type {it}")
            if it == _ARRAY and depth + 1 >= MAX_NESTING:
                self._fail(f"{self._where} nests arrays more than {MAX_NESTING} deep")
            self._check_count(n, _MIN_BYTES[it], MAX_VALUES, "array elements")
            self._count_values(n)
            if it == _STRING:
                return self._strings(n)
            if it in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[it])
                return np.frombuffer(self._take(n * dt.itemsize), dtype=dt).tolist()
            return [self._value(it, depth + 1) for _ in range(n)]
        if t not in _SCALARS:
            self._fail(f"{self._where} has unknown GGUF value type {t}")
        return self._scalar(t)

    # -- tensor infos
    def _tensor_info(self, name: str):
        """(shape, type, offset, bytes) of one tensor info, checked on its own."""
        import gguf

        n_dims = self._scalar(4)
        if not 1 <= n_dims <= MAX_DIMS:
            self._fail(f"tensor {name!r} has {n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
        shape = [self._scalar(10) for _ in range(n_dims)]
        qt, offset = self._scalar(4), self._scalar(10)
        if any(s == 0 for s in shape):
            self._fail(f"tensor {name!r} has a zero dimension (shape {shape})")
        n_elements = math.prod(shape)  # Python ints: no wrap-around
        if n_elements > MAX_ELEMENTS:
            self._fail(f"tensor {name!r} has shape {shape}, whose {n_elements:,} elements overflow a 64-bit count")
        try:
            if self.powerinfer and qt >= 16:  # PowerInfer's ggml numbers types up to 18 only
                qtype = _POWERINFER_TYPES[qt]
            else:
                qtype = gguf.GGMLQuantizationType(qt)
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self._fail(f"tensor {name!r} has unknown GGML type id {qt}",
                       "the file is damaged or needs a newer sparseinfer")
        if shape[0] % block:
            self._fail(f"tensor {name!r} has {shape[0]} columns, not a multiple of the {qtype.name} block of {block}")
        return shape, qtype, offset, n_elements // block * type_bytes

    def _check_key_types(self) -> None:
        for key, (kind, element) in KEY_TYPES.items():
            v = self.metadata.get(key)
            if v is None:
                continue
            if element is None:
                ok, want = _IS[kind](v), kind
            else:
                ok, want = isinstance(v, list) and all(map(_IS[element], v)), f"an array of {_PLURAL[element]}"
            if not ok:
                self._where = f"key {key!r}"
                got = "other values" if isinstance(v, list) and element else _kind(v)
                self._fail(f"key {key!r} holds {got}; it must hold {want}")

    def _alignment(self) -> int:
        a = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(a) is not int or a <= 0 or a & (a - 1):
            self._where = "key 'general.alignment'"
            self._fail(f"general.alignment is {a!r}; it must be a power of two")
        return a

    def _check_layout(self) -> None:
        """Tensor data aligned, inside the file, and no two tensors sharing bytes."""
        size = self._end
        for t in self.tensors:
            off = t.data_offset - self.data_start
            if off % self.alignment:
                self._fail(f"tensor {t.name!r} starts at data offset {off:,}, not a multiple of "
                           f"the alignment {self.alignment}")
            end = t.data_offset + t.n_bytes
            if end > size:
                self._fail(f"truncated GGUF file: tensor {t.name!r} needs bytes up to {end:,} "
                           f"but the file has {size:,}", "re-download it")
        prev = None
        for t in sorted(self.tensors, key=lambda t: t.data_offset):
            if prev is not None and t.data_offset < prev.data_offset + prev.n_bytes:
                self._fail(f"tensor {t.name!r} starts at byte {t.data_offset:,}, inside tensor {prev.name!r} "
                           f"(bytes {prev.data_offset:,} to {prev.data_offset + prev.n_bytes:,}): tensors overlap")
            prev = t


def open_reader(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header, turning malformed input into ModelFormatError."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in MAGICS:
        raise ModelFormatError(
            f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF', or b'PWRI' for PowerInfer's files); "
            "pass a .gguf file or a Hugging Face model folder"
        )
    try:
        return GGUFFile(path)
    except ModelFormatError:
        raise
    except Exception as e:  # a last resort: every known damage has its own message above
        raise ModelFormatError(
            f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e}); re-download or re-convert it"
        ) from e


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value pairs of a GGUF file as Python values (str, int, float, bool, lists)."""
    return dict(reader.metadata)


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
    # a scale beyond 8191 makes the min -8d overflow float16 to -inf, and a NaN scale gives a
    # NaN min: non-finite values like any other in a file (`--check-tensors` reports them), not
    # numpy warnings
    with np.errstate(over="ignore", invalid="ignore"):
        m = (d.astype(np.float32) * -8).astype(np.float16)
    return "q4", raw[..., 2:18], d, m


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


def _q6_k(raw: np.ndarray):
    """Q6_K (ql[128], qh[64], int8 scales[16], f16 d per 256) -> q6 codes in value order and
    per-16 f16 scales d * scale (ggml's order: in each half of 128 values, value l + 32 i
    takes nibble i // 2 of ql[l + 32 (i % 2)] and bits 2i of qh[l], for l < 32)."""
    lead = raw.shape[:-1]
    ql = raw[..., 0:128].reshape(*lead, 2, 1, 2, 32)  # half, nibble, ql byte group, l
    lo = (ql >> np.array([0, 4], np.uint8).reshape(2, 1, 1)) & 0x0F  # (..., 2, 2, 2, 32)
    qh = raw[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = lo.reshape(*lead, 2, 4, 32) | ((qh & 3) << 4)  # (..., half, i, l): value 128 h + 32 i + l
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(raw[..., 208:210]).astype(np.float32)[..., None]
    return "q6", q.reshape(*lead, 256).astype(np.uint8), (d * sc).astype(np.float16), None


_BLOCK_CONVERTERS = {
    "Q4_0": (32, _q4_0), "Q4_1": (32, _q4_1), "Q8_0": (32, _q8_0),
    "Q5_0": (32, _q5_0), "Q5_1": (32, _q5_1), "Q4_K": (256, _q4_k), "Q5_K": (256, _q5_k),
    "Q6_K": (256, _q6_k),
}
BLOCK_TYPES = tuple(_BLOCK_CONVERTERS)  # the block types kept as integer codes (`tensor_to_qweight`)
# Types with no exact repack into our formats: dequantized by the gguf package, then re-quantized
# to q8 per 32 (8 bits for <= 6-bit data: the added error is far below the type's own step).
_REQUANT_Q8 = ("Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = ("F32", "F16", "BF16") + tuple(_BLOCK_CONVERTERS) + _REQUANT_Q8


# Block types the compiled repack handles, with their super-block bytes.
_C_REPACK = {"Q4_K": 144, "Q6_K": 210}


def _repack_c(tname: str, raw: np.ndarray, rows: int, cols: int):
    """Q4_K / Q6_K -> QWeight with the compiled repack (sparseinfer/csrc/repack.c): the same
    bytes and scales as `_q4_k` / `_q6_k` + `pack_q6` (tests compare them), much faster.
    None for other types or when the extension is not built (the numpy converters then do it)."""
    import torch

    from ..quant import QWeight

    try:  # the compiled core itself: io sits below the kernels' Python wrappers
        from .. import _cpu as lib
    except ImportError:
        lib = None
    if lib is None or raw.dtype != np.uint8 or raw.shape[-1] != _C_REPACK.get(tname):
        return None
    src = np.ascontiguousarray(raw)
    nsuper = rows * (cols // 256)
    if tname == "Q4_K":
        qs = torch.empty(rows, cols // 2, dtype=torch.uint8)
        d = torch.empty(rows, cols // 32, dtype=torch.float32)
        m = torch.empty(rows, cols // 32, dtype=torch.float32)
        lib.repack_q4_k(src.ctypes.data, nsuper, qs.data_ptr(), d.data_ptr(), m.data_ptr())
        # f32 -> f16 rounds to nearest even, as numpy's astype in the reference converters
        return QWeight("q4", rows, cols, qs, d.to(torch.float16), m.to(torch.float16))
    qs = torch.empty(rows, cols * 3 // 4, dtype=torch.uint8)
    d = torch.empty(rows, cols // 16, dtype=torch.float32)
    lib.repack_q6_k(src.ctypes.data, nsuper, qs.data_ptr(), d.data_ptr())
    return QWeight("q6", rows, cols, qs, d.to(torch.float16), None)


def tensor_to_qweight(t, keep_float: str | None = None, alloc=None):
    """A 2-D GGUF tensor (ReaderTensor) -> QWeight, without expanding quantized data to floats.

    `keep_float` forces float tensors (F32/F16/BF16) into that float format (e.g. "f32").
    `alloc(part, rows)`: for block types, the QWeight to write the rows into, shaped like the
    converted rows `part` (another layout, e.g. row records), or None for the plain one."""
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
    block = _BLOCK_CONVERTERS[tname][0]
    if cols % block:
        raise ModelFormatError(f"tensor {t.name!r}: {cols} columns is not a multiple of the {tname} block size {block}")
    raw = np.asarray(t.data).reshape(rows, cols // block, -1)
    step = max(1, _CHUNK_BYTES // max(1, raw[0].nbytes))
    if rows <= step and alloc is None:
        return _repack(tname, raw, rows, cols)
    # row chunks into the final buffers: the temporaries stay the size of one chunk, and a
    # chunk's pages of the file leave as soon as it is converted (`release_rows`)
    release = getattr(t, "release_rows", None)
    out = None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = _repack(tname, raw[r0:r1], r1 - r0, cols)
        if out is None:
            out = alloc(part, rows) if alloc is not None else None
            if out is None:
                out = QWeight(part.fmt, rows, cols, *(None if x is None else x.new_empty((rows, *x.shape[1:]))
                                                      for x in (part.qs, part.d, part.m)))
        for name in ("qs", "d", "m"):
            if getattr(part, name) is not None:
                # numpy copies into a strided layout (row records) far faster than torch
                getattr(out, name)[r0:r1].numpy()[...] = getattr(part, name).numpy()
        del part
        if release is not None:
            release(r0, r1)
    return out


_CHUNK_BYTES = 4 << 20  # file bytes converted at a time (`tensor_to_qweight`)


# Kernel levels that load Q4_K as q4k (GGUF Q4_K as the file stores it, 4.5 bits per weight)
# rather than the q4 repack (5 bits) by default: those whose dense projections then read it
# in row tiles (tq4k, `kernels.cpu.ROW_TILE_LEVELS`), which decode and read prompts faster
# than q4's tiles there (`python benchmarks/compare_llamacpp.py --ours-args "--dense
# SPARSEINFER_Q4K=0" --ours-args "--dense SPARSEINFER_Q4K=1"`, alternated; docs/kernels.md).
# Elsewhere the row-major q4k kernels are slower than q4's.
Q4K_LEVELS: tuple[str, ...] = ("avx512", "avx512vnni")


def keep_q4k() -> bool:
    """Whether Q4_K tensors stay as the file stores them (format q4k) rather than being
    repacked to q4: $SPARSEINFER_Q4K=1 or 0 when set, else where the kernel level in use is
    one of `Q4K_LEVELS` and row tiles are not turned off ($SPARSEINFER_TILES=0).  Every level
    computes with either format."""
    env = os.environ.get("SPARSEINFER_Q4K", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if os.environ.get("SPARSEINFER_TILES", "").strip() == "0":
        return False
    try:  # the compiled core itself: io sits below the kernels' Python wrappers
        from .. import _cpu as lib
    except ImportError:
        return False
    return lib.simd_level() in Q4K_LEVELS


def _repack(tname: str, raw: np.ndarray, rows: int, cols: int):
    from ..quant import Q4K_BLOCK, QWeight

    if tname == "Q4_K" and cols % Q4K_BLOCK == 0 and keep_q4k():
        import torch

        # the file's bytes as they are (a copy: the file's pages leave after the conversion)
        return QWeight("q4k", rows, cols, torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(rows, -1)))
    fast = _repack_c(tname, raw, rows, cols)
    return fast if fast is not None else _repack_numpy(tname, raw, rows, cols)


def q4k_to_q4(w):
    """A q4k weight (Q4_K as the file stores it) as the q4 repack the loader makes of the same
    bytes otherwise (sub-block scales and mins folded into f16 per 32)."""
    from ..quant import Q4K_BYTES

    raw = w.qs.numpy().reshape(w.rows, -1, Q4K_BYTES)
    fast = _repack_c("Q4_K", raw, w.rows, w.cols)
    return fast if fast is not None else _repack_numpy("Q4_K", raw, w.rows, w.cols)


def _repack_numpy(tname: str, raw: np.ndarray, rows: int, cols: int):
    """Raw (rows, blocks, block bytes) of a block type -> QWeight with the numpy converters."""
    import torch

    from ..quant import QWeight

    fmt, qs, d, m = _BLOCK_CONVERTERS[tname][1](raw)
    nb = cols // 32
    if fmt == "q6":  # codes in value order -> the q6 byte layout; one scale per 16 values
        from ..quant import pack_q6

        qs = pack_q6(torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, cols)))
        nb = cols // 16
    else:
        qs = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, -1))
    d = torch.from_numpy(np.ascontiguousarray(d).reshape(rows, nb))
    m = None if m is None else torch.from_numpy(np.ascontiguousarray(m).reshape(rows, nb))
    return QWeight(fmt, rows, cols, qs, d, m)


def logical_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape rows first (as torch), without ggml's trailing 1s: ggml pads every
    shape to 4 dims with 1s, so [576] and [576, 1] are the same tensor."""
    dims = [int(s) for s in t.shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(reversed(dims))


def tensor_to_float(t):
    """A GGUF tensor of any supported type -> float32 torch tensor in its logical shape (rows first)."""
    import gguf
    import torch

    shape = logical_shape(t)
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
