"""Falcon family (7B multi-query; 40B/180B "new decoder architecture" with grouped KV, two norms).

Attention and MLP read the same residual stream in parallel; fused qkv is split at load.  The
MLP is also given that stream (``residual``): a PowerInfer file's predictors read it."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import UnsupportedError
from ..io.weights import WeightSource
from ..quant import QWeight
from .base import CausalLM, Embedding, Has, TensorShapes, linear_shapes, norm_shapes
from .layers import MLP, Attention, LayerNorm, Linear, Module, Rotary


class Block(Module):
    def __init__(self, attn: Attention, mlp: MLP, ln_attn: LayerNorm, ln_mlp: LayerNorm | None):
        super().__init__()
        self.attn, self.mlp, self.ln_attn, self.ln_mlp = attn, mlp, ln_attn, ln_mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        a = self.ln_attn(x)
        m = a if self.ln_mlp is None else self.ln_mlp(x)
        return x + self.attn(a, positions, kv) + self.mlp(m, residual=x)



EMBED = "transformer.word_embeddings.weight"  # the token embedding (also the output head when the file has no lm_head)

def _split_qkv(w: QWeight, bias: torch.Tensor | None, n_heads: int, n_kv: int, d: int, grouped: bool):
    """Fused qkv rows -> (q, k, v) row indices. HF new-arch groups [q.. q k v] per KV head;
    GGUF (llama.cpp's converter) and the old multi-query layout store [all q, all k, all v]."""
    if grouped:
        g = n_heads // n_kv
        idx = torch.arange(w.rows).view(n_kv, g + 2, d)
        q, k, v = idx[:, :g].reshape(-1), idx[:, g].reshape(-1), idx[:, g + 1].reshape(-1)
    else:
        q = torch.arange(0, n_heads * d)
        k = torch.arange(n_heads * d, (n_heads + n_kv) * d)
        v = torch.arange((n_heads + n_kv) * d, (n_heads + 2 * n_kv) * d)
    return [Linear(w.select_rows(i), None if bias is None else bias[i]) for i in (q, k, v)]


def _ln(src: WeightSource, prefix: str, eps: float) -> LayerNorm:
    return LayerNorm(src.tensor(f"{prefix}.weight"), src.maybe_tensor(f"{prefix}.bias"), eps)


def build(src: WeightSource) -> CausalLM:
    c = src.config
    if not c.parallel_attn:
        raise UnsupportedError("Falcon variants without parallel attention are not supported")
    rotary = Rotary(c.n_rot, c.rope_theta, c.max_position_embeddings, c.rope_scaling)
    two_norms = src.has("transformer.h.0.ln_attn.weight")  # 40B/180B: ln_attn and ln_mlp
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"transformer.h.{i}"
        qkv = f"{p}.self_attention.query_key_value"
        q, k, v = _split_qkv(src.qweight(f"{qkv}.weight"), src.maybe_tensor(f"{qkv}.bias"),
                             c.num_attention_heads, c.n_kv_heads, c.d_head, src.falcon_qkv_grouped)
        dense = f"{p}.self_attention.dense"
        o = Linear(src.qweight(f"{dense}.weight"), src.maybe_tensor(f"{dense}.bias"))
        attn = Attention(q, k, v, o, c.num_attention_heads, c.n_kv_heads, c.d_head, rotary)
        up, down = f"{p}.mlp.dense_h_to_4h", f"{p}.mlp.dense_4h_to_h"
        mlp = MLP(None, Linear(src.qweight(f"{up}.weight"), src.maybe_tensor(f"{up}.bias")),
                  Linear(src.qweight(f"{down}.weight"), src.maybe_tensor(f"{down}.bias")), c.hidden_act)
        ln_attn = _ln(src, f"{p}.ln_attn" if two_norms else f"{p}.input_layernorm", c.layer_norm_eps)
        ln_mlp = _ln(src, f"{p}.ln_mlp", c.layer_norm_eps) if two_norms else None
        layers.append(Block(attn, mlp, ln_attn, ln_mlp))
    embed = Embedding(src.qweight(EMBED))
    head = Linear(src.qweight("lm_head.weight")) if src.has("lm_head.weight") else Linear(embed.weight)
    return CausalLM(c, embed, layers, _ln(src, "transformer.ln_f", c.layer_norm_eps), head)


def tensor_shapes(c: ModelConfig, has: Has) -> TensorShapes:
    """Every tensor `build` reads, with the shape the config implies (see `registry.check_shapes`)."""
    n, f, v, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.d_head
    yield EMBED, (v, n), True
    yield from norm_shapes("transformer.ln_f", n)
    yield "lm_head.weight", (v, n), False
    two_norms = has("transformer.h.0.ln_attn.weight")
    for i in range(c.num_hidden_layers):
        p = f"transformer.h.{i}"
        yield from linear_shapes(f"{p}.self_attention.query_key_value", (c.num_attention_heads + 2 * c.n_kv_heads) * d, n)
        yield from linear_shapes(f"{p}.self_attention.dense", n, c.num_attention_heads * d)
        yield from linear_shapes(f"{p}.mlp.dense_h_to_4h", f, n)
        yield from linear_shapes(f"{p}.mlp.dense_4h_to_h", n, f)
        yield from norm_shapes(f"{p}.ln_attn" if two_norms else f"{p}.input_layernorm", n)
        if two_norms:
            yield from norm_shapes(f"{p}.ln_mlp", n)
