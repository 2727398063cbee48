"""The causal LM shell shared by every family: embeddings, a stack of blocks, final norm, head."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels import decode_plan
from ..kv_cache import DEFAULT_CACHE_TYPE, KVCache
from ..quant import QWeight
from .layers import Linear, Module


# What a family's `tensor_shapes(config, has)` yields: (tensor name, shape the config implies,
# required).  `has(name)` says whether the file holds a tensor, for families whose layout varies.
TensorShapes = Iterator[tuple[str, tuple[int, ...], bool]]
Has = Callable[[str], bool]


def linear_shapes(prefix: str, rows: int, cols: int, bias_required: bool = False) -> TensorShapes:
    """A linear layer's weight (rows, cols) and its optional bias (rows,)."""
    yield f"{prefix}.weight", (rows, cols), True
    yield f"{prefix}.bias", (rows,), bias_required


def norm_shapes(prefix: str, n: int) -> TensorShapes:
    """A norm's weight (n,) and, for LayerNorm, its optional bias (n,)."""
    yield f"{prefix}.weight", (n,), True
    yield f"{prefix}.bias", (n,), False


class Embedding(nn.Module):
    """Token embedding kept in its stored format; only the looked-up rows are dequantized."""

    def __init__(self, weight: QWeight):
        super().__init__()
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1).to(self.weight.qs.device)
        rows = self.weight.select_rows(flat).dequantize()
        return rows.view(*tokens.shape, -1)


class CausalLM(Module):
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

    # the KV cache type of `new_cache` (`kv_cache.CACHE_TYPES`); `sparseinfer.load` sets it
    cache_type = DEFAULT_CACHE_TYPE

    def new_cache(self, max_len: int | None = None, cache_type: str | None = None) -> KVCache:
        """A cache for `max_len` tokens (default: the model's maximum), of `cache_type` (default:
        the model's `cache_type`)."""
        n = max_len or self.config.max_position_embeddings
        return KVCache(len(self.layers), n, cache_type or self.cache_type, device=self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with `last_only` (prefill)."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        T = tokens.shape[1]
        cache.check_room(T)
        cache.record(tokens)
        positions = torch.arange(cache.length, cache.length + T, device=self.device)
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)[None]
        if tokens.numel() == 1:
            x = self.decode_layers(x, positions, cache)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, positions, cache[i])
        if last_only:
            x = x[:, -1:]
        return self._logits(self.norm(x), cache)

    def _logits(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The head's logits of x; a head that reads the sequence's tokens (`takes_context`,
        the head preview of `sparse.head`) also gets the ids the cache holds."""
        if getattr(self.head, "takes_context", False):
            return self.head(x, cache.tokens)
        return self.head(x)

    def decode_batch(self, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decode step of B sequences at once: token b appended to `caches[b]` (each its own
        length) -> next-token logits (B, vocab).  Every product runs once over the B rows (the
        weights are read once per step); rotary and attention go row by row (`decode_layers`).  A row's logits do
        not depend on the other rows where `kernels.cpu.matmul_equals_gemv()` (docs/kernels.md,
        Determinism); they equal the one-token path (`forward`) within the accuracy contract."""
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"decode_batch needs one cache per token (got {len(tokens)} tokens, {len(caches)} caches)")
        for c in caches:
            c.check_room(1)
        B = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(B, 1)
        positions = torch.tensor([c.length for c in caches], dtype=torch.long).view(B, 1)
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions.to(self.device))
        if len({id(c) for c in caches}) != B:
            raise ValueError("decode_batch needs a different cache for every row")
        for c, t in zip(caches, tokens):
            c.tokens.append(int(t))
        x = self.decode_layers(x, positions, caches)
        x = self.norm(x)
        return (self._logits(x, caches[0]) if B == 1 else self.head(x))[:, 0]

    def decode_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | list[KVCache]) -> torch.Tensor:
        """One token of one sequence, x (1, 1, n), through every layer; or one token of each of
        B sequences, x (B, 1, n) at positions (B, 1), `cache` their B caches (`decode_batch`).
        A layer whose block has C decode steps (`Block.steps`: its plan, built once) runs them
        on one float32 buffer in place (B rows: each product over all the rows at once), any
        other runs its torch modules (the reference; accelerators, other norms)."""
        rows = isinstance(cache, list)
        caches = cache if rows else [cache]
        B = len(caches)
        buf = None
        for i, layer in enumerate(self.layers):
            kvs = [c.layers[i] for c in caches]
            on_cpu = kvs[0].on_cpu if not rows else (
                all(kv.on_cpu for kv in kvs) and len({kv.kv_code for kv in kvs}) == 1)
            steps = layer.steps() if hasattr(layer, "steps") and on_cpu else None
            if steps is None:
                if buf is not None:
                    x, buf = buf.view(B, 1, -1), None
                dev = self.layer_device(i)
                x = layer(x.to(dev), positions.to(dev), kvs if rows else kvs[0])
                continue
            if buf is None:
                buf = x.reshape(B, -1).to("cpu", torch.float32).clone()
            attn, ffn = steps.attn, steps.ffn
            if buf.shape[1] != attn.n or (ffn is not None and ffn.n != attn.n):
                raise ValueError(f"layer {i} is {attn.n} wide, its input {buf.shape[1]}: the model file is inconsistent")
            if rows:
                layer.attn.run_step_rows(attn, buf, positions, kvs)
            else:
                layer.attn.run_step(attn, buf.view(-1), positions, kvs[0])
            if ffn is None:  # an FFN without a C step (e.g. split across devices): its module
                buf += layer.mlp(layer.ffn_norm(buf.view(B, 1, -1))).view(B, -1).to(buf.device)
            elif rows:
                ffn.run_rows(buf, buf)
            else:
                ffn.run(buf.view(-1), buf.view(-1))
        return x if buf is None else buf.view(B, 1, -1)

    def layer_device(self, i: int) -> torch.device:
        """Where layer i's residual stream lives (an accelerator-placed model overrides this)."""
        return self.device

    def build_steps(self) -> None:
        """Build (and have C check) every block's decode steps now; `decode_layers` otherwise
        builds each on the first token (and again after a layer changes)."""
        for layer in self.layers:
            if hasattr(layer, "steps"):
                layer.steps()

    def drop_steps(self) -> None:
        """Forget every module's C decode step; the next decode builds them from the current
        weights (after moving or replacing modules)."""
        for m in self.modules():
            decode_plan.drop_step(m)
