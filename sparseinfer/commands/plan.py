"""`sparseinfer plan MODEL --vram-budget X`: print (and plot) where each part would live.

Planning needs no GPU: it costs the parts as a CUDA device would hold them, so a placement can
be inspected on the laptop that will never run it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .args import build_from_args


def add_parser(subparsers):
    from ..hybrid.placement import DEFAULT_GROUP

    p = subparsers.add_parser("plan", help="show the GPU/CPU placement for a VRAM budget (no GPU needed)")
    p.add_argument("model", nargs="?", default=None, help="a .gguf file, a Hugging Face folder or a catalog name")
    p.add_argument("--vram-budget", required=True, help="GPU memory to use: 4GiB, 512MiB, or a number of GiB")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size the KV cache is sized for")
    p.add_argument("--offload", choices=("auto", "neurons", "layers"), default="auto",
                   help="neurons: hot FFN neurons (needs a sparsity pack); layers: whole layers (-ngl); "
                        "auto: neurons when there is a pack")
    p.add_argument("--sparse", default="auto", metavar="PACK", help="sparsity pack (default: MODEL.sparse if present)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP, help="neurons per ILP unit")
    p.add_argument("--solver", choices=("ilp", "greedy"), default="ilp")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of the placement here")
    p.add_argument("--sweep", default=None, metavar="PNG",
                   help="also plot the GPU's share of activations against the budget (ILP, greedy, layer offload)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the placement as JSON here")
    p.add_argument("--verbose", action="store_true")
    return p


def run(a: argparse.Namespace) -> int:
    from ..hybrid import NeuronStats, cost_model, format_bytes, parse_vram_budget, plan_for_model
    from ..hybrid.plan import plot_placement, plot_sweep
    from ..quant import qweight_nbytes

    budget = parse_vram_budget(a.vram_budget)
    path, src, model, pack = build_from_args(a, sparse=None if a.offload == "layers" else a.sparse)
    limit = model.config.max_position_embeddings
    ctx = min(a.ctx_size, limit) if a.ctx_size else min(limit, 4096)  # as `LLM` sizes it
    stats = NeuronStats.from_pack(pack) if pack is not None else None
    mode = a.offload
    if mode == "neurons" and stats is None:
        print("no sparsity pack for this model (make one with `sparseinfer prepare`); showing layer offload",
              file=sys.stderr)
        mode = "layers"
    p = plan_for_model(model, budget, ctx, "cuda", stats, mode, src.fingerprint(), group_size=a.group_size,
                       solver=a.solver)
    print(f"model: {path} ({format_bytes(qweight_nbytes(model))} of weights), context {ctx}")
    print(p.describe())
    if a.json:
        Path(a.json).write_text(p.to_json())
    if a.plot:
        plot_placement(p, a.plot, title=f"{Path(str(path)).name}, VRAM budget {format_bytes(budget)}")
        print(f"plot: {a.plot}")
    if a.sweep:
        freqs = stats.hot_frequencies() if stats is not None else None
        plot_sweep(cost_model(model, ctx, "cuda"), freqs, a.sweep, title=f"{Path(str(path)).name}, context {ctx}",
                   group_size=a.group_size)
        print(f"sweep plot: {a.sweep}")
    return 0
