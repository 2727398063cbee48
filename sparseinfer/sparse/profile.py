"""Activation profiles: per-neuron frequencies, hotness order, and power-law summaries."""
from __future__ import annotations

import torch


def hotness_order(freq: torch.Tensor) -> torch.Tensor:
    """Neuron ids from most to least frequently active (stable: ties keep their id order)."""
    return torch.sort(freq, descending=True, stable=True).indices


def mass_curve(freq: torch.Tensor) -> torch.Tensor:
    """Cumulative share of all activations covered by the k hottest neurons, k = 1..n."""
    srt = freq.double().sort(descending=True).values
    total = srt.sum()
    return (srt.cumsum(0) / total).float() if total > 0 else torch.zeros_like(srt).float()


def hot_fraction(freq: torch.Tensor, mass: float = 0.8) -> float:
    """Smallest fraction of neurons that covers `mass` of all activations (skew: low = skewed)."""
    curve = mass_curve(freq)
    if curve.numel() == 0 or curve[-1] == 0:
        return 0.0
    k = int(torch.searchsorted(curve, torch.tensor(mass, dtype=curve.dtype)).item()) + 1
    return min(k, curve.numel()) / curve.numel()


def summarize(freq: torch.Tensor) -> dict[str, float]:
    """density (mean frequency), hot80 (neurons holding 80% of activations), dead (never active)."""
    return {"density": float(freq.mean()), "hot80": hot_fraction(freq, 0.8),
            "dead": float((freq == 0).float().mean()), "max_freq": float(freq.max()) if freq.numel() else 0.0}
