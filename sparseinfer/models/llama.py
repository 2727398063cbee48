"""Llama family: Llama-2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias), ReLU-Llama/ProSparse, Bamboo (dReLU)."""
from __future__ import annotations

import torch
from torch import nn

from ..io.weights import WeightSource
from .base import CausalLM, Embedding
from .layers import MLP, Attention, Linear, RMSNorm, Rotary


class Block(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, attn_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.ffn_norm = attn, mlp, attn_norm, ffn_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        # one decode token on the CPU: one C call per half-block where the layers allow it
        h = self.attn.decode_step(x, self.attn_norm, positions, kv) if x.shape[1] == 1 else None
        if h is None:
            h = x + self.attn(self.attn_norm(x), positions, kv)
        step = getattr(self.mlp, "decode_step", None) if x.shape[1] == 1 else None  # MLP, SparseFFN
        y = step(h, self.ffn_norm) if step is not None else None
        return y if y is not None else h + self.mlp(self.ffn_norm(h))

    def decode_args(self):
        """(attention, MLP) arguments of the C decode steps for `CausalLM`'s one-token loop; MLP
        None: the MLP runs in Python (e.g. a HybridFFN); None: the block has no C step.  The
        MLP is an `MLP` or a `SparseFFN` (each has `decode_args` and `decode_into`)."""
        a = self.attn.decode_args(self.attn_norm)
        if a is None:
            return None
        m = getattr(self.mlp, "decode_args", None)
        return a, m(self.ffn_norm) if m is not None else None


def linear(src: WeightSource, prefix: str) -> Linear:
    return Linear(src.qweight(f"{prefix}.weight"), src.maybe_tensor(f"{prefix}.bias"))


def build(src: WeightSource) -> CausalLM:
    c = src.config
    rotary = Rotary(c.n_rot, c.rope_theta, c.max_position_embeddings, c.rope_scaling)
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        attn = Attention(linear(src, f"{a}.q_proj"), linear(src, f"{a}.k_proj"), linear(src, f"{a}.v_proj"),
                         linear(src, f"{a}.o_proj"), c.num_attention_heads, c.n_kv_heads, c.d_head, rotary)
        m = f"{p}.mlp"
        mlp = MLP(linear(src, f"{m}.gate_proj"), linear(src, f"{m}.up_proj"), linear(src, f"{m}.down_proj"), c.hidden_act)
        layers.append(Block(attn, mlp, RMSNorm(src.tensor(f"{p}.input_layernorm.weight"), c.rms_norm_eps),
                            RMSNorm(src.tensor(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps)))
    embed = Embedding(src.qweight("model.embed_tokens.weight"))
    head = Linear(src.qweight("lm_head.weight")) if src.has("lm_head.weight") else Linear(embed.weight)
    return CausalLM(c, embed, layers, RMSNorm(src.tensor("model.norm.weight"), c.rms_norm_eps), head)
