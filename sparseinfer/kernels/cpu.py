"""Fast CPU kernels: quantized dense and activation-sparse products (C, SIMD, threads).

A thin wrapper over the compiled extension `sparseinfer._cpu` (sources in
`sparseinfer/csrc`): checks the inputs, then passes data pointers.  The extension picks
AVX-512 VNNI / AVX-512 / AVX2 / scalar kernels at run time (`simd_level()`), runs them on its
own thread pool (`set_num_threads`), and gives bit-identical results across runs and thread
counts.  Integer formats quantize x per block of 32 to int8 (llama.cpp's Q8 activations;
`set_activation_mode("precise")` adds a second int8 term, about f32 accuracy); the accuracy
contract is in `sparseinfer.kernels.reference`.  Without the compiled extension every function falls back
to the reference (with one warning).

All inputs are CPU tensors; x float32; row ids int32 (int64 is converted); outputs float32.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F

import ctypes

from sparseinfer.kernels import reference
from sparseinfer.kernels.cstructs import QMat, check_layout
from sparseinfer.kv_cache import KV_CODES, row_bytes, storage_dtype
from sparseinfer.quant import FORMATS, Q4K_BLOCK, Q4K_BYTES, TILE_FORMATS, ColWeight, QWeight, tiles_shape, to_tiles

try:
    from sparseinfer import _cpu

    check_layout(_cpu)
except ImportError as e:  # no compiler at install time, or a stale build
    _cpu = None
    _IMPORT_ERROR = e

__all__ = ["gemv", "matmul", "gemv_rows", "axpy_rows", "sparse_ffn", "rms_norm", "attend1", "matmul_f32", "matmul_bf16", "dequantize_rows", "set_num_threads",
           "get_num_threads", "simd_level", "neuron_records", "interleave_rows", "interleave_pays", "empty_records_like", "is_interleaved", "stacked_view", "hidden_rows", "set_activation_mode", "activation_mode", "ACTIVATION_MODES", "available", "empty_hugepages"]

_FMT = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4, "q6": 5, "q4k": 6, "tq4": 7, "tq6": 8, "tq4k": 9}
_ACT = {"silu": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3}
_QS_DTYPE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
             "q8": torch.int8, "q4": torch.uint8, "q6": torch.uint8, "q4k": torch.uint8, "tq4": torch.uint8, "tq6": torch.uint8, "tq4k": torch.uint8}
_F32 = torch.float32
_I32 = torch.int32
_Tensor = torch.Tensor
_warned = False


def available() -> bool:
    """True when the compiled kernels are in use (False: reference fallback)."""
    return _cpu is not None


def _require() -> None:
    if _cpu is None:
        raise RuntimeError(f"sparseinfer._cpu is not built ({_IMPORT_ERROR}); reinstall with a C compiler (gcc)")


def _fallback() -> bool:
    global _warned
    if _cpu is None:
        if not _warned:
            warnings.warn(f"sparseinfer._cpu is not built ({_IMPORT_ERROR}); using the slow reference "
                          "kernels. Reinstall with a C compiler (gcc) available.", RuntimeWarning, stacklevel=3)
            _warned = True
        return True
    return False


def _desc(w: QWeight) -> int:
    """The address of the weight's C descriptor (a `cstructs.QMat`), built and cached on the
    QWeight after checking its tensors once.  Rows may be strided (row views into a larger
    buffer, e.g. `SparseFFN`'s neuron records); values within a row must be contiguous."""
    return qmat(w)[1]


def qmat(w: QWeight) -> tuple[QMat, int]:
    """(`QMat`, its address) describing `w` to C; cached while w's tensors stay the same."""
    c = w.__dict__.get("_cpu_desc")
    if c is not None and c.qs is w.qs and c.d is w.d and c.m is w.m and c.desc.qs == w.qs.data_ptr():
        return c.desc, c.addr
    if not isinstance(w, QWeight):
        raise ValueError(f"expected a QWeight, got {type(w).__name__}")
    if w.fmt not in _FMT:
        raise ValueError(f"unknown weight format {w.fmt!r}; expected one of {FORMATS + TILE_FORMATS}")
    kp = (w.cols + 31) // 32 * 32
    shapes = {"f32": (w.rows, w.cols), "f16": (w.rows, w.cols), "bf16": (w.rows, w.cols),
              "q8": (w.rows, kp), "q4": (w.rows, kp // 2), "q6": (w.rows, kp // 4 * 3),
              "q4k": (w.rows, w.cols // Q4K_BLOCK * Q4K_BYTES), "tq4": tiles_shape(w.rows, w.cols, "tq4"),
              "tq6": tiles_shape(w.rows, w.cols, "tq6"), "tq4k": tiles_shape(w.rows, w.cols, "tq4k")}
    if w.fmt in TILE_FORMATS and (w.d is not None or w.m is not None or not w.qs.is_contiguous()):
        raise ValueError(f"{w.fmt} weight needs contiguous tiles and no separate scales")
    if w.fmt in ("q4k", "tq4k") and (w.cols % Q4K_BLOCK or w.d is not None or w.m is not None):
        raise ValueError(f"q4k weight needs a multiple of {Q4K_BLOCK} columns (got {w.cols}) and no separate scales")
    qst = _check_tensor(w.qs, f"{w.fmt} weight qs", _QS_DTYPE[w.fmt], shapes[w.fmt])
    d = m = dst = 0
    if w.fmt in ("q8", "q4", "q6"):
        if w.d is None:
            raise ValueError(f"{w.fmt} weight needs scales d")
        dst = _check_tensor(w.d, "scales d", torch.float16, (w.rows, kp // (16 if w.fmt == "q6" else 32)))
        d = w.d.data_ptr()
        if w.fmt == "q6" and w.m is not None:
            raise ValueError("q6 weight takes no mins m")
        if w.m is not None:
            if _check_tensor(w.m, "mins m", torch.float16, (w.rows, kp // 32)) != dst:
                raise ValueError("mins m and scales d must have the same row stride")
            m = w.m.data_ptr()
        elif w.fmt == "q4":
            raise ValueError("q4 weight needs mins m")
    desc = QMat(fmt=_FMT[w.fmt], rows=w.rows, cols=w.cols, row_bytes=qst * w.qs.element_size(), ds=dst,
                qs=w.qs.data_ptr(), d=d or None, m=m or None)
    c = w.__dict__["_cpu_desc"] = _DescCache(w, desc)
    return desc, c.addr


class _DescCache:
    """A QWeight's C descriptor and the tensors it was made from; a copy of the QWeight (deep
    copy, pickle) gets none, since the descriptor's pointers address the original's tensors."""

    def __init__(self, w: QWeight, desc: QMat):
        self.qs, self.d, self.m, self.desc, self.addr = w.qs, w.d, w.m, desc, ctypes.addressof(desc)

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def _check_tensor(t, what, dtype, shape) -> int:
    """Check a weight tensor; returns its row stride in elements (0 when it is contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, is on {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, is {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_contiguous():
        return 0
    if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) and t.stride(0) >= t.shape[1]:
        return t.stride(0)
    raise ValueError(f"{what} must be contiguous, or a view of whole rows with contiguous values "
                     f"(strides {tuple(t.stride())})")


def _vec(x, n, what="x"):
    """x as a contiguous float32 CPU vector of length n (fast path: a few cheap checks)."""
    if type(x) is _Tensor and x.dtype is _F32 and x.is_cpu and x.ndim == 1 and x.numel() == n:
        return x if x.is_contiguous() else x.contiguous()
    if not isinstance(x, torch.Tensor) or x.dtype != _F32 or not x.is_cpu:
        raise ValueError(f"{what} must be a float32 CPU tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', '?')}")
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{what} must have shape ({n},), has {tuple(x.shape)}")
    return x.contiguous()


def _out(out, n, what="out"):
    if out is None:
        return torch.empty(n, dtype=_F32)
    return _vec(out, n, what)


def _rows(rows):
    if type(rows) is _Tensor and rows.dtype is _I32 and rows.is_cpu and rows.ndim == 1:
        return rows if rows.is_contiguous() else rows.contiguous()
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or not rows.is_cpu:
        raise ValueError("rows must be a 1-D CPU tensor of row ids")
    if rows.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"rows must be int32 (or another integer type), is {rows.dtype}")
    return rows.to(_I32).contiguous()


def gemv(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[N] = W x."""
    if _cpu is None:
        _fallback()
        return _store(reference.gemv(w, x), out)
    desc = _desc(w)
    x = _vec(x, w.cols)
    y = _out(out, w.rows)
    _cpu.gemv(desc, x.data_ptr(), y.data_ptr())
    return y


def matmul(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Y[M, N] = X W^T for X (M, K); M == 1 runs the gemv path (bit-identical rows)."""
    if _cpu is None:
        _fallback()
        return _store(reference.matmul(w, x), out)
    desc = _desc(w)
    if not isinstance(x, torch.Tensor) or x.dtype != _F32 or not x.is_cpu:
        raise ValueError("X must be a float32 CPU tensor")
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"X must have shape (M, {w.cols}), has {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        y = torch.empty(m, w.rows, dtype=_F32)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype != _F32 or tuple(out.shape) != (m, w.rows) \
                or not out.is_contiguous() or not out.is_cpu:
            raise ValueError(f"out must be a contiguous float32 CPU tensor of shape ({m}, {w.rows})")
        y = out
    _cpu.matmul(desc, x.data_ptr(), m, y.data_ptr())
    return y


def gemv_rows(w: QWeight, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[j] = W[rows[j]] . x (row ids may repeat and come in any order)."""
    if _cpu is None:
        _fallback()
        return _store(reference.gemv_rows(w, x, rows), out)
    desc = _desc(w)
    x = _vec(x, w.cols)
    rows = _rows(rows)
    n = rows.numel()
    y = _out(out, n)
    _cpu.gemv_rows(desc, x.data_ptr(), rows.data_ptr(), n, y.data_ptr())
    return y


def axpy_rows(wt: QWeight, h: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[wt.cols] = sum_j h[j] * Wt[rows[j]] (Wt: neuron-major transposed down projection)."""
    if _cpu is None:
        _fallback()
        return _store(reference.axpy_rows(wt, h, rows), out)
    desc = _desc(wt)
    rows = _rows(rows)
    n = rows.numel()
    h = _vec(h, n, "h")
    y = _out(out, wt.cols)
    _cpu.axpy_rows(desc, h.data_ptr(), rows.data_ptr(), n, y.data_ptr())
    return y


def gemv_int8(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[N] = W x for a tq4 weight with x in one int8 term whatever the activation mode
    (products that feed approximations, such as the output head's preview)."""
    if w.fmt != "tq4":
        raise ValueError(f"gemv_int8 takes tq4 weights, not {w.fmt}")
    if _cpu is None:
        _fallback()
        return _store(reference.gemv_emulated(w, x, "int8").float(), out)
    desc = _desc(w)
    x = _vec(x, w.cols)
    y = _out(out, w.rows)
    _cpu.gemv_int8(desc, x.data_ptr(), y.data_ptr())
    return y


def select_ids(p: torch.Tensor, thr: float, extra: list | None = None, out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, int]:
    """(the ids i with p[i] >= thr or listed in `extra` (a list of ints, or an integer tensor;
    ids outside the vector are ignored), ascending and distinct, as int32; how many have
    p[i] >= thr).  `out`: an int32 buffer of p's length to return a view of."""
    n = p.numel()
    if _cpu is None:
        _fallback()
        return reference.select_ids(p, thr, extra).to(_I32), int((p >= thr).sum())
    p = _vec(p, n, "p")
    if out is None:
        out = torch.empty(n, dtype=_I32)
    elif type(out) is not _Tensor or out.dtype is not _I32 or out.numel() < n or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"out must be a contiguous int32 CPU tensor of at least {n} elements")
    if isinstance(extra, torch.Tensor):
        extra = extra.tolist()
    elif extra is not None and not isinstance(extra, list):
        extra = list(extra)
    k, above = _cpu.select_ids(p.data_ptr(), n, float(thr), extra, out.data_ptr())
    return out[:k], above


def _cols_args(w: ColWeight) -> tuple:
    if not isinstance(w, ColWeight):
        raise ValueError(f"expected a ColWeight, got {type(w).__name__}")
    g = (w.cols + 31) // 32
    _check_tensor(w.qs, "column weight qs", torch.uint8, (g * 32, w.np // 2))
    _check_tensor(w.d, "column scales d", torch.float16, (g, w.np))
    _check_tensor(w.m, "column mins m", torch.float16, (g, w.np))
    if not (w.qs.is_contiguous() and w.d.is_contiguous() and w.m.is_contiguous()):
        raise ValueError("column-grouped weight tensors must be contiguous")
    return w.rows, w.cols, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr()


def gemv_cols(w: ColWeight, x: torch.Tensor, thr: float = -1.0, out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, int]:
    """(y[N] = W (x masked to |x_j| > thr), inputs kept) on a column-grouped weight, reading
    the columns of the kept inputs only (thr < 0: all)."""
    if _cpu is None:
        _fallback()
        y, kept = reference.gemv_cols(w, x, thr)
        return _store(y.float(), out), kept
    args = _cols_args(w)
    x = _vec(x, w.cols)
    y = _out(out, w.rows)
    return y, _cpu.gemv_cols(*args, x.data_ptr(), float(thr), y.data_ptr())


def gemv_cols_list(w: ColWeight, h: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[N] = sum_j h[j] * W[:, idx[j]] on a column-grouped weight (idx ascending, distinct)."""
    if _cpu is None:
        _fallback()
        return _store(reference.gemv_cols_list(w, h, idx).float(), out)
    args = _cols_args(w)
    idx = _rows(idx)
    n = idx.numel()
    h = _vec(h, n, "h")
    y = _out(out, w.rows)
    _cpu.gemv_cols_list(*args, h.data_ptr(), idx.data_ptr(), n, y.data_ptr())
    return y


_NO_GATE = 0  # no weight


def sparse_ffn(x: torch.Tensor, gate: QWeight | None, up: QWeight, down_t: QWeight,
               rows: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """FFN of one token over the active neurons `rows`.

    h_i = act(gate_i . x) * (up_i . x)  (or act(up_i . x) when gate is None), then
    y[d_model] = sum_i h_i * down_t[i].  act: silu, relu, gelu (erf), gelu_tanh."""
    code = _ACT.get(act)
    if code is None:
        raise ValueError(f"unknown activation {act!r}; expected one of {tuple(_ACT)}")
    if _cpu is None:
        _fallback()
        return _store(reference.sparse_ffn(x, gate, up, down_t, rows, act), out)
    du, dd = _desc(up), _desc(down_t)
    if gate is None:
        dg = _NO_GATE
    else:
        dg = _desc(gate)
        if gate.rows != up.rows or gate.cols != up.cols:
            raise ValueError(f"gate {gate.shape} and up {up.shape} shapes differ")
    if down_t.rows != up.rows:
        raise ValueError(f"down_t must be neuron-major ({up.rows}, d_model), has shape {down_t.shape}")
    x = _vec(x, up.cols)
    rows = _rows(rows)
    y = _out(out, down_t.cols)
    _cpu.sparse_ffn(code, dg, du, dd, x.data_ptr(), rows.data_ptr(), rows.numel(), y.data_ptr())
    return y


def dequantize_rows(w: QWeight, r0: int = 0, r1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [r0, r1) of W as a float32 (r1 - r0, cols) matrix (equal to `reference`'s dequantize)."""
    r1 = w.rows if r1 is None else r1
    if not 0 <= r0 <= r1 <= w.rows:
        raise ValueError(f"row range [{r0}, {r1}) is outside [0, {w.rows})")
    if out is None:
        out = torch.empty(r1 - r0, w.cols, dtype=_F32)
    elif out.dtype != _F32 or tuple(out.shape) != (r1 - r0, w.cols) or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape ({r1 - r0}, {w.cols})")
    if _cpu is None:
        _fallback()
        out.copy_(w.dequantize()[r0:r1])
        return out
    _cpu.dequantize_rows(_desc(w), r0, r1, out.data_ptr())
    return out


# Scratch per slice of dequantized rows in `matmul_f32`: small enough to stay in the cache
# between the dequantization that writes it and the product that reads it.
_SLICE_BYTES = 4 << 20


def matmul_f32(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """Y[M, N] = X W^T with torch's float32 GEMM over slices of W's rows dequantized on the fly.

    For prefill (many tokens per weight) this beats `matmul`'s integer kernels, whose
    activations are re-quantized per 32 values: the GEMM reuses each weight M times, so
    dequantizing each weight once is a small part of the work.  torch runs it on as many
    threads as the kernels use (the engine keeps torch at one thread for decode)."""
    return _gemm_on_slices(w, x, _F32)


def matmul_bf16(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """Y[M, N] = X W^T with torch's bfloat16 GEMM over slices of W's rows dequantized on the
    fly (X and each slice rounded to bfloat16, the products summed in float32, Y rounded to
    bfloat16 and returned as float32).  For long prompts on CPUs that multiply bfloat16 in
    hardware (`bf16_gemm_native`), where it outruns the integer kernels of some formats; its
    rounding (8 significant bits of each weight and activation) is finer than the int8
    activations' of those kernels.  Reference: `reference.matmul_bf16`."""
    return _gemm_on_slices(w, x, torch.bfloat16)


def _gemm_on_slices(w: QWeight, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """matmul_f32 (dtype float32) and matmul_bf16 (bfloat16): slices of rows dequantized to
    float32 (rounded to bfloat16 after), each multiplied by X in torch's GEMM of that dtype."""
    if not isinstance(x, torch.Tensor) or x.dtype != _F32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"X must be a float32 CPU tensor of shape (M, {w.cols})")
    m = x.shape[0]
    xt = x.t() if dtype == _F32 else x.t().to(dtype)
    yt = torch.empty(w.rows, m, dtype=_F32)
    step = max(16, _SLICE_BYTES // (4 * max(1, w.cols)) // 16 * 16)
    plain = w.fmt == "f32" and dtype == _F32  # the weight's own rows are the slices
    s32 = None if plain else torch.empty(min(step, w.rows), w.cols, dtype=_F32)
    low = None if dtype == _F32 else torch.empty(min(step, w.rows), w.cols, dtype=dtype)
    desc = None if _cpu is None else _desc(w)  # checked once, not per slice
    n = get_num_threads()
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    try:
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            if plain:
                s = w.qs[r0:r1]
            elif desc is None:
                s = dequantize_rows(w, r0, r1, s32[: r1 - r0])
            else:
                s = s32[: r1 - r0]
                _cpu.dequantize_rows(desc, r0, r1, s.data_ptr())
            if low is None:
                torch.mm(s, xt, out=yt[r0:r1])
            else:
                low[: r1 - r0].copy_(s)
                yt[r0:r1].copy_(torch.mm(low[: r1 - r0], xt))
    finally:
        if old != n:
            torch.set_num_threads(old)
    return yt.t().contiguous()


@functools.cache
def bf16_gemm_native() -> bool:
    """True on CPUs whose vector or tile unit multiplies bfloat16 (AVX512_BF16 or AMX-BF16; the
    compiled core's CPU detection), where torch's bfloat16 GEMM runs at hardware speed;
    elsewhere it is emulated and slow.  Asked once (cpuid traps to the hypervisor on a VM)."""
    return _cpu is not None and bool(_cpu.cpu_bf16())


def act(x: torch.Tensor, name: str) -> torch.Tensor:
    """The decode steps' element-wise FFN activation (`_ACT` names; SiLU/ReLU vectorized) of a
    float32 CPU tensor, as a new tensor; reference: torch's."""
    y = x.float().contiguous().clone()
    _cpu.act(_ACT[name], y.data_ptr(), y.numel())
    return y


def hidden_rows(g: torch.Tensor, u: torch.Tensor | None, act: str, threshold: float,
                order: torch.Tensor | None = None, relu_up: bool = False) -> torch.Tensor:
    """The thresholded hidden activations of a (sparsified) FFN for M tokens in one pass:
    a = act(g), h = a * u (relu(u) with `relu_up`; u None: h = a), zero where |a| <= threshold,
    returned (M, n) with column k moved to `order[k]` (order None: in place).  g and u are
    (M, n) float32 CPU tensors whose rows may be strided (e.g. the halves of a fused gate+up
    product); g is overwritten with act(g).  Reference: the torch composition in
    `SparseFFN._dense`."""
    M, n = g.shape
    ok = (_cpu is not None and g.dtype is _F32 and g.is_cpu and g.stride(1) == 1 and g.stride(0) >= n
          and (u is None or (u.dtype is _F32 and u.is_cpu and u.shape == g.shape and u.stride(1) == 1
                             and u.stride(0) >= n)))
    if not ok:
        raise ValueError("hidden_rows needs float32 CPU (M, n) tensors with contiguous rows")
    if order is not None:
        order = order.to(torch.int64).contiguous()
        if order.shape != (n,):
            raise ValueError(f"order must have {n} entries")
    out = torch.empty(M, n, dtype=_F32)
    _cpu.hidden_rows(_ACT[act], int(bool(relu_up)), g.data_ptr(), g.stride(0), 0 if u is None else u.data_ptr(),
                     0 if u is None else u.stride(0), M, n, float(threshold), _ptr(order), out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim of a float32 CPU tensor
    (torch's F.rms_norm, without its ~6-op dispatch cost on one decode row)."""
    n = x.shape[-1]
    if _cpu is None or type(x) is not _Tensor or x.dtype is not _F32 or not x.is_cpu \
            or weight.dtype is not _F32 or not weight.is_cpu or weight.shape != (n,):
        return F.rms_norm(x, (n,), weight, eps)
    x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty_like(x)
    _cpu.rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n if n else 0, n, float(eps))
    return y


def attend1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one new query per head over all L cached positions (decode: no mask),
    scale 1/sqrt(D): q (1, H, 1, D), k and v (1, Hk, L, D) with H a multiple of Hk (GQA: head
    h reads KV head h // (H/Hk)), float32 CPU; K and V may be views into a longer cache (rows
    of D contiguous floats).  Returns (1, H, 1, D), `F.scaled_dot_product_attention` with
    repeated K/V to f32 rounding, on the kernel threads (torch's runs on one here); falls back
    to torch for other inputs."""
    B, H, T, D = q.shape
    Hk, L = k.shape[1], k.shape[2]
    ok = (_cpu is not None and B == 1 and T == 1 and L >= 1 and H % Hk == 0 and q.dtype is _F32
          and k.dtype is _F32 and v.dtype is _F32 and q.is_cpu and k.is_cpu and v.is_cpu and k.shape == v.shape
          and k.stride(3) == 1 and k.stride(2) == D and v.stride(3) == 1 and v.stride(2) == D)
    if not ok:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hk)
    q = q.contiguous()
    o = torch.empty_like(q)
    _cpu.attend1(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), H, Hk, D, L, 4 * k.stride(1), 4 * v.stride(1),
                 D ** -0.5, 0)
    return o


def attend1_stored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_type: str) -> torch.Tensor:
    """`attend1` over keys and values in the stored form of a KV cache type (`kv_cache`):
    q (1, H, 1, D) float32, k and v (1, Hk, L, row) as `kv_cache.encode` makes them, rows
    contiguous.  The decode step's kernel; needs the compiled core."""
    _require()
    B, H, T, D = q.shape
    Hk, L, rb = k.shape[1], k.shape[2], row_bytes(cache_type, D)
    for t in (k, v):
        if not t.is_cpu or t.shape != (1, Hk, L, t.shape[3]) or t.shape[3] * t.element_size() != rb or t.stride(3) != 1 \
                or t.stride(2) != t.shape[3]:
            raise ValueError(f"k and v must be (1, Hk, L, row) CPU tensors of {cache_type} rows of {D} values")
    if B != 1 or T != 1 or H % Hk or q.dtype is not _F32 or not q.is_cpu:
        raise ValueError("q must be (1, H, 1, D) float32 on the CPU, H a multiple of Hk")
    q = q.contiguous()
    o = torch.empty_like(q)
    es = k.element_size()
    _cpu.attend1(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), H, Hk, D, L, es * k.stride(1),
                 es * v.stride(1), D ** -0.5, KV_CODES[cache_type])
    return o


def attend1_rows(q: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor, int]], cache_type: str) -> torch.Tensor:
    """`attend1_stored` for B sequences at once: row b of q (B, H, 1, D) attends over the first
    L_b positions of its own stored cache (k_b, v_b, L_b), k_b and v_b (1, Hk, capacity, row)
    whole cache buffers. Returns (B, H, 1, D); each row is exactly `attend1_stored` of that row."""
    _require()
    B, H, T, D = q.shape
    if T != 1 or q.dtype is not _F32 or not q.is_cpu or len(kvs) != B:
        raise ValueError("q must be (B, H, 1, D) float32 on the CPU, with one (k, v, length) per row")
    rb = row_bytes(cache_type, D)
    code = KV_CODES[cache_type]
    q = q.contiguous()
    o = torch.empty_like(q)
    step = H * D * 4
    for b, (k, v, L) in enumerate(kvs):
        Hk = k.shape[1]
        for t in (k, v):
            if not t.is_cpu or t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != Hk or not 1 <= L <= t.shape[2] \
                    or t.shape[3] * t.element_size() != rb or t.stride(3) != 1 or t.stride(2) != t.shape[3]:
                raise ValueError(f"k and v must be (1, Hk, capacity, row) CPU tensors of {cache_type} rows of "
                                 f"{D} values, holding at least {L} positions")
        if H % Hk:
            raise ValueError(f"{H} query heads do not share {Hk} KV heads evenly")
        es = k.element_size()
        _cpu.attend1(q.data_ptr() + b * step, k.data_ptr(), v.data_ptr(), o.data_ptr() + b * step, H, Hk, D, L,
                     es * k.stride(1), es * v.stride(1), D ** -0.5, code)
    return o


def kv_store(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    """The rows of x (..., D) float32 in the stored form of `cache_type`, converted by the C
    core (what the decode step writes; `kv_cache.encode` is the reference)."""
    _require()
    x = x.float().contiguous()
    D = x.shape[-1]
    rb = row_bytes(cache_type, D)
    dt = storage_dtype(cache_type)
    out = torch.empty(*x.shape[:-1], rb // dt.itemsize, dtype=dt)
    flat, rows = x.reshape(-1, D), out.reshape(-1, out.shape[-1])
    for i in range(flat.shape[0]):
        _cpu.kv_store(KV_CODES[cache_type], flat[i].data_ptr(), rows[i].data_ptr(), D)
    return out


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _check_f32(t, what):
    if t is not None and (t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous()):
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor")


def _store(y, out):
    if out is None:
        return y
    out.copy_(y)
    return out


def empty_hugepages(shape, dtype=torch.uint8) -> torch.Tensor:
    """torch.empty whose memory asks for 2 MB transparent huge pages (Linux, THP "madvise").

    For weight buffers: sparse kernels read scattered rows, and with 4 KB pages every row
    costs TLB misses, which huge pages mostly avoid (`python benchmarks/kernels.py` probes
    random-row reads).  Write the data after allocating (copy_), so the first touch maps huge
    pages."""
    t = torch.empty(shape, dtype=dtype)
    if _cpu is not None and t.numel():
        _cpu.advise_hugepages(t.data_ptr(), t.numel() * t.element_size())
    return t


def neuron_records(weights: list[QWeight]) -> tuple[torch.Tensor, list[QWeight]]:
    """One contiguous record per row holding row i of every weight in `weights` (same row
    count, integer formats), each weight's scales (and mins) then its values: a (rows, R) uint8
    buffer, R a multiple of 64, and the weights as row views into it (qs, d, m strided by R;
    `kernels.cpu` takes them).  A sparse pass then reads one whole record per active neuron
    instead of six smaller pieces at six places (longer scattered reads stream faster than
    short ones).  `sparse_ffn` and the sparse decode
    step take their one pass over whole records when given such views (`benchmarks/kernels.py`:
    `sparse_ffn_records`)."""
    if any(w.rows != weights[0].rows or w.fmt not in ("q4", "q8") for w in weights):
        raise ValueError("neuron records need q4/q8 weights with the same number of rows")
    return _records([[w] for w in weights])


def interleave_rows(*ws: QWeight) -> QWeight:
    """The rows of `ws` (one format and width) stacked into one weight whose rows each hold
    their scales (and mins) just before their values, in one buffer on 2 MB pages.  Every
    kernel takes either layout and gives the same results; this one keeps a neuron's bytes
    contiguous, so a row-sparse product reads no scales of inactive neighbours (with separate
    scale tensors a 64-byte line of q4 scales spans 1.3 rows of 1536-wide scales, and each row
    is three streams to fetch instead of one); with the AVX-512 kernels it speeds up the row
    products and the dense gemv alike (`python benchmarks/kernels.py --layout rows` against
    `--layout split`).  A float weight has no scales: one comes back as it is, several are
    refused (`fuse_weights` stacks those itself)."""
    w0 = ws[0]
    if any(w.fmt != w0.fmt or w.cols != w0.cols or (w.d is None) != (w0.d is None) or (w.m is None) != (w0.m is None)
           for w in ws):
        raise ValueError("interleave_rows stacks weights of one format and width (scales and mins alike)")
    if w0.fmt not in ("q4", "q8", "q6"):
        if len(ws) == 1:
            return w0
        raise ValueError(f"interleave_rows: {w0.fmt} weights have no scales to interleave")
    return _records([list(ws)])[1][0]


def interleave_pays(w: QWeight) -> bool:
    """Whether `interleave_rows` is expected to speed up products over `w`: integer formats on
    the CPU with the AVX-512 kernels, except q4 rows wider than 4096 values, whose dense gemv
    reads a little slower interleaved (q8 and q6 do not).  With the AVX2 kernels the row
    products gain from it but decode, whose sparse FFN reads neuron records either way, hardly
    moves, and the copy adds to the load time: they keep the split layout until it is compared
    on an AVX2-only CPU.  Compare with `python benchmarks/kernels.py --layout rows` against
    `--layout split` (and `SPARSEINFER_SIMD=avx2` for the AVX2 kernels)."""
    return (w.fmt in ("q4", "q8", "q6") and w.qs.is_cpu and (w.fmt != "q4" or w.cols <= 4096)
            and available() and simd_level().startswith("avx512"))


# Kernel levels whose dense products read weights in row tiles (tq4, tq6, csrc/tiles.c) by
# default, and the formats they tile: `load` converts the dense projections' weights
# (`models.registry.tile_weights`); $SPARSEINFER_TILES=1 (every level, q4 and q6) or 0 overrides.
# Chosen by `python benchmarks/compare_llamacpp.py --ours-args="--dense SPARSEINFER_TILES=0"
# --ours-args="--dense"`, alternated (docs/kernels.md has the measurements): on avx2 q6 stays
# row-major (its prompts ran slower tiled), and avx512amx, whose prompt products run on the
# AMX unit from row-major weights, was not compared.
ROW_TILE_LEVELS: dict[str, tuple[str, ...]] = {"avx2": ("q4",), "avx512": ("q4", "q6", "q4k"),
                                                 "avx512vnni": ("q4", "q6", "q4k")}


def tiles_pay(w: QWeight) -> bool:
    """Whether a q4, q6 or q4k weight read whole (dense projections) should be held as row
    tiles (tq4, tq6, tq4k)."""
    if "t" + w.fmt not in TILE_FORMATS or (w.fmt == "q4" and w.m is None) or not w.qs.is_cpu or not available():
        return False
    env = os.environ.get("SPARSEINFER_TILES", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return w.fmt in ROW_TILE_LEVELS.get(simd_level(), ())


def tile(w: QWeight) -> QWeight:
    """`w` (q4, q6 or q4k) as row tiles (tq4, tq6, tq4k) in a buffer on huge pages
    (`quant.to_tiles` is the reference of the compiled conversion)."""
    fmt = "t" + w.fmt
    out = empty_hugepages(tiles_shape(w.rows, w.cols, fmt))
    if _cpu is None or "t" + w.fmt not in TILE_FORMATS:
        return to_tiles(w, out)
    _cpu.tile_rows(_desc(w), out.data_ptr())
    return QWeight(fmt, w.rows, w.cols, out)


def empty_records_like(w: QWeight, rows: int) -> QWeight:
    """`rows` uninitialised rows in `interleave_rows`'s layout, each shaped like a row of `w`
    (its format, width, scales and mins): a converter writes a weight's rows into them
    directly, with no second full-size copy.  Pair with `interleave_pays`."""
    return _record_buffer([w], rows)[1][0]


def stacked_view(ws: list[QWeight]) -> QWeight | None:
    """The weight whose rows are the rows of `ws` when they already lie one after the other in
    one buffer (row views of it, in order: what a loader that converts a fused group into one
    buffer gives), as a view of that buffer; else None."""
    w0 = ws[0]
    tensors = [[getattr(w, n) for w in ws] for n in ("qs", "d", "m")]
    for ts in tensors:
        if ts[0] is None:
            if any(t is not None for t in ts):
                return None
            continue
        t0 = ts[0]
        if any(t is None or t.dim() != 2 or t.dtype != t0.dtype or t.stride() != t0.stride() or t.device != t0.device
               or t.shape[1] != t0.shape[1] or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()
               for t in ts):
            return None
        off = t0.storage_offset()
        for t in ts:
            if t.storage_offset() != off:
                return None
            off += t.shape[0] * t.stride(0)
    rows = sum(w.rows for w in ws)
    whole = [None if ts[0] is None else ts[0].as_strided((rows, ts[0].shape[1]), ts[0].stride(), ts[0].storage_offset())
             for ts in tensors]
    return QWeight(w0.fmt, rows, w0.cols, *whole)


def is_interleaved(w: QWeight) -> bool:
    """Whether `w`'s rows are records (`interleave_rows`): its values are a strided view."""
    return w.d is not None and w.qs.dim() == 2 and w.qs.stride(0) != w.qs.shape[1]


def _record_buffer(weights: list[QWeight], rows: int) -> tuple[torch.Tensor, list[QWeight]]:
    """A (rows, R) buffer of records, one piece per weight of `weights` (format, width, scales
    and mins), and each weight's row views into it; the pieces' padding is zeroed, the rest not.
    Each weight's scales and mins, then its values, weight after weight: the order the pass
    reads them in (the dot tiles and the axpy load a row's scales before its values), which
    the records pass reads a little faster than all values first, then all scales.  Each
    weight's piece starts on a 64-byte line, one common piece size apart, so that the records
    pass can read a neuron's gate and up rows as one stream (sparse.c, rec_ctx.pair)."""
    pieces = [[(name, t, t.shape[1] * t.element_size()) for name in ("d", "m", "qs")
               if (t := getattr(w, name)) is not None] for w in weights]
    piece = (max(sum(n for *_, n in ps) for ps in pieces) + 63) // 64 * 64
    buf = empty_hugepages((rows, piece * len(weights)))
    nbuf = buf.numpy()
    views = []
    for i, (w, ps) in enumerate(zip(weights, pieces)):
        o, v = piece * i, {"d": None, "m": None}
        for name, t, nbytes in ps:
            v[name] = buf[:, o:o + nbytes].view(t.dtype)
            o += nbytes
        nbuf[:, o:piece * (i + 1)] = 0  # the piece's padding
        views.append(QWeight(w.fmt, rows, w.cols, v["qs"], v["d"], v["m"]))
    return buf, views


def _records(groups: list[list[QWeight]]) -> tuple[torch.Tensor, list[QWeight]]:
    """One buffer of records, one weight per group: a group's weights (one format and width)
    are stacked by rows, and every group has the same total row count."""
    buf, views = _record_buffer([g[0] for g in groups], sum(w.rows for w in groups[0]))
    for group, view in zip(groups, views):
        for name in ("d", "m", "qs"):
            dst = getattr(view, name)
            if dst is None:
                continue
            # numpy's strided copy: torch's copy_ into a column slice of a wider buffer moves
            # these rows an order of magnitude slower, a visible share of the load time
            out, r0 = dst.view(torch.uint8).numpy(), 0
            for src in group:
                part = getattr(src, name).contiguous()
                out[r0:r0 + src.rows] = part.view(torch.uint8).view(src.rows, -1).numpy()
                r0 += src.rows
    return buf, views


def set_num_threads(n: int) -> None:
    """Threads used by the kernels (default: CPUs available to the process, or
    $SPARSEINFER_NUM_THREADS)."""
    if _cpu is not None:
        _cpu.set_num_threads(int(n))


def get_num_threads() -> int:
    return _cpu.get_num_threads() if _cpu is not None else 1


ACTIVATION_MODES = reference.MODES  # ("int8", "precise"), indexed as the core's ACT_* values


def set_activation_mode(mode: str) -> None:
    """How integer formats (q4/q8) quantize the activation x, per block of 32 values:
    "int8" (default): one int8 term, llama.cpp's Q8 activations (~1e-2 relative error per
    product; teacher-forced KL to the f32 model on par with llama.cpp's);
    "precise": plus a second int8 term of the rounding residual (about f32 accuracy; slower
    decode).  `tests/test_smollm2.py` bounds both KLs (figures: docs/performance.md).
    Process-wide; $SPARSEINFER_ACT_MODE sets it at start-up.  The contract is in
    `kernels.reference`."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activation mode must be one of {', '.join(ACTIVATION_MODES)} (got {mode!r})")
    if _cpu is not None:
        _cpu.set_act_mode(ACTIVATION_MODES.index(mode))


def activation_mode() -> str:
    """The current activation mode (without the compiled core the reference computes in f32:
    "precise")."""
    return ACTIVATION_MODES[_cpu.act_mode()] if _cpu is not None else "precise"


def simd_level() -> str:
    """'avx512amx', 'avx512vnni', 'avx512', 'avx2' (x86-64), 'neon_dotprod', 'neon' (AArch64),
    'scalar' (compiled kernels) or 'reference'
    (fallback).  The best level the CPU (and, for AMX, the OS) supports is the default;
    $SPARSEINFER_SIMD picks another at start-up."""
    return _cpu.simd_level() if _cpu is not None else "reference"


# Levels whose many-token products (prefill) run on a tile unit that sums each block's
# products exactly but scales and adds them in another order than the one-token kernels: their
# matmul rows equal gemv of the same token within the error contract, not bit for bit.
TILE_LEVELS = ("avx512amx",)


def matmul_equals_gemv() -> bool:
    """True when a matmul row is bit-identical to gemv of that token at the current level."""
    return simd_level() not in TILE_LEVELS
