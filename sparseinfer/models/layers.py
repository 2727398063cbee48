"""Shared layers: linear over any weight format, norms, rotary embeddings, attention, dense MLP.

Everything computes in float32 on (batch, time, features) tensors.  Weights stay in their
`QWeight` format; `Linear` hands them to the CPU kernels (or, on an accelerator, to torch).
"""
from __future__ import annotations

import functools
import math
import operator
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import QWeight
from ..kv_cache import LayerKV


# Rows of X (tokens) from which a CPU product runs as torch's float32 GEMM on weights
# dequantized slice by slice instead of our integer kernels, per activation mode (measured on
# 8960x1536, 2 threads, AVX2).  "precise" (two int8 terms per block): q4 is 1.1x faster by
# GEMM at 128 tokens and 1.3-1.7x at 512; q8 1.1x at 64 and 2.2-2.6x at 512.  "int8" (one
# term, llama.cpp's rounding): the q4 kernels stay ahead at every size (131 vs ~80 GOPS at
# 128 tokens, 116 vs ~100 at 512; Qwen2.5-Coder-1.5B prompt 34 -> 44 tok/s at 512 tokens,
# 25 -> 48 at 128, A/B in one process), q8 up to ~256 tokens.  q6 (same shape, 2 threads,
# AVX-512 Xeon): int8 kernels 66 vs 64 ms by GEMM at 512 tokens, 33 vs 42 at 256; precise
# 38 vs 32 ms at 128 tokens, 16 vs 23 at 64.
# On a tile level (AMX, int8 mode) the integer kernels beat the GEMM at every size: 8960x1536
# and 1536x8960 at 512 tokens, 2 threads, Xeon: q4 ~770 GOPS, q8 ~850-890, q6 ~570-590, where
# the VNNI tiles give 200-350 and the dequantize + float32 GEMM path less than either.
_F32_GEMM_MIN_ROWS = {
    "int8": {"q4": 1 << 62, "q8": 256, "q6": 512, "f16": 64, "bf16": 64, "f32": 64},
    "precise": {"q4": 128, "q8": 64, "q6": 128, "f16": 64, "bf16": 64, "f32": 64},
    "tiles": {"q4": 1 << 62, "q8": 1 << 62, "q6": 1 << 62, "f16": 64, "bf16": 64, "f32": 64},
}


def _gemm_min_rows(k) -> dict:
    mode = k.activation_mode()
    return _F32_GEMM_MIN_ROWS["tiles" if mode == "int8" and k.simd_level() in k.TILE_LEVELS else mode]


def _matmul(w: QWeight, x2: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 -> (M, N) through the fastest kernel for the weight's format and device."""
    if x2.device.type == "cpu":
        k = _cpu_kernels()
        if x2.shape[0] > 1 and k.available() \
                and x2.shape[0] >= _gemm_min_rows(k).get(w.fmt, 1 << 62):
            return k.matmul_f32(w, x2)
        return k.matmul(w, x2)
    from ..hybrid.device_ops import matmul as dev_matmul

    return dev_matmul(w, x2)


@functools.cache
def _cpu_kernels():
    from ..kernels import cpu  # falls back to the reference kernels if the C core is not built

    return cpu


class Linear(nn.Module):
    """y = x W^T (+ b) with W in any `QWeight` format; a drop-in for nn.Linear at inference."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.cols

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _matmul(self.weight, x.reshape(-1, x.shape[-1]).float().contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, -1)


class _Fused:
    """A stacked weight and bias for `fuse_linears`; a plain object, not a submodule, so module
    walks (byte counts, device moves, FFN replacement) see only the parts."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return Linear.forward(self, x)


def fuse_weights(*ws: QWeight) -> tuple[QWeight, list[QWeight]] | None:
    """One weight whose rows are the rows of `ws` stacked, and the parts as row views of it (no
    extra memory); None when the formats, input widths or devices differ or a part is off the CPU."""
    w0 = ws[0]
    if w0.qs.device.type != "cpu" or any(
            w.fmt != w0.fmt or w.cols != w0.cols or w.qs.device != w0.qs.device
            or (w.d is None) != (w0.d is None) or (w.m is None) != (w0.m is None) for w in ws):
        return None
    k = _cpu_kernels()
    if k.interleave_pays(w0):
        # each row's scales next to its values (`interleave_rows`): one stream per row for the
        # dense products, and no neighbours' scales read by the row-sparse ones
        fused = k.interleave_rows(*ws)
    else:
        cat = lambda name: None if getattr(w0, name) is None else torch.cat([getattr(w, name) for w in ws])  # noqa: E731
        fused = QWeight(w0.fmt, sum(w.rows for w in ws), w0.cols, cat("qs"), cat("d"), cat("m"))
    views, a = [], 0
    for w in ws:
        b = a + w.rows
        cut = lambda t: None if t is None else t[a:b]  # noqa: E731
        views.append(QWeight(w.fmt, w.rows, w.cols, cut(fused.qs), cut(fused.d), cut(fused.m)))
        a = b
    return fused, views


def fuse_linears(*linears: Linear) -> _Fused | None:
    """A weight whose rows are the rows of `linears` stacked (e.g. q, k, v or gate, up), so a
    CPU forward quantizes x once and makes one kernel call instead of several; the parts'
    weights become row views of it (`fuse_weights`).  None when the formats, input widths or
    devices differ, or a part has a bias and another not."""
    if any(not isinstance(lin, Linear) for lin in linears):
        return None
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    got = fuse_weights(*(lin.weight for lin in linears))
    if got is None:
        return None
    fused, views = got
    for lin, w in zip(linears, views):
        lin.weight = w
    bias = None if biases[0] is None else torch.cat([b.float() for b in biases])
    return _Fused(fused, bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight.float(), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:  # the C norm; it falls back to F.rms_norm for what it does not take
            return _cpu_kernels().rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        from ..errors import UnsupportedError

        raise UnsupportedError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)}, drelu)")
    return ACTIVATIONS[name]


def kernel_act_name(name: str) -> str:
    """Our activation name as the CPU kernels spell it."""
    return {"swish": "silu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "drelu": "relu"}.get(name, name)


class MLP(nn.Module):
    """Dense feed-forward block, the readable reference that `SparseFFN` replaces.

    Gated (llama): down(act(gate x) * up x); `drelu` (Bamboo/TurboSparse): down(relu(gate x) * relu(up x)).
    Plain (OPT, Falcon): down(act(up x)), `gate` is None."""

    def __init__(self, gate: Linear | None, up: Linear, down: Linear, act: str):
        super().__init__()
        self.gate, self.up, self.down, self.act_name = gate, up, down, act
        self.act = F.relu if act == "drelu" else activation(act)
        self._gate_up = None if gate is None else fuse_linears(gate, up)
        self._parts = (gate.weight, up.weight) if self._gate_up is not None else None

    def _intact(self) -> bool:
        """The fused gate+up applies while the parts still are its views (not moved or replaced)."""
        return self._parts is not None and self.gate.weight is self._parts[0] and self.up.weight is self._parts[1]

    def _fused(self, x: torch.Tensor) -> bool:
        return x.is_cpu and self._intact()

    @property
    def n_neurons(self) -> int:
        return self.up.out_features

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The per-neuron activations h that `down` mixes: shape (..., n_neurons)."""
        if self.gate is None:
            return self.act(self.up(x))
        if self._fused(x):
            g, up = self._gate_up(x).split([self.gate.out_features, self.up.out_features], dim=-1)
            if self.act_name == "drelu":
                up = F.relu(up)
            return self.act(g).mul_(up)
        up = self.up(x)
        if self.act_name == "drelu":
            up = F.relu(up)
        return self.act(self.gate(x)) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.hidden(x))

    def decode_args(self, norm: nn.Module) -> tuple | None:
        """The arguments after (x, out) of the C step `_cpu.decode_mlp`, which computes
        ``x + self(norm(x))`` for one token in one call (the products and element-wise work of
        `forward`, without its ~15 torch operations); None where that step does not apply (no
        gate, biases, another norm, weights off the CPU, no compiled kernels).  Built once and
        reused while the weights, biases and norm are the same objects."""
        g, u, d = self.gate, self.up, self.down
        if g is None:
            return None
        key = (norm, norm.weight, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)
        return _reuse(self, key, lambda: self._build_decode_args(norm))

    def _build_decode_args(self, norm: nn.Module) -> tuple | None:
        k = _cpu_kernels()
        if type(norm) is not RMSNorm or self.act_name not in _DECODE_ACTS or not k.available() or not norm.weight.is_cpu:
            return None
        if self._intact():  # (the fused weight is on the CPU: `fuse_linears` makes no other)
            g, up = self._gate_up.weight, None
            if self._gate_up.bias is not None:
                return None
        else:
            g, up = self.gate.weight, self.up.weight
            if self.gate.bias is not None or self.up.bias is not None or not (g.qs.is_cpu and up.qs.is_cpu):
                return None
        down = self.down.weight
        if self.down.bias is not None or not down.qs.is_cpu:
            return None
        return (g.cols, norm.weight.data_ptr(), norm.eps, k._ACT[_DECODE_ACTS[self.act_name]], int(self.act_name == "drelu"),
                *k._desc(g), *(k._NO_GATE if up is None else k._desc(up)), down.cols, *k._desc(down))

    def decode_step(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        """``x + self(norm(x))`` for one token (x (1, 1, n) float32 on the CPU) through the C step
        (`decode_args`), or None where it does not apply."""
        return ffn_decode_step(self, x, norm, self.down.out_features)

    @staticmethod
    def decode_into(x: torch.Tensor, y: torch.Tensor, args: tuple) -> None:
        """Run the C step with `decode_args`' `args` from x into y (may be x)."""
        _cpu_kernels()._cpu.decode_mlp(x.data_ptr(), y.data_ptr(), *args)


def ffn_decode_step(ffn: nn.Module, x: torch.Tensor, norm: nn.Module, width: int) -> torch.Tensor | None:
    """``x + ffn(norm(x))`` for one token (x (1, 1, width) float32 on the CPU) through the FFN's
    C step (its `decode_args` / `decode_into`: `MLP`, `SparseFFN`), or None where it does not apply."""
    if not x.is_cpu or x.dtype is not torch.float32 or x.numel() != width:
        return None
    args = ffn.decode_args(norm)
    if args is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    ffn.decode_into(x, y, args)
    return y


def _reuse(mod: nn.Module, key: tuple, build):
    """`build()`, kept for `mod` and reused while the objects in `key` are the same ones: the C
    decode steps' arguments would otherwise be rebuilt per layer and token (~35 us each).
    Kept beside the module, not in it, so a copy of the module (whose tensors live elsewhere)
    does not inherit the pointers."""
    c = _DECODE_ARGS.get(mod)
    if c is None or not all(map(operator.is_, c[0], key)):  # (keys of one module have one length)
        c = _DECODE_ARGS[mod] = (key, build())
    return c[1]


_DECODE_ARGS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


# Activations of the fused decode step (`MLP.decode_step`), as the kernels spell them.
_DECODE_ACTS = {"silu": "silu", "swish": "silu", "relu": "relu", "drelu": "relu", "gelu": "gelu",
                "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half (NeoX/HF) convention, over the first `n_rot` dims."""

    def __init__(self, n_rot: int, theta: float, max_pos: int, scaling: dict | None = None):
        super().__init__()
        self.n_rot, self.theta, self.scaling = n_rot, theta, scaling
        self._inv_freq = self._frequencies()
        self._cos = self._sin = torch.empty(0)
        self._last = None

    def _frequencies(self) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.n_rot, 2, dtype=torch.float64) / self.n_rot))
        sc = self.scaling or {}
        kind = sc.get("rope_type", sc.get("type", "default"))
        if kind == "linear":
            inv = inv / sc["factor"]
        elif kind == "llama3":
            inv = _llama3_scale(inv, sc)
        return inv

    def _table(self, n: int):
        if self._cos.shape[0] < n:
            size = max(n, 2 * self._cos.shape[0], 256)
            ang = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
            ang = torch.cat([ang, ang], dim=-1)
            self._cos, self._sin = ang.cos().float(), ang.sin().float()
        return self._cos, self._sin

    def _cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, broadcastable to (B, H, T, n_rot); the last pair is kept,
        since every layer of one forward passes the same positions tensor."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == device:
            return last[2], last[3]
        cos, sin = self._table(int(positions.max()) + 1)
        cos, sin = cos[positions].to(device), sin[positions].to(device)
        if positions.dim() == 1:
            cos, sin = cos[None, None], sin[None, None]
        else:
            cos, sin = cos[:, None], sin[:, None]
        self._last = (positions, device, cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, d_head); positions: (T,) or (B, T) absolute positions."""
        cos, sin = self._cos_sin(positions, x.device)
        r, half = self.n_rot, self.n_rot // 2
        xr = x[..., :r]
        # rotate-half: out = xr * cos + [-x2, x1] * sin, without building the rotated copy
        out = xr * cos
        out[..., :half].addcmul_(xr[..., half:], sin[..., :half], value=-1.0)
        out[..., half:].addcmul_(xr[..., :half], sin[..., half:])
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def _llama3_scale(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(is_mid, mid, scaled)


class Attention(nn.Module):
    """Multi-head attention with grouped/multi-query KV heads and an explicit per-layer cache."""

    def __init__(self, q: Linear, k: Linear, v: Linear, o: Linear, n_heads: int, n_kv_heads: int,
                 d_head: int, rotary: Rotary | None):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads, self.n_kv_heads, self.d_head, self.rotary = n_heads, n_kv_heads, d_head, rotary
        self._qkv = fuse_linears(q, k, v)
        self._parts = (q.weight, k.weight, v.weight) if self._qkv is not None else None

    def _intact(self) -> bool:
        """The fused q/k/v applies while the parts still are its views (not moved or replaced)."""
        p = self._parts
        return p is not None and self.q.weight is p[0] and self.k.weight is p[1] and self.v.weight is p[2]

    def _fused(self, x: torch.Tensor) -> bool:
        return x.is_cpu and self._intact()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        B, T, _ = x.shape
        if self._fused(x):
            return self._forward_fused(x, positions, cache)
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        start = cache.length
        k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, start)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))

    def decode_args(self, norm: nn.Module) -> tuple | None:
        """(pre, post): the arguments of the C step `_cpu.decode_attn` around its per-token ones,
        ``decode_attn(x, out, *pre, cos, sin, k_cache, v_cache, kstride, vstride, pos, *post)``,
        which computes ``x + self(norm(x), positions, cache)`` for one token in one call (norm,
        q/k/v products and biases, rotary, cache write, attention, o product, residual); None
        where that step does not apply (another norm, weights off the CPU, no compiled kernels).
        Built once and reused while the weights, biases, norm and rotary are the same objects."""
        q, k, v, o = self.q, self.k, self.v, self.o
        key = (norm, norm.weight, q.weight, k.weight, v.weight, o.weight, q.bias, k.bias, v.bias, o.bias, self.rotary)
        return _reuse(self, key, lambda: self._build_decode_args(norm))

    def _build_decode_args(self, norm: nn.Module) -> tuple | None:
        kern = _cpu_kernels()
        if type(norm) is not RMSNorm or not kern.available() or not norm.weight.is_cpu:
            return None
        if self._intact():  # (the fused weight is on the CPU: `fuse_linears` makes no other)
            ws, bs = (self._qkv.weight, None, None), (self._qkv.bias, None, None)
        else:
            ws = (self.q.weight, self.k.weight, self.v.weight)
            bs = (self.q.bias, self.k.bias, self.v.bias)
        o = self.o.weight
        if not all(w.qs.is_cpu for w in ws if w is not None) or not o.qs.is_cpu or not all(
                b is None or (b.is_cpu and b.dtype is torch.float32 and b.is_contiguous()) for b in (*bs, self.o.bias)):
            return None
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        descs = tuple(d for w in ws for d in (kern._NO_GATE if w is None else kern._desc(w)))
        n_rot = 0 if self.rotary is None else self.rotary.n_rot
        pre = (ws[0].cols, norm.weight.data_ptr(), norm.eps, *descs, *(ptr(b) for b in bs),
               self.n_heads, self.n_kv_heads, self.d_head, n_rot)
        return pre, (*kern._desc(o), ptr(self.o.bias), self.d_head ** -0.5)

    def decode_step(self, x: torch.Tensor, norm: nn.Module, positions: torch.Tensor, cache: LayerKV) -> torch.Tensor | None:
        """``x + self(norm(x), positions, cache)`` for one token (x (1, 1, n) float32 on the CPU)
        through the C step (`decode_args`), or None where it does not apply (also: a cache
        that is not float32 on the CPU)."""
        if not x.is_cpu or x.dtype is not torch.float32 or x.numel() != x.shape[-1] or not cache.on_cpu_f32 \
                or (cache.k is not None and cache.k.shape[0] != 1):
            return None
        args = self.decode_args(norm)
        if args is None or args[0][0] != x.shape[-1]:
            return None
        x = x.contiguous()
        y = torch.empty_like(x)
        self.decode_into(x, y, args, positions, cache)
        return y

    def decode_into(self, x: torch.Tensor, y: torch.Tensor, args: tuple, positions: torch.Tensor, cache: LayerKV) -> None:
        """Run the C step with `decode_args`' `args` from x into y (may be x), appending to `cache`."""
        pre, post = args
        H, Hk, D, n_rot = pre[-4:]
        cos = sin = 0
        if n_rot:  # (shared by all layers of this forward, see Rotary._cos_sin)
            c, s = self.rotary._cos_sin(positions, x.device)
            cos, sin = c.data_ptr(), s.data_ptr()
        kc, vc, slot = cache.slot(Hk, D)
        stride = kc.shape[2] * D
        _cpu_kernels()._cpu.decode_attn(x.data_ptr(), y.data_ptr(), *pre, cos, sin, kc.data_ptr(), vc.data_ptr(),
                                        stride, stride, slot, *post)
        cache.advance()

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """Same as `forward`: one product for q, k and v, one rotary call for q and k together."""
        B, T, _ = x.shape
        H, Hk, D = self.n_heads, self.n_kv_heads, self.d_head
        y = self._qkv(x)
        qk = y[..., : (H + Hk) * D].view(B, T, H + Hk, D).transpose(1, 2)
        if self.rotary is not None:
            qk = self.rotary(qk, positions)
        q, k = qk[:, :H], qk[:, H:]
        v = y[..., (H + Hk) * D:].view(B, T, Hk, D).transpose(1, 2)
        start = cache.length
        k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, start)
        return self.o(out.transpose(1, 2).reshape(B, T, H * D))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of T new queries (positions start..start+T-1) over L = start+T keys."""
    T, L = q.shape[2], k.shape[2]
    B, H, _, D = q.shape
    Hk = k.shape[1]
    if T == 1 and q.is_cpu:
        # One query per head, no mask: our C kernel on the kernel threads, reading each KV head
        # once for its query heads (0.08 vs 0.14 ms per call at 600 cached tokens, 12/2 heads
        # of 128, 2 threads; torch's SDPA runs on its one thread here).
        return _cpu_kernels().attend1(q, k, v)
    if T == 1 and H != Hk:
        # One query per head and no mask: the g = H/Hk query heads that share a KV head (head h
        # uses KV head h // g, as repeat_kv does) become g query rows of that KV head, so K/V
        # are read in place.  torch's enable_gqa path copies K/V per query head: 0.77 ms vs
        # 0.17 ms per call at 600 cached tokens, 12/2 heads of 128, one thread.
        out = F.scaled_dot_product_attention(q.reshape(B, Hk, H // Hk, D), k, v)
        return out.view(B, H, 1, D)
    mask = None
    if T > 1:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=start)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
