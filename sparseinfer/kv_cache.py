"""Per-layer key/value cache, passed explicitly to each attention call (never global state)."""
from __future__ import annotations

import torch

from .errors import ContextOverflowError

_STEP = 256  # grow the buffers in chunks so a long context costs memory only once it is used


class LayerKV:
    """Keys and values of one layer: (batch, n_kv_heads, length, d_head), grown in steps."""

    def __init__(self, max_len: int, dtype=torch.float32, device="cpu"):
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        # the fused decode step (csrc/decode.c) writes float32 CPU buffers itself
        self.on_cpu_f32 = dtype == torch.float32 and torch.device(device).type == "cpu"

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
        nk = torch.zeros(B, H, new_cap, D, dtype=self.dtype, device=self.device)
        nv = torch.zeros_like(nk)
        if self.k is not None:
            nk[:, :, : self.length] = self.k[:, :, : self.length]
            nv[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = nk, nv

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, T, D) keys/values; return all keys/values so far."""
        T = k.shape[2]
        self._ensure(k, self.length + T)
        self.k[:, :, self.length : self.length + T] = k
        self.v[:, :, self.length : self.length + T] = v
        self.length += T
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def slot(self, n_kv_heads: int, d_head: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(k, v, pos): the whole (1, n_kv_heads, capacity, d_head) buffers with room for one more
        token at row `pos` (= length), for a kernel that writes that row itself; `advance()`
        afterwards counts it."""
        if self.k is None or self.length >= self.k.shape[2]:
            self._ensure(torch.empty(1, n_kv_heads, 0, d_head, dtype=self.dtype), self.length + 1)
        return self.k, self.v, self.length

    def advance(self, n: int = 1) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class KVCache:
    """The whole model's cache: one `LayerKV` per layer, plus the shared position counter."""

    def __init__(self, n_layers: int, max_len: int, dtype=torch.float32, device="cpu"):
        self.layers = [LayerKV(max_len, dtype, device) for _ in range(n_layers)]
        self.max_len = max_len

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

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
