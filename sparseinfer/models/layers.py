"""Shared layers: linear over any weight format, norms, rotary embeddings, attention, dense MLP.

Everything computes in float32 on (batch, time, features) tensors.  Weights stay in their
`QWeight` format; `Linear` hands them to the CPU kernels (or, on an accelerator, to torch).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedError
from ..kernels import cpu, decode_plan, matmul
from ..kernels.reference import activation_fn, canonical_activation
from ..kv_cache import LayerKV
from ..kv_cache import encode as kv_encode
from ..quant import QWeight


class Module(nn.Module):
    """An nn.Module whose attribute assignments (a replaced weight, norm or sub-module) make the
    C decode steps check what they were built from (`kernels.decode_plan.cached_step`).  Layers
    a decode step is built from derive from it; modules that set attributes while they compute
    (e.g. `Rotary`'s table) must not."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        decode_plan.modules_changed()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        decode_plan.modules_changed()


class Linear(Module):
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
        y = matmul(self.weight, x.reshape(-1, x.shape[-1]).float().contiguous())
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
    if cpu.interleave_pays(w0):
        # each row's scales next to its values (`interleave_rows`): one stream per row for the
        # dense products, and no neighbours' scales read by the row-sparse ones; a loader may
        # have converted the parts into one such buffer already (`registry.prefetch`)
        fused = cpu.stacked_view(list(ws)) if all(cpu.is_interleaved(w) for w in ws) else None
        fused = fused or cpu.interleave_rows(*ws)
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


class RMSNorm(Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight.float(), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:  # the C norm; it falls back to F.rms_norm for what it does not take
            return cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LayerNorm(Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def activation(name: str):
    """The torch function of a config's activation name (`kernels.reference`'s table)."""
    try:
        return activation_fn(name)
    except ValueError as e:
        raise UnsupportedError(str(e)) from None


class MLP(Module):
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: the stream the block normalized into x; unused here (a sparse FFN's
        predictor may read it: `sparse.ffn`)."""
        return self.down(self.hidden(x))

    def step(self, norm: nn.Module) -> decode_plan.FFNStep | None:
        """The C decode step of ``x + self(norm(x))`` for one token (`kernels.decode_plan`),
        built on first use; None where it does not apply (a norm other than RMSNorm, weights
        off the CPU, no compiled kernels): the block then runs this module."""
        def key():
            parts = [x for x in (self.gate, self.up, self.down) if x is not None]
            return (norm.weight, *(x.weight for x in parts), *(x.bias for x in parts))
        return decode_plan.cached_step(self, key, lambda: self._build_step(norm), norm)

    def _build_step(self, norm: nn.Module) -> decode_plan.FFNStep | None:
        g, u, d = self.gate, self.up, self.down
        if type(norm) is not RMSNorm or not decode_plan.available() or not decode_plan.on_cpu(
                norm.weight, *(x.weight for x in (g, u, d) if x is not None), *(x.bias for x in (g, u, d) if x is not None)):
            return None
        return decode_plan.dense_ffn_step(
            act=canonical_activation(self.act_name), relu_up=self.act_name == "drelu",
            gate=None if g is None else g.weight, up=u.weight, down=d.weight,
            gate_bias=None if g is None else g.bias, up_bias=u.bias, down_bias=d.bias,
            gate_up_fused=self._intact(), norm_w=norm.weight, eps=norm.eps)


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


class Attention(Module):
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerKV | list[LayerKV]) -> torch.Tensor:
        """x (B, T, n) at `positions` (T,) appended to `cache`; or one token per row, x (B, 1, n)
        at positions (B, 1), row b appended to its own cache `cache[b]` (`CausalLM.decode_batch`)."""
        if isinstance(cache, list):
            return self._forward_rows(x, positions, cache)
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

    def step(self, norm: nn.Module) -> decode_plan.AttnStep | None:
        """The C decode step of ``x + self(norm(x), positions, cache)`` for one token
        (`kernels.decode_plan`), built on first use; None where it does not apply (a norm other
        than RMSNorm, weights off the CPU, no compiled kernels): the block then runs this module."""
        def key():
            lins = (self.q, self.k, self.v, self.o)
            return (norm.weight, self.rotary, *lins, *(x.weight for x in lins), *(x.bias for x in lins))
        return decode_plan.cached_step(self, key, lambda: self._build_step(norm), norm)

    def _build_step(self, norm: nn.Module) -> decode_plan.AttnStep | None:
        lins = (self.q, self.k, self.v, self.o)
        if type(norm) is not RMSNorm or not decode_plan.available() or not all(isinstance(x, Linear) for x in lins) \
                or not decode_plan.on_cpu(norm.weight, *(x.weight for x in lins), *(x.bias for x in lins)):
            return None
        fused = self._intact()
        return decode_plan.AttnStep(
            norm_w=norm.weight, eps=norm.eps, q=self._qkv.weight if fused else self.q.weight,
            k=None if fused else self.k.weight, v=None if fused else self.v.weight, o=self.o.weight,
            bq=self._qkv.bias if fused else self.q.bias, bk=None if fused else self.k.bias,
            bv=None if fused else self.v.bias, bo=self.o.bias, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            d_head=self.d_head, n_rot=0 if self.rotary is None else self.rotary.n_rot)

    def run_step(self, step: decode_plan.AttnStep, x: torch.Tensor, positions: torch.Tensor, cache: LayerKV) -> None:
        """Run `step` on the flat one-token state x (n,) in place, appending to `cache`."""
        cos = sin = None
        if step.n_rot:  # (shared by all layers of this forward, see Rotary._cos_sin)
            cos, sin = self.rotary._cos_sin(positions, x.device)
        kc, vc, slot = cache.slot(step.n_kv_heads, step.d_head)
        step.run(x, x, cos, sin, kc, vc, slot, cache.kv_code)
        cache.advance()

    def run_step_rows(self, step: decode_plan.AttnStep, x: torch.Tensor, positions: torch.Tensor,
                      caches: list[LayerKV]) -> None:
        """`run_step` for one token of each of B sequences: x (B, n) in place, row b at
        positions[b] appended to caches[b] (all on the CPU, one cache type)."""
        cos = sin = None
        if step.n_rot:
            cos, sin = self.rotary._cos_sin(positions, x.device)
        slots = [kv.slot(step.n_kv_heads, step.d_head) for kv in caches]
        step.run_rows(x, x, cos, sin, slots, caches[0].kv_code)
        for kv in caches:
            kv.advance()

    def _forward_rows(self, x: torch.Tensor, positions: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        """One token per row, each row over its own cache (ragged lengths): the projections are
        one product over all rows (each weight read once), rotary and attention go row by row.
        Every row gets the numbers it would get alone (`cpu.matmul_equals_gemv`)."""
        B = x.shape[0]
        H, Hk, D = self.n_heads, self.n_kv_heads, self.d_head
        y = self._qkv(x) if self._fused(x) else torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        qk = y[..., : (H + Hk) * D].reshape(B, 1, H + Hk, D).transpose(1, 2)
        if self.rotary is not None:  # q and k in one call
            qk = self.rotary(qk, positions)
        q, k = qk[:, :H], qk[:, H:]
        v = y[..., (H + Hk) * D:].reshape(B, 1, Hk, D).transpose(1, 2)
        types = {kv.cache_type for kv in caches}
        if x.is_cpu and cpu.available() and len(types) == 1 and all(kv.on_cpu for kv in caches):
            # the rows' new keys and values stored at once, then each row attends over its own cache
            (ctype,) = types
            ek, ev = kv_encode(ctype, k), kv_encode(ctype, v)
            kvs = []
            for b, kv in enumerate(caches):
                kc, vc, pos = kv.slot(Hk, D)
                kc[0, :, pos] = ek[b, :, 0]
                vc[0, :, pos] = ev[b, :, 0]
                kv.advance()
                kvs.append((kc, vc, kv.length))
            out = cpu.attend1_rows(q.float(), kvs, ctype)
        else:
            out = torch.empty(B, H, 1, D, device=x.device)
            for b, kv in enumerate(caches):
                out[b: b + 1] = attend_cached(q[b: b + 1], k[b: b + 1], v[b: b + 1], kv)
        return self.o(out.transpose(1, 2).reshape(B, 1, H * D))

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


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV) -> torch.Tensor:
    """One new token of one sequence: append k, v (1, Hk, 1, D) to `cache` and attend q
    (1, H, 1, D) over everything cached.  On the CPU the C kernel reads the stored form in place
    (`cpu.attend1_stored`); elsewhere the float32 copies go to `attend`."""
    if not (cache.on_cpu and q.is_cpu and cpu.available()):
        start = cache.length
        k, v = cache.update_and_fetch(k, v)
        return attend(q, k, v, start)
    kc, vc, pos = cache.slot(k.shape[1], k.shape[3])
    kc[:, :, pos: pos + 1] = kv_encode(cache.cache_type, k)
    vc[:, :, pos: pos + 1] = kv_encode(cache.cache_type, v)
    cache.advance()
    n = cache.length
    return cpu.attend1_stored(q.float(), kc[:, :, :n], vc[:, :, :n], cache.cache_type)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of T new queries (positions start..start+T-1) over L = start+T keys."""
    T, L = q.shape[2], k.shape[2]
    B, H, _, D = q.shape
    Hk = k.shape[1]
    if T == 1 and q.is_cpu:
        # One query per head, no mask: our C kernel on the kernel threads, reading each KV head
        # once for its query heads (torch's SDPA runs on its one thread here).
        return cpu.attend1(q, k, v)
    if T == 1 and H != Hk:
        # One query per head and no mask: the g = H/Hk query heads that share a KV head (head h
        # uses KV head h // g, as repeat_kv does) become g query rows of that KV head, so K/V
        # are read in place.  torch's enable_gqa path copies K/V per query head, a copy that
        # dominates the call.
        out = F.scaled_dot_product_attention(q.reshape(B, Hk, H // Hk, D), k, v)
        return out.view(B, H, 1, D)
    mask = None
    if T > 1:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=start)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
