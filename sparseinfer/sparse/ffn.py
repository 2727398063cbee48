"""`SparseFFN`: the drop-in replacement of the dense `MLP` that exploits activation sparsity.

The *sparsified model* it computes is defined by one number per layer, the threshold t:
neuron i is active for a token when |a_i| > t and h_i != 0, where a = act(gate x) (gated FFNs)
or act(up x) (plain FFNs) and h = a * up x is what `down` mixes.  ReLU-family FFNs use t = 0
(active = nonzero, exactly the dense model); gated SiLU/GELU FFNs use a calibrated t > 0.
Inactive neurons are exactly zero.

Neurons are stored in hotness order (`order[k]` = original id of the k-th hottest neuron):
gate/up rows are permuted (lossless row selection) and `down_t`, the neuron-major transpose of
`down`, is built in that order, so the hot set is a contiguous prefix.  `down` itself keeps
the original column order for the dense (T > 1) path, which un-permutes h instead.

Modes (`mode`):
- ``predict`` (runtime): one token (B = T = 1) runs the predictor, then the sparse kernels on
  the predicted rows, with the threshold applied inside that set (false positives are zeroed
  exactly as the sparsified model would).  Without a predictor (the pack's "first" policy,
  where predicting costs more than it saves) the first projection runs dense (with up, in one
  pass over their fused weight, where most neurons stay active) and the threshold picks the
  rows of up/down: exact.  Up and down each run dense instead above a kept fraction set by
  their bytes and the kernels' measured cost per byte (`crossover`, `up_crossover`).
  Prefill (T > 1) is dense with the threshold mask;
  batched decode (T = 1, B > 1) applies predictor x threshold masks per token.
- ``faithful`` (perplexity): every token, T > 1 included, gets predictor mask x threshold mask
  on the dense hidden activations: mathematically what per-token sparse decode computes.
- ``threshold``: dense with the threshold mask only (the quality reference of the pack).
- ``oracle``: decode on exactly the active rows (computed densely); for tests.
One token in ``predict`` mode runs as one C call (`decode_args`, csrc/decode.c: predictor, row
choice, kernels, counters); `decode_py` drives the same kernels from Python and is its reference.
Layers that read rows (a predictor or a forced density) and expect at most half their neurons
active keep each neuron's first, up and down_t rows in one contiguous *record*
(`make_records`, `kernels.cpu.neuron_records`): the C step then reads one block per active
neuron in a single pass, up and down always on the kept rows.  Prefill's threshold-masked
hidden activations come from one C pass (`kernels.cpu.hidden_rows`) where the mask is the
threshold alone.
`density` (bench): force the active fraction to D: the top-D rows by predictor score, or a
random set of rows per token (from a bank drawn once) when there is no predictor (speed only;
see `_forced_rows`).
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import MLP, Linear, RMSNorm, _reuse, ffn_decode_step, fuse_weights, kernel_act_name
from ..quant import FLOAT_FORMATS, QWeight, from_float

MODES = ("predict", "faithful", "threshold", "oracle")


@dataclass
class DecodeStats:
    """Counters of the single-token path (reset by the benchmark after warm-up)."""

    tokens: int = 0
    rows: int = 0            # FFN weight rows read (gate + up + down_t), summed over tokens
    kept: int = 0            # neurons whose up/down rows were computed, summed over tokens
    bytes: int = 0           # FFN + predictor weight bytes read
    predictor_seconds: float = 0.0

    def reset(self) -> None:
        self.tokens = self.rows = self.kept = self.bytes = 0
        self.predictor_seconds = 0.0


# Neurons per re-quantization slice in `transpose_neuron_major` (temporaries stay in cache).
_TRANSPOSE_SLICE = 1024


def transpose_neuron_major(down: QWeight, order: torch.Tensor) -> QWeight:
    """(d_model, n) `down` -> (n, d_model) neuron-major copy in `order`: float formats stay
    exact, quantized ones are re-quantized to q8 (per-neuron rows of 32-blocks).

    Done at load for every sparse layer, so: the compiled dequantization, `from_float` on
    slices of neurons read through the transposed view, then the quantized rows gathered into
    `order` (rows are quantized independently, so this is the whole-matrix
    `from_float(down.dequantize().T[order])`, bit for bit; Qwen2.5-1.5B's 8960x1536 down:
    0.48 -> 0.06-0.08 s)."""
    cpu = _kernels()
    full = cpu.dequantize_rows(down) if cpu.available() else down.dequantize()
    ft = full.T
    fmt = down.fmt if down.fmt in FLOAT_FORMATS else "q8"
    parts = [from_float(ft[r0:r0 + _TRANSPOSE_SLICE], fmt) for r0 in range(0, ft.shape[0], _TRANSPOSE_SLICE)]
    del full, ft
    order = order.long()
    pick = lambda ts: torch.cat(ts).index_select(0, order)  # noqa: E731
    return QWeight(fmt, len(order), down.rows, pick([p.qs for p in parts]),
                   None if parts[0].d is None else pick([p.d for p in parts]), None)


def _kernels():
    from ..kernels import cpu

    return cpu


_ROW_BANK = 64  # random row sets per layer for forced density without a predictor

# Time per byte of the sparse kernels on many rows, relative to a dense gemv of the stored
# weight; they set the dense crossovers.  Measured on 2 AVX2 cores from DRAM: axpy_rows over
# every row of a q8 down_t 0.94 ms vs the dense q8 down 0.64 ms (`benchmarks/kernels.py`,
# 8960x1536: 1.46), and in Qwen2.5-Coder-1.5B's FFNs with its pack (~70% kept) the dense
# down beat the rows until the cost was set to 2; gemv_rows over 70% of the rows of its q4
# up took what the dense gate gemv took (12.5 vs 12.6 ms over 28 layers: 1.4).
AXPY_COST = 2.0
GEMV_ROWS_COST = 1.4

# Neuron records (`SparseFFN.records`) for layers whose expected (profiled or forced) active
# fraction is at most this: their up and down then always run on the kept rows.
RECORDS_MAX_DENSITY = 0.5


class SparseFFN(nn.Module):
    """Activation-sparse FFN with the `MLP` call signature (see the module docstring)."""

    def __init__(self, mlp: MLP, threshold: float = 0.0, order: torch.Tensor | None = None,
                 predictor=None, mode: str = "predict", density: float | None = None,
                 expected_density: float | None = None):
        super().__init__()
        n = mlp.n_neurons
        self.n_neurons, self.d_model = n, mlp.down.out_features
        self.act_name, self.act = mlp.act_name, mlp.act
        self.kernel_act = kernel_act_name(mlp.act_name)
        self.threshold = threshold
        self.order = torch.arange(n) if order is None else order.long()
        self.inverse = torch.argsort(self.order)
        self.permuted = not bool(torch.equal(self.order, torch.arange(n)))
        pick = self._permute_rows
        self.gate = None if mlp.gate is None else pick(mlp.gate.weight)
        self.up = pick(mlp.up.weight)
        # gate and up as row views of one weight, so a dense first projection covers both in one
        # pass (as `MLP` runs them); kept as they come when the permuted rows already are that
        self._gate_up: QWeight | None = None
        if self.gate is not None:
            if not self.permuted and mlp._intact():
                self._gate_up = mlp._gate_up.weight
            else:
                got = fuse_weights(self.gate, self.up)
                if got is not None:
                    self._gate_up, (self.gate, self.up) = got
        self._parts = (self.gate, self.up)
        self.gate_bias = None if mlp.gate is None else self._permute_vec(mlp.gate.bias)
        self.up_bias = self._permute_vec(mlp.up.bias)
        self.down = mlp.down
        self._down_t: QWeight | None = None
        self.predictor = predictor
        self.density = density
        self.mode = mode
        self.observer = None  # calibration hook: observer(ffn, x2, a, h, mask)
        self._stats = DecodeStats()
        # counters of the C decode step (`decode_into`), folded into `stats` when read (`_count`):
        # tokens, fused-kernel rows, first-projection rows, gate+up passes, dense ups, up rows,
        # dense downs, down_t rows, neurons kept, predictions; then the predictor's seconds as a
        # float64 in the last slot (numpy: no inference-mode tensor)
        self._ccount = np.zeros(11, dtype=np.int64)
        self._row_bank: list[torch.Tensor] | None = None  # forced density without a predictor
        self._row_next = [0]  # next set of the bank (a list: no Module.__setattr__ per token)
        self._all_rows = torch.arange(n, dtype=torch.int32)
        # above this kept fraction up/down run dense on the masked h; None: where the kept rows'
        # bytes reach the dense products' (`crossover`)
        self.dense_crossover: float | None = None
        # without candidate rows (the "first" policy): gate and up in one dense pass rather than
        # up on the kept rows only; pays when up would run dense anyway (`up_crossover`), so
        # chosen from the layer's profiled density (the pack's frequencies)
        self.dense_gate_up = expected_density is not None and expected_density > self.up_crossover
        self.expected_density = expected_density
        # neuron records (first, up and down_t rows of a neuron in one contiguous block) for
        # the C decode step: True / False, or None to decide from the expected density
        self.records: bool | None = None
        self._records: torch.Tensor | None = None  # their buffer, once built

    # ------------------------------------------------------------------ set-up
    def _permute_rows(self, w: QWeight) -> QWeight:
        return w.select_rows(self.order) if self.permuted else w

    def _permute_vec(self, b: torch.Tensor | None) -> torch.Tensor | None:
        if b is None:
            return None
        return b.float().index_select(0, self.order) if self.permuted else b.float()

    @property
    def threshold(self) -> float:
        return self._threshold

    @threshold.setter
    def threshold(self, t: float) -> None:
        self._threshold = float(t)
        self._fused = None  # re-decided on the next decode

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown SparseFFN mode {mode!r}; expected one of {MODES}")
        self._mode = mode

    @property
    def stats(self) -> DecodeStats:
        """Counters of the single-token path (the C step's included)."""
        c = self._ccount
        if c[0]:
            self._fold(c)
        return self._stats

    def _fold(self, c: np.ndarray) -> None:
        tokens, fr, first, gu, upd, upr, dd, dr, kept, pc = c[:10].tolist()
        seconds = float(c[10:].view(np.float64)[0])
        c[:] = 0
        self._stats.tokens += tokens
        self._count(fused=fr, first=first, gate_up=gu, up_dense=upd, up_rows=upr, down_dense=dd, down_rows=dr,
                    kept=kept)
        if self.predictor is not None:
            self._stats.bytes += pc * self.predictor.nbytes
        self._stats.predictor_seconds += seconds

    def _count(self, fused: int = 0, first: int = 0, gate_up: int = 0, up_dense: int = 0, up_rows: int = 0,
               down_dense: int = 0, down_rows: int = 0, kept: int = 0) -> None:
        """Add to the counters: rows through the fused kernel, first-projection rows, dense
        gate+up passes, dense ups, up rows, dense downs, down_t rows, neurons kept."""
        self.down_t  # noqa: B018 (sets the byte counts)
        st, n, rb = self._stats, self.n_neurons, self._rb
        st.rows += ((3 if self.gate is not None else 2) * fused + first + 2 * n * gate_up + n * up_dense + up_rows
                    + n * down_dense + down_rows)
        st.kept += fused + kept
        st.bytes += fused * rb[1] + first * rb[0] + down_rows * rb[2] + down_dense * self.down.weight.nbytes
        if self.gate is not None:
            st.bytes += up_dense * self.up.nbytes + up_rows * self.up.row_bytes()
            if gate_up:
                st.bytes += gate_up * self._gate_up.nbytes

    @property
    def down_t(self) -> QWeight:
        """(n, d_model) neuron-major `down`, built on first use."""
        if self._down_t is None:
            dt = transpose_neuron_major(self.down.weight, self.order)
            # each neuron's scales next to its values: axpy_rows reads one piece per active row
            self._down_t = _kernels().interleave_rows(dt) if _kernels().interleave_pays(dt) else dt
            g = 0 if self.gate is None else self.gate.row_bytes()
            # bytes per row read by decode: first projection, all three (fused kernel), down_t
            self._rb = (self.first.row_bytes(), self.up.row_bytes() + self.down_t.row_bytes() + g,
                        self.down_t.row_bytes())
        return self._down_t

    def down_column_norms(self) -> torch.Tensor:
        """||down[:, i]||^2 per neuron (hotness order): how much a unit of h_i moves the output."""
        return self.down.weight.dequantize().pow(2).sum(0).index_select(0, self.order)

    @property
    def first(self) -> QWeight:
        """The projection whose activation decides activity: gate (gated FFNs) or up."""
        return self.up if self.gate is None else self.gate

    @property
    def first_bias(self) -> torch.Tensor | None:
        return self.up_bias if self.gate is None else self.gate_bias

    @property
    def crossover(self) -> float:
        """The kept fraction above which down runs dense (its stored weight, h scattered) rather
        than `axpy_rows` over the kept rows of the q8 `down_t`: `dense_crossover`, or where the
        rows' time reaches the dense product's, by bytes and the measured cost per byte
        (`AXPY_COST`).  A q8 down (from Q6_K) gives ~0.5, a q4 one ~0.26."""
        if self.dense_crossover is not None:
            return self.dense_crossover
        self.down_t  # noqa: B018 (sets the byte counts)
        return min(1.0, self.down.weight.nbytes / (self.n_neurons * self._rb[2] * AXPY_COST))

    @property
    def up_crossover(self) -> float:
        """The kept fraction above which up runs dense rather than `gemv_rows` on the kept rows:
        `dense_crossover`, or where the rows' time reaches the dense gemv's (`GEMV_ROWS_COST`)."""
        if self.dense_crossover is not None:
            return self.dense_crossover
        return 1.0 / GEMV_ROWS_COST

    @property
    def _gate_up_intact(self) -> bool:
        """Gate and up still are the views of the fused weight (not moved or replaced)."""
        return self._gate_up is not None and self.gate is self._parts[0] and self.up is self._parts[1]

    @property
    def _dense_gate_up(self) -> bool:
        """`dense_gate_up` applies: chosen, and gate/up still are views of the fused weight."""
        return self.dense_gate_up and self._gate_up_intact

    @property
    def _fusable(self) -> bool:
        """The fused kernel computes exactly the sparsified model on any superset of the active
        rows when no threshold cut and no bias is needed (ReLU zeroes false positives itself)."""
        return (self.threshold == 0.0 and self.act_name != "drelu" and self.gate_bias is None
                and self.up_bias is None and self.kernel_act in ("silu", "relu", "gelu", "gelu_tanh"))

    # ------------------------------------------------------------------ dense (T > 1) path
    def hidden(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, d) -> (a, h), both (M, n) in hotness order, before masking."""
        g, u = self._pre(x2)
        a = self.act(g)
        if self.gate is None:
            return a, a
        if self.act_name == "drelu":
            u = F.relu(u)
        return a, a * u

    def _pre(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(M, d) -> the first projection (gate, or up of a plain FFN) and up (None when plain),
        biases added, before the activation; (M, n) each, in hotness order."""
        lin = lambda w, b: Linear(w, b)(x2)  # noqa: E731
        if self.gate is not None and x2.is_cpu and self._gate_up_intact:
            # one product over the fused gate+up rows: x is quantized once (prefill, as `MLP`)
            g, u = Linear(self._gate_up, None)(x2).split(self.n_neurons, dim=-1)
            if self.gate_bias is not None:
                g = g + self.gate_bias
            if self.up_bias is not None:
                u = u + self.up_bias
        else:
            g = lin(self.first, self.first_bias)
            u = None if self.gate is None else lin(self.up, self.up_bias)
        return g, u

    def active_mask(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The sparsified model's active set: |a| > t and h != 0."""
        return (a.abs() > self.threshold) & (h != 0)

    def mask(self, x2: torch.Tensor, a: torch.Tensor, h: torch.Tensor, per_token: bool) -> torch.Tensor:
        """Which neurons contribute, (M, n) bool.  Forced density: the top-D predicted rows
        only, per token (all rows for T > 1 without a predictor).  Otherwise the active set,
        intersected with the per-token predicted set when `per_token`."""
        if self.density is not None:
            return self._predicted_mask(x2) if per_token else torch.ones_like(h, dtype=torch.bool)
        mask = self.active_mask(a, h)
        if per_token and self.predictor is not None:
            mask &= self.predictor.mask_batch(x2)
        return mask

    def _dense(self, x2: torch.Tensor, per_token_predictor: bool) -> torch.Tensor:
        if self._one_pass_hidden(x2, per_token_predictor):
            # activation, threshold mask, gating and un-permutation in one C pass (prefill)
            g, u = self._pre(x2)
            h = _kernels().hidden_rows(g, u, self.kernel_act, self.threshold,
                                       self.order if self.permuted else None, relu_up=self.act_name == "drelu")
            return self.down(h)
        a, h = self.hidden(x2)
        mask = self.mask(x2, a, h, per_token_predictor)
        if self.observer is not None:
            self.observer(self, x2, a, h, mask)
        h = h * mask
        if self.permuted:
            h = h.index_select(1, self.inverse)
        return self.down(h)

    def _one_pass_hidden(self, x2: torch.Tensor, per_token_predictor: bool) -> bool:
        """Where the mask is the threshold alone (no forced density, no per-token predictor, no
        calibration observer) on the CPU kernels: `cpu.hidden_rows` computes h in one pass."""
        return (self.observer is None and self.density is None and x2.is_cpu
                and not (per_token_predictor and self.predictor is not None)
                and self.kernel_act in _kernels()._ACT and _kernels().available())

    def _predicted_mask(self, x2: torch.Tensor) -> torch.Tensor:
        """Forced density: the top-D rows by predictor score, per token."""
        if self.predictor is None:
            return torch.ones(x2.shape[0], self.n_neurons, dtype=torch.bool)
        top = self.predictor.scores_batch(x2).topk(self._k(), dim=1).indices
        return torch.zeros(x2.shape[0], self.n_neurons, dtype=torch.bool).scatter_(1, top, True)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        single = x.dim() < 2 or x.shape[-2] == 1  # one position per sequence: decode
        if x2.shape[0] == 1 and self._mode in ("predict", "oracle") and self.observer is None:
            return self.decode(x2[0]).view(*lead, -1)
        per_token = self._mode == "faithful" or (self._mode == "predict" and single)
        return self._dense(x2, per_token).view(*lead, -1)

    # ------------------------------------------------------------------ decode (one token)
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """x (d,) -> y (d,): predictor -> rows -> sparse kernels (threshold applied in-set), in
        one C call where it applies (`decode_args`), else `decode_py`."""
        args = self.decode_args(None)
        if args is not None and x.dtype is torch.float32 and x.is_contiguous():
            y = torch.empty(self.d_model)
            self.decode_into(x, y, args)
            return y
        return self.decode_py(x)

    def decode_py(self, x: torch.Tensor) -> torch.Tensor:
        """`decode` through the Python-driven kernels: the reference of the C step."""
        rows = self._rows(x)
        y = self._sparse_rows(x, rows)
        if self.down.bias is not None:
            y = y + self.down.bias
        return y

    def _rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Candidate active rows (hotness-order ids, int32; ascending except forced density); None: all of them
        (no predictor: the first projection runs dense and the threshold picks the rows)."""
        if self._mode == "oracle":
            a, h = self.hidden(x[None])
            return self.active_mask(a, h)[0].nonzero().view(-1).to(torch.int32)
        if self.density is not None:
            return self._forced_rows(x)
        if self.predictor is None:
            return None
        t0 = time.perf_counter()
        rows = self.predictor.active_rows(x)
        self.stats.predictor_seconds += time.perf_counter() - t0
        self.stats.bytes += self.predictor.nbytes
        return rows

    def _k(self) -> int:
        return max(1, min(self.n_neurons, round(self.density * self.n_neurons)))

    def _forced_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Exactly round(D * n) rows: the predictor's top scores, or (no pack) a random set
        per token (from a bank of `_ROW_BANK` sets drawn once per layer), a stand-in for the
        scattered rows of a ReLU model at that density."""
        k = self._k()
        if self.predictor is None:
            # drawn ahead of time: a fresh randperm + sort per layer and token costs ~0.1 ms,
            # about 10% of a 1.5B model's decode at density 0.1, which is not the model's work
            if self._row_bank is None or self._row_bank[0].numel() != k:
                g = torch.Generator().manual_seed(self.n_neurons * 31 + k)
                self._row_bank = [torch.randperm(self.n_neurons, generator=g)[:k].sort().values.to(torch.int32)
                                  for _ in range(_ROW_BANK)]
                self._row_next = [0]
            i = self._row_next[0]
            self._row_next[0] = (i + 1) % _ROW_BANK
            return self._row_bank[i]
        t0 = time.perf_counter()
        rows = self.predictor.top_rows(x, k)
        self.stats.predictor_seconds += time.perf_counter() - t0
        self.stats.bytes += self.predictor.nbytes
        return rows

    def _sparse_rows(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        cpu = _kernels()
        self.stats.tokens += 1
        if rows is None:
            return self._staged(cpu, x, None, self.threshold)
        if rows.numel() == 0:
            return torch.zeros(self.d_model)
        forced = self.density is not None
        if self._fused is None:
            self._fused = self._fusable
        if not self._records_intact and (self._fused or (forced and self._fusable_forced)):
            self._count(fused=rows.numel())
            return cpu.sparse_ffn(x, self.gate, self.up, self.down_t, rows, self.kernel_act)
        return self._staged(cpu, x, rows, -1.0 if forced else self.threshold)

    @property
    def _fusable_forced(self) -> bool:
        return self.act_name != "drelu" and self.gate_bias is None and self.up_bias is None

    def _staged(self, cpu, x: torch.Tensor, rows: torch.Tensor | None, cut: float) -> torch.Tensor:
        """First projection on the candidate rows (rows None: all, dense; with up in one pass
        when `_dense_gate_up`), threshold cut, then up on the kept rows (dense above
        `up_crossover`) and down on them (dense above `crossover`); with neuron records, up
        and down on the kept rows always (the C step's one pass over the records)."""
        n = self.n_neurons
        rec = rows is not None and self._records_intact
        u_all = None  # up of every neuron, once a dense pass has computed it
        if rows is None:
            if self._dense_gate_up:
                pre, u_all = cpu.gemv(self._gate_up, x).split(n)
                self._count(gate_up=1)
            else:
                pre = cpu.gemv(self.first, x)
                self._count(first=n)
            if self.first_bias is not None:
                pre = pre + self.first_bias
            rows = self._all_rows
        else:
            pre = cpu.gemv_rows(self.first, x, rows)
            self._count(first=rows.numel())
            if self.first_bias is not None:
                pre = pre + self.first_bias[rows]
        a = self.act(pre)
        keep = a.abs() > cut
        kept, h = rows[keep], a[keep]
        nk = kept.numel()
        self._count(kept=nk)
        if self.gate is not None and nk:
            if u_all is None and not rec and nk > self.up_crossover * n:
                u_all = cpu.gemv(self.up, x)
                self._count(up_dense=1)
            if u_all is not None:
                u = u_all[kept.long()]
            else:
                u = cpu.gemv_rows(self.up, x, kept)
                self._count(up_rows=nk)
            if self.up_bias is not None:
                u = u + self.up_bias[kept]
            if self.act_name == "drelu":
                u = F.relu(u)
            h = h * u
        if not rec and nk > self.crossover * n:  # down dense, in its stored column order
            self._count(down_dense=1)
            full = torch.zeros(n).index_copy_(0, self.order[kept.long()], h)
            return cpu.gemv(self.down.weight, full)
        if nk == 0:
            return torch.zeros(self.d_model)
        self._count(down_rows=nk)
        return cpu.axpy_rows(self.down_t, h.contiguous(), kept)

    # ------------------------------------------------------------------ neuron records
    @property
    def _records_wanted(self) -> bool:
        """Records pay where the decode step reads rows (a predictor or a forced density), the
        weights are integer formats on the CPU, and few neurons are expected active."""
        if self.records is not None:
            want = self.records
        else:
            dens = self.density if self.density is not None else self.expected_density
            want = dens is not None and dens <= RECORDS_MAX_DENSITY and not self.dense_gate_up
        ws = [self.first, self.down_t] + ([self.up] if self.gate is not None else [])
        return (want and (self.predictor is not None or self.density is not None)
                and all(w.fmt in ("q4", "q8") and w.qs.is_cpu for w in ws))

    @property
    def _records_intact(self) -> bool:
        """The weights still are the views into the records (not moved or replaced)."""
        return self._records is not None and all(map(operator.is_, self._rec_parts, (self.gate, self.up, self._down_t)))

    def build_decode_layout(self) -> None:
        """The decode step's weight copies: `down_t`, and the neuron records where they pay
        (`sparsify` calls this at load; the C step's arguments otherwise build it on first use)."""
        self.down_t  # noqa: B018
        if self._records is None and self._records_wanted:
            self.make_records()

    def make_records(self) -> None:
        """Move first (gate), up and down_t into neuron records (`neuron_records`); gate and up
        stop being views of the fused gate+up weight, whose memory is released."""
        ws = [self.first, self.up, self.down_t] if self.gate is not None else [self.up, self.down_t]
        self._records, views = _kernels().neuron_records(ws)
        if self.gate is not None:
            self.gate, self.up, self._down_t = views
        else:
            self.up, self._down_t = views
        self._gate_up, self._parts = None, (self.gate, self.up)
        self._rec_parts = (self.gate, self.up, self._down_t)

    # ------------------------------------------------------------------ C decode step
    def decode_args(self, norm: nn.Module | None) -> tuple | None:
        """Arguments of the C step `_cpu.decode_sparse_mlp` (decode.c), which computes one token
        of `decode` (norm None) or ``x + self(norm(x))`` (norm an RMSNorm) in one call: predictor,
        candidate rows, kernels and element-wise work without the ~15 Python operations per layer
        of `decode_py`.  None where it does not apply (another mode or norm, a calibration
        observer, weights off the CPU, no compiled kernels).  Built once and reused while the
        weights, predictor and settings are the same objects."""
        if self._mode != "predict" or self.observer is not None or not _kernels().available():
            return None
        key = (norm, None if norm is None else norm.weight, self.gate, self.up, self.gate_bias, self.up_bias,
               self.down.weight, self.down.bias, self.predictor, self._threshold, self.density, self.dense_crossover,
               self.dense_gate_up)
        return _reuse(self, key, lambda: self._build_decode_args(norm))

    def _build_decode_args(self, norm: nn.Module | None) -> tuple | None:
        cpu = _kernels()
        if norm is not None and (type(norm) is not RMSNorm or not norm.weight.is_cpu):
            return None
        code = cpu._ACT.get(self.kernel_act)
        weights = [self.first, self.up, self.down.weight]
        vecs = [self.first_bias, self.up_bias, self.down.bias]
        p = self.predictor
        if p is not None:
            weights += [p.w1, p.w2t]
            vecs += [p.b1, p.cut]
        if code is None or not all(w.qs.is_cpu for w in weights) or \
                not all(v is None or (v.is_cpu and v.dtype is torch.float32 and v.is_contiguous()) for v in vecs):
            return None
        gated = self.gate is not None
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        self._order32 = self.order.to(torch.int32)
        forced = self.density is not None
        fused = self._fusable or (forced and self._fusable_forced)
        topk = self._k() if forced and p is not None else 0
        pred = (*cpu._desc(p.w1), ptr(p.b1), *cpu._desc(p.w2t), ptr(p.cut)) if p is not None \
            else (*cpu._NO_GATE, 0, *cpu._NO_GATE, 0)
        self.build_decode_layout()
        flags = int(fused) | (2 if self._dense_gate_up else 0) | (4 if self._records_intact else 0)
        static = (self.d_model, code, int(self.act_name == "drelu"), flags, self.n_neurons,
                  *cpu._desc(self.first), ptr(self.first_bias),
                  *(cpu._desc(self.up) if gated else cpu._NO_GATE), ptr(self.up_bias if gated else None),
                  *cpu._desc(self.down_t), *cpu._desc(self.down.weight), self._order32.data_ptr(),
                  ptr(self.down.bias), *pred, topk, -1.0 if forced else self.threshold, self.crossover, self.up_crossover,
                  self._ccount.ctypes.data)
        return (0 if norm is None else norm.weight.data_ptr(), 0.0 if norm is None else norm.eps, static)

    def decode_into(self, x: torch.Tensor, y: torch.Tensor, args: tuple) -> None:
        """Run the C step with `decode_args`' `args` from x (d,) float32 into y (may be x)."""
        norm_ptr, eps, static = args
        if self.density is not None and self.predictor is None:
            rows = self._forced_rows(x)
            rp, nr = rows.data_ptr(), rows.numel()
        else:
            rp, nr = 0, -1
        _kernels()._cpu.decode_sparse_mlp(x.data_ptr(), y.data_ptr(), norm_ptr, eps, rp, nr, *static)

    def decode_step(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        """``x + self(norm(x))`` for one token (x (1, 1, n) float32 on the CPU) through the C step,
        or None where it does not apply."""
        return ffn_decode_step(self, x, norm, self.d_model)

    # ------------------------------------------------------------------ reference
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Slow, obvious per-token computation of what `forward` computes in the current mode:
        dense hidden activations, masked by threshold (x predictor, unless `threshold` mode)."""
        x2 = x.reshape(-1, x.shape[-1]).float()
        out = []
        for row in x2:
            a, h = self.hidden(row[None])
            mask = self.mask(row[None], a, h, per_token=self._mode in ("predict", "faithful"))
            h = (h * mask)[:, self.inverse]
            out.append(h @ self.down.weight.dequantize().T + (0 if self.down.bias is None else self.down.bias))
        return torch.cat(out).view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return (f"n_neurons={self.n_neurons}, act={self.act_name}, threshold={self.threshold:.4g}, "
                f"mode={self._mode}, predictor={'yes' if self.predictor is not None else 'no'}, "
                f"density={self.density}")
