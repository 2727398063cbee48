"""Swap dense `MLP`s for `SparseFFN`s by rule after the model is built; find a model's pack.

The rule: every child of a block in `model.layers` that is an `MLP` (the model files build
them and never mention sparsity) is replaced in place by a `SparseFFN` made from it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from torch import nn

from ..errors import SparsityPackError
from ..models.layers import MLP
from ..quant import qweights
from .ffn import SparseFFN

PACK_SUFFIX = ".sparse"
FOLDER_PACK = "sparsity.sparse"


def ffn_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each layer's feed-forward module, in layer order."""
    slots = []
    for block in model.layers:
        for name, child in block.named_children():
            if isinstance(child, (MLP, SparseFFN)):
                slots.append((block, name))
    return slots


def dense_mlps(model: nn.Module) -> list[MLP]:
    """The model's dense FFNs in layer order; an error when some layer is not one any more."""
    mlps = [getattr(p, n) for p, n in ffn_slots(model)]
    if not all(isinstance(m, MLP) for m in mlps):
        raise SparsityPackError("the model is already sparsified; load it again with dense=True")
    return mlps


def replace_ffns(model: nn.Module, make: Callable[[int, MLP], nn.Module]) -> list[MLP]:
    """Replace each dense `MLP` by `make(layer, mlp)`; return the MLPs (for `restore`).  All or
    nothing: if `make` raises, the layers already replaced get their MLPs back."""
    originals = []
    try:
        for i, ((parent, name), mlp) in enumerate(zip(ffn_slots(model), dense_mlps(model))):
            originals.append(mlp)
            setattr(parent, name, make(i, mlp))
    except BaseException:
        restore(model, originals)
        raise
    return originals


def restore(model: nn.Module, originals: list[MLP]) -> None:
    for (parent, name), mlp in zip(ffn_slots(model), originals):
        setattr(parent, name, mlp)


def sparse_ffns(model: nn.Module) -> list[SparseFFN]:
    return [getattr(p, n) for p, n in ffn_slots(model) if isinstance(getattr(p, n), SparseFFN)]


def sparsify(model: nn.Module, pack=None, mode: str = "predict", density: float | None = None,
             build_decode: bool = True) -> nn.Module:
    """Replace every MLP by a `SparseFFN` from `pack` (a `SparsityPack`), in place.

    Without a pack only forced-density decoding makes sense (`density` must be given): each
    token then uses a random set of rows (a speed stand-in for a ReLU model of that density)."""
    if pack is None and density is None:
        raise ValueError("sparsify needs a sparsity pack or a forced density")
    if density is not None and not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")

    def make(i: int, mlp: MLP) -> SparseFFN:
        if pack is None:
            return SparseFFN(mlp, mode=mode, density=density)
        if i >= len(pack.layers):
            raise SparsityPackError(f"sparsity pack has {len(pack.layers)} layers, the model more")
        pack.check_layer(i, mlp.n_neurons)
        layer = pack.layers[i]
        return SparseFFN(mlp, layer.threshold, layer.order, layer.predictor(for_ranking=density is not None),
                         mode=mode, density=density, expected_density=float(layer.freq.float().mean()))

    if pack is not None:  # every layer checked before any is replaced
        pack.check_model(dense_mlps(model))
    originals = replace_ffns(model, make)
    if build_decode:  # the neuron-major copies and records, now rather than inside the first decode
        try:
            for ffn in sparse_ffns(model):
                ffn.build_decode_layout()
        except BaseException:
            restore(model, originals)
            raise
    return model


def set_mode(model: nn.Module, mode: str) -> None:
    for ffn in sparse_ffns(model):
        ffn.mode = mode


def reset_stats(model: nn.Module) -> None:
    for ffn in sparse_ffns(model):
        ffn.reset_stats()
    head = getattr(model, "head", None)
    if hasattr(head, "fallbacks"):
        head.tokens = head.fallbacks = 0


def decode_stats(model: nn.Module) -> dict:
    """Totals of the single-token path since the last `reset_stats`: tokens per layer, FFN
    rows touched (fraction of all FFN rows), FFN + predictor bytes, predictor seconds."""
    ffns = sparse_ffns(model)
    if not ffns or ffns[0].stats.tokens == 0:
        return {}
    tokens = ffns[0].stats.tokens
    rows = sum(f.stats.rows for f in ffns)
    total_rows = sum(f.n_neurons * (2 if f.gate is None else 3) for f in ffns)
    kept = sum(f.stats.kept for f in ffns) / (tokens * sum(f.n_neurons for f in ffns))
    return {"tokens": tokens, "ffn_rows_touched_fraction": rows / (tokens * total_rows), "density": kept,
            "ffn_bytes_per_token": sum(f.stats.bytes for f in ffns) / tokens,
            "predictor_seconds": sum(f.stats.predictor_seconds for f in ffns)}


def default_pack_path(model_path: str | os.PathLike) -> Path:
    """`model.gguf` -> `model.gguf.sparse`; a Hugging Face folder -> `folder/sparsity.sparse`."""
    p = Path(model_path)
    return p / FOLDER_PACK if p.is_dir() else p.with_name(p.name + PACK_SUFFIX)


def find_pack(model_path: str | os.PathLike) -> Path | None:
    p = default_pack_path(model_path)
    return p if p.is_file() else None


def resolve_pack(model_path: str | os.PathLike, sparse, source=None):
    """`sparse`: None/False (no pack), "auto" (the pack next to the model, if any; else, for a
    PowerInfer file, the pack its predictors make: `sparse.powerinfer`) or a path.
    Returns a checked `SparsityPack` or None."""
    from .pack import SparsityPack

    if sparse is None or sparse is False:
        return None
    if sparse == "auto":
        path = find_pack(model_path)
        if path is None:
            from . import powerinfer

            return powerinfer.pack_from_source(source) if powerinfer.is_powerinfer(source) else None
    else:
        path = Path(sparse)
        if not path.is_file():
            raise SparsityPackError(f"sparsity pack {path} not found; make one with `sparseinfer prepare MODEL`")
    pack = SparsityPack.load(path)
    if source is not None:
        pack.check(source)
    return pack


def apply_sparsity(model: nn.Module, model_path, source, sparse="auto", density: float | None = None,
                   notes: list[str] | None = None):
    """The engine's hook: find/check the pack named by `sparse` and sparsify the model with it
    (or, with only a forced `density`, without one).  Returns the pack or None.  A pack found
    next to the model (`sparse="auto"`) is used as `prepare` measured it on this CPU
    (`speed.parts_here`): whole, its head preview alone (the FFNs dense), or not at all; the
    reason for leaving a part out is appended to `notes`."""
    pack = resolve_pack(model_path, sparse, source)
    use_ffns = use_head = pack is not None
    if pack is not None and sparse == "auto" and density is None:
        from .speed import parts_here

        use_ffns, use_head, why = parts_here(pack)
        if why and notes is not None:
            notes.append(why)
        if not (use_ffns or use_head):
            return None
    head = None
    if use_head and pack.head is not None and density is None:
        from .head import PreviewHead

        try:  # checked before anything changes
            head = PreviewHead(model.head, pack.head)
        except ValueError as e:
            raise SparsityPackError(f"sparsity pack {pack.path}: {e}; make one for this model with "
                                    "`sparseinfer prepare MODEL` or run with --dense") from None
    if use_ffns or density is not None:
        sparsify(model, pack if use_ffns else None, density=density)
    if head is not None:
        model.head = head
    return pack


def perplexity_mode(llm) -> str:
    """Put a sparsified model in the mode perplexity must use and name it: "sparse" scores
    per-token predictor x threshold masks on whole chunks (what sparse decode computes)."""
    ffns = sparse_ffns(llm.model)
    if not ffns:
        return "dense"
    set_mode(llm.model, "faithful")
    return "sparse" if ffns[0].density is None else f"density {ffns[0].density:g}"


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes a dense decode step reads outside the FFNs, dense FFN bytes).  The embedding
    table counts only when the head shares it (a lookup reads one row); a previewed head
    (`sparse.head`) counts its preview and its candidates' rows."""
    ffn_ids, ffn_bytes = set(), 0
    for p, n in ffn_slots(model):
        down_t = getattr(getattr(p, n), "_down_t", None)
        for w in qweights(getattr(p, n)):
            if id(w.qs) not in ffn_ids:
                ffn_ids.add(id(w.qs))
                ffn_bytes += 0 if w is down_t else w.nbytes  # the decode copy is not a dense read
    head = {id(w.qs) for w in qweights(model.head)} if hasattr(model, "head") else set()
    embed = {id(w.qs) for w in qweights(model.embed)} if hasattr(model, "embed") else set()
    seen, other = set(), 0
    for w in qweights(model):
        k = id(w.qs)
        if k in seen or k in ffn_ids or (k in embed and k not in head):
            continue
        seen.add(k)
        other += w.nbytes
    from .head import PreviewHead

    if isinstance(getattr(model, "head", None), PreviewHead):  # the preview's candidates, not every row
        w = model.head.weight
        other -= w.nbytes - model.head.k * (w.nbytes // w.rows)
    return other, ffn_bytes


def bench_fields(model: nn.Module, decode_seconds: float) -> dict:
    """The benchmark's sparsity fields for the decode steps since `reset_stats`: mode, density,
    FFN rows touched, weight bytes read per token, predictor share of decode time."""
    from .head import PreviewHead

    other, ffn_dense = weight_bytes(model)
    st = decode_stats(model)
    head = getattr(model, "head", None)
    hf = ({"head": f"preview rank {head.hp.rank}", "head_fallback_fraction": head.fallbacks / max(head.tokens, 1)}
          if isinstance(head, PreviewHead) else {"head": "exact", "head_fallback_fraction": 0.0})
    if not st:
        return {"mode": "dense", "density": 1.0, "ffn_rows_touched_fraction": 1.0,
                "bytes_per_token": other + ffn_dense, "predictor_time_fraction": 0.0, **hf}
    forced = sparse_ffns(model)[0].density
    return {"mode": "sparse" if forced is None else "density", "density": st["density"],
            "ffn_rows_touched_fraction": st["ffn_rows_touched_fraction"],
            "bytes_per_token": other + st["ffn_bytes_per_token"],
            "predictor_time_fraction": st["predictor_seconds"] / max(decode_seconds, 1e-9), **hf}
