"""Device byte counts of a built model's parts (`CostModel`), in the format each part has on the device."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..models.layers import Rotary
from ..kv_cache import DEFAULT_CACHE_TYPE, row_bytes
from ..quant import FLOAT_FORMATS, QWeight, from_float
from ..sparse.ffn import SparseFFN
from ..kernels.torch_device import CHUNK_ELEMS, DEQUANT_BYTES_PER_ELEM, device_nbytes, qweight_device_nbytes
from .ffn import FFNPart, carried_predictor
from .placement import CostModel, LayerCosts

MiB = 1 << 20
DEVICE_CHUNK = 64            # tokens per forward pass while any part is on the device (bounds activations)
HEAD_PIECE = 4               # tokens per head matmul on the device (full logits are vocab-wide)
CUDA_WORKSPACE = 64 * MiB    # cuBLAS/cuBLASLt workspaces and SDPA kernels' own buffers
FFN_TENSORS = 11             # gate/up/down_t (qs, d, m) + 2 biases: allocator rounding per layer


def module_tensors(m: nn.Module | None) -> Iterator[torch.Tensor]:
    """Every tensor a module tree holds, `QWeight` parts included (modules here keep tensors as
    plain attributes).  Rotary tables are shared caches moved per call, so they are left out."""
    if m is None:
        return
    seen: set[int] = set()
    for sub in m.modules():
        if isinstance(sub, Rotary):
            continue
        values = list(vars(sub).values()) + list(sub._parameters.values()) + list(sub._buffers.values())
        for v in values:
            ts = [v] if isinstance(v, torch.Tensor) else [v.qs, v.d, v.m] if isinstance(v, QWeight) else []
            for t in ts:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield t


def device_bytes(m: nn.Module | None) -> int:
    """Bytes of `m` once moved: QWeight parts as they are, other float tensors as float32."""
    total = 0
    for t in module_tensors(m):
        if t.is_floating_point() and t.dtype != torch.float32 and t.dim() <= 1:
            total += device_nbytes(t.float())  # biases and norm weights become float32
        else:
            total += device_nbytes(t)
    return total


def qrow_bytes(fmt: str, cols: int) -> int:
    """Bytes of one row of `cols` values in `fmt`, scales included."""
    if fmt in FLOAT_FORMATS:
        return cols * torch.empty(0, dtype={"f32": torch.float32, "f16": torch.float16,
                                            "bf16": torch.bfloat16}[fmt]).element_size()
    return from_float(torch.zeros(1, cols), fmt).nbytes


def neuron_bytes(ffn: nn.Module) -> int:
    """Device bytes of one FFN neuron: gate row, up row, down_t row, gate/up bias entries.
    A dense `MLP` is costed as the `SparseFFN` it would become (down_t: q8 for quantized)."""
    if isinstance(ffn, SparseFFN):
        return FFNPart.of(ffn).neuron_bytes()
    up, down = ffn.up.weight, ffn.down.weight
    b = up.row_bytes() + qrow_bytes(down.fmt if down.fmt in FLOAT_FORMATS else "q8", down.rows)
    if ffn.gate is not None:
        b += ffn.gate.weight.row_bytes() + (4 if ffn.gate.bias is not None else 0)
    return b + (4 if ffn.up.bias is not None else 0)


def predictor_device_bytes(ffn: nn.Module) -> int:
    pred = carried_predictor(ffn)
    return 0 if pred is None else pred.device_nbytes()


def dense_ffn_bytes(ffn: nn.Module) -> int:
    """The FFN in its dense layout (layer offload): gate/up/down weights and biases."""
    if isinstance(ffn, SparseFFN):
        lins = [w for w in (ffn.gate, ffn.up) if w is not None]
        return sum(qweight_device_nbytes(w) for w in lins) + device_bytes(ffn.down) + \
            device_nbytes(ffn.gate_bias) + device_nbytes(ffn.up_bias)
    return device_bytes(ffn)


def kv_bytes(config, ctx_size: int, cache_type: str = DEFAULT_CACHE_TYPE) -> int:
    """K and V of one layer for `ctx_size` positions, batch 1, stored as `cache_type`."""
    one = row_bytes(cache_type, config.d_head) * config.n_kv_heads * ctx_size
    return 2 * (-(-one // 512) * 512)


def scratch_bytes(config, ctx_size: int, n_ffn: int, device_type: str = "cuda",
                  predictor_hidden: int = 0, chunk: int = DEVICE_CHUNK) -> int:
    """Transient device memory of one forward pass of `chunk` tokens, counted generously:
    residual stream, q/k/v, attention scores and GQA-expanded K/V (math kernel, worst case),
    FFN activations, logits, predictor activations, one dequantized weight chunk, workspaces."""
    d, h, hkv, dh, v = config.hidden_size, config.num_attention_heads, config.n_kv_heads, config.d_head, config.vocab_size
    t, L = chunk, ctx_size
    floats = (8 * t * d                        # residual, norm output, partial sums, transfers
              + 3 * t * (h + 2 * hkv) * dh     # q, k, v and their rotated copies
              + 3 * t * h * L + 2 * h * L * dh  # scores/softmax, expanded K/V
              + 2 * t * h * dh                 # attention output
              + 4 * t * n_ffn                  # gate, up, h (+ one temporary)
              + 2 * HEAD_PIECE * v             # logits of one piece (+ a copy)
              + 2 * t * max(predictor_hidden, 0))
    b = 4 * floats + DEQUANT_BYTES_PER_ELEM * CHUNK_ELEMS
    b = int(b * 1.25) + 16 * MiB
    return b + (CUDA_WORKSPACE if device_type == "cuda" else 0)


def cost_model(model, ctx_size: int, device_type: str = "cuda", cache_type: str | None = None,
               chunk: int = DEVICE_CHUNK, n_seq: int = 1) -> CostModel:
    """The `CostModel` of a built `CausalLM` (FFNs: `MLP` or `SparseFFN`) for `n_seq` sequences
    of `ctx_size` tokens alive at once (each with its own KV cache of `cache_type`, default the
    model's own `cache_type`; one forward at a time)."""
    c = model.config
    cache_type = cache_type or model.cache_type
    layers, pred_hidden = [], 0
    for block, ffn in zip(model.layers, ffn_modules(model)):
        norms = sum(device_bytes(ch) for ch in block.children() if ch is not block.attn and ch is not ffn)
        layers.append(LayerCosts(attn=device_bytes(block.attn), kv=n_seq * kv_bytes(c, ctx_size, cache_type), norms=norms,
                                 predictor=predictor_device_bytes(ffn), neuron=neuron_bytes(ffn),
                                 n_neurons=ffn.n_neurons, dense_ffn=dense_ffn_bytes(ffn)))
        pred = carried_predictor(ffn)
        pred_hidden = max(pred_hidden, 0 if pred is None else pred.hidden_size)
    # the exact head: a head placed on the device leaves its CPU preview behind (`sparse.head`)
    head = device_bytes(model.norm) + device_bytes(getattr(model.head, "exact", model.head))
    n_ffn = max(lc.n_neurons for lc in layers) if layers else 0
    scratch = scratch_bytes(c, ctx_size, n_ffn, device_type, pred_hidden, chunk)
    return CostModel(tuple(layers), head, scratch, FFN_TENSORS * 512)


def ffn_modules(model) -> list[nn.Module]:
    """Each layer's feed-forward module (`MLP` or `SparseFFN`), in layer order."""
    from ..sparse.apply import ffn_slots

    slots = ffn_slots(model)
    if len(slots) != len(model.layers):
        raise ValueError(f"found {len(slots)} feed-forward modules in {len(model.layers)} layers")
    return [getattr(parent, name) for parent, name in slots]
