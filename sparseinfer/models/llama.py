"""Llama family: Llama-2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias), ReLU-Llama/ProSparse, Bamboo (dReLU)."""
from __future__ import annotations

import torch

from ..io.weights import WeightSource
from ..kernels import decode_plan
from ..config import ModelConfig
from .base import CausalLM, Embedding, Has, TensorShapes, linear_shapes
from .layers import MLP, Attention, Linear, Module, RMSNorm, Rotary


class Block(Module):
    def __init__(self, attn: Attention, mlp: MLP, attn_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.ffn_norm = attn, mlp, attn_norm, ffn_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), positions, kv)
        return h + self.mlp(self.ffn_norm(h))

    def steps(self) -> decode_plan.BlockSteps | None:
        """The C decode steps of one token (`kernels.decode_plan`): attention, then FFN (None
        where the FFN runs as a module, e.g. split across devices); None where the attention has
        no C step (the block then runs as modules)."""
        return decode_plan.cached_step(self, self._part_steps, self._build_steps)

    def _part_steps(self):
        step = getattr(self.mlp, "step", None)  # MLP, SparseFFN
        return self.attn.step(self.attn_norm), None if step is None else step(self.ffn_norm)

    def _build_steps(self):
        a, f = self._part_steps()
        return None if a is None else decode_plan.BlockSteps(a, f)



EMBED = "model.embed_tokens.weight"  # the token embedding (also the output head when the file has no lm_head)

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
    embed = Embedding(src.qweight(EMBED))
    head = Linear(src.qweight("lm_head.weight")) if src.has("lm_head.weight") else Linear(embed.weight)
    return CausalLM(c, embed, layers, RMSNorm(src.tensor("model.norm.weight"), c.rms_norm_eps), head)


def fused_groups(c: ModelConfig) -> list[list[str]]:
    """The weights `build` fuses (`Attention`: q, k, v; `MLP`: gate, up), for loading them
    into one buffer each (`registry.prefetch`)."""
    out = []
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out += [[f"{a}.{x}_proj.weight" for x in "qkv"], [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"]]
    return out


def tensor_shapes(c: ModelConfig, has: Has) -> TensorShapes:
    """Every tensor `build` reads, with the shape the config implies (see `registry.check_shapes`)."""
    n, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    nq, nkv = c.num_attention_heads * c.d_head, c.n_kv_heads * c.d_head
    yield EMBED, (v, n), True
    yield "model.norm.weight", (n,), True
    yield "lm_head.weight", (v, n), False
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (n,), True
        yield f"{p}.post_attention_layernorm.weight", (n,), True
        for name, rows, cols in (("q", nq, n), ("k", nkv, n), ("v", nkv, n), ("o", n, nq)):
            yield from linear_shapes(f"{p}.self_attn.{name}_proj", rows, cols)
        for name, rows, cols in (("gate", f, n), ("up", f, n), ("down", n, f)):
            yield from linear_shapes(f"{p}.mlp.{name}_proj", rows, cols)
