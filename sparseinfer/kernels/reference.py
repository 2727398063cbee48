"""Slow, obviously correct kernels: torch on `w.dequantize()`.

Same signatures as `sparseinfer.kernels.cpu`; they define what the fast kernels compute.

Accuracy contract of the fast kernels against these:

- float formats (f32/f16/bf16): weights are converted exactly to f32 and multiplied in f32,
  so only the summation order differs: ``|y - ref| <= 1e-5 * sum_k |w_k x_k|`` (+ 1e-30).
  For q8/q4 the same relative term uses ``|d*q| + |m|`` in place of ``|w|`` (`magnitude`),
  since the kernels add the two parts separately and they can cancel.
- integer formats (q8/q4/q6/q4k, and tq4 / tq6 / tq4k as q4 / q6 / q4k): the fast kernels quantize the
  activation x per block of 32 (per super-block of 256 for q4k and tq4k, llama.cpp's Q8_K;
  `activation_group`) to int8:
  ``d_hi = amax/127``, ``q_hi = round(x/d_hi)`` (`quantize_activation`, llama.cpp's Q8
  activations; mode "int8", the default), so each x value is off by at most d_hi/2 (~1e-2 of
  ``sum |w x|``).  In mode "precise" (`cpu.set_activation_mode`, $SPARSEINFER_ACT_MODE) a
  second int8 term q_lo, d_lo quantizes the f32 residual ``r = x - d_hi*q_hi`` the same way
  (`quantize_activation2`), ``x ~ d_hi*q_hi + d_lo*q_lo``, each value off by at most
  ``d_lo/2`` (about amax/32000): roughly f32-level relative error (~1e-5 of ``sum |w x|``).
  The ``m`` term uses each term's block sums ``d*sum(q)``, i.e. the same rounded x as the
  products, so the rounding error meets the true weights ``d*q + m`` (centred) rather than
  the nibbles ``d*q`` (offset by ~8d for q4).  So
  ``|y - ref| <= sum_b (step_b / 2) * sum_{k in b} |w_k|  +  1e-5 * sum_k |w_k x_k|``
  (`error_bound`), step = d_hi ("int8") or d_lo ("precise").
  Against `gemv_emulated` (the same arithmetic with the rounding of x reproduced) the
  difference is only summation order, like the float formats.
- `axpy_rows` never quantizes its coefficients h: float contract for every format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparseinfer.quant import (BLOCK, Q4K_BLOCK, TILE_FORMATS, ColWeight, QWeight, from_tiles, padded, q4k_affine,
                               unpack_nibbles, unpack_q6)

INT_FORMATS = ("q8", "q4", "q6", "q4k", "tq4", "tq6", "tq4k")


def activation_group(fmt: str) -> int:
    """How many activation values share one int8 scale in a format's integer products."""
    return Q4K_BLOCK if fmt in ("q4k", "tq4k") else BLOCK

# The activation table: every name a config may use, mapped to the one of ACTIVATIONS that
# computes it (the C kernels' names, in the order of their ACT_* codes).  dReLU (Bamboo,
# TurboSparse) is ReLU on gate and on up: its `relu_up` flag is set by the FFN.
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_tanh")
ACTIVATION_ALIASES = {"swish": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "drelu": "relu"}
_ACT_FNS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def canonical_activation(name: str) -> str:
    """A config's activation name as one of ACTIVATIONS; ValueError for an unknown one."""
    got = ACTIVATION_ALIASES.get(name, name)
    if got not in ACTIVATIONS:
        known = ", ".join((*ACTIVATIONS, *ACTIVATION_ALIASES))
        raise ValueError(f"activation {name!r} is not supported (supported: {known})")
    return got


def activation_fn(name: str):
    """The torch function of activation `name` (any spelling of the table)."""
    return _ACT_FNS[canonical_activation(name)]


def activation(name: str, v: torch.Tensor) -> torch.Tensor:
    return activation_fn(name)(v)


def gemv(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """y[N] = W x."""
    return w.dequantize() @ x.float()


def matmul(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """Y[M, N] = X W^T."""
    return x.float() @ w.dequantize().T


def matmul_bf16(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """Y[M, N] = X W^T with X and W rounded to bfloat16, summed in float64, Y rounded to bfloat16."""
    xb, wb = x.float().bfloat16().double(), w.dequantize().bfloat16().double()
    return (xb @ wb.T).float().bfloat16().float()


def gemv_rows(w: QWeight, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y[j] = W[rows[j]] . x."""
    return w.dequantize()[rows.long()] @ x.float()


def axpy_rows(wt: QWeight, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y[wt.cols] = sum_j h[j] * Wt[rows[j]]."""
    return h.float() @ wt.dequantize()[rows.long()]


def input_mask(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Input sparsity (TEAL): x with every value of magnitude <= thr set to zero."""
    return torch.where(x.abs() > thr, x, torch.zeros((), dtype=x.dtype))


def gemv_cols(w: ColWeight, x: torch.Tensor, thr: float) -> tuple[torch.Tensor, int]:
    """(W input_mask(x, thr), inputs kept) in float64 (the model the fast kernel computes)."""
    xm = input_mask(x.double(), thr)
    return w.dequantize().double() @ xm, int((x.abs() > thr).sum())


def gemv_cols_list(w: ColWeight, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """y = sum_j h[j] * W[:, idx[j]] in float64."""
    return w.dequantize().double()[:, idx.long()] @ h.double()


def select_ids(p: torch.Tensor, thr: float, extra=None) -> torch.Tensor:
    """The ids i with p[i] >= thr or in `extra` (ids outside [0, len(p)) ignored), ascending."""
    keep = p >= thr
    if extra is not None and len(extra):
        e = torch.as_tensor(list(extra), dtype=torch.long)
        keep[e[(e >= 0) & (e < p.numel())]] = True
    return torch.nonzero(keep).view(-1)


def gemv_cols_emulated(w: ColWeight, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """W (x where keep) with the fast kernels' rounding of x reproduced, in float64: per group
    of 32 inputs, the kept ones as int8 (d_x = max|x|/127 over them, q = round(x / d_x)); the
    kernels differ from this only in summation order.  `keep`: a boolean mask of the inputs
    (`x.abs() > thr` for `gemv_cols`, the listed ones for `gemv_cols_list`)."""
    q, dx, _ = quantize_activation(torch.where(keep, x.float(), torch.zeros(())))  # zeros quantize to 0
    xr = (q.view(-1, BLOCK).double() * dx.double()[:, None]).reshape(-1)[: w.cols]
    return w.dequantize().double() @ xr


def sparse_ffn(x: torch.Tensor, gate: QWeight | None, up: QWeight, down_t: QWeight,
               rows: torch.Tensor, act: str) -> torch.Tensor:
    """FFN restricted to neurons `rows`: h = act(gate x) * (up x) (or act(up x)), y = h @ down_t."""
    u = gemv_rows(up, x, rows)
    h = activation(act, u) if gate is None else activation(act, gemv_rows(gate, x, rows)) * u
    return axpy_rows(down_t, h, rows)


def predict_rows(x: torch.Tensor, w1: QWeight, b1: torch.Tensor, w2t: QWeight, cut: torch.Tensor,
                 topk: int = 0, matvec=None) -> torch.Tensor:
    """A predictor's rows for one token x (d,), ascending: score = W2t^T relu(W1 x + b1);
    neuron k is active when score_k > cut_k, or (topk > 0) the topk highest score_k - cut_k
    (ties: the lowest ids).  matvec(w, x) -> W x (default `gemv`); W2t^T z is computed as
    z @ W2t, never re-quantizing z."""
    z = torch.relu((matvec or gemv)(w1, x) + b1)
    score = z @ w2t.dequantize().to(z.device)
    if topk <= 0:
        return (score > cut).nonzero().view(-1)
    best = (score - cut).sort(descending=True, stable=True).indices[:topk]
    return best.sort().values


def sparse_ffn_token(x: torch.Tensor, first: QWeight, second: QWeight | None, down_t: QWeight, act: str,
                     threshold: float, rows: torch.Tensor | None = None, first_bias: torch.Tensor | None = None,
                     second_bias: torch.Tensor | None = None, relu_up: bool = False,
                     rows_gemv=None, rows_axpy=None) -> torch.Tensor:
    """The one-token activation-sparse FFN: the algorithm `csrc/decode.c` runs (its C step).

    Neurons are in hotness order; first = gate (or up of a plain FFN), second = up or None,
    down_t = the down projection neuron-major (one row per neuron).  Over the candidate rows
    (default all): a = act(first x + b), h = a * (second x + b) (ReLU'd for dReLU; h = a
    without second); a neuron counts only when |a| > threshold; y = sum_k h_k down_t[k].
    rows_gemv / rows_axpy: the row products (default this module's; the hybrid FFN's device
    part passes torch ones).  Masked rather than compacted, so nothing waits on the device."""
    gemv_r, axpy_r = rows_gemv or gemv_rows, rows_axpy or axpy_rows
    if rows is None:
        rows = torch.arange(first.rows, device=x.device)
    rows = rows.long()
    if rows.numel() == 0:
        return torch.zeros(down_t.cols, device=x.device)
    pre = gemv_r(first, x, rows)
    if first_bias is not None:
        pre = pre + first_bias[rows]
    a = activation(act, pre)
    h = a
    if second is not None:
        u = gemv_r(second, x, rows)
        if second_bias is not None:
            u = u + second_bias[rows]
        h = a * (F.relu(u) if relu_up else u)
    return axpy_r(down_t, h * (a.abs() > threshold), rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float64."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


# ---------------------------------------------------------------- integer-format emulation

def quantize_activation(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' 8-bit activation quantizer: (q int8 (Kp,), d f32 (nb,), s f32 (nb,)).

    Per group of `group` values (32, or 256 for q4k; x padded with zeros): d = amax/127,
    q = round(x * (127/amax)) (ties to even); d is given per block of 32 (equal within a
    group) and s = d * sum(q) in f32 per block of 32 (the block's sum as the products see it;
    for the ``m`` term)."""
    x = x.float().reshape(-1)
    kp = padded(x.numel())
    kg = (kp + group - 1) // group * group
    xp = torch.zeros(kg)
    xp[: x.numel()] = x
    b = xp.view(-1, group)
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv[:, None]).to(torch.int8).reshape(kg)[:kp]
    d = (amax / 127.0).repeat_interleave(group // BLOCK)[: kp // BLOCK]
    return q, d, d * q.view(-1, BLOCK).sum(-1, dtype=torch.int32).float()


MODES = ("int8", "precise")


def quantize_activation2(x: torch.Tensor, group: int = BLOCK):
    """The kernels' two-term activation quantizer ("precise"): (q_hi, d_hi, q_lo, d_lo, s).
    q_hi, d_hi as `quantize_activation`; q_lo, d_lo are `quantize_activation` of the f32
    residual ``x - d_hi*q_hi`` (product rounded to f32, then the difference); s (float64) =
    the two terms' block sums added."""
    x = x.float().reshape(-1)
    qh, dh, sh = quantize_activation(x, group)
    kp = qh.numel()
    xp = torch.zeros(kp)
    xp[: x.numel()] = x
    r = xp.view(-1, BLOCK) - dh[:, None] * qh.view(-1, BLOCK).float()
    ql, dl, sl = quantize_activation(r.reshape(kp)[: x.numel()], group)
    return qh, dh, ql, dl, sh.double() + sl.double()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"activation mode must be one of {MODES} (got {mode!r})")


def activation_rounded(x: torch.Tensor, mode: str = "int8", group: int = BLOCK) -> torch.Tensor:
    """(nb, 32) float64: x as the integer-format kernels see it in `mode` (padded with zeros)."""
    _check_mode(mode)
    if mode == "precise":
        qh, dh, ql, dl, _ = quantize_activation2(x, group)
        return (qh.double().view(-1, BLOCK) * dh.double()[:, None]
                + ql.double().view(-1, BLOCK) * dl.double()[:, None])
    q, d, _ = quantize_activation(x, group)
    return q.double().view(-1, BLOCK) * d.double()[:, None]


def gemv_emulated(w: QWeight, x: torch.Tensor, mode: str = "int8") -> torch.Tensor:
    """y = W x for q8/q4/q6 with x rounded exactly as the fast kernels do in `mode` (float64)."""
    _check_mode(mode)
    g = activation_group(w.fmt)
    s = quantize_activation2(x, g)[4] if mode == "precise" else quantize_activation(x, g)[2].double()
    xdq = activation_rounded(x, mode, g)  # (nb, 32)
    codes, m = _affine(w)
    y = codes @ xdq.reshape(-1)
    if m is not None:
        y = y + m @ s
    return y


def magnitude(w: QWeight) -> torch.Tensor:
    """(rows, cols) float64 |d*q| + |m| (|w| for float formats): the size of the terms a
    kernel adds, which is what rounding errors scale with (d*q and m can cancel)."""
    if w.fmt not in INT_FORMATS:
        return w.dequantize().double().abs()
    codes, m = _affine(w)
    a = codes.abs().view(w.rows, -1, BLOCK)
    if m is not None:
        a = a + m.abs()[..., None]
    return a.reshape(w.rows, -1)[:, : w.cols]


def _affine(w: QWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d*q (rows, Kp), m (rows, nb) or None) in float64: an integer-format weight as the
    kernels split it, value = d*q + m per block of 32."""
    if w.fmt in TILE_FORMATS:
        return _affine(from_tiles(w))
    if w.fmt == "q4k":
        q, step, off = q4k_affine(w)
        return (q.double().view(w.rows, -1, BLOCK) * step.double()[..., None]).view(w.rows, -1), off.double()
    return _scaled_codes(w), None if w.m is None else w.m.double()


def _scaled_codes(w: QWeight) -> torch.Tensor:
    """(rows, Kp) float64 d*q of a q8/q4/q6 weight (q - 32 for q6), without the m term."""
    if w.fmt == "q6":
        q = unpack_q6(w.qs).double() - 32
        return (q.view(w.rows, -1, 16) * w.d.double()[..., None]).view(w.rows, -1)
    q = w.qs.double() if w.fmt == "q8" else unpack_nibbles(w.qs).double()
    return (q.view(w.rows, -1, BLOCK) * w.d.double()[..., None]).view(w.rows, -1)


def error_bound(w: QWeight, x: torch.Tensor, mode: str = "int8") -> torch.Tensor:
    """Per-row bound of |fast - reference| for gemv in activation `mode`, from the contract
    above (float64)."""
    _check_mode(mode)
    xd = x.double().reshape(-1)
    fl = 1e-5 * (magnitude(w) @ xd.abs()) + 1e-30
    if w.fmt not in INT_FORMATS:
        return fl
    g = activation_group(w.fmt)
    d = quantize_activation2(x, g)[3] if mode == "precise" else quantize_activation(x, g)[1]
    kp = padded(w.cols)
    wa = torch.zeros(w.rows, kp, dtype=torch.float64)
    wa[:, : w.cols] = w.dequantize().double().abs()
    return wa.view(w.rows, -1, BLOCK).sum(-1) @ (d.double() / 2) + fl
