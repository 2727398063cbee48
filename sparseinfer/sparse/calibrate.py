"""Calibration: text -> token sequences, FFN recording through `SparseFFN.observer`, per-layer
thresholds for gated SiLU/GELU FFNs, and the sparsity search against a perplexity budget.

Thresholds are CATS-style: for a target sparsity s, layer l's threshold is the s-quantile of
|act(gate x)| over calibration tokens of the dense model, so every layer drops the same
fraction of its neurons; `search_sparsity` finds the largest s whose perplexity on a held-out
slice stays within a budget.  The recording pass then runs the *sparsified* model (thresholds
applied), so profiles and predictor targets describe the model that will actually run.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SparseInferError
from .predictor import pack_bits

# The mix used for a folder that holds these files (the project's shared/data, which the CLI
# passes by default): WikiText-2 test's last quarter (perplexity runs with a limited number of
# chunks score its beginning, so they stay disjoint), Shakespeare, and Dolly chat prompts.
DEFAULT_MIX = (("wikitext-2-raw/wiki.test.raw", 0.75, 1.0, 0.5),
               ("tinyshakespeare.txt", 0.0, 0.3, 0.25),
               ("prompts.jsonl", 0.0, 1.0, 0.25))


@dataclass
class CalibrationSet:
    seqs: torch.Tensor                # (S, T) token ids: recording + predictor training
    eval: torch.Tensor                # (E, T_eval) held-out: sparsity search + final check
    description: dict = field(default_factory=dict)


def _read_text(path: Path) -> str:
    if path.suffix == ".jsonl":
        parts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                parts.append("\n\n".join(str(r[k]) for k in ("prompt", "context", "text") if r.get(k)))
        return "\n\n".join(parts)
    return path.read_text(encoding="utf-8", errors="replace")


def _sources(data: str | Path | None) -> list[tuple[str, str, float]]:
    """[(description, text, share of tokens)]: a file, a folder of text files (equal shares),
    or a folder holding every file of `DEFAULT_MIX` (that mix)."""
    if data is None:
        raise SparseInferError("no calibration text: pass a text/.jsonl file or a folder of them (--data)")
    p = Path(data)
    if p.is_dir() and all((p / rel).is_file() for rel, *_ in DEFAULT_MIX):
        out = []
        for rel, a, b, share in DEFAULT_MIX:
            text = _read_text(p / rel)
            out.append((f"{rel}[{a:.0%}:{b:.0%}]", text[int(a * len(text)): int(b * len(text))], share))
        return out
    files = sorted(f for f in p.iterdir() if f.suffix in (".txt", ".raw", ".jsonl")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise SparseInferError(f"calibration data {p} not found (a text/.jsonl file or a folder of them)")
    return [(str(f), _read_text(f), 1.0 / len(files)) for f in files]


def _cut(ids: list[int], seq_len: int, n: int, bos: int | None) -> list[list[int]]:
    seqs = []
    for i in range(min(n, len(ids) // seq_len)):
        s = ids[i * seq_len: (i + 1) * seq_len]
        if bos is not None:
            s[0] = bos
        seqs.append(s)
    return seqs


def calibration_set(tokenizer, data=None, n_tokens: int = 8192, seq_len: int = 256,
                    eval_tokens: int = 2048, eval_len: int = 512, seed: int = 0) -> CalibrationSet:
    """Token sequences from `data` (a file or folder, see `_sources`); the eval slice comes from
    the first source, after the tokens used for calibration."""
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    seqs, desc, ev = [], [], []
    for i, (name, text, share) in enumerate(_sources(data)):
        want = max(1, round(n_tokens * share / seq_len))
        extra = eval_tokens if i == 0 else 0
        text = text[: (want * seq_len + extra) * 8]  # ~4 chars per token, with room to spare
        ids = tokenizer.encode(text, add_bos=False, parse_special=False)
        got = _cut(ids, seq_len, want, bos)
        seqs += got
        desc.append({"source": name, "tokens": len(got) * seq_len})
        if i == 0:
            rest = ids[len(got) * seq_len:]
            ev = _cut(rest, eval_len, max(1, eval_tokens // eval_len), bos)
    if not seqs:
        raise SparseInferError(f"calibration text is shorter than one sequence of {seq_len} tokens")
    if not ev:  # short custom data: borrow the last sequences
        ev = [s for s in seqs[-max(1, len(seqs) // 10):]]
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor(seqs)[torch.randperm(len(seqs), generator=g)]  # interleave the sources
    d = {"sources": desc, "seq_len": seq_len, "tokens": int(t.numel()),
         "eval": {"sequences": len(ev), "seq_len": len(ev[0])}}
    return CalibrationSet(t, torch.tensor(ev), d)


# ---------------------------------------------------------------------------- model passes
def forward_batches(model, seqs: torch.Tensor, batch: int, desc: str, progress: bool = True) -> None:
    """Run `seqs` through the model (logits of the last position only: hooks do the work)."""
    with torch.inference_mode():
        for s in tqdm(range(0, len(seqs), batch), desc=desc, unit="batch", disable=not progress):
            b = seqs[s: s + batch]
            model(b, model.new_cache(b.shape[1]), last_only=True)


def eval_nll(model, seqs: torch.Tensor, batch: int = 2, progress: bool = False, desc: str = "eval") -> float:
    """Mean negative log-likelihood of the second half of each sequence (llama.cpp's scoring)."""
    first = seqs.shape[1] // 2
    total, count = 0.0, 0
    with torch.inference_mode():
        for s in tqdm(range(0, len(seqs), batch), desc=desc, unit="batch", disable=not progress, leave=False):
            b = seqs[s: s + batch]
            logits = model(b, model.new_cache(b.shape[1]))
            logp = torch.log_softmax(logits[:, first:-1].float(), dim=-1)
            total -= logp.gather(2, b[:, first + 1:, None]).sum().item()
            count += b[:, first + 1:].numel()
    return total / count


class Recorder:
    """An observer for every `SparseFFN`: activation counts; optionally the FFN inputs (f16)
    and active masks (bit-packed); optionally a sample of |a| for threshold quantiles."""

    def __init__(self, ffns, record: bool = False, sample_per_call: int = 0, seed: int = 0):
        self.index = {id(f): i for i, f in enumerate(ffns)}
        n = len(ffns)
        self.counts = [torch.zeros(f.n_neurons, dtype=torch.int64) for f in ffns]
        self.tokens = [0] * n
        self.xs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.ys: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.samples: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.weights: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.colnorms = [f.down_column_norms() for f in ffns] if sample_per_call else None
        self.record, self.sample_per_call = record, sample_per_call
        self.gen = torch.Generator().manual_seed(seed)
        for f in ffns:
            f.observer = self

    def __call__(self, ffn, x2: torch.Tensor, a: torch.Tensor, h: torch.Tensor, mask: torch.Tensor) -> None:
        i = self.index[id(ffn)]
        self.counts[i] += mask.sum(0)
        self.tokens[i] += mask.shape[0]
        if self.record:
            self.xs[i].append(x2.half())
            self.ys[i].append(pack_bits(mask))
        if self.sample_per_call:
            k = min(self.sample_per_call, a.numel())
            idx = torch.randint(a.numel(), (k,), generator=self.gen)
            self.samples[i].append(a.abs().reshape(-1)[idx])
            # the squared output change dropping each sample would cause (columns ~orthogonal)
            self.weights[i].append(h.reshape(-1)[idx].pow(2) * self.colnorms[i][idx % a.shape[-1]])

    def detach(self, ffns) -> None:
        for f in ffns:
            f.observer = None

    def frequencies(self) -> list[torch.Tensor]:
        return [c.double().div(max(t, 1)).float() for c, t in zip(self.counts, self.tokens)]

    def sorted_samples(self) -> list["ScoreSamples"]:
        out = []
        for s, w in zip(self.samples, self.weights):
            s, w = torch.cat(s), torch.cat(w).double()
            srt = s.sort()
            cw = w[srt.indices].cumsum(0)
            out.append(ScoreSamples(srt.values, (cw / cw[-1].clamp_min(1e-30)).float()))
        return out


@dataclass
class ScoreSamples:
    """One layer's sampled |a| (ascending) and, per sample, the share of the FFN output energy
    dropped by a threshold just above it (a proxy: sum of h_i^2 ||down_i||^2 below it)."""

    scores: torch.Tensor
    error: torch.Tensor

    def threshold_for_sparsity(self, s: float) -> float:
        if s <= 0:
            return 0.0
        return float(self.scores[min(int(s * (len(self.scores) - 1)), len(self.scores) - 1)])

    def threshold_for_error(self, err: float) -> float:
        k = int(torch.searchsorted(self.error, torch.tensor(err, dtype=self.error.dtype)))
        return 0.0 if k == 0 else float(self.scores[k - 1])

    def sparsity_at(self, t: float) -> float:
        return int(torch.searchsorted(self.scores, torch.tensor(t, dtype=self.scores.dtype), right=True)) / len(self.scores)


ALLOCATIONS = ("uniform", "error")


def thresholds_at(samples: list[ScoreSamples], level: float, allocation: str = "uniform") -> list[float]:
    """Per-layer |a| thresholds.  uniform: each layer drops a fraction `level` of its (token,
    neuron) pairs; error: each layer drops the same share `level` of its output energy."""
    if allocation == "uniform":
        return [s.threshold_for_sparsity(level) for s in samples]
    if allocation == "error":
        return [s.threshold_for_error(level) for s in samples]
    raise ValueError(f"unknown allocation {allocation!r}; expected one of {ALLOCATIONS}")


def thresholds_for(samples: list[ScoreSamples], sparsity: float, allocation: str = "uniform") -> list[float]:
    """Per-layer thresholds zeroing a mean fraction `sparsity` of neurons, allocated uniformly
    or by equal output-error share (sensitive layers keep more neurons)."""
    if allocation == "error" and sparsity > 0:
        return thresholds_at(samples, error_level_for_sparsity(samples, sparsity), "error")
    return thresholds_at(samples, sparsity, "uniform")


def mean_sparsity(samples: list[ScoreSamples], thresholds: list[float]) -> float:
    return sum(s.sparsity_at(t) for s, t in zip(samples, thresholds)) / len(samples)


def error_level_for_sparsity(samples: list[ScoreSamples], sparsity: float, iters: int = 40) -> float:
    """The equal-error level whose thresholds zero a mean fraction `sparsity` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if mean_sparsity(samples, thresholds_at(samples, mid, "error")) < sparsity:
            lo = mid
        else:
            hi = mid
    return hi


def set_thresholds(ffns, thresholds: list[float]) -> None:
    for f, t in zip(ffns, thresholds):
        f.threshold = float(t)


@dataclass
class SearchResult:
    sparsity: float
    dense_ppl: float
    ppl: float
    history: list[dict]


def search_sparsity(model, ffns, samples, eval_seqs: torch.Tensor, max_increase: float,
                    hi: float = 0.95, steps: int = 6, progress: bool = True,
                    allocation: str = "uniform", on_point=None, dense_ppl: float | None = None) -> SearchResult:
    """Largest mean sparsity whose thresholded perplexity on `eval_seqs` is within
    (1 + max_increase) x dense, by bisection (perplexity grows with sparsity).
    `on_point(s)`, when given, runs at each sparsity tried (its thresholds set) and returns a
    dict added to that point of the history (e.g. a measured decode speed).  `dense_ppl`: the
    dense model's perplexity on `eval_seqs`, the budget's reference (default: measured here as
    the thresholded FFNs' at sparsity 0, which can differ from the dense FFNs' in the last digits)."""
    if dense_ppl is None:
        set_thresholds(ffns, [0.0] * len(ffns))
        dense_ppl = math.exp(eval_nll(model, eval_seqs))
    dense = dense_ppl
    budget = dense * (1 + max_increase)
    history = [{"sparsity": 0.0, "ppl": dense}]
    bar = tqdm(total=steps + 1, desc="sparsity search", disable=not progress)

    def ppl_at(s: float) -> float:
        set_thresholds(ffns, thresholds_for(samples, s, allocation))
        p = math.exp(eval_nll(model, eval_seqs))
        history.append({"sparsity": s, "ppl": p, **(on_point(s) if on_point else {})})
        bar.update(1)
        bar.set_postfix(s=f"{s:.3f}", ppl=f"{p:.3f}", budget=f"{budget:.3f}")
        return p

    lo, best = 0.0, (0.0, dense)
    p = ppl_at(hi)
    if p <= budget:
        best = (hi, p)
    else:
        for _ in range(steps):
            mid = (lo + hi) / 2
            p = ppl_at(mid)
            if p <= budget:
                lo, best = mid, (mid, p)
            else:
                hi = mid
    bar.close()
    return SearchResult(best[0], dense, best[1], history)


class RecallMeter:
    """An observer measuring each layer's predictor against the sparsified model's active set
    (micro-averaged over tokens and neurons): recall, precision, predicted and true density."""

    def __init__(self, ffns, predictors=None):
        self.index = {id(f): i for i, f in enumerate(ffns)}
        self.predictors = predictors or [f.predictor for f in ffns]
        self.tp = [0] * len(ffns)
        self.npred = [0] * len(ffns)
        self.ntrue = [0] * len(ffns)
        self.total = [0] * len(ffns)
        for f in ffns:
            f.observer = self

    def __call__(self, ffn, x2, a, h, mask) -> None:
        i = self.index[id(ffn)]
        if self.predictors[i] is None:
            return
        pred = self.predictors[i].mask_batch(x2)
        self.tp[i] += int((pred & mask).sum())
        self.npred[i] += int(pred.sum())
        self.ntrue[i] += int(mask.sum())
        self.total[i] += mask.numel()

    def layers(self) -> list[dict]:
        return [{"recall": tp / max(nt, 1), "precision": tp / max(npd, 1), "density_predicted": npd / max(tot, 1),
                 "density_true": nt / max(tot, 1)}
                for tp, npd, nt, tot in zip(self.tp, self.npred, self.ntrue, self.total)]

    def overall(self) -> dict:
        tp, npd, nt, tot = sum(self.tp), sum(self.npred), sum(self.ntrue), sum(self.total)
        return {"recall": tp / max(nt, 1), "precision": tp / max(npd, 1), "density_predicted": npd / max(tot, 1),
                "density_true": nt / max(tot, 1)}
