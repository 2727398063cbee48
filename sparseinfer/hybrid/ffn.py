"""`HybridFFN`: a `SparseFFN` split by hotness between an accelerator (hot prefix) and the CPU.

`SparseFFN` (sparseinfer.sparse) stores neurons in hotness order, so the hot set is the prefix
[0, n_hot) and the cold set the rest.  `HybridFFN` computes exactly what that `SparseFFN`
computes (same threshold, predictor and modes) as two parts of one FFN added together, each
running the one sparse-FFN algorithm on its own neurons:

- one token (decode): the predicted rows are split at n_hot; the device part runs
  `kernels.reference.sparse_ffn_token` with torch row products on the accelerator
  (`kernels.torch_device`), the CPU part the same algorithm's C step (`kernels.decode_plan`,
  no norm, no residual) in a worker thread (it releases the GIL, so the two overlap);
- several tokens (prefill, batches) or no predictor: every neuron, hot block on the
  accelerator, cold block on the CPU, threshold (and per-token predictor) masks applied;

and the two partial sums are added on the accelerator.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import cpu, decode_plan
from ..kernels import reference as ref
from ..kernels import torch_device as dev
from ..kernels.reference import canonical_activation
from ..models.layers import Module
from ..quant import QWeight
from ..sparse.ffn import MODES, DecodeStats, SparseFFN


@dataclass
class FFNPart:
    """A contiguous range of neurons (in hotness order) on one device."""

    gate: QWeight | None      # (n, d_model) rows, or None (plain FFN)
    up: QWeight               # (n, d_model)
    down_t: QWeight           # (n, d_model): the down projection, neuron-major
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, ffn: SparseFFN) -> "FFNPart":
        return cls(ffn.gate, ffn.up, ffn.down_t, ffn.gate_bias, ffn.up_bias)

    @property
    def n(self) -> int:
        return self.up.rows

    @property
    def first(self) -> QWeight:
        """The projection whose activation decides activity (gate, or up without a gate)."""
        return self.up if self.gate is None else self.gate

    @property
    def first_bias(self) -> torch.Tensor | None:
        return self.up_bias if self.gate is None else self.gate_bias

    def rows(self, start: int, end: int, device: torch.device | str = "cpu") -> "FFNPart":
        """Neurons [start, end) copied to `device`."""
        cut = lambda b: None if b is None else b[start:end].float().contiguous().to(device)  # noqa: E731
        gate = None if self.gate is None else dev.copy_rows(self.gate, start, end, device)
        return FFNPart(gate, dev.copy_rows(self.up, start, end, device), dev.copy_rows(self.down_t, start, end, device),
                       cut(self.gate_bias), cut(self.up_bias))

    def nbytes(self) -> int:
        """Device bytes (allocator rounding included)."""
        ws = [w for w in (self.gate, self.up, self.down_t) if w is not None]
        return sum(dev.qweight_device_nbytes(w) for w in ws) + dev.device_nbytes(self.gate_bias) + \
            dev.device_nbytes(self.up_bias)

    def neuron_bytes(self) -> int:
        """Device bytes per neuron, without allocator rounding."""
        b = self.up.row_bytes() + self.down_t.row_bytes() + (4 if self.up_bias is not None else 0)
        if self.gate is not None:
            b += self.gate.row_bytes() + (4 if self.gate_bias is not None else 0)
        return b


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


def carried_predictor(ffn):
    """The predictor a split of `ffn` runs: its own, except one that reads the residual stream
    (a PowerInfer Falcon or OPT file's), which is not carried over: the split then picks rows by the
    exact activation (as under the pack's "first" policy)."""
    pred = getattr(ffn, "predictor", None)
    return None if pred is None or getattr(pred, "reads", "ffn_input") == "residual" else pred


class HybridFFN(Module):
    """Drop-in for `MLP`/`SparseFFN`: hot neurons on `accel`, cold ones on the CPU.

    hot: neurons [0, n_hot) on `accel` (None when n_hot = 0); cold: the rest on the CPU (None
    when every neuron is hot).  `home` is where the block's residual stream lives (the output
    goes back there).  `predictor`: the pack's `QPredictor`, on the CPU or on `accel`."""

    def __init__(self, hot: FFNPart | None, cold: FFNPart | None, act, act_name: str, accel: torch.device,
                 home: torch.device, threshold: float = 0.0, down_bias: torch.Tensor | None = None,
                 predictor=None, mode: str = "predict", worker: CpuWorker | None = None):
        super().__init__()
        self.hot, self.cold, self.act, self.act_name = hot, cold, act, act_name
        self.accel, self.home = torch.device(accel), torch.device(home)
        self.threshold, self.predictor, self.mode = float(threshold), predictor, mode
        self.on_device_predictor = predictor is not None and predictor.torch_ops
        self.worker = worker or CpuWorker()
        self.n_hot = 0 if hot is None else hot.n
        self.n_neurons = self.n_hot + (0 if cold is None else cold.n)
        self.out_device = self.accel if hot is not None else torch.device("cpu")
        self.down_bias = None if down_bias is None else down_bias.float().to(self.out_device)
        self.kernel_act = canonical_activation(act_name)
        self._fused = (self.threshold == 0.0 and act_name != "drelu" and self.kernel_act in
                       ("silu", "relu", "gelu", "gelu_tanh") and (cold is None or (cold.gate_bias is None
                                                                                   and cold.up_bias is None)))
        self._cold_step = None  # the CPU part's C step, built on first use
        self.stats = DecodeStats()
        some = hot if hot is not None else cold
        self._n_mats = 2 if some.gate is None else 3
        self._row_bytes = some.neuron_bytes()
        self._predictor_bytes = 0 if predictor is None else (
            predictor.device_nbytes() if self.on_device_predictor else predictor.nbytes)
        self.split = {"hot_rows": 0, "cold_rows": 0}  # predicted rows served by each side (decode)

    @classmethod
    def from_sparse(cls, ffn: SparseFFN, n_hot: int, accel: torch.device, home: torch.device,
                    predictor_on_device: bool = False, worker: CpuWorker | None = None) -> "HybridFFN":
        """Split a `SparseFFN`: rows [0, n_hot) copied to `accel`, the rest kept on the CPU."""
        if ffn.density is not None:
            raise ValueError("forced-density SparseFFNs (benchmark stand-ins) cannot be split")
        part, n = FFNPart.of(ffn), ffn.n_neurons
        hot = part.rows(0, n_hot, accel) if n_hot else None
        cold = part.rows(n_hot, n, "cpu") if n_hot < n else None
        pred = carried_predictor(ffn)
        if pred is not None and predictor_on_device:
            pred = pred.to(accel, torch_ops=True)
        return cls(hot, cold, ffn.act, ffn.act_name, accel, home, ffn.threshold, ffn.down.bias, pred, ffn.mode, worker)

    # `SparseFFN`-compatible attributes for the sparse package's helpers (stats, modes)
    density = None

    @property
    def gate(self) -> QWeight | None:
        """A gate part (None for plain FFNs): tells gated from plain, as on `SparseFFN`."""
        some = self.hot if self.hot is not None else self.cold
        return some.gate

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown SparseFFN mode {mode!r}; expected one of {MODES}")
        self._mode = mode

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: unused (see `from_sparse`)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()
        single = x.dim() < 2 or x.shape[-2] == 1
        if x2.shape[0] == 1 and self._mode == "predict":
            y = self._decode(x2[0])[None]
        else:
            per_token = self.predictor is not None and (self._mode == "faithful" or (self._mode == "predict" and single))
            y = self._dense(x2, per_token)
        return y.to(self.home).view(*lead, -1)

    # ------------------------------------------------------------------ one token: predicted rows
    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """One token.  Without a predictor (the pack's "first" policy, or every neuron kept) the
        first projection runs dense on each side and the threshold picks the rows, as in
        `SparseFFN`; ids None below stands for that."""
        hot_ids = cold_ids = None
        t0 = time.perf_counter()
        if self.predictor is not None:
            hot_ids, cold_ids = self._predict(x)
        n_hot = self.n_hot if hot_ids is None else int(hot_ids.numel())
        n_cold = self.n_neurons - self.n_hot if cold_ids is None else int(cold_ids.numel())
        self._count(n_hot + n_cold, time.perf_counter() - t0)
        cold = None
        if self.cold is not None:
            self.split["cold_rows"] += n_cold
            cold = self._run_cold(self._cold_rows, x.to("cpu").contiguous(), cold_ids)
        hot = None
        if self.hot is not None:
            self.split["hot_rows"] += n_hot
            xa = x.to(self.accel)
            hot = self._part_dense(self.hot, xa[None], None, True)[0] if hot_ids is None else self._hot_rows(xa, hot_ids)
        return self._sum(hot, cold)

    def _count(self, n_rows: int, predictor_seconds: float) -> None:
        """`SparseFFN`-compatible counters (rows of gate/up/down_t read; bytes incl. predictor)."""
        st = self.stats
        st.tokens += 1
        st.rows += self._n_mats * n_rows
        st.kept += n_rows
        st.bytes += n_rows * self._row_bytes + self._predictor_bytes
        st.predictor_seconds += predictor_seconds

    def _predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hot row ids on the accelerator, cold row ids int32 on the CPU, relative to the cold part)."""
        if self.on_device_predictor:
            mask = self.predictor.mask_batch(x.to(self.accel)[None])[0]
            hot = mask[: self.n_hot].nonzero().view(-1)
            cold = mask[self.n_hot:].to("cpu").nonzero().view(-1).to(torch.int32)
            return hot, cold
        rows = self.predictor.active_rows(x.to("cpu").contiguous())  # int32, ascending
        k = int(torch.searchsorted(rows, self.n_hot))
        return rows[:k].long().to(self.accel), rows[k:] - self.n_hot

    def _hot_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the device part for one token: the one-token algorithm with torch row
        products on the accelerator (the threshold cut is a mask: no device->host sync)."""
        h = self.hot
        return ref.sparse_ffn_token(x, h.first, h.up if h.gate is not None else None, h.down_t, self.kernel_act,
                                    self.threshold, ids, h.first_bias, h.up_bias if h.gate is not None else None,
                                    relu_up=self.act_name == "drelu", rows_gemv=dev.rows_gemv, rows_axpy=dev.rows_axpy)

    def _cold_rows(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Rows `rows` (None: all) of the CPU part for one token (worker thread): the same
        algorithm's C step, or its reference without the compiled kernels."""
        c = self.cold
        second = c.up if c.gate is not None else None
        second_bias = c.up_bias if c.gate is not None else None
        if not decode_plan.available():
            return ref.sparse_ffn_token(x, c.first, second, c.down_t, self.kernel_act, self.threshold, rows,
                                        c.first_bias, second_bias, relu_up=self.act_name == "drelu")
        if self._cold_step is None:
            self._cold_step = decode_plan.sparse_ffn_step(
                act=self.kernel_act, relu_up=self.act_name == "drelu", first=c.first, second=second, down_t=c.down_t,
                down=None, order=None, threshold=self.threshold, crossover=1.0, up_crossover=1.0,
                first_bias=c.first_bias, second_bias=second_bias, fused=self._fused)
        y = torch.empty(c.down_t.cols)
        self._cold_step.run(x, y, None if rows is None else rows.to(torch.int32).contiguous())
        return y

    # ------------------------------------------------------------------ many tokens: every neuron
    def _dense(self, x2: torch.Tensor, per_token: bool) -> torch.Tensor:
        pmask = None
        if per_token:
            p = self.predictor
            pmask = p.mask_batch(x2.to(self.accel)) if self.on_device_predictor else p.mask_batch(x2.to("cpu"))
        cold = None
        if self.cold is not None:
            cm = None if pmask is None else pmask[:, self.n_hot:].to("cpu")
            cold = self._run_cold(self._cold_dense, x2.to("cpu").contiguous(), cm)
        hot = None
        if self.hot is not None:
            hm = None if pmask is None else pmask[:, : self.n_hot].to(self.accel)
            hot = self._part_dense(self.hot, x2.to(self.accel), hm, torch_lin=True)
        return self._sum(hot, cold)

    def _cold_dense(self, x2: torch.Tensor, pmask: torch.Tensor | None) -> torch.Tensor:
        return self._part_dense(self.cold, x2, pmask, torch_lin=False)

    def _part_dense(self, part: FFNPart, x2: torch.Tensor, pmask: torch.Tensor | None, torch_lin: bool) -> torch.Tensor:
        """All neurons of `part`: h masked by the sparsified model's rule (|a| > t and h != 0)
        and the per-token predictor mask, then the down projection."""
        lin = dev.matmul if torch_lin else cpu.matmul

        def proj(w, b):
            y = lin(w, x2)
            return y if b is None else y + b

        a = self.act(proj(part.first, part.first_bias))
        if part.gate is None:
            h = a
        else:
            u = proj(part.up, part.up_bias)
            h = a * (F.relu(u) if self.act_name == "drelu" else u)
        mask = (a.abs() > self.threshold) & (h != 0)
        if pmask is not None:
            mask &= pmask
        return dev.matmul_t(h * mask, part.down_t)

    # ------------------------------------------------------------------ plumbing
    def _run_cold(self, fn, *args) -> Future:
        if self.hot is None:  # nothing to overlap with: run here
            return _done(fn(*args))
        return self.worker.submit(fn, *args)

    def _sum(self, hot: torch.Tensor | None, cold: Future | None) -> torch.Tensor:
        y = hot
        if cold is not None:
            yc = cold.result()
            y = yc.to(self.out_device) if y is None else y + yc.to(self.accel)
        return y if self.down_bias is None else y + self.down_bias

    def extra_repr(self) -> str:
        return (f"n_hot={self.n_hot}/{self.n_neurons} on {self.accel}, act={self.act_name}, "
                f"threshold={self.threshold:.4g}, mode={self._mode}, predictor="
                f"{'device' if self.on_device_predictor else 'cpu' if self.predictor is not None else 'none'}")
