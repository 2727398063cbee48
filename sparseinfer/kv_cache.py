"""Per-layer key/value cache, passed explicitly to each attention call (never global state).

Cache types (the element type of the stored keys and values; `csrc/common.h` KV_* reads the
same layouts):

- "f32": float32, the exact reference (4 bytes per value);
- "f16": IEEE half, rounded to nearest even (2 bytes per value; the default);
- "q8_0": per 32 values of one head's row, one f16 scale d and 32 int8 q (GGUF's Q8_0 block,
  34 bytes per 32 values); value = d * q.  A row is quantized once, when its token is written.

The torch layers (prefill, accelerators) get float32 copies of what is stored
(`update_and_fetch`); the C decode step reads and writes the stored form itself.
"""
from __future__ import annotations

import torch

from .errors import ContextOverflowError, SparseInferError

_STEP = 256  # grow the buffers in chunks so a long context costs memory only once it is used

CACHE_TYPES = ("f32", "f16", "q8_0")
DEFAULT_CACHE_TYPE = "f16"
KV_CODES = {"f32": 0, "f16": 1, "q8_0": 2}  # csrc/common.h KV_F32, KV_F16, KV_Q8_0
_STORAGE = {"f32": torch.float32, "f16": torch.float16, "q8_0": torch.uint8}
Q8_0_VALUES, Q8_0_BYTES = 32, 34  # values and bytes of one Q8_0 block


def check_cache_type(cache_type: str) -> str:
    """`cache_type` if it is one of CACHE_TYPES, else a clear error."""
    if cache_type not in CACHE_TYPES:
        raise SparseInferError(f"unknown KV cache type {cache_type!r}; use one of {', '.join(CACHE_TYPES)}")
    return cache_type


def storage_dtype(cache_type: str) -> torch.dtype:
    """The torch dtype a cache of `cache_type` stores (q8_0: bytes)."""
    return _STORAGE[check_cache_type(cache_type)]


def row_bytes(cache_type: str, d_head: int) -> int:
    """Bytes of one cached position of one KV head (`d_head` values)."""
    if cache_type == "q8_0":
        return Q8_0_BYTES * -(-d_head // Q8_0_VALUES)
    return d_head * _STORAGE[check_cache_type(cache_type)].itemsize


# --------------------------------------------------------------- q8_0: the slow, obvious reference
def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float -> (..., ceil(D/32) * 34) uint8 rows of Q8_0 blocks: per 32 values (the
    last block padded with zeros) amax = max |x|, d = amax / 127, q = round-half-even(x * (1/d))
    in float32; each block is d as f16 (2 bytes) followed by the 32 int8 q."""
    x = x.float()
    D = x.shape[-1]
    nb = -(-D // Q8_0_VALUES)
    if nb * Q8_0_VALUES != D:
        x = torch.nn.functional.pad(x, (0, nb * Q8_0_VALUES - D))
    blocks = x.reshape(*x.shape[:-1], nb, Q8_0_VALUES)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return out.reshape(*x.shape[:-1], nb * Q8_0_BYTES)


def dequantize_q8_0(rows: torch.Tensor, d_head: int) -> torch.Tensor:
    """(..., ceil(D/32) * 34) uint8 Q8_0 rows -> (..., D) float32: value = f32(d) * q."""
    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(*rows.shape[:-1], -1)[..., :d_head]


def encode(cache_type: str, x: torch.Tensor) -> torch.Tensor:
    """(..., D) float values in the stored form of `cache_type`."""
    if cache_type == "q8_0":
        return quantize_q8_0(x)
    return x.to(_STORAGE[cache_type])


def decode(cache_type: str, stored: torch.Tensor, d_head: int) -> torch.Tensor:
    """The stored form back to float32 (..., d_head); f32 storage is returned as it is (a view)."""
    if cache_type == "q8_0":
        return dequantize_q8_0(stored, d_head)
    return stored.float()


class LayerKV:
    """Keys and values of one layer, (batch, n_kv_heads, length, row) in the stored form of
    `cache_type` (row: d_head values, or Q8_0 bytes), grown in steps."""

    def __init__(self, max_len: int, cache_type: str = DEFAULT_CACHE_TYPE, device="cpu"):
        self.max_len, self.cache_type, self.device = max_len, check_cache_type(cache_type), device
        self.kv_code = KV_CODES[cache_type]
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.d_head = 0
        self.length = 0
        # the fused decode step (csrc/decode.c) reads and writes CPU buffers of every type itself
        self.on_cpu = torch.device(device).type == "cpu"

    def _alloc(self, B: int, H: int, cap: int, D: int) -> torch.Tensor:
        row = -(-D // Q8_0_VALUES) * Q8_0_BYTES if self.cache_type == "q8_0" else D
        return torch.zeros(B, H, cap, row, dtype=_STORAGE[self.cache_type], device=self.device)

    def _ensure(self, k: torch.Tensor, need: int) -> None:
        if need > self.max_len:
            raise ContextOverflowError(
                f"context overflow: {need} tokens do not fit in the context of {self.max_len}; "
                "raise -c/--ctx-size or shorten the prompt"
            )
        cap = 0 if self.k is None else self.k.shape[2]
        if need <= cap:
            return
        new_cap = min(self.max_len, max(need, cap + _STEP) + (-max(need, cap + _STEP)) % _STEP)
        B, H, _, D = k.shape
        self.d_head = D
        nk, nv = self._alloc(B, H, new_cap, D), self._alloc(B, H, new_cap, D)
        if self.k is not None:
            nk[:, :, : self.length] = self.k[:, :, : self.length]
            nv[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = nk, nv

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, T, D) keys/values (stored as `cache_type`); return all keys/values so
        far as float32 (B, H, length, D): views for f32, dequantized copies otherwise."""
        T = k.shape[2]
        self._ensure(k, self.length + T)
        self.k[:, :, self.length : self.length + T] = encode(self.cache_type, k)
        self.v[:, :, self.length : self.length + T] = encode(self.cache_type, v)
        self.length += T
        return self.fetch()

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values as float32 (B, H, length, d_head)."""
        n = self.length
        return (decode(self.cache_type, self.k[:, :, :n], self.d_head),
                decode(self.cache_type, self.v[:, :, :n], self.d_head))

    def slot(self, n_kv_heads: int, d_head: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(k, v, pos): the whole (1, n_kv_heads, capacity, row) buffers with room for one more
        token at row `pos` (= length), for a kernel that writes that row itself (in the stored
        form); `advance()` afterwards counts it."""
        if self.k is None or self.length >= self.k.shape[2]:
            self._ensure(torch.empty(1, n_kv_heads, 0, d_head), self.length + 1)
        return self.k, self.v, self.length

    def advance(self, n: int = 1) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class KVCache:
    """The whole model's cache: one `LayerKV` per layer, plus the shared position counter and,
    for a cache of one sequence, the ids of the tokens it holds (`tokens`, in order)."""

    def __init__(self, n_layers: int, max_len: int, cache_type: str = DEFAULT_CACHE_TYPE, device="cpu"):
        self.layers = [LayerKV(max_len, cache_type, device) for _ in range(n_layers)]
        self.max_len, self.cache_type = max_len, cache_type
        self.tokens: list[int] = []

    def record(self, ids) -> None:
        """Note the ids of tokens about to be cached: a (1, T) tensor, one sequence's, is kept
        in `tokens`; a batch of several sequences in one cache is not (their ids would mix)."""
        if ids.shape[0] == 1:
            self.tokens.extend(ids[0].tolist())

    def __getitem__(self, i: int) -> LayerKV:
        return self.layers[i]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.max_len:
            raise ContextOverflowError(
                f"context overflow: {self.length} cached + {n_new} new tokens exceed the context size "
                f"{self.max_len}; raise -c/--ctx-size or shorten the prompt"
            )

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)
        del self.tokens[max(0, length):]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
