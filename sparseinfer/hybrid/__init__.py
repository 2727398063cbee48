"""Hybrid accelerator/CPU inference under a VRAM budget (PowerInfer's GPU-CPU split).

    from sparseinfer.hybrid import place_model, parse_vram_budget
    model, placement = place_model(model, "cuda", parse_vram_budget("4GiB"), ctx_size=4096, stats=stats)

`placement` decides what lives on the accelerator (attention + KV, norms, predictors, head, hot
FFN neurons chosen by an ILP); `model` applies it (`HybridFFN`: hot neurons on the accelerator,
cold ones on the CPU, overlapped).  See docs/hybrid.md.
"""
from __future__ import annotations

import logging

import torch

from ..errors import SparseInferError
from ..kv_cache import DEFAULT_CACHE_TYPE
from .budget import BudgetError, budget_bytes, format_bytes, parse_vram_budget, resolve_device
from .costs import cost_model
from .model import HybridCausalLM, NeuronStats, apply_placement, sparsify_dense
from .placement import Placement, cached_plan, plan_layer_offload, plan_placement

log = logging.getLogger("sparseinfer.hybrid")

__all__ = ["BudgetError", "HybridCausalLM", "NeuronStats", "Placement", "apply_placement", "budget_bytes",
           "cost_model", "format_bytes", "parse_vram_budget", "place_model", "plan_for_model",
           "plan_layer_offload", "plan_placement", "prepare", "resolve_device"]


def plan_for_model(model, budget: int, ctx_size: int, device_type: str = "cuda", stats: NeuronStats | None = None,
                   mode: str = "auto", fingerprint: str = "", use_cache: bool = True, n_seq: int = 1,
                   cache_type: str | None = None, **params) -> Placement:
    """The placement of a built CPU model. mode: 'neurons' (hybrid; needs `stats`), 'layers' (dense
    layer offload) or 'auto' (neurons when there are stats, else layers); the KV cache counted
    in `cache_type` (default: the model's own, `model.cache_type`)."""
    if mode == "auto":
        mode = "neurons" if stats is not None else "layers"
    if mode not in ("neurons", "layers"):
        raise ValueError(f"unknown offload mode {mode!r}: use neurons, layers or auto")
    if mode == "neurons" and stats is None:
        raise ValueError("neuron placement needs activation statistics (a sparsity pack)")
    costs = cost_model(model, ctx_size, device_type, cache_type=cache_type, n_seq=n_seq)
    freqs = stats.hot_frequencies() if mode == "neurons" else None
    fp = fingerprint + (stats.fingerprint if stats is not None else "")
    if not fp:
        use_cache = False  # an anonymous model has no stable identity to cache under
    return cached_plan(fp, costs, freqs, budget, mode=mode, use_cache=use_cache, device=device_type, **params)


def place_model(model, accel: torch.device | str, budget: int, ctx_size: int, stats: NeuronStats | None = None,
                mode: str = "auto", fingerprint: str = "", use_cache: bool = True, n_seq: int = 1,
                cache_type: str | None = None, **params):
    """Plan and apply: (model to run, placement). `accel` may be torch-CPU standing in for a GPU;
    KV caches of `cache_type` (default: the model's own)."""
    accel = torch.device(accel)
    cache_type = cache_type or model.cache_type
    p = plan_for_model(model, budget, ctx_size, accel.type, stats, mode, fingerprint, use_cache, n_seq, cache_type,
                       **params)
    for note in p.notes:
        log.warning(note)
    if p.mode == "neurons":
        sparsify_dense(model, stats)
    return apply_placement(model, p, accel, ctx_size, cache_type, n_seq=n_seq), p


def prepare(model, device: str | torch.device | None = "auto", vram_budget: str | float | None = None,
            ctx_size: int = 4096, pack=None, fingerprint: str = "", mode: str = "auto", n_seq: int = 1,
            cache_type: str = DEFAULT_CACHE_TYPE, **params):
    """The engine's hook: resolve `device` ('auto', 'cpu', 'cuda[:N]') and `vram_budget` ('4GiB',
    '512MiB', 1.5 = GiB; None = free memory minus a margin), then place the model: hot neurons
    with a sparsity `pack`, whole layers without; KV caches of `cache_type` counted for `n_seq`
    live sequences.
    Returns (model, placement or None on the CPU)."""
    if vram_budget is not None:
        parse_vram_budget(vram_budget)  # a bad budget is an error even when no GPU is used
    dev = resolve_device(device)
    if dev.type == "cpu":
        return model, None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    from ..sparse.apply import sparse_ffns

    if any(f.density is not None for f in sparse_ffns(model)):
        raise SparseInferError("--density is a CPU speed measurement; run it with --device cpu")
    budget = budget_bytes(vram_budget, dev)
    stats = NeuronStats.from_pack(pack) if pack is not None else None
    if stats is None and sparse_ffns(model):
        raise SparseInferError("the model is sparsified without a pack; hybrid placement needs the pack's statistics")
    model, p = place_model(model, dev, budget, ctx_size, stats, mode, fingerprint, n_seq=n_seq, cache_type=cache_type,
                           **params)
    log.info("placement: %s", p.describe())
    return model, (p if p.on_device else None)
