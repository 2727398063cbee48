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
