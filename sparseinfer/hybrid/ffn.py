"""`HybridFFN`: one FFN block split by hotness between an accelerator (hot prefix) and the CPU.

Neurons are reordered by hotness, so the hot set is the prefix [0, n_hot) and the cold set the
rest.  Per token, the predictor's active set is split: active hot neurons run on the
accelerator with torch ops (`device_ops`), active cold neurons on the CPU with the C sparse
kernels in a worker thread (they release the GIL, so the two really overlap), and the two
partial sums are added on the accelerator.  Without a predictor, or for several tokens at once
(prefill, batches), every neuron is computed: the result is the dense FFN, split the same way.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..kernels import cpu
from ..models.layers import kernel_act_name
from ..quant import FLOAT_FORMATS, QWeight, from_float
from . import device_ops as dev

# predictor protocol: x (d_model,) -> bool mask (n_neurons,) over neurons in *hotness order*
Predictor = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class FFNPart:
    """A contiguous range of neurons (in hotness order) on one device."""

    gate: QWeight | None      # (n, d_model) rows, or None (non-gated FFN)
    up: QWeight               # (n, d_model)
    down_t: QWeight           # (n, d_model): the down projection, neuron-major
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.up.rows

    def rows(self, start: int, end: int, device: torch.device | str = "cpu") -> "FFNPart":
        """Neurons [start, end) copied to `device`."""
        cut = lambda b: None if b is None else b[start:end].contiguous().to(device)  # noqa: E731
        gate = None if self.gate is None else dev.copy_rows(self.gate, start, end, device)
        return FFNPart(gate, dev.copy_rows(self.up, start, end, device), dev.copy_rows(self.down_t, start, end, device),
                       cut(self.gate_bias), cut(self.up_bias))

    def nbytes(self) -> int:
        """Device bytes (allocator rounding included)."""
        ws = [w for w in (self.gate, self.up, self.down_t) if w is not None]
        return sum(dev.qweight_device_nbytes(w) for w in ws) + dev.device_nbytes(self.gate_bias) + \
            dev.device_nbytes(self.up_bias)


def down_t_format(fmt: str) -> str:
    """The format the transposed down projection is stored in (the original one)."""
    return fmt


def transpose_down(down: QWeight) -> QWeight:
    """(d_model, n) -> (n, d_model) neuron-major. Float formats transpose exactly; quantized ones
    are re-quantized along the new rows (their blocks ran along the neuron axis)."""
    if down.fmt in FLOAT_FORMATS:
        return QWeight(down.fmt, down.cols, down.rows, down.qs.T.contiguous())
    return from_float(down.dequantize().T.contiguous(), down_t_format(down.fmt))


def mlp_part(mlp: nn.Module, order: torch.Tensor) -> FFNPart:
    """A dense `MLP`'s neurons, reordered by hotness (`order[0]` is the hottest neuron id), on the CPU."""
    order = order.long()
    pick_b = lambda lin: None if lin.bias is None else lin.bias.float().index_select(0, order)  # noqa: E731
    gate = None if mlp.gate is None else mlp.gate.weight.select_rows(order)
    down_t = transpose_down(mlp.down.weight).select_rows(order)
    return FFNPart(gate, mlp.up.weight.select_rows(order), down_t,
                   None if mlp.gate is None else pick_b(mlp.gate), pick_b(mlp.up))


class CpuWorker:
    """One background thread that runs the cold neurons while the accelerator works."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseinfer-cold")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class HybridFFN(nn.Module):
    """Drop-in for `MLP`: hot neurons on `accel`, cold neurons on the CPU, outputs summed on `accel`.

    hot: neurons [0, n_hot) already on `accel` (None when n_hot = 0); cold: the rest on the CPU
    (None when every neuron is hot); `home`: where the block's residual stream lives (the
    output goes back there); `down_bias` lives on `accel` (or the CPU with no hot part)."""

    def __init__(self, hot: FFNPart | None, cold: FFNPart | None, act, act_name: str, accel: torch.device,
                 home: torch.device, down_bias: torch.Tensor | None = None, predictor: Predictor | None = None,
                 predictor_device: torch.device | None = None, worker: CpuWorker | None = None):
        super().__init__()
        self.hot, self.cold, self.act, self.act_name = hot, cold, act, act_name
        self.accel, self.home = torch.device(accel), torch.device(home)
        self.down_bias, self.predictor = down_bias, predictor
        self.predictor_device = torch.device(predictor_device or "cpu")
        self.worker = worker or CpuWorker()
        self.n_hot = 0 if hot is None else hot.n
        self.n_neurons = self.n_hot + (0 if cold is None else cold.n)
        self._fused = cold is not None and cold.gate_bias is None and cold.up_bias is None and \
            act_name != "drelu" and kernel_act_name(act_name) in ("silu", "relu", "gelu", "gelu_tanh")
        self._all_cold = None if cold is None else torch.arange(cold.n, dtype=torch.int32)
        # statistics: active neurons seen on each side (decode steps only)
        self.stats = {"tokens": 0, "hot_active": 0, "cold_active": 0}

    @property
    def out_device(self) -> torch.device:
        return self.accel if self.hot is not None else torch.device("cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        if x2.shape[0] == 1 and self.predictor is not None:
            y = self._sparse(x2[0])[None]
        else:
            y = self._dense(x2)
        return y.to(self.home).view(*lead, -1)

    # -- several tokens, or no predictor: every neuron
    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        cold = None
        if self.cold is not None:
            fn = self._cold_one if x2.shape[0] == 1 else self._cold_dense
            cold = self._run_cold(fn, x2.to("cpu").contiguous(), self._all_cold)
        hot = None if self.hot is None else dev.hot_ffn_dense(x2.to(self.accel), self.hot, self.act, self.act_name)
        return self._sum(hot, cold)

    # -- one token with a predictor: active neurons only
    def _sparse(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.predictor(x.to(self.predictor_device))
        mask_cpu = mask.to("cpu")
        cold = None
        if self.cold is not None:
            ids = mask_cpu[self.n_hot:].nonzero().flatten().to(torch.int32)
            self.stats["cold_active"] += int(ids.numel())
            cold = self._run_cold(self._cold_one, x.to("cpu").contiguous()[None], ids)
        hot = None
        if self.hot is not None:
            hmask = mask[: self.n_hot].to(self.accel)
            ids = hmask.nonzero().flatten()
            self.stats["hot_active"] += int(ids.numel())
            hot = dev.hot_ffn_sparse(x.to(self.accel), self.hot, ids, self.act, self.act_name)[None]
        self.stats["tokens"] += 1
        return self._sum(hot, cold)

    def _run_cold(self, fn, x2: torch.Tensor, ids: torch.Tensor) -> Future:
        if self.hot is None:  # nothing to overlap with: run here
            return _done(fn(x2, ids))
        return self.worker.submit(fn, x2, ids)

    def _sum(self, hot: torch.Tensor | None, cold: Future | None) -> torch.Tensor:
        y = hot
        if cold is not None:
            yc = cold.result()
            y = yc.to(self.out_device) if y is None else y + yc.to(self.accel)
        return y if self.down_bias is None else y + self.down_bias

    # -- CPU side (runs in the worker thread: C kernels release the GIL)
    def _cold_one(self, x2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One token over neurons `ids` of the cold part -> (1, d_model)."""
        c, x = self.cold, x2[0]
        if self._fused:
            return cpu.sparse_ffn(x, c.gate, c.up, c.down_t, ids, kernel_act_name(self.act_name))[None]
        u = cpu.gemv_rows(c.up, x, ids)
        if c.up_bias is not None:
            u = u + c.up_bias[ids.long()]
        g = None
        if c.gate is not None:
            g = cpu.gemv_rows(c.gate, x, ids)
            if c.gate_bias is not None:
                g = g + c.gate_bias[ids.long()]
        h = dev.ffn_hidden(g, u, self.act, self.act_name).contiguous()
        return cpu.axpy_rows(c.down_t, h, ids)[None]

    def _cold_dense(self, x2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All cold neurons for (M, d) inputs -> (M, d_model)."""
        c = self.cold
        u = cpu.matmul(c.up, x2)
        if c.up_bias is not None:
            u = u + c.up_bias
        g = None
        if c.gate is not None:
            g = cpu.matmul(c.gate, x2)
            if c.gate_bias is not None:
                g = g + c.gate_bias
        return dev.matmul_t(dev.ffn_hidden(g, u, self.act, self.act_name), c.down_t)
