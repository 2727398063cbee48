"""GGUF files as editable lists, written byte by byte: for tests that need files no converter
writes (bad counts, shapes, offsets, types).  `read_spec` turns a good file into a `Spec`
(via the gguf package's reader, the independent reference), tests change it, `write_spec`
writes it back exactly as told, checks left to the reader under test."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

V = gguf.GGUFValueType
_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
        V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


@dataclass
class KV:
    key: str
    vtype: int
    value: object
    sub: int | None = None  # element type of an array


@dataclass
class Tensor:
    name: str
    dims: list[int]          # ggml order: dims[0] = columns
    qtype: int
    data: bytes
    offset: int | None = None  # None: next aligned offset after the previous tensor


@dataclass
class Spec:
    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32
    n_kv: int | None = None       # header counts; None: the lists' lengths
    n_tensors: int | None = None

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def set(self, key: str, value, vtype: int | None = None) -> None:
        for k in self.kvs:
            if k.key == key:
                k.value, k.vtype = value, k.vtype if vtype is None else vtype
                return
        self.kvs.append(KV(key, V.UINT32 if vtype is None else vtype, value))

    def set_f32(self, name: str, a: np.ndarray) -> None:
        """Replace tensor `name` by float32 values `a` (logical shape, rows first)."""
        t = self.tensor(name)
        t.dims, t.qtype, t.data = list(reversed(a.shape)), int(gguf.GGMLQuantizationType.F32), a.astype(np.float32).tobytes()


def read_spec(path: Path) -> Spec:
    r = gguf.GGUFReader(path)
    spec = Spec()
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[1] if vt == V.ARRAY else None
        spec.kvs.append(KV(f.name, int(vt), f.contents(), None if sub is None else int(sub)))
        if f.name == "general.alignment":
            spec.alignment = int(f.contents())
    for t in r.tensors:
        spec.tensors.append(Tensor(t.name, [int(s) for s in t.shape], int(t.tensor_type), bytes(np.asarray(t.data).tobytes())))
    return spec


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, v, sub: int | None = None) -> bytes:
    if vtype == V.STRING:
        return _string(v)
    if vtype == V.ARRAY:
        return struct.pack("<IQ", sub, len(v)) + b"".join(_value(sub, x) for x in v)
    return struct.pack(_FMT[V(vtype)], v)


def spec_bytes(spec: Spec) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", spec.version,
                                len(spec.tensors) if spec.n_tensors is None else spec.n_tensors,
                                len(spec.kvs) if spec.n_kv is None else spec.n_kv)]
    for k in spec.kvs:
        out += [_string(k.key), struct.pack("<I", k.vtype), _value(k.vtype, k.value, k.sub)]
    a = spec.alignment if spec.alignment > 0 else 32
    offsets, pos = [], 0
    for t in spec.tensors:
        off = pos if t.offset is None else t.offset
        offsets.append(off)
        if off + len(t.data) <= 1 << 26:  # data of tensors placed far beyond it is not written
            pos = max(pos, -(-(off + len(t.data)) // a) * a)
    for t, off in zip(spec.tensors, offsets):
        out += [_string(t.name), struct.pack("<I", len(t.dims)), struct.pack(f"<{len(t.dims)}Q", *t.dims),
                struct.pack("<IQ", t.qtype, off)]
    head = b"".join(out)
    data_start = -(-len(head) // a) * a
    data = bytearray(pos)
    for t, off in zip(spec.tensors, offsets):
        if off + len(t.data) <= len(data):
            data[off:off + len(t.data)] = t.data
    return head + bytes(data_start - len(head)) + bytes(data)


def write_spec(spec: Spec, path: Path) -> Path:
    path.write_bytes(spec_bytes(spec))
    return path


def add_tokenizer(spec: Spec) -> Spec:
    """A byte-level BPE vocabulary of 256 tokens: GPT-2's byte alphabet with the tokens of
    bytes 0 and 1 replaced by two merges ("Ġt", "he"), bytes 2 and 3 as BOS and EOS; enough for
    `Tokenizer.from_gguf_metadata` and a short prompt."""
    from sparseinfer.io.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    tokens[0], tokens[1] = b2u[ord(" ")] + "t", "he"
    spec.kvs += [KV("tokenizer.ggml.model", V.STRING, "gpt2"),
                 KV("tokenizer.ggml.tokens", V.ARRAY, tokens, V.STRING),
                 KV("tokenizer.ggml.token_type", V.ARRAY, [1] * len(tokens), V.INT32),
                 KV("tokenizer.ggml.merges", V.ARRAY, [f"{b2u[ord(' ')]} t", "h e"], V.STRING),
                 KV("tokenizer.ggml.bos_token_id", V.UINT32, 2),
                 KV("tokenizer.ggml.eos_token_id", V.UINT32, 3)]
    return spec
