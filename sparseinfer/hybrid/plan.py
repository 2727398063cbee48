"""Placement reports: weight bytes of a model, plots of a placement and of a budget sweep, and a
fixed-width table (`sparseinfer plan` and the hybrid benchmark print and draw with these).

Plotting needs matplotlib (`pip install 'sparseinfer[plots]'`), imported only when a plot is drawn.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import SparseInferError
from .placement import DEFAULT_GROUP, Placement


def plot_placement(p: Placement, path: str | Path, title: str = "") -> Path:
    """Per layer: share of FFN neurons and of expected activations on the GPU, where attention
    runs; below, the budget split by kind."""
    import numpy as np

    plt = _pyplot()
    n = p.n_layers
    x = np.arange(n)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(6.0, 0.28 * n + 3), 5.5), height_ratios=[3, 1],
                                 constrained_layout=True)
    share = [k / max(m, 1) for k, m in zip(p.n_hot, p.n_neurons)]
    ax.bar(x - 0.2, share, 0.4, label="FFN neurons on GPU", color="#4c72b0")
    ax.bar(x + 0.2, p.layer_fraction, 0.4, label="expected activations served by GPU", color="#dd8452")
    on = [i for i in range(n) if p.attn_on_device[i]]
    ax.scatter(on, [1.04] * len(on), marker="s", s=12, color="#55a868", label="attention + KV on GPU")
    ax.set_xlim(-0.7, n - 0.3)
    ax.set_ylim(0, 1.32)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_xlabel("layer")
    ax.set_ylabel("fraction")
    ax.legend(loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title(f"{title}\n{p.mode} placement ({p.solver}): {p.expected_fraction:.1%} of FFN activations "
                 f"on the GPU, head on {'GPU' if p.head_on_device else 'CPU'}", fontsize=10)
    left = 0
    colors = {"scratch": "#bbbbbb", "attention": "#55a868", "kv": "#8fd19e", "norms": "#c44e52", "predictors": "#8172b2",
              "head": "#937860", "ffn": "#4c72b0"}
    gib = 1 << 30
    for kind, b in p.bytes.items():
        if b:
            bx.barh(0, b / gib, left=left / gib, color=colors.get(kind, "#999999"), label=kind)
            left += b
    bx.axvline(p.budget / gib, color="black", linestyle="--", label="budget")
    bx.set_yticks([])
    bx.set_xlabel("GiB")
    bx.set_xlim(0, max(p.budget, p.bytes_used, 1) / gib * 1.05)
    bx.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(costs, freqs, path: str | Path, title: str = "", group_size: int = DEFAULT_GROUP,
               points: int = 24) -> Path:
    """Against the budget: the weight bytes the CPU still reads per token (what bounds decode
    speed while the CPU is the slower side) and the share of FFN activations on the GPU, for hot
    neurons by ILP and by greedy (with a pack) and for whole-layer offload of the dense model."""
    import numpy as np

    from .placement import plan_layer_offload, plan_placement

    plt = _pyplot()

    full = costs.scratch + costs.head + sum(lc.core + lc.predictor + lc.neuron * lc.n_neurons + costs.ffn_overhead
                                            for lc in costs.layers)
    budgets = np.linspace(costs.scratch, full * 1.02, points).astype(int)
    plans = {"layer offload (dense, -ngl)": [plan_layer_offload(costs, int(b)) for b in budgets]}
    if freqs is not None:
        for solver in ("ilp", "greedy"):
            plans[f"hot neurons ({solver})"] = [plan_placement(costs, freqs, int(b), group_size=group_size,
                                                               solver=solver) for b in budgets]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(6.5, 6), sharex=True, constrained_layout=True)
    mib = budgets / (1 << 20)
    for (name, ps), style in zip(plans.items(), ("-", "-", "--")):
        ax.plot(mib, [p.read_bytes["cpu"] / (1 << 20) for p in ps], style, label=name)
        bx.plot(mib, [p.expected_fraction for p in ps], style, label=name)
    for a in (ax, bx):
        a.axvline(costs.scratch / (1 << 20), color="#999999", linewidth=0.8)
    ax.set_ylabel("weight MiB the CPU reads per token")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    bx.set_ylabel("FFN activations on the GPU")
    bx.set_ylim(0, 1.02)
    bx.set_xlabel("VRAM budget (MiB); grey line: scratch, reserved first")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise SparseInferError("plots need matplotlib: pip install 'sparseinfer[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def placement_table(rows: list[dict]) -> str:
    """A fixed-width table of dicts (same keys), for benchmark output."""
    if not rows:
        return ""
    keys = list(rows[0])
    width = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.rjust(width[k]) for k in keys)]
    lines += ["  ".join(_fmt(r[k]).rjust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
