"""Decode plans: what the C core needs to run one token through a half-block, packed once.

A model's layers are built as readable torch modules (`sparseinfer.models.layers`); those stay
the reference and run prefill, batches and accelerators.  For one token on the CPU each block
instead runs two C calls, an attention step and an FFN step, on structs (`cstructs.AttnPlan`,
`cstructs.FFNPlan`) filled here from plain tensors and weights when the layer is first decoded,
and checked by C once (`check_attn_plan` / `check_ffn_plan`).  A step keeps references to every
tensor its plan points into, so the memory stays valid while the step lives.

- `AttnStep`: x + o(attend(rope(qkv(rms_norm(x))))), writing the token's k/v to the cache.
- `FFNStep`: the dense MLP or the activation-sparse FFN (predictor -> candidate rows -> sparse
  kernels; `reference.sparse_ffn_token` is its slow, obvious reference), with its norm and
  residual (x + ffn(rms_norm(x))) or without (ffn(x), e.g. the CPU part of a hybrid FFN).
"""
from __future__ import annotations

import ctypes
import operator

import torch

from ..kv_cache import KV_CODES
from ..quant import QWeight
from . import cpu
from .cstructs import (FFN_DENSE, FFN_FUSED, FFN_GATE_UP, FFN_RECORDS, FFN_SPARSE, NO_WEIGHT, AttnPlan,
                       FFNPlan, FFNStats)

ACT_CODES = cpu._ACT  # activation name (kernel spelling) -> C code


class _Stale:
    """What a copied or unpickled step becomes: its plan's pointers would still address the
    original's tensors, so the copy builds its own on first use."""

    def __repr__(self) -> str:
        return "STALE"


STALE = _Stale()


def _stale():
    return STALE


class _NoCopy:
    """Copies (deepcopy, pickle) of a step are `STALE`."""

    def __deepcopy__(self, memo):
        return STALE

    def __reduce__(self):
        return _stale, ()


# Bumped by every attribute assignment on a model's modules (`models.layers.Module`): while it
# is unchanged no step's inputs can have been replaced, so `cached_step` needs no key check.
_generation = [0]


def modules_changed() -> None:
    """Note that some module's attributes changed: the next `cached_step` checks its key."""
    _generation[0] += 1


def cached_step(module, key_fn, build, *args):
    """The decode step of `module`, kept in its `_step` slot: built by `build()` again when an
    object in `args` (the step method's arguments, compared on every call) or in `key_fn()`
    (what it is built from: weights, biases, sub-modules) is not the same one any more, or when
    it is a copy's `STALE` step.  `key_fn` only runs after some module changed
    (`modules_changed`), so a token's steps cost one lookup each."""
    got = module.__dict__.get("_step")
    gen = _generation[0]
    if got is not None and got[0] == gen and got[2] is not STALE and all(map(operator.is_, got[1], args)):
        return got[2]
    key = (*args, *key_fn())
    if got is None or got[2] is STALE or len(got[1]) != len(key) or not all(map(operator.is_, got[1], key)):
        step = build()
    else:
        step = got[2]
    module.__dict__["_step"] = (gen, key, step)
    return step


def built_step(module):
    """The step `cached_step` last built for `module` (None if none, or a copy's `STALE`)."""
    got = module.__dict__.get("_step")
    return None if got is None or got[2] is STALE else got[2]


def drop_step(module):
    """Forget `module`'s step (the next `cached_step` builds it); returns what `built_step` did."""
    got = built_step(module)
    module.__dict__.pop("_step", None)
    return got


def available() -> bool:
    """Decode steps need the compiled core."""
    return cpu.available()


def on_cpu(*ws: QWeight | torch.Tensor | None) -> bool:
    """Every given weight or tensor lives in CPU memory (None counts as absent)."""
    return all(w is None or (w.qs.is_cpu if isinstance(w, QWeight) else w.is_cpu) for w in ws)


def _vec(t: torch.Tensor | None, n: int, what: str, keep: list) -> int:
    """Address of a float32 vector of n values (0 for None), checked: C reads exactly n."""
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor) or not t.is_cpu:
        raise ValueError(f"{what} must be a CPU tensor")
    if t.numel() != n:
        raise ValueError(f"{what} has {t.numel()} values, the layer needs {n}")
    t = t.detach().reshape(-1).to(torch.float32).contiguous()
    keep.append(t)
    return t.data_ptr()


def _weight(w: QWeight | None, keep: list):
    if w is None:
        return NO_WEIGHT
    keep.append(w)
    return cpu.qmat(w)[0]


class AttnStep(_NoCopy):
    """A checked attention plan and the tensors it points into."""

    def __init__(self, *, norm_w: torch.Tensor, eps: float, q: QWeight, k: QWeight | None, v: QWeight | None,
                 o: QWeight, bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                 bo: torch.Tensor | None, n_heads: int, n_kv_heads: int, d_head: int, n_rot: int):
        """q, k, v: the projections, or k = v = None and q the fused q/k/v weight (bq its bias)."""
        keep: list = []
        n = q.cols
        nq, nkv = n_heads * d_head, n_kv_heads * d_head
        p = AttnPlan(n=n, H=n_heads, Hk=n_kv_heads, D=d_head, n_rot=n_rot, eps=eps, scale=d_head ** -0.5)
        p.norm_w = _vec(norm_w, n, "attention norm weight", keep)
        p.q, p.k, p.v, p.o = (_weight(w, keep) for w in (q, k, v, o))
        p.bq = _vec(bq, nq + (2 * nkv if k is None else 0), "q bias", keep)
        p.bk, p.bv = _vec(bk, nkv, "k bias", keep), _vec(bv, nkv, "v bias", keep)
        p.bo = _vec(bo, n, "o bias", keep)
        cpu._cpu.check_attn_plan(ctypes.addressof(p))
        self.plan, self.addr, self._keep = p, ctypes.addressof(p), keep
        self.n, self.n_kv_heads, self.d_head, self.n_rot = n, n_kv_heads, d_head, n_rot
        # one plan per KV cache type (`kv_cache.KV_CODES`), copies of this one made on first use
        self._plans: list = [None] * len(KV_CODES)
        self._addrs: list = [None] * len(KV_CODES)
        self._plans[0], self._addrs[0] = p, self.addr

    def _plan_for(self, kv_code: int) -> int:
        if not 0 <= kv_code < len(self._addrs):
            raise ValueError(f"unknown KV cache type code {kv_code}")
        p = AttnPlan.from_buffer_copy(self.plan)
        p.kv_type = kv_code
        cpu._cpu.check_attn_plan(ctypes.addressof(p))
        self._plans[kv_code], self._addrs[kv_code] = p, ctypes.addressof(p)
        return self._addrs[kv_code]

    def run(self, x: torch.Tensor, xo: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
            k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, kv_code: int = 0) -> None:
        """xo = x + attention(norm(x)) for one token at `pos` (x, xo: n float32, may alias);
        its k/v go to row `pos` of the caches (n_kv_heads, capacity, row), stored as the cache
        type `kv_code` says (`kv_cache.KV_CODES`; the layout of `kv_cache.LayerKV`)."""
        addr = self._addrs[kv_code] if 0 <= kv_code < len(self._addrs) else None
        if addr is None:
            addr = self._plan_for(kv_code)
        cpu._cpu.decode_attn(addr, x.data_ptr(), xo.data_ptr(), 0 if cos is None else cos.data_ptr(),
                             0 if sin is None else sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             k_cache.shape[-2], v_cache.shape[-2], pos)


    def run_rows(self, x: torch.Tensor, xo: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 caches: list, kv_code: int = 0) -> None:
        """`run` for B tokens of B sequences at once (batched decode): row b of x / xo (B, n)
        float32, contiguous, may alias) at position caches[b][2] with cos/sin row b (B rows of
        n_rot), its k/v written to caches[b] = (k_cache, v_cache, pos); each projection reads
        its weight once for all the rows."""
        B = x.shape[0]
        if x.shape != (B, self.n) or xo.shape != x.shape or not x.is_contiguous() or not xo.is_contiguous():
            raise ValueError(f"run_rows takes (B, {self.n}) contiguous rows, got {tuple(x.shape)} -> {tuple(xo.shape)}")
        if len(caches) != B:
            raise ValueError(f"run_rows: {B} rows but {len(caches)} caches")
        if self.n_rot and (cos is None or cos.numel() != B * self.n_rot or sin.numel() != B * self.n_rot):
            raise ValueError(f"run_rows needs {B} cos/sin rows of {self.n_rot}")
        addr = self._addrs[kv_code] if 0 <= kv_code < len(self._addrs) else None
        if addr is None:
            addr = self._plan_for(kv_code)
        refs = torch.tensor([[k.data_ptr(), v.data_ptr(), k.shape[-2], v.shape[-2], pos] for k, v, pos in caches],
                            dtype=torch.int64)
        cpu._cpu.decode_attn_rows(addr, B, x.data_ptr(), xo.data_ptr(), 0 if cos is None else cos.data_ptr(),
                                  0 if sin is None else sin.data_ptr(), refs.data_ptr())


class BlockSteps(_NoCopy):
    """A block's steps for one token: `attn`, then `ffn` (None where the FFN runs as a module)."""

    __slots__ = ("attn", "ffn")

    def __init__(self, attn: AttnStep, ffn: "FFNStep | None"):
        self.attn, self.ffn = attn, ffn


class FFNStep(_NoCopy):
    """A checked FFN plan (dense or sparse) and the tensors it points into; `stats` are the
    sparse step's counters, summed over tokens (zero them with `reset_stats`)."""

    def __init__(self, plan: FFNPlan, keep: list, forced_rows=None):
        cpu._cpu.check_ffn_plan(ctypes.addressof(plan))
        self.plan, self.addr, self._keep = plan, ctypes.addressof(plan), keep
        self.n = plan.n
        self.forced_rows = forced_rows  # x -> candidate rows (int32), or None: predicted / all

    @property
    def stats(self) -> FFNStats:
        return self.plan.stats

    def reset_stats(self) -> None:
        ctypes.memset(ctypes.addressof(self.plan.stats), 0, ctypes.sizeof(FFNStats))

    def run(self, x: torch.Tensor, xo: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """xo = x + ffn(norm(x)), or ffn(x) for a plan without norm (x, xo: n float32, may
        alias); rows: candidate rows (int32, sparse plans), default predicted or all."""
        if rows is None and self.forced_rows is not None:
            rows = self.forced_rows(x)
        if rows is None:
            cpu._cpu.decode_ffn(self.addr, x.data_ptr(), xo.data_ptr(), 0, -1)
        else:
            cpu._cpu.decode_ffn(self.addr, x.data_ptr(), xo.data_ptr(), rows.data_ptr(), rows.numel())

    def run_rows(self, x: torch.Tensor, xo: torch.Tensor) -> None:
        """`run` (predicted or all rows) for B tokens at once: x, xo (B, n) float32, contiguous,
        may alias; a dense plan reads each weight once for all the rows."""
        B = x.shape[0]
        if x.shape != (B, self.n) or xo.shape != x.shape or not x.is_contiguous() or not xo.is_contiguous():
            raise ValueError(f"run_rows takes (B, {self.n}) contiguous rows, got {tuple(x.shape)} -> {tuple(xo.shape)}")
        if self.forced_rows is not None:
            for b in range(B):
                self.run(x[b], xo[b])
            return
        cpu._cpu.decode_ffn_rows(self.addr, B, x.data_ptr(), xo.data_ptr())


def _ffn_plan(kind: int, act: str, relu_up: bool, n: int, F: int, norm_w, eps: float, keep: list) -> FFNPlan:
    code = ACT_CODES.get(act)
    if code is None:
        raise ValueError(f"activation {act!r} has no C kernel; expected one of {tuple(ACT_CODES)}")
    p = FFNPlan(kind=kind, act=code, relu_up=int(relu_up), n=n, F=F, eps=eps)
    for name in ("first", "second", "gate_up", "down", "down_t", "w1", "w2t"):
        setattr(p, name, NO_WEIGHT)  # absent until given (a zeroed descriptor would read as f32)
    p.norm_w = _vec(norm_w, n, "FFN norm weight", keep)
    return p


def dense_ffn_step(*, act: str, relu_up: bool, gate: QWeight | None, up: QWeight, down: QWeight,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None, gate_up_fused: bool = False,
                   norm_w: torch.Tensor | None = None, eps: float = 0.0) -> FFNStep:
    """The dense MLP down(act(gate x) * up x) (gate None: down(act(up x))); `gate_up_fused`:
    gate and up are adjacent row blocks of one weight (one pass computes both)."""
    keep: list = []
    F, n = up.rows, up.cols
    p = _ffn_plan(FFN_DENSE, act, relu_up, n, F, norm_w, eps, keep)
    first, second = (up, None) if gate is None else (gate, up)
    first_bias, second_bias = (up_bias, None) if gate is None else (gate_bias, up_bias)
    p.first, p.second, p.down = _weight(first, keep), _weight(second, keep), _weight(down, keep)
    p.first_bias, p.second_bias = _vec(first_bias, F, "gate bias", keep), _vec(second_bias, F, "up bias", keep)
    p.down_bias = _vec(down_bias, n, "down bias", keep)
    p.flags = FFN_GATE_UP if gate_up_fused else 0
    return FFNStep(p, keep)


def sparse_ffn_step(*, act: str, relu_up: bool, first: QWeight, second: QWeight | None, down_t: QWeight,
                    down: QWeight | None, order: torch.Tensor | None, threshold: float, crossover: float,
                    up_crossover: float,
                    first_bias: torch.Tensor | None = None, second_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, predictor=None, topk: int = 0, fused: bool = False,
                    gate_up_fused: bool = False, records: bool = False, forced_rows=None,
                    norm_w: torch.Tensor | None = None, eps: float = 0.0) -> FFNStep:
    """The one-token activation-sparse FFN (`reference.sparse_ffn_token`): neurons in hotness
    order; first = gate (or up of a plain FFN), second = up or None; down_t the neuron-major
    down, down the stored one (columns in `order`).  predictor: a `QPredictor` (rows it
    predicts; topk > 0: its k best) or None (all rows, or `forced_rows(x)`).  fused: the
    one-pass kernel on the candidates (exact when no cut is needed); records: first, second and
    down_t are row views of one neuron record each."""
    keep: list = []
    F, n = first.rows, first.cols
    p = _ffn_plan(FFN_SPARSE, act, relu_up, n, F, norm_w, eps, keep)
    p.first, p.second, p.down, p.down_t = (_weight(w, keep) for w in (first, second, down, down_t))
    p.first_bias, p.second_bias = _vec(first_bias, F, "gate bias", keep), _vec(second_bias, F, "up bias", keep)
    p.down_bias = _vec(down_bias, n, "down bias", keep)
    if down is not None:
        order32 = order.to(torch.int32).contiguous()
        if order32.numel() != F or not bool(((order32 >= 0) & (order32 < F)).all()):
            raise ValueError(f"neuron order must hold {F} ids in [0, {F})")
        keep.append(order32)
        p.order = order32.data_ptr()
    if predictor is not None:
        p.w1, p.w2t = _weight(predictor.w1, keep), _weight(predictor.w2t, keep)
        p.b1 = _vec(predictor.b1, predictor.w1.rows, "predictor bias", keep)
        p.cut = _vec(predictor.cut, F, "predictor cut", keep)
    p.topk, p.threshold, p.crossover, p.up_crossover = topk, threshold, crossover, up_crossover
    p.flags = (FFN_FUSED if fused else 0) | (FFN_GATE_UP if gate_up_fused else 0) | (FFN_RECORDS if records else 0)
    return FFNStep(p, keep, forced_rows)
