"""Apply a `Placement` to a built model: move what it says to the accelerator, split the FFNs.

Construct -> transform: the model is built on the CPU as usual, then each placed part is moved
(quantized weights keep their format), each FFN becomes a `HybridFFN` (neurons mode) or, for
the dense layer-offload baseline, keeps its `MLP` with device weights.  The result is a
`HybridCausalLM`, a `CausalLM` whose residual stream follows each block to where its
attention runs and whose KV cache lives next to its attention.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..errors import SparseInferError
from ..kernels import decode_plan
from ..kv_cache import DEFAULT_CACHE_TYPE, KVCache, LayerKV, row_bytes
from ..models.base import CausalLM
from ..models.layers import MLP, Linear, Module, Rotary
from ..quant import QWeight
from ..sparse.apply import ffn_slots
from ..sparse.ffn import SparseFFN
from .costs import DEVICE_CHUNK, HEAD_PIECE, kv_bytes
from ..kernels.torch_device import ALLOC_ROUND, device_nbytes, matmul, qweight_device_nbytes
from .ffn import CpuWorker, HybridFFN, carried_predictor
from .placement import Placement

CPU = torch.device("cpu")


@dataclass
class NeuronStats:
    """What placement needs from a sparsity pack, per layer (original neuron ids)."""

    frequency: list[torch.Tensor]   # (n,) activation frequency of each neuron
    order: list[torch.Tensor]       # (n,) neuron ids, hottest first
    fingerprint: str = ""

    @classmethod
    def from_pack(cls, pack) -> "NeuronStats":
        """From a `SparsityPack`."""
        return cls([lp.freq for lp in pack.layers], [lp.order for lp in pack.layers], pack.fingerprint)

    def hot_frequencies(self) -> list:
        """Per layer, frequencies in hotness order (numpy), as the planner wants them."""
        return [f.float()[o.long()].numpy() for f, o in zip(self.frequency, self.order)]


class KVPool:
    """The KV bytes one layer may hold on the accelerator (what the placement counted: `n_seq`
    sequences of the planned context); caches take from it when they allocate and give back
    when they are freed, so any mix of caches stays within the budget."""

    def __init__(self, limit: int, what: str):
        self.limit, self.used, self.what = limit, 0, what
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.limit:
                raise SparseInferError(
                    f"a KV cache of {n} bytes on the accelerator would exceed the {self.limit} the VRAM placement "
                    f"counted ({self.what}, {self.used} in use); load with a larger ctx_size (-c) or more sequences "
                    "(n_seq / --parallel), or use --device cpu")
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class DeviceLayerKV(LayerKV):
    """A layer's cache on the accelerator, allocated whole at first use (growing it in steps
    would briefly hold two copies) out of the layer's `KVPool`."""

    def __init__(self, max_len: int, cache_type: str, device, pool: KVPool):
        super().__init__(max_len, cache_type, device)
        self.pool, self._taken = pool, 0

    def _ensure(self, k: torch.Tensor, need: int) -> None:
        if self.k is None and need <= self.max_len:
            B, H, _, D = k.shape
            one = B * H * self.max_len * row_bytes(self.cache_type, D)
            n = 2 * (-(-one // ALLOC_ROUND) * ALLOC_ROUND)
            self.pool.take(n)
            self._taken = n
            self.d_head = D
            self.k, self.v = self._alloc(B, H, self.max_len, D), self._alloc(B, H, self.max_len, D)
        super()._ensure(k, need)

    def __del__(self):
        if self._taken:
            self.pool.give(self._taken)
            self._taken = 0


class HybridCausalLM(CausalLM):
    """A `CausalLM` with parts on an accelerator; same call signature, logits on the CPU."""

    def __init__(self, base: CausalLM, placement: Placement, accel: torch.device, ctx_size: int,
                 homes: Sequence[torch.device], worker: CpuWorker, cache_type: str = DEFAULT_CACHE_TYPE, n_seq: int = 1,
                 chunk: int = DEVICE_CHUNK):
        super().__init__(base.config, base.embed, list(base.layers), base.norm, base.head, base.pos_embed)
        self.placement, self.accel, self.ctx_size = placement, torch.device(accel), ctx_size
        self.homes, self.worker, self.cache_type, self.chunk = list(homes), worker, cache_type, chunk
        self.head_device = self.accel if placement.head_on_device else CPU
        limit = n_seq * kv_bytes(self.config, ctx_size, cache_type)
        what = f"{n_seq} sequence(s) of {ctx_size} tokens"
        self.kv_pools = [KVPool(limit, what) if on else None for on in placement.attn_on_device]

    def new_cache(self, max_len: int | None = None, cache_type: str | None = None) -> KVCache:
        """A cache whose accelerator layers draw on the placement's KV pools (default: the planned
        context and cache type)."""
        n, t = max_len or self.ctx_size, cache_type or self.cache_type
        cache = KVCache(len(self.layers), n, t)
        for i, pool in enumerate(self.kv_pools):
            if pool is not None:
                cache.layers[i] = DeviceLayerKV(n, t, self.homes[i], pool)
        return cache

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab) on the CPU, `chunk` tokens per pass."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        T = tokens.shape[1]
        cache.check_room(T)
        cache.record(tokens)
        outs = []
        for s in range(0, T, self.chunk):
            x = self._blocks(tokens[:, s: s + self.chunk], cache)
            if last_only and s + self.chunk < T:
                continue
            outs.append(self._head(x[:, -1:] if last_only else x, cache))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _blocks(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        T = tokens.shape[1]
        positions = torch.arange(cache.length, cache.length + T)
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)[None]
        if tokens.numel() == 1:  # CPU layers on their C decode steps, the others as modules
            return self.decode_layers(x, positions, cache)
        for i, layer in enumerate(self.layers):
            x = layer(x.to(self.homes[i]), positions, cache[i])
        return x

    def layer_device(self, i: int) -> torch.device:
        return self.homes[i]

    def _head(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits on the CPU; on the device `HEAD_PIECE` tokens at a time (vocab-wide rows)."""
        if self.head_device.type == "cpu":
            return self._logits(self.norm(x.to(CPU)), cache)
        pieces = [self.head(self.norm(x[:, s: s + HEAD_PIECE].to(self.head_device))).to(CPU)
                  for s in range(0, x.shape[1], HEAD_PIECE)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def close(self) -> None:
        """Stop the CPU worker thread (it is also stopped when the model is collected)."""
        self.worker.close()

    def __del__(self):
        try:
            self.worker.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ------------------------------------------------------------------------------- moving parts
class DeviceLinear(Module):
    """`Linear` for a weight that lives on an accelerator (or torch-CPU standing in for one)."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    @classmethod
    def moved(cls, linear: nn.Module, device: torch.device) -> "DeviceLinear":
        bias = None if linear.bias is None else linear.bias.float().to(device)
        return cls(linear.weight.to(device), bias)

    @property
    def in_features(self) -> int:
        return self.weight.cols

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def nbytes(self) -> int:
        return qweight_device_nbytes(self.weight) + device_nbytes(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = matmul(self.weight, x.reshape(-1, x.shape[-1]).float())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, -1)


def move_module(m: nn.Module, device: torch.device) -> nn.Module:
    """Move every tensor of a module tree to `device`; `Linear`s become `DeviceLinear`s.
    Norm weights and biases become float32 (they are computed in float32 anyway)."""
    decode_plan.drop_step(m)  # a C decode step built from the CPU weights
    if isinstance(m, Linear):
        return DeviceLinear.moved(m, device)
    for name, child in list(m.named_children()):
        setattr(m, name, move_module(child, device))
    if isinstance(m, Rotary):
        return m  # tables are moved per call
    for name, v in list(vars(m).items()):
        if isinstance(v, torch.Tensor):
            setattr(m, name, (v.float() if v.is_floating_point() else v).to(device))
        elif isinstance(v, QWeight):
            setattr(m, name, v.to(device))
    for name, p in list(m._parameters.items()):
        if p is not None:
            m._parameters[name] = nn.Parameter(p.detach().to(device), requires_grad=False)
    for name, b in list(m._buffers.items()):
        if b is not None:
            m._buffers[name] = b.to(device)
    return m


def _move_block_core(block: nn.Module, ffn: nn.Module, device: torch.device) -> None:
    """Attention and norms of a block to `device`; the FFN is handled separately."""
    for name, child in list(block.named_children()):
        if child is not ffn:
            setattr(block, name, move_module(child, device))


def sparsify_dense(model: CausalLM, stats: NeuronStats) -> None:
    """Layers whose FFN is still a dense `MLP` get a `SparseFFN` in the stats' hotness order
    without predictor (it computes the dense FFN): the unit the hybrid split works on."""
    for i, (parent, name) in enumerate(ffn_slots(model)):
        ffn = getattr(parent, name)
        if isinstance(ffn, MLP):
            setattr(parent, name, SparseFFN(ffn, 0.0, stats.order[i].long(), None))


def _split_ffn(ffn: nn.Module, n_hot: int, accel: torch.device, home: torch.device, pred_on_device: bool,
               worker: CpuWorker) -> nn.Module:
    if not isinstance(ffn, SparseFFN):
        raise ValueError(f"neuron placement needs SparseFFN blocks, found {type(ffn).__name__}")
    if n_hot == 0 and not (pred_on_device and carried_predictor(ffn) is not None):
        return ffn  # all on the CPU: the SparseFFN as it is
    return HybridFFN.from_sparse(ffn, n_hot, accel, home, pred_on_device, worker)


def apply_placement(model: CausalLM, placement: Placement, accel: torch.device | str, ctx_size: int,
                    cache_type: str = DEFAULT_CACHE_TYPE, n_seq: int = 1) -> CausalLM:
    """Move and split `model` (in place) as `placement` says; returns the model to run.
    Neurons mode wants `SparseFFN` blocks (see `sparsify_dense`); layers mode dense `MLP`s.
    A CPU-only placement returns `model` itself."""
    if not placement.on_device:
        return model
    accel = torch.device(accel)
    worker = CpuWorker()
    homes = []
    for i, (block, name) in enumerate(ffn_slots(model)):
        ffn = getattr(block, name)
        home = accel if placement.attn_on_device[i] else CPU
        if placement.attn_on_device[i]:
            _move_block_core(block, ffn, accel)
        if placement.mode == "layers":
            if not isinstance(ffn, MLP):
                raise ValueError("dense layer offload runs the dense model: load it without a sparsity pack")
            if placement.n_hot[i]:
                setattr(block, name, move_module(ffn, accel))
        else:
            setattr(block, name, _split_ffn(ffn, placement.n_hot[i], accel, home, placement.predictor_on_device[i],
                                            worker))
        homes.append(home)
    if placement.head_on_device:
        from ..sparse.head import remove

        remove(model)  # the preview pays where the head is read from CPU memory; on the GPU the exact head
        model.norm = move_module(model.norm, accel)
        model.head = DeviceLinear.moved(model.head, accel)
    model.drop_steps()
    return HybridCausalLM(model, placement, accel, ctx_size, homes, worker, cache_type, n_seq)
