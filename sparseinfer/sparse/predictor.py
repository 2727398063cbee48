"""Activation predictors: one small MLP per layer, x -> relu(W1 x + b1) -> W2 . + b2 -> logits
over the layer's neurons (in hotness order); a neuron is predicted active when its logit > tau.

Training (torch on CPU) is recall-oriented: missed neurons cost quality, extra ones only
speed.  tau is tuned on held-out tokens to reach a recall target, and recall/precision/density
are then measured on *other* held-out tokens, so the reported numbers are honest estimates.
The hidden size adapts per layer (PowerInfer's adaptive predictors): sizes are tried from a
ladder, smallest first, and the one with the fewest bytes read per token, predictor plus the
FFN rows it selects, wins.  At run time `QPredictor` holds W1/W2 as q8 `QWeight`s and runs
through our CPU kernels (`gemv` for decode, `matmul` for whole chunks).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..kernels import cpu, torch_device
from ..quant import from_float

LADDER = (32, 64, 128, 256, 512, 1024)
# What a predictor reads: the FFN's input (after its norm; every trained predictor), or the
# residual stream the FFN reads through its norm (a PowerInfer Falcon/OPT file's predictors,
# whose LayerNorm no change of weights folds away; the block passes that stream to the FFN)
READS = ("ffn_input", "residual")


# ---------------------------------------------------------------------------- bit packing
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(M, n) bool -> (M, ceil(n/8)) uint8, bit j of byte k = column 8k + j."""
    m, n = mask.shape
    pad = (-n) % 8
    if pad:
        mask = torch.cat([mask, torch.zeros(m, pad, dtype=torch.bool)], dim=1)
    bits = mask.view(m, -1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (M, ceil(n/8)) uint8 -> (M, n) bool."""
    bits = (packed[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(packed.shape[0], -1)[:, :n].bool()


# ---------------------------------------------------------------------------- runtime
class QPredictor:
    """A trained predictor in q8 for our kernels; rows it returns are hotness-order ids."""

    def __init__(self, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 tau: float, fmt: str = "q8", w1_fmt: str | None = None, reads: str = "ffn_input"):
        """Weights in `fmt`; W1 in `w1_fmt` when given (a float W1 computed from a file's
        weights, kept in f32 so that rounding does not move scores across the cut).  `reads`:
        the input it was trained on (`READS`)."""
        if reads not in READS:
            raise ValueError(f"a predictor reads one of {READS}, not {reads!r}")
        self.reads = reads
        r = w1.shape[0] if w1.dim() == 2 else -1
        if (r < 1 or tuple(b1.shape) != (r,) or w2.dim() != 2 or w2.shape[1] != r or w2.shape[0] < 1
                or tuple(b2.shape) != (w2.shape[0],)):
            raise ValueError(f"predictor shapes do not fit together: w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, "
                             f"w2 {tuple(w2.shape)}, b2 {tuple(b2.shape)} (expected (r, d), (r,), (n, r), (n,))")
        if not math.isfinite(float(tau)):
            raise ValueError(f"predictor cut tau must be finite, got {tau}")
        self.w1 = from_float(w1.float(), w1_fmt or fmt)
        # W2 is stored transposed, (r, n): decode computes W2 z as sum_j z_j W2t[j] (`axpy_rows`
        # over r long rows, which stream far better than `gemv` over n short rows of r values),
        # and z is not re-quantized; chunks and the accelerator use the same values
        self.w2t = from_float(w2.float().T.contiguous(), fmt)
        self._hidden_ids = torch.arange(self.w2t.rows, dtype=torch.int32)
        self.b1, self.b2 = b1.float().contiguous(), b2.float().contiguous()
        self.tau = float(tau)
        self.cut = (self.tau - self.b2).contiguous()  # logit > tau  <=>  W2 z > tau - b2
        self._cut_np = self.cut.numpy()
        self._nbytes: int | None = None
        self.torch_ops = False  # batches through torch ops (an accelerator) instead of our kernels

    @property
    def device(self) -> torch.device:
        return self.w1.qs.device

    def to(self, device: torch.device | str, torch_ops: bool | None = None) -> "QPredictor":
        """A copy with its weights on `device`, run with torch ops there (`torch_ops`, default:
        off the CPU; True on the CPU makes it a stand-in for an accelerator): same values and
        decision rule."""
        out = copy.copy(self)
        out.torch_ops = torch.device(device).type != "cpu" if torch_ops is None else torch_ops
        out.w1, out.w2t = self.w1.to(device), self.w2t.to(device)
        out.b1, out.b2, out.cut = self.b1.to(device), self.b2.to(device), self.cut.to(device)
        out._hidden_ids = self._hidden_ids.to(device)
        return out

    def device_nbytes(self) -> int:
        """Bytes it takes in an accelerator's memory (allocator rounding included)."""
        td = torch_device
        return (td.qweight_device_nbytes(self.w1) + td.qweight_device_nbytes(self.w2t) + td.device_nbytes(self.b1)
                + td.device_nbytes(self.cut))

    @property
    def hidden_size(self) -> int:
        return self.w1.rows

    @property
    def n_neurons(self) -> int:
        return self.w2t.cols

    @property
    def nbytes(self) -> int:
        """Bytes one prediction reads (W1, W2^T, biases and cut)."""
        if self._nbytes is None:
            self._nbytes = self.w1.nbytes + self.w2t.nbytes + 4 * (self.b1.numel() + self.cut.numel())
        return self._nbytes

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        z = cpu.gemv(self.w1, x)
        z.add_(self.b1).relu_()
        return cpu.axpy_rows(self.w2t, z, self._hidden_ids)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n,) for one FFN input x (d,)."""
        return self._raw(x) + self.b2

    def active_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted active rows, int32 ascending (the decode hot path)."""
        # numpy's flatnonzero: less per-call overhead than torch.nonzero at this size
        return torch.from_numpy(np.flatnonzero(self._raw(x).numpy() > self._cut_np).astype(np.int32))

    def top_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The k highest-scoring rows, int32 ascending (ranked by logit - tau, as the C decode
        step does: the same order as the logits; ties go to the lowest ids, as there)."""
        order = self._raw(x).sub_(self.cut).sort(descending=True, stable=True).indices
        return order[:k].sort().values.to(torch.int32)

    def scores_batch(self, x2: torch.Tensor) -> torch.Tensor:
        """Logits (M, n) for inputs (M, d) on the predictor's device, through `matmul`
        (chunks, perplexity, an accelerator's tokens)."""
        x2 = x2.float().contiguous()
        if not self.torch_ops:  # our kernels at every size: decisions must match the C decode step's
            z = cpu.matmul(self.w1, x2)
            return z.add_(self.b1).relu_() @ self.w2t.dequantize() + self.b2
        z = torch_device.matmul(self.w1, x2)
        return torch_device.matmul_t(z.add_(self.b1).relu_(), self.w2t) + self.b2

    def mask_batch(self, x2: torch.Tensor) -> torch.Tensor:
        """(M, n) bool: predicted active, per input row (logit > tau)."""
        return self.scores_batch(x2) > self.tau

    def reference_scores(self, x2: torch.Tensor) -> torch.Tensor:
        """Slow reference of `scores_batch`: dequantized weights, torch float math."""
        z = torch.relu(x2.float() @ self.w1.dequantize().T + self.b1)
        return z @ self.w2t.dequantize() + self.b2


def q8_bytes(rows: int, cols: int) -> int:
    """Bytes of a q8 QWeight of this shape (int8 values + one f16 scale per 32)."""
    kp = (cols + 31) // 32 * 32
    return rows * kp + rows * (kp // 32) * 2


def predictor_bytes(d: int, r: int, n: int, fmt: str = "q8") -> int:
    """Bytes of a runtime predictor (W1, W2^T, b1, the cut) with weights in `fmt` (a float
    `fmt`: W2 in it, W1 in f32, as `LayerPack.predictor` makes them)."""
    if fmt == "q8":
        return q8_bytes(r, d) + q8_bytes(n, r) + 4 * (r + 2 * n)
    return 4 * r * d + n * r * (4 if fmt == "f32" else 2) + 4 * (r + 2 * n)


# ---------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    sizes: tuple[int, ...] = LADDER
    recall: float = 0.99
    steps: int = 400
    batch: int = 256
    lr: float = 3e-3
    pos_weight: float = 2.0  # recall-oriented: a missed neuron costs more than an extra one
    seed: int = 0


@dataclass
class PredictorResult:
    """A trained predictor (float weights, normalization folded in) and its held-out metrics."""

    state: dict[str, torch.Tensor]
    tau: float
    hidden: int
    recall: float
    precision: float
    density_predicted: float
    density_true: float
    nbytes: int
    cost_bytes: float  # predictor + first-projection rows it selects, bytes per token
    tried: list[dict] = field(default_factory=list)
    policy: str = "predictor"  # or "first": the exact first projection is cheaper than predicting

    def runtime(self) -> QPredictor:
        s = self.state
        return QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], self.tau)


class _Net(nn.Module):
    def __init__(self, d: int, r: int, n: int, prior: torch.Tensor):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, r), nn.Linear(r, n)
        with torch.no_grad():
            self.fc2.weight.mul_(0.1)
            self.fc2.bias.copy_(torch.logit(prior.clamp(1e-4, 1 - 1e-4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@dataclass
class LayerData:
    """One layer's recording: FFN inputs (N, d) f16, targets (N, ceil(n/8)) packed bits in
    hotness order, and the split of tokens into train / tune (tau) / report (metrics)."""

    x: torch.Tensor
    y: torch.Tensor
    n: int
    train: torch.Tensor
    tune: torch.Tensor
    report: torch.Tensor

    def targets(self, idx: torch.Tensor) -> torch.Tensor:
        return unpack_bits(self.y.index_select(0, idx), self.n)

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        return self.x.index_select(0, idx).float()


def split_tokens(n_tokens: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids for train / tune (tau) / report (metrics): whole sequences, about 8:1:1 with at
    least one sequence each (calibration sequences come shuffled, so every split mixes every
    kind of text); with under 3 sequences, every 10th token position instead."""
    n_seq = n_tokens // seq_len
    seq = torch.arange(n_tokens) // seq_len
    if n_seq < 3:
        k = torch.arange(n_tokens) % 10
        return (k < 8).nonzero().view(-1), (k == 8).nonzero().view(-1), (k == 9).nonzero().view(-1)
    m = max(1, round(n_seq / 10))
    train, tune = seq < n_seq - 2 * m, (seq >= n_seq - 2 * m) & (seq < n_seq - m)
    return train.nonzero().view(-1), tune.nonzero().view(-1), (seq >= n_seq - m).nonzero().view(-1)


def _train_net(data: LayerData, r: int, cfg: TrainConfig, mu: torch.Tensor, sd: torch.Tensor,
               prior: torch.Tensor) -> _Net:
    with torch.inference_mode(False), torch.enable_grad():  # callers may hold inference mode
        return _train_loop(data, r, cfg, mu.clone(), sd.clone(), prior.clone())


def _train_loop(data: LayerData, r: int, cfg: TrainConfig, mu: torch.Tensor, sd: torch.Tensor,
                prior: torch.Tensor) -> _Net:
    g = torch.Generator().manual_seed(cfg.seed + r)
    torch.manual_seed(cfg.seed + r)
    net = _Net(data.x.shape[1], r, data.n, prior)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    # warm-up over 10% of the steps, at least two (torch's one-cycle schedule divides by the
    # warm-up length minus one, and by the length of the rest)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(cfg.steps, 4),
                                                pct_start=max(0.1, 2 / max(cfg.steps, 4)))
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(cfg.pos_weight))
    xs = ((data.inputs(data.train) - mu) / sd).clone()  # standardized once: (N_train, d) f32
    ys = data.targets(data.train).clone()                 # unpacked once: (N_train, n) bool
    for _ in range(cfg.steps):
        b = torch.randint(len(xs), (min(cfg.batch, len(xs)),), generator=g)
        loss = loss_fn(net(xs[b]), ys[b].float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net


def _fold(net: _Net, mu: torch.Tensor, sd: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fold the input standardization into fc1: W1 (x - mu)/sd + b1 = (W1/sd) x + (b1 - W1/sd mu)."""
    w1 = net.fc1.weight.detach() / sd
    b1 = net.fc1.bias.detach() - w1 @ mu
    return {"w1": w1.contiguous(), "b1": b1.contiguous(), "w2": net.fc2.weight.detach().contiguous(),
            "b2": net.fc2.bias.detach().contiguous()}


def tune_tau(logits: torch.Tensor, target: torch.Tensor, recall: float) -> float:
    """The largest tau with recall(logits > tau) >= `recall` over all (token, neuron) pairs."""
    pos = logits[target]
    if pos.numel() == 0:
        return float(logits.max()) if logits.numel() else 0.0
    srt = pos.sort().values
    k = min(int(math.floor((1.0 - recall) * pos.numel())), pos.numel() - 1)
    return float(srt[k]) - 1e-6 * max(1.0, abs(float(srt[k])))


def metrics(pred: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Micro-averaged recall and precision, predicted and true density, of bool (M, n) masks."""
    tp = (pred & target).sum().item()
    npred, ntrue, total = pred.sum().item(), target.sum().item(), max(target.numel(), 1)
    return {"recall": tp / ntrue if ntrue else 1.0, "precision": tp / npred if npred else 1.0,
            "density_predicted": npred / total, "density_true": ntrue / total}


def _evaluate(state: dict, data: LayerData, cfg: TrainConfig) -> tuple[float, dict]:
    q = QPredictor(state["w1"], state["b1"], state["w2"], state["b2"], 0.0)
    tau = tune_tau(q.scores_batch(data.inputs(data.tune)), data.targets(data.tune), cfg.recall)
    rep = q.scores_batch(data.inputs(data.report)) > tau
    return tau, metrics(rep, data.targets(data.report))


def train_predictor(data: LayerData, cfg: TrainConfig, first_row_bytes: int) -> PredictorResult:
    """Train the ladder's sizes smallest first; keep the one with the lowest bytes per token:
    predictor + the first-projection (gate, or up) rows it selects (up/down rows follow the
    true active set either way); stop once a bigger size stops paying for itself.

    The decode policy is "predictor" when that beats computing the first projection densely
    and thresholding it (exact, no predictor: `n * first_row_bytes`), else "first"; the
    predictor is kept either way (forced-density benchmarks rank rows with it)."""
    d = data.x.shape[1]
    xt = data.inputs(data.train)
    mu, sd = xt.mean(0), xt.std(0).clamp_min(1e-3)
    del xt
    prior = data.targets(data.train[: 4096]).float().mean(0)
    sizes = [r for r in cfg.sizes if r <= max(cfg.sizes[0], min(d, data.n) // 2)]
    best, tried = None, []
    for r in sizes:
        net = _train_net(data, r, cfg, mu, sd, prior)
        state = _fold(net, mu, sd)
        tau, m = _evaluate(state, data, cfg)
        nbytes = predictor_bytes(d, r, data.n)
        cost = nbytes + m["density_predicted"] * data.n * first_row_bytes
        tried.append({"hidden": r, "cost_bytes": cost, **m})
        res = PredictorResult(state, tau, r, m["recall"], m["precision"], m["density_predicted"],
                              m["density_true"], nbytes, cost, tried)
        if best is not None and cost >= best.cost_bytes:
            break
        best = res
        if m["density_predicted"] <= 1.05 * m["density_true"]:
            break  # nothing left to gain from a bigger predictor
    best.tried = tried
    best.policy = decode_policy(best.cost_bytes, data.n * first_row_bytes)
    return best


# A predictor must save this share of the first projection's bytes: its rows go through the
# sparse kernels (slower per byte than a dense gemv) and its misses cost quality, most of it
# in marginal layers whose predicted density is close to dense anyway.  A tuned constant:
# perplexity with the pack (`python benchmarks/sparsity_ppl.py --packs`) against decode speed
# (`python benchmarks/sparsity_bench.py`).
PREDICTOR_MARGIN = 0.8


def decode_policy(cost_bytes: float, first_bytes: float) -> str:
    """"predictor" when predictor + selected first-projection rows beat the dense first
    projection by the margin, else "first" (dense first projection + threshold: exact)."""
    return "predictor" if cost_bytes < PREDICTOR_MARGIN * first_bytes else "first"
