"""The causal LM shell shared by every family: embeddings, a stack of blocks, final norm, head."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kv_cache import KVCache
from ..quant import QWeight
from .layers import Linear


class Embedding(nn.Module):
    """Token embedding kept in its stored format; only the looked-up rows are dequantized."""

    def __init__(self, weight: QWeight):
        super().__init__()
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1).to(self.weight.qs.device)
        rows = self.weight.select_rows(flat).dequantize()
        return rows.view(*tokens.shape, -1)


class CausalLM(nn.Module):
    """tokens -> logits. Family files supply the blocks; every block takes (x, positions, layer_kv)."""

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[nn.Module], norm: nn.Module,
                 head: Linear, pos_embed: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.embed, self.norm, self.head, self.pos_embed = embed, norm, head, pos_embed
        self.layers = nn.ModuleList(layers)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.qs.device

    def new_cache(self, max_len: int | None = None) -> KVCache:
        n = max_len or self.config.max_position_embeddings
        return KVCache(len(self.layers), n, device=self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with `last_only` (prefill)."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        T = tokens.shape[1]
        cache.check_room(T)
        positions = torch.arange(cache.length, cache.length + T, device=self.device)
        if tokens.numel() == 1 and self.pos_embed is None:
            y = self._decode_one(tokens, positions, cache)
            if y is not None:
                return y
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)[None]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cache[i])
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm(x))

    def _decode_one(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """One token of one sequence through blocks that all have C decode steps (`decode_args`,
        llama.py): one C call per half-block on a single hidden-state buffer, no Python layer
        in between (per layer that saves ~0.15 ms of interpreter work, whose data the weight
        streaming keeps evicting from the caches).  None (nothing done) where a block or its
        cache does not qualify; then `forward` runs the layers."""
        steps = []
        for layer, kv in zip(self.layers, cache.layers):
            f = getattr(layer, "decode_args", None)
            s = f() if f is not None else None
            if s is None or not kv.on_cpu_f32 or (kv.k is not None and kv.k.shape[0] != 1):
                return None
            steps.append(s)
        x = self.embed(tokens).reshape(-1).float().contiguous()
        if x.device.type != "cpu" or any(a[0][0] != x.numel() for a, _ in steps):
            return None
        for layer, kv, (a, m) in zip(self.layers, cache.layers, steps):
            layer.attn.decode_into(x, x, a, positions, kv)
            if m is not None:
                layer.mlp.decode_into(x, x, m)
            else:
                x += layer.mlp(layer.ffn_norm(x.view(1, 1, -1))).view(-1)
        return self.head(self.norm(x.view(1, 1, -1)))

