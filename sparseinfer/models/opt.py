"""OPT family (the ReLU models PowerInfer's paper measured): learned positions, biases, LayerNorm.

The MLP is also given the residual stream it reads through its norm (``residual``): a
PowerInfer file's predictors read it."""
from __future__ import annotations

import torch
from torch import nn

from ..config import OPT_POSITION_OFFSET, ModelConfig
from ..io.weights import WeightSource
from .base import CausalLM, Embedding, Has, TensorShapes, linear_shapes, norm_shapes
from .layers import MLP, Attention, LayerNorm, Linear, Module


class Positions(nn.Module):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table.float()

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions + OPT_POSITION_OFFSET]


class Block(Module):
    def __init__(self, attn: Attention, mlp: MLP, ln_attn: LayerNorm, ln_ffn: LayerNorm, pre_norm: bool):
        super().__init__()
        self.attn, self.mlp, self.ln_attn, self.ln_ffn, self.pre_norm = attn, mlp, ln_attn, ln_ffn, pre_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        if self.pre_norm:
            h = x + self.attn(self.ln_attn(x), positions, kv)
            return h + self.mlp(self.ln_ffn(h), residual=h)
        h = self.ln_attn(x + self.attn(x, positions, kv))
        return self.ln_ffn(h + self.mlp(h, residual=h))



EMBED = "model.decoder.embed_tokens.weight"  # the token embedding (also the output head when the file has no lm_head)

def _linear(src: WeightSource, prefix: str) -> Linear:
    return Linear(src.qweight(f"{prefix}.weight"), src.maybe_tensor(f"{prefix}.bias"))


def _ln(src: WeightSource, prefix: str, eps: float) -> LayerNorm:
    return LayerNorm(src.tensor(f"{prefix}.weight"), src.maybe_tensor(f"{prefix}.bias"), eps)


def build(src: WeightSource) -> CausalLM:
    c = src.config
    eps = c.layer_norm_eps
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.decoder.layers.{i}"
        a = f"{p}.self_attn"
        attn = Attention(_linear(src, f"{a}.q_proj"), _linear(src, f"{a}.k_proj"), _linear(src, f"{a}.v_proj"),
                         _linear(src, f"{a}.out_proj"), c.num_attention_heads, c.n_kv_heads, c.d_head, None)
        mlp = MLP(None, _linear(src, f"{p}.fc1"), _linear(src, f"{p}.fc2"), c.hidden_act)
        layers.append(Block(attn, mlp, _ln(src, f"{p}.self_attn_layer_norm", eps), _ln(src, f"{p}.final_layer_norm", eps),
                            c.do_layer_norm_before))
    embed = Embedding(src.qweight(EMBED))
    head = Linear(src.qweight("lm_head.weight")) if src.has("lm_head.weight") else Linear(embed.weight)
    final = _ln(src, "model.decoder.final_layer_norm", eps) if c.do_layer_norm_before else nn.Identity()
    pos = Positions(src.tensor("model.decoder.embed_positions.weight"))
    return CausalLM(c, embed, layers, final, head, pos_embed=pos)


def tensor_shapes(c: ModelConfig, has: Has) -> TensorShapes:
    """Every tensor `build` reads, with the shape the config implies (see `registry.check_shapes`)."""
    n, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    nq, nkv = c.num_attention_heads * c.d_head, c.n_kv_heads * c.d_head
    yield EMBED, (v, n), True
    yield "model.decoder.embed_positions.weight", (c.max_position_embeddings + OPT_POSITION_OFFSET, n), True
    if c.do_layer_norm_before:
        yield from norm_shapes("model.decoder.final_layer_norm", n)
    yield "lm_head.weight", (v, n), False
    for i in range(c.num_hidden_layers):
        p = f"model.decoder.layers.{i}"
        for name, rows, cols in (("q_proj", nq, n), ("k_proj", nkv, n), ("v_proj", nkv, n), ("out_proj", n, nq)):
            yield from linear_shapes(f"{p}.self_attn.{name}", rows, cols)
        yield from linear_shapes(f"{p}.fc1", f, n)
        yield from linear_shapes(f"{p}.fc2", n, f)
        yield from norm_shapes(f"{p}.self_attn_layer_norm", n)
        yield from norm_shapes(f"{p}.final_layer_norm", n)
