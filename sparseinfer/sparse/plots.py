"""Plots (matplotlib, Agg): the activation-frequency power law of a pack, perplexity vs sparsity."""
from __future__ import annotations

from pathlib import Path

import torch

from .profile import mass_curve


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
