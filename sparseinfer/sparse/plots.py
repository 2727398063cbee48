"""Plots (matplotlib, Agg): the activation-frequency power law of a pack, perplexity vs sparsity,
perplexity vs decode speed."""
from __future__ import annotations

from pathlib import Path

import torch

from .profile import mass_curve


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_activation_frequency(freqs: list[torch.Tensor], path: str | Path, title: str = "") -> Path:
    """Left: each layer's sorted neuron frequencies (log-log, rank as a fraction of neurons);
    right: share of activation mass held by the hottest fraction of neurons (the CDF)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("viridis")
    L = len(freqs)
    for i, f in enumerate(freqs):
        n = f.numel()
        srt = f.sort(descending=True).values.clamp_min(1e-6).numpy()
        rank = (torch.arange(1, n + 1) / n).numpy()
        color = cmap(i / max(L - 1, 1))
        ax1.plot(rank, srt, color=color, lw=0.9)
        ax2.plot(rank, mass_curve(f).numpy(), color=color, lw=0.9)
    ax1.set(xscale="log", yscale="log", xlabel="neuron rank / n (hottest first)",
            ylabel="activation frequency", title="sorted neuron frequency per layer")
    ax2.plot([0, 1], [0, 1], "k:", lw=0.8, label="uniform")
    ax2.set(xlabel="fraction of neurons (hottest first)", ylabel="share of all activations",
            title="activation mass CDF", xlim=(0, 1), ylim=(0, 1.01))
    ax2.legend(loc="lower right")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, L - 1))
    fig.colorbar(sm, ax=[ax1, ax2], label="layer")
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_ppl_vs_sparsity(curves: dict[str, list[dict]], path: str | Path) -> Path:
    """curves: model name -> records {"kind": "dense"|"thresholds"|"pack", "sparsity", "ppl_dense",
    "ppl_threshold", "ppl_sparse" (packs)}: the perplexity increase over dense of thresholds
    alone (a line) and of each calibrated pack with its predictors (a star)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for (name, recs), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        line = sorted((r for r in recs if r.get("kind") != "pack"), key=lambda r: r["sparsity"])
        ax.plot([r["sparsity"] for r in line], [100 * (r["ppl_threshold"] / r["ppl_dense"] - 1) for r in line],
                "-o", color=color, ms=4, label=f"{name}: thresholds")
        packs = [r for r in recs if r.get("kind") == "pack" and r.get("ppl_sparse")]
        if packs:
            ax.plot([r["sparsity"] for r in packs], [100 * (r["ppl_sparse"] / r["ppl_dense"] - 1) for r in packs],
                    "*", color=color, ms=13, label=f"{name}: packs (thresholds + predictors)")
    ax.axhline(3, color="grey", lw=0.8, ls=":", label="+3%")
    ax.set(xlabel="FFN sparsity (mean fraction of neurons zeroed per token)",
           ylabel="WikiText-2 perplexity increase over dense (%)", title="Perplexity vs activation sparsity")
    ax.legend(fontsize=7.5)
    return _save(plt, fig, path)


def plot_ppl_vs_speed(search: list[dict], budget: float, ev: dict | None, speed: dict, path: str | Path,
                      title: str = "", head: dict | None = None) -> Path:
    """The sparsity search of `sparseinfer prepare` as perplexity against speed: each sparsity
    tried (points {"sparsity", "ppl", "speedup"}, the first one dense) at its held-out
    perplexity increase and its measured decode speed-up with the thresholds alone (first
    projection dense); the pack (thresholds + predictors, with its head preview if any,
    `ev["ppl_sparse"]`) at its measured speed-up (`speed["speedup"]`); the head preview alone
    (`head`, a speed record; dense FFNs, so dense perplexity) when given; the budget as a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    dense = search[0]["ppl"]
    pts = sorted((p for p in search if "speedup" in p or p["sparsity"] == 0.0), key=lambda p: p["sparsity"])
    xs = [p.get("speedup", 1.0) for p in pts]
    ys = [100 * (p["ppl"] / dense - 1) for p in pts]
    ax.plot(xs, ys, "-o", color="tab:blue", ms=5, lw=0.6, label="thresholds alone, each sparsity tried")
    for p, x, y in zip(pts, xs, ys):
        ax.annotate(f"{p['sparsity']:.2f}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if ev and ev.get("ppl_sparse"):
        ax.plot([speed["speedup"]], [100 * (ev["ppl_sparse"] / ev["ppl_dense"] - 1)], "*", color="tab:orange", ms=14,
                label=f"the pack (thresholds + predictors{' + head preview' if head else ''}): "
                      f"{speed['sparse_tok_s']:.1f} vs {speed['dense_tok_s']:.1f} tok/s")
    if head:
        ax.plot([head["speedup"]], [0.0], "D", color="tab:green", ms=8,
                label=f"the head preview alone, dense FFNs: {head['sparse_tok_s']:.1f} vs {head['dense_tok_s']:.1f} tok/s")
    ax.axhline(100 * budget, color="grey", lw=0.8, ls=":", label=f"budget +{100 * budget:.0f}%")
    ax.axvline(1.0, color="black", lw=0.6)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(min(-0.5, 1.5 * min(ys)), 2 * max(max(ys), 100 * budget) + 1)
    ax.set(xlabel="decode speed-up over dense, measured here", ylabel="held-out perplexity increase (%)",
           title=title or "Perplexity vs decode speed")
    ax.legend(fontsize=7.5)
    return _save(plt, fig, path)
