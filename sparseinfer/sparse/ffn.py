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
  their bytes and the row kernels' cost per byte relative to a dense gemv (`crossover`,
  `up_crossover`).
  Prefill (T > 1) is dense with the threshold mask;
  batched decode (T = 1, B > 1) applies predictor x threshold masks per token.
- ``faithful`` (perplexity): every token, T > 1 included, gets predictor mask x threshold mask
  on the dense hidden activations: mathematically what per-token sparse decode computes.
- ``threshold``: dense with the threshold mask only (the quality reference of the pack).
- ``oracle``: decode on exactly the active rows (computed densely); for tests.
One token in ``predict`` mode runs as one C call on the layer's decode plan (`step`,
`kernels.decode_plan`, csrc/decode.c: predictor, row choice, kernels, counters);
`reference_token` computes the same with `kernels.reference.sparse_ffn_token`, the slow,
obvious version of that algorithm, and runs where the C step does not (no compiled kernels,
weights on an accelerator).
Layers that read rows (a predictor or a forced density) and expect at most half their neurons
active keep each neuron's first, up and down_t rows in one contiguous *record*
(`make_records`, `kernels.cpu.neuron_records`): the C step then reads one block per active
neuron in a single pass, up and down always on the kept rows.  Prefill's threshold-masked
hidden activations come from one C pass (`kernels.cpu.hidden_rows`) where the mask is the
threshold alone.
A predictor that reads the residual stream (``predictor.reads == "residual"``: a PowerInfer
Falcon or OPT file's, trained on the stream before a LayerNorm) is given that stream by the
block (``ffn(x, residual=...)``); one token then picks its rows from it in Python and the C step
runs on those rows (it never runs such a predictor itself).
`density` (bench): force the active fraction to D: the top-D rows by predictor score, or a
random set of rows per token (from a bank drawn once) when there is no predictor (speed only;
see `_forced_rows`).
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu, decode_plan
from ..kernels import reference as ref
from ..kernels.decode_plan import FFNStep
from ..kernels.reference import canonical_activation
from ..models.layers import MLP, Linear, Module, RMSNorm, fuse_weights
from ..quant import FLOAT_FORMATS, TILE_FORMATS, QWeight, from_float, row_major

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
    `from_float(down.dequantize().T[order])`, bit for bit)."""
    full = cpu.dequantize_rows(down) if cpu.available() else down.dequantize()
    ft = full.T
    fmt = down.fmt if down.fmt in FLOAT_FORMATS else "q8"
    parts = [from_float(ft[r0:r0 + _TRANSPOSE_SLICE], fmt) for r0 in range(0, ft.shape[0], _TRANSPOSE_SLICE)]
    del full, ft
    order = order.long()
    pick = lambda ts: torch.cat(ts).index_select(0, order)  # noqa: E731
    return QWeight(fmt, len(order), down.rows, pick([p.qs for p in parts]),
                   None if parts[0].d is None else pick([p.d for p in parts]), None)


_ROW_BANK = 64  # random row sets per layer for forced density without a predictor

# Time per byte of the sparse kernels on many rows, relative to a dense gemv of the stored
# weight; they set the dense crossovers (`SparseFFN.crossover`, `up_crossover`).  Tuned
# constants: `python benchmarks/kernels.py` gives the kernel ratio (axpy_rows / gemv_rows at
# active fraction 1 against the dense gemv of the same shape), then decode of a model with
# its pack at a high kept fraction (`python benchmarks/sparsity_bench.py`) places the point
# where the dense product wins; AXPY_COST sits above the kernel ratio because in decode the
# dense down won earlier than that ratio alone predicts.
AXPY_COST = 2.0
GEMV_ROWS_COST = 1.4

# Neuron records (`SparseFFN.records`) for layers whose expected (profiled or forced) active
# fraction is at most this: their up and down then always run on the kept rows.
RECORDS_MAX_DENSITY = 0.5

# Attributes the C step is built from: setting one drops it (`SparseFFN.__setattr__`).
_STEP_INPUTS = frozenset({"_threshold", "_mode", "density", "predictor", "dense_crossover", "dense_gate_up", "records",
                          "observer", "gate", "up", "_down_t", "down", "gate_bias", "up_bias", "_records", "_gate_up"})


class SparseFFN(Module):
    """Activation-sparse FFN with the `MLP` call signature (see the module docstring)."""

    def __init__(self, mlp: MLP, threshold: float = 0.0, order: torch.Tensor | None = None,
                 predictor=None, mode: str = "predict", density: float | None = None,
                 expected_density: float | None = None):
        super().__init__()
        n = mlp.n_neurons
        self.n_neurons, self.d_model = n, mlp.down.out_features
        self.act_name, self.act = mlp.act_name, mlp.act
        self.kernel_act = canonical_activation(mlp.act_name)
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
            if not self.permuted and mlp._intact() and mlp._gate_up.weight.fmt not in TILE_FORMATS:
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
        self._stats = DecodeStats()  # counters of C steps dropped since the last reset
        self._row_bank: list[torch.Tensor] | None = None  # forced density without a predictor
        self._row_next = [0]  # next set of the bank (a list: no Module.__setattr__ per token)
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
        """`w`'s rows in hotness order, row-major (the sparse kernels address rows)."""
        return w.select_rows(self.order) if self.permuted else row_major(w)

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
        """Counters of the single-token path (the C step's, translated into rows and bytes)."""
        st = DecodeStats(**vars(self._stats))
        step = decode_plan.built_step(self)
        if isinstance(step, FFNStep):
            self._add_counters(st, step.stats)
        return st

    def reset_stats(self) -> None:
        self._stats.reset()
        step = decode_plan.built_step(self)
        if isinstance(step, FFNStep):
            step.reset_stats()

    def _add_counters(self, st: DecodeStats, c) -> None:
        """Add the C step's counters `c` (`cstructs.FFNStats`) to `st` as rows and bytes read."""
        self.down_t  # noqa: B018 (sets the byte counts)
        n, rb = self.n_neurons, self._rb
        st.tokens += c.tokens
        st.rows += ((3 if self.gate is not None else 2) * c.fused_rows + c.first_rows + 2 * n * c.gate_up_passes
                    + n * c.dense_ups + c.up_rows + n * c.dense_downs + c.down_rows)
        st.kept += c.fused_rows + c.kept
        st.bytes += (c.fused_rows * rb[1] + c.first_rows * rb[0] + c.down_rows * rb[2]
                     + c.dense_downs * self.down.weight.nbytes)
        if self.gate is not None:
            st.bytes += c.dense_ups * self.up.nbytes + c.up_rows * self.up.row_bytes()
            if c.gate_up_passes:
                st.bytes += c.gate_up_passes * (self.gate.nbytes + self.up.nbytes)
        if self.predictor is not None:
            st.bytes += c.predictions * self.predictor.nbytes
        st.predictor_seconds += c.predictor_seconds

    @property
    def down_t(self) -> QWeight:
        """(n, d_model) neuron-major `down`, built on first use."""
        if self._down_t is None:
            dt = transpose_neuron_major(self.down.weight, self.order)
            # each neuron's scales next to its values: axpy_rows reads one piece per active row
            self._down_t = cpu.interleave_rows(dt) if cpu.interleave_pays(dt) else dt
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
        rows' time reaches the dense product's, by bytes and the relative cost per byte
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

    def mask(self, x2: torch.Tensor, a: torch.Tensor, h: torch.Tensor, per_token: bool,
             p2: torch.Tensor | None = None) -> torch.Tensor:
        """Which neurons contribute, (M, n) bool.  Forced density: the top-D predicted rows
        only, per token (all rows for T > 1 without a predictor).  Otherwise the active set,
        intersected with the per-token predicted set when `per_token`.  p2: what the predictor
        reads (`predictor_input`), default x2."""
        p2 = x2 if p2 is None else p2
        if self.density is not None:
            return self._predicted_mask(p2) if per_token else torch.ones_like(h, dtype=torch.bool)
        mask = self.active_mask(a, h)
        if per_token and self.predictor is not None:
            mask &= self.predictor.mask_batch(p2)
        return mask

    @property
    def reads_residual(self) -> bool:
        """The predictor reads the residual stream, not this FFN's input (see the module docstring)."""
        return self.predictor is not None and getattr(self.predictor, "reads", "ffn_input") == "residual"

    def predictor_input(self, x2: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """(M, d) rows the predictor reads: x2, or the residual stream where it reads that (an
        error when the caller did not pass it: its decisions would be made on the wrong input)."""
        if not self.reads_residual:
            return x2
        if residual is None:
            raise ValueError("this layer's predictor reads the residual stream before the FFN's norm (a PowerInfer "
                             "Falcon or OPT file's); call the FFN with residual=the block's stream")
        r2 = residual.reshape(-1, residual.shape[-1]).float().contiguous()
        if r2.shape != x2.shape:
            raise ValueError(f"residual stream of shape {tuple(r2.shape)} for FFN input {tuple(x2.shape)}")
        return r2

    def _dense(self, x2: torch.Tensor, per_token_predictor: bool, p2: torch.Tensor | None = None) -> torch.Tensor:
        if self._one_pass_hidden(x2, per_token_predictor):
            # activation, threshold mask, gating and un-permutation in one C pass (prefill)
            g, u = self._pre(x2)
            h = cpu.hidden_rows(g, u, self.kernel_act, self.threshold,
                                       self.order if self.permuted else None, relu_up=self.act_name == "drelu")
            return self.down(h)
        a, h = self.hidden(x2)
        mask = self.mask(x2, a, h, per_token_predictor, p2)
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
                and self.kernel_act in cpu._ACT and cpu.available())

    def _predicted_mask(self, x2: torch.Tensor) -> torch.Tensor:
        """Forced density: the top-D rows by predictor score, per token."""
        if self.predictor is None:
            return torch.ones(x2.shape[0], self.n_neurons, dtype=torch.bool)
        top = self.predictor.scores_batch(x2).topk(self._k(), dim=1).indices
        return torch.zeros(x2.shape[0], self.n_neurons, dtype=torch.bool).scatter_(1, top, True)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: the FFN's input; residual: the stream the block normalized into x (read only by a
        predictor that reads it, `reads_residual`)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        single = x.dim() < 2 or x.shape[-2] == 1  # one position per sequence: decode
        p2 = self.predictor_input(x2, residual) if self.reads_residual else None
        if x2.shape[0] == 1 and self._mode in ("predict", "oracle") and self.observer is None:
            return self.decode(x2[0], None if p2 is None else p2[0]).view(*lead, -1)
        per_token = self._mode == "faithful" or (self._mode == "predict" and single)
        return self._dense(x2, per_token, p2).view(*lead, -1)

    # ------------------------------------------------------------------ decode (one token)
    def decode(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (d,) -> y (d,): predictor -> candidate rows -> sparse kernels (threshold applied
        within the candidates), through the C step where it applies (`step`), else the
        reference (`reference_token`).  residual (d,): what a residual-reading predictor reads."""
        step = self.step(None)
        if step is None or not x.is_cpu:
            return self.reference_token(x, residual)
        y = torch.empty(self.d_model)
        if self._mode == "oracle":
            rows = self._oracle_rows(x)
        elif self.reads_residual:
            rows = self._residual_rows(self.predictor_input(x[None], None if residual is None else residual[None])[0])
        else:
            rows = None
        step.run(x.float().contiguous(), y, rows)
        return y

    def _residual_rows(self, r: torch.Tensor) -> torch.Tensor:
        """A residual-reading predictor's rows for one token (int32 ascending; its k best under
        a forced density), through the kernels the C step would use; counted in `stats`."""
        t0 = time.perf_counter()
        p = self.predictor
        rows = p.top_rows(r, self._k()) if self.density is not None else p.active_rows(r)
        self._stats.bytes += p.nbytes
        self._stats.predictor_seconds += time.perf_counter() - t0
        return rows

    def reference_token(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`decode` by the slow, obvious one-token algorithm (`reference.sparse_ffn_token`)."""
        if self._mode == "oracle":
            rows = self._oracle_rows(x)
        elif self.density is not None and self.predictor is None:
            rows = self._forced_rows(x)
        elif self.predictor is not None:
            p = self.predictor
            xp = self.predictor_input(x[None], None if residual is None else residual[None])[0]
            # the predictor's first product through the kernels the C step uses on the CPU, so a
            # score at the cut decides the same way in both
            rows = ref.predict_rows(xp.float(), p.w1, p.b1, p.w2t, p.cut, self._k() if self.density is not None else 0,
                                    matvec=cpu.gemv if x.is_cpu else None)
        else:
            rows = None
        y = ref.sparse_ffn_token(x.float(), self.first, self.up if self.gate is not None else None, self.down_t,
                                 self.kernel_act, -1.0 if self.density is not None else self.threshold, rows,
                                 self.first_bias, self.up_bias if self.gate is not None else None,
                                 relu_up=self.act_name == "drelu")
        return y if self.down.bias is None else y + self.down.bias

    def _oracle_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Exactly the active rows of this token, computed densely (tests)."""
        a, h = self.hidden(x.float()[None])
        return self.active_mask(a, h)[0].nonzero().view(-1).to(torch.int32)

    def _k(self) -> int:
        return max(1, min(self.n_neurons, round(self.density * self.n_neurons)))

    def _forced_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Forced density without a predictor: exactly round(D * n) random rows per token (from
        a bank of `_ROW_BANK` sets drawn once per layer), a stand-in for the scattered rows of
        a ReLU model at that density; drawn ahead of time so the draw is not counted as the
        model's work."""
        k = self._k()
        if self._row_bank is None or self._row_bank[0].numel() != k:
            g = torch.Generator().manual_seed(self.n_neurons * 31 + k)
            self._row_bank = [torch.randperm(self.n_neurons, generator=g)[:k].sort().values.to(torch.int32)
                              for _ in range(_ROW_BANK)]
            self._row_next = [0]
        i = self._row_next[0]
        self._row_next[0] = (i + 1) % _ROW_BANK
        return self._row_bank[i]

    @property
    def _fusable_forced(self) -> bool:
        return self.act_name != "drelu" and self.gate_bias is None and self.up_bias is None


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
        self._records, views = cpu.neuron_records(ws)
        if self.gate is not None:
            self.gate, self.up, self._down_t = views
        else:
            self.up, self._down_t = views
        self._gate_up, self._parts = None, (self.gate, self.up)
        self._rec_parts = (self.gate, self.up, self._down_t)

    # ------------------------------------------------------------------ C decode step
    def step(self, norm: nn.Module | None) -> FFNStep | None:
        """The C step of one token (`kernels.decode_plan.sparse_ffn_step`): `decode` (norm None)
        or ``x + self(norm(x))`` (norm an RMSNorm), built on first use and rebuilt after a
        setting changes; None where it does not apply (another mode or norm, a calibration
        observer, weights off the CPU, no compiled kernels)."""
        return decode_plan.cached_step(self, tuple, lambda: self._build_step(norm), norm)

    def _build_step(self, norm: nn.Module | None) -> FFNStep | None:
        old = decode_plan.built_step(self)
        if isinstance(old, FFNStep):  # rebuilt (e.g. for another norm): keep its counters
            self._add_counters(self._stats, old.stats)
        if self._mode not in ("predict", "oracle") or self.observer is not None or not decode_plan.available():
            return None
        if norm is not None and (type(norm) is not RMSNorm or self._mode == "oracle" or self.reads_residual):
            return None  # (oracle and residual-predicted rows come from `decode`, which passes them)
        p = None if self.reads_residual else self.predictor  # (never run by C on the FFN input)
        if not decode_plan.on_cpu(self.first, self.up, self.down.weight, self.first_bias, self.up_bias, self.down.bias,
                                  None if norm is None else norm.weight, *(() if p is None else (p.w1, p.w2t))):
            return None
        self.build_decode_layout()
        forced = self.density is not None
        gated = self.gate is not None
        return decode_plan.sparse_ffn_step(
            act=self.kernel_act, relu_up=self.act_name == "drelu", first=self.first, second=self.up if gated else None,
            down_t=self.down_t, down=self.down.weight, order=self.order, threshold=-1.0 if forced else self.threshold,
            crossover=self.crossover, up_crossover=self.up_crossover, first_bias=self.first_bias,
            second_bias=self.up_bias if gated else None, down_bias=self.down.bias, predictor=p,
            topk=self._k() if forced and p is not None else 0,
            fused=self._fusable or (forced and self._fusable_forced), gate_up_fused=self._dense_gate_up,
            records=self._records_intact, forced_rows=self._forced_rows if forced and self.predictor is None else None,
            norm_w=None if norm is None else norm.weight, eps=0.0 if norm is None else norm.eps)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in _STEP_INPUTS and "_step" in self.__dict__:  # the C step was built from the old value
            got = decode_plan.drop_step(self)
            if isinstance(got, FFNStep):
                self._add_counters(self._stats, got.stats)


    # ------------------------------------------------------------------ reference
    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Slow, obvious per-token computation of what `forward` computes in the current mode:
        dense hidden activations, masked by threshold (x predictor, unless `threshold` mode)."""
        x2 = x.reshape(-1, x.shape[-1]).float()
        p2 = self.predictor_input(x2, residual)
        out = []
        for row, prow in zip(x2, p2):
            a, h = self.hidden(row[None])
            mask = self.mask(row[None], a, h, per_token=self._mode in ("predict", "faithful"), p2=prow[None])
            h = (h * mask)[:, self.inverse]
            out.append(h @ self.down.weight.dequantize().T + (0 if self.down.bias is None else self.down.bias))
        return torch.cat(out).view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return (f"n_neurons={self.n_neurons}, act={self.act_name}, threshold={self.threshold:.4g}, "
                f"mode={self._mode}, predictor={'yes' if self.predictor is not None else 'no'}, "
                f"density={self.density}")
