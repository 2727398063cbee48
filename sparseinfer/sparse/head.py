"""A sparse output head: a cheap preview of the logits picks candidate tokens, the exact head
scores only those.

The head W (vocab x d) is the largest single matrix of a small model and is read whole for
every decoded token.  Its logits W h need not be: only the top few matter for greedy decoding
and almost all of the probability mass for sampling.  The preview is a low-rank product
A (B h) with A = W L V_r (vocab x r) and B = V_r^T L^-1 (r x d), where L L^T is the covariance
of the head's input h on calibration text and V_r the top r right singular vectors of W L: the
rank-r approximation of the logits with the least expected squared error over inputs like the
calibration ones (without the weighting by h's covariance the preview misses the true top
token far more often, since a few directions of h carry most of its energy).  A is held in q8
(read by the ordinary gemv kernel) or in q4 in 16-row tiles (format tq4, `quant.to_tiles`, read
by `cpu.gemv_int8`: rows of a few hundred weights are per-row-overhead bound in the row-major
kernels).

Per token: z = B h; p = A z (the preview); the candidates are the tokens whose preview is at
least the estimated k-th largest (found on a strided sample of p, so no full sort), and the
tokens of the sequence so far (its last `CONTEXT_WINDOW`, which the model's KV cache records):
a low-rank preview misses mostly tokens particular to one text (a list's `"\n`, a name in
code), and those tend to repeat within the text.  The exact logits of the candidates come
from the head's own rows (`gemv_rows`).  Uncertain tokens, where the best exact candidate is
not one of the context's and ranks low in the preview (below its estimated k/4-th value), or
where the estimate found far too many or too few candidates, get the full exact head.
Non-candidates get -inf: sampling and greedy decoding see exact logits for the candidates and
nothing else.

`fit` computes the basis once; `preview` cuts it at a rank; `agreement` measures, on held-out
inputs, how often the module's greedy token equals the exact head's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels import cpu
from ..quant import from_float, to_tiles

SAMPLE_STRIDE = 16      # the k-th largest preview value is estimated on every 16th logit
MAX_ROWS = 1            # more rows at once (batched decode) read the exact head once for all
RANK_STEP = 32          # ranks are multiples of the q8 block
CONTEXT_WINDOW = 1024   # the sequence's last tokens that are always candidates


PREVIEW_FORMATS = ("q8", "q4")   # what A is held in for decode


@dataclass
class HeadPreview:
    """A (vocab x rank) and B (rank x d) of the preview, the candidate count k, how it was
    measured (stats: rank, held-out agreement, fallback fraction, tokens), and the format A is
    held in for decode (`PREVIEW_FORMATS`)."""

    a: torch.Tensor
    b: torch.Tensor
    candidates: int
    stats: dict = field(default_factory=dict)
    fmt: str = "q8"

    @property
    def rank(self) -> int:
        return int(self.b.shape[0])



@dataclass
class Basis:
    """Everything `preview` needs for any rank: W L V (vocab x d, columns by falling singular
    value) and V^T L^-1 (d x d)."""

    wlv: torch.Tensor
    vtl: torch.Tensor


def candidate_count(vocab: int) -> int:
    """k: 1/32 of the vocabulary, at least 512 and at most 4096 tokens (their rows cost a few
    percent of the head; fewer let the exact top token slip out more often on generated text)."""
    return int(min(vocab, max(512, min(4096, vocab // 32))))


def _rows(w, r0: int, r1: int) -> torch.Tensor:
    return cpu.dequantize_rows(w, r0, r1)


def fit(head_w, hidden: torch.Tensor, chunk: int = 8192) -> Basis:
    """The preview basis of the head weight `head_w` (a `QWeight`, vocab x d) for inputs like
    `hidden` (N x d, the final norm's outputs on calibration text)."""
    d = head_w.cols
    if hidden.dim() != 2 or hidden.shape[1] != d or hidden.shape[0] < 2:
        raise ValueError(f"hidden states must be (N >= 2, {d}), got {tuple(hidden.shape)}")
    h = hidden.double()
    cov = h.T @ h / h.shape[0]
    ev, u = torch.linalg.eigh(cov)
    ev = ev.clamp_min(float(ev.max()) * 1e-9)
    lo, lo_inv = u * ev.sqrt(), (u / ev.sqrt()).T        # cov = L L^T
    gram = torch.zeros(d, d, dtype=torch.float64)
    for r0 in range(0, head_w.rows, chunk):                # (W L)^T (W L) without W whole in f64
        wl = (_rows(head_w, r0, min(head_w.rows, r0 + chunk)).double() @ lo)
        gram += wl.T @ wl
    _, v = torch.linalg.eigh(gram)
    v = v.flip(1)                                          # by falling singular value
    lv = (lo @ v).float()
    wlv = torch.cat([_rows(head_w, r0, min(head_w.rows, r0 + chunk)) @ lv
                     for r0 in range(0, head_w.rows, chunk)])
    return Basis(wlv, (v.T @ lo_inv).float())


def preview(basis: Basis, rank: int, candidates: int, fmt: str = "q8") -> HeadPreview:
    rank = min(basis.vtl.shape[0], max(RANK_STEP, rank // RANK_STEP * RANK_STEP))
    return HeadPreview(basis.wlv[:, :rank].contiguous(), basis.vtl[:rank].contiguous(), candidates, fmt=fmt)


def select(p: torch.Tensor, k: int, context=None, out: torch.Tensor | None = None
           ) -> tuple[torch.Tensor | None, float]:
    """(ids (int32) of the tokens whose preview is at least the estimated k-th largest and of
    the tokens in `context` (ids; the last `CONTEXT_WINDOW` count), ascending; the estimated
    (k/4)-th largest value), or (None, _) when the estimate is off by over 4x.  `out`: an int32
    buffer of p's length for the ids."""
    s = p[::SAMPLE_STRIDE]
    ks = max(4, k // SAMPLE_STRIDE)
    if ks >= s.numel():
        return torch.arange(p.numel(), dtype=torch.int32), float("-inf")
    top = torch.topk(s, ks).values                           # sorted, largest first
    ctx = None if context is None or not len(context) else context[-CONTEXT_WINDOW:]
    ids, n = cpu.select_ids(p, float(top[-1]), ctx, out)
    if not k // 4 <= n <= 4 * k:
        return None, 0.0
    return ids, float(top[ks // 4 - 1])


def preview_matrix(hp: HeadPreview):
    """A as decode reads it: a row-major q8 `QWeight`, or q4 in row tiles (tq4)."""
    a = from_float(hp.a.float(), hp.fmt)
    return to_tiles(a) if hp.fmt == "q4" else a


def preview_product(a, z: torch.Tensor) -> torch.Tensor:
    """p = A z for `preview_matrix`'s A."""
    return cpu.gemv_int8(a, z) if a.fmt == "tq4" else cpu.gemv(a, z)


class PreviewHead(nn.Module):
    """A drop-in for the model's head `exact` (a `Linear`): one row at a time on the CPU goes
    through the preview (module docstring); anything else (prompts, perplexity, batched rows,
    an accelerator) through `exact`.  `tokens` and `fallbacks` count the rows of each kind.
    The model passes the ids its cache holds as `context` (`takes_context`)."""

    takes_context = True

    def __init__(self, exact: nn.Module, hp: HeadPreview):
        super().__init__()
        w = exact.weight
        if hp.a.shape[0] != w.rows or hp.b.shape[1] != w.cols or hp.a.shape[1] != hp.b.shape[0]:
            raise ValueError(f"head preview of shape A {tuple(hp.a.shape)}, B {tuple(hp.b.shape)} does not fit a "
                             f"{w.rows} x {w.cols} head")
        self.exact, self.hp = exact, hp
        if hp.fmt not in PREVIEW_FORMATS or hp.a.shape[1] % RANK_STEP:
            raise ValueError(f"head preview of rank {hp.a.shape[1]} in {hp.fmt!r}: expected a multiple of "
                             f"{RANK_STEP} in one of {', '.join(PREVIEW_FORMATS)}")
        self.a = preview_matrix(hp)
        self.b = hp.b.float().contiguous()
        self.k = hp.candidates
        self.tokens = self.fallbacks = 0
        self._ids = torch.empty(w.rows, dtype=torch.int32)

    @property
    def weight(self):
        return self.exact.weight

    @property
    def preview_bytes(self) -> int:
        """Bytes of the preview as decode reads it (A in its format, B in f32)."""
        return self.a.nbytes + self.b.numel() * 4

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > MAX_ROWS or x.device.type != "cpu" or self.exact.weight.qs.device.type != "cpu":
            return self.exact(x)
        return torch.stack([self.row(r, context) for r in flat.float()]).view(*lead, -1)

    def row(self, h: torch.Tensor, context=None) -> torch.Tensor:
        """The logits of one input row: exact for the candidates, -inf elsewhere (or the exact
        head's, when uncertain).  `context`: the ids of the sequence's tokens so far."""
        self.tokens += 1
        h = h.contiguous()
        p = preview_product(self.a, self.b @ h)
        ids, sure = select(p, self.k, context, self._ids)
        if ids is not None:
            ex = cpu.gemv_rows(self.exact.weight, h, ids)
            if self.exact.bias is not None:
                ex += self.exact.bias[ids]
            best = int(ids[int(ex.argmax())])
            if float(p[best]) >= sure or (context is not None and best in context[-CONTEXT_WINDOW:]):
                out = p.fill_(float("-inf"))              # the preview's buffer, no longer needed
                out[ids] = ex
                return out
        self.fallbacks += 1
        return self.exact(h[None])[0]


def install(model: nn.Module, hp: HeadPreview) -> PreviewHead:
    """Put a `PreviewHead` in front of `model.head` (replacing an earlier one)."""
    exact = model.head.exact if isinstance(model.head, PreviewHead) else model.head
    model.head = PreviewHead(exact, hp)
    return model.head


def remove(model: nn.Module) -> None:
    if isinstance(model.head, PreviewHead):
        model.head = model.head.exact


def exact_tokens(exact: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The exact head's greedy token for each row of `hidden`, one row at a time as decode
    computes it (a batched product rounds activations differently and can flip near-ties)."""
    with torch.inference_mode():
        return torch.tensor([int(exact(h[None].float())[0].argmax()) for h in hidden])


def agreement(head: PreviewHead, hidden: torch.Tensor, want: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None) -> dict:
    """Over the rows of `hidden` (held-out final-norm outputs): the fraction whose greedy token
    through `head` equals the exact head's (`want`, default `exact_tokens`), and the fraction
    that fell back to the exact head.  `tokens` (S, T): the input ids the rows came from, S
    sequences of T in order, which the head gets as each row's context."""
    want = exact_tokens(head.exact, hidden) if want is None else want
    if tokens is not None and tokens.numel() != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {tokens.numel()} tokens")
    t0, f0 = head.tokens, head.fallbacks
    T = tokens.shape[1] if tokens is not None else 0
    with torch.inference_mode():
        got = torch.tensor([int(head.row(h.float(), None if tokens is None else tokens[i // T, : i % T + 1]).argmax())
                            for i, h in enumerate(hidden)])
    n = hidden.shape[0]
    fell = head.fallbacks - f0
    head.tokens, head.fallbacks = t0, f0
    return {"agreement": int((got == want).sum()) / n, "fallback": fell / n, "tokens": n}


RANK_FRACTIONS = (8, 6, 5, 4, 3, 2)   # ranks tried, as fractions of d (rounded up to RANK_STEP)
MAX_FALLBACK = 0.005                  # a preview that needs the exact head more often is not kept


def preview_seconds(hp: HeadPreview, reps: int = 15) -> float:
    """The median time of the preview's product A z here, with A coming from memory as in
    decode (where the whole model passes through the caches between two tokens)."""
    import time

    a = preview_matrix(hp)
    z = torch.randn(hp.rank)
    evict = torch.ones(16 << 20)             # 64 MB, more than the last-level caches we meet
    ts = []
    for _ in range(reps):
        evict.add_(1.0)
        t = time.perf_counter()
        preview_product(a, z)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]


class HiddenRecorder:
    """Collects the head's inputs (the final norm of the last block's output, every position)
    while the model runs forward passes, up to `limit` rows."""

    def __init__(self, model: nn.Module, limit: int = 16384):
        self.rows: list[torch.Tensor] = []
        self.limit, self.n = limit, 0
        norm = model.norm

        def hook(_mod, _inp, out):
            if self.n < self.limit:
                x = out[0] if isinstance(out, tuple) else out
                h = norm(x).reshape(-1, x.shape[-1]).float()[: self.limit - self.n].cpu()
                self.rows.append(h)
                self.n += h.shape[0]

        self.handle = model.layers[-1].register_forward_hook(hook)

    def detach(self) -> torch.Tensor:
        self.handle.remove()
        return torch.cat(self.rows) if self.rows else torch.zeros(0)


def choose(model: nn.Module, hidden: torch.Tensor, target: float = 0.9999, held_out: float = 0.25,
           progress: bool = True, tokens: torch.Tensor | None = None) -> tuple[HeadPreview | None, list[dict]]:
    """Fit the preview on the first rows of `hidden` and measure it on the last `held_out` share
    (whole calibration sequences: the rows come sequence by sequence).  The ranks of
    `RANK_FRACTIONS` in each of `PREVIEW_FORMATS` are tried from the fastest product here
    (`preview_seconds`: a narrow q4 product can be slower than a wider q8 one) to the slowest;
    the first whose greedy agreement with the exact head is at least `target` and that falls
    back to the exact head on at most `MAX_FALLBACK` of the rows is kept, else None.  `tokens`
    (S, T): the calibration sequences the rows came from (the first rows' worth are used), so
    that held-out rows are scored with their context as decode would.
    Returns it (its stats filled) and every preview tried."""
    exact = model.head.exact if isinstance(model.head, PreviewHead) else model.head
    w = exact.weight
    n = hidden.shape[0]
    cut = n - max(1, int(n * held_out))
    if tokens is not None:
        T = tokens.shape[1]
        if n % T or n // T > tokens.shape[0]:
            raise ValueError(f"{n} hidden rows are not whole sequences of the {tuple(tokens.shape)} tokens")
        cut = cut // T * T
        tokens = tokens[cut // T: n // T]
    if cut < 2:
        return None, []
    basis = fit(w, hidden[:cut])
    k = candidate_count(w.rows)
    want = exact_tokens(exact, hidden[cut:])
    ranks = sorted({-(-w.cols // frac // RANK_STEP) * RANK_STEP for frac in RANK_FRACTIONS})
    configs = [(r, fmt) for r in ranks if r < w.cols for fmt in PREVIEW_FORMATS]
    cost = [preview_seconds(preview(basis, r, k, fmt)) for r, fmt in configs]   # one preview in memory at a time
    tried = []
    for c, (r, fmt) in sorted(zip(cost, configs), key=lambda t: t[0]):
        hp = preview(basis, r, k, fmt)
        ph = PreviewHead(exact, hp)
        st = {"rank": hp.rank, "format": hp.fmt, "candidates": k, "preview_ms": round(1e3 * c, 3),
              "preview_bytes": ph.preview_bytes, "head_bytes": w.nbytes, **agreement(ph, hidden[cut:], want, tokens)}
        tried.append(st)
        if progress:
            print(f"head preview rank {hp.rank} in {hp.fmt} ({st['preview_ms']:.2f} ms): greedy agreement "
                  f"{st['agreement']:.4f}, exact head for {100 * st['fallback']:.2f}% of {st['tokens']} held-out tokens",
                  flush=True)
        if st["agreement"] >= target and st["fallback"] <= MAX_FALLBACK:
            hp.stats = dict(st)
            return hp, tried
    return None, tried
