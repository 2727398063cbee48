"""A PowerInfer model file's predictors and statistics as a sparsity pack (`pack_from_source`).

The pack is built in memory at load, when the model is a PowerInfer file (`io.powerinfer`) and
no `.sparse` pack lies next to it; decode then runs through the usual sparse path:

- **Predictors.**  PowerInfer's layer predictor scores neuron i as
  ``(fc2 · relu(fc1 · x))_i`` and computes the neuron when the score reaches the file's
  threshold (`powerinfer.sparse_threshold`, 0 when absent).  Its input x is the residual stream
  before the FFN's RMS norm, while ours reads the normalized input ``xn = g * x / rms(x)``.
  A positive scale passes through ReLU and both products, so
  ``fc2 · relu((fc1 / g) · xn) = (fc2 · relu(fc1 · x)) / rms(x)``: the same sign for every
  score.  The pack's predictor is therefore ``w1 = fc1 / g`` (per input column), ``w2 = fc2``
  with no biases and the cut ``tau`` = the threshold; w2 in the file's float type, w1 in f32
  (its values are computed: f16 rounding could move a score near 0 across the cut), both q8
  when the file's predictors are quantized.  With a threshold of 0 the decisions are PowerInfer's
  (except at a score of exactly 0, which PowerInfer computes and we skip; where the threshold
  is not 0 the division by rms(x) changes the rule, and the cut applies to the scaled score).
  Falcon and OPT predictors read the residual stream before a LayerNorm (Falcon: the block's
  input; OPT: the stream before the FFN's norm; mean removed, bias added), which no change of
  weights maps onto the LayerNorm's output: the pack keeps ``w1 = fc1``, ``w2 = fc2`` and marks
  the predictor as reading the residual stream (``predictor_reads="residual"``), which those
  blocks hand to their FFN; the cut is the threshold itself, PowerInfer's rule (but for a score
  exactly at it).
- **Neuron order.**  From PowerInfer's profile (``activation/activation_{i}.pt``): hottest
  first, frequencies = counts / the layer's largest count.  Else from its GPU split
  (``MODEL.generated.gpuidx``): the GPU neurons first, frequency 1, the others 0.  Else the
  file's order, frequency 0.5 for every neuron (unknown).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SparsityPackError
from ..io import powerinfer as pi
from .pack import SparsityPack, LayerPack

# the norm before each family's FFN, whose weight the predictors' first layer is divided by, or
# None where the predictors read the residual stream before that norm as they are
_FFN_NORM = {"llama": "model.layers.{}.post_attention_layernorm.weight", "falcon": None, "opt": None}
_FLOAT_FORMATS = {"F32": "f32", "F16": "f16", "BF16": "f16"}


def is_powerinfer(src) -> bool:
    return bool(getattr(src, "powerinfer", False))


def _fail(src, what: str) -> SparsityPackError:
    return SparsityPackError(f"{src.path}: {what}; run it with --dense, or make a sparsity pack for it with "
                             f"`sparseinfer prepare {src.path}`")


def neuron_stats(src, n_neurons: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
    """(frequencies in original order, hotness orders, where they came from) per layer."""
    n_layers = len(n_neurons)
    got = pi.activation_counts(src.path, n_layers, n_neurons)
    if got is not None:
        counts, folder = got
        freqs = [(c / c.max()).float() if float(c.max()) > 0 else torch.zeros(len(c)) for c in counts]
        orders = [torch.sort(c, descending=True, stable=True).indices for c in counts]
        return freqs, orders, f"activation counts ({folder})"
    got = pi.gpu_index(src.path, n_layers, n_neurons)
    if got is not None:
        masks, path = got
        freqs = [m.float() for m in masks]
        orders = [torch.sort(m.to(torch.int8), descending=True, stable=True).indices for m in masks]
        return freqs, orders, f"GPU split ({path.name})"
    return [torch.full((n,), 0.5) for n in n_neurons], [torch.arange(n) for n in n_neurons], "none (file order)"


def pack_from_source(src) -> SparsityPack:
    """The pack of a PowerInfer file (`src` a `GGUFSource` with `powerinfer` set): its
    predictors mapped onto ours and its neuron statistics (see the module docstring).
    Errors name what is missing."""
    c = src.config
    n_layers, d, n = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    threshold = pi.threshold(src.metadata, src.path)
    used = c.family in _FFN_NORM
    norm = _FFN_NORM.get(c.family)
    preds = []
    for i in range(n_layers if used else 0):  # (no predictors used: none needed)
        n1, n2 = pi.predictor_names(i)
        missing = [name for name in (n1, n2) if src.file_tensor_info(name) is None]
        if missing:
            raise _fail(src, f"PowerInfer file without layer {i}'s predictor (tensor {missing[0]} is missing)")
        fc1, fc2 = src.file_tensor(n1), src.file_tensor(n2)
        r = fc1.shape[0] if fc1.dim() == 2 else 0
        if fc1.dim() != 2 or fc1.shape[1] != d or r < 1 or tuple(fc2.shape) != (n, r):
            raise _fail(src, f"layer {i}'s predictor has shapes {n1} {list(fc1.shape)}, {n2} {list(fc2.shape)}; "
                             f"expected (hidden, {d}) and ({n}, hidden): the file is damaged")
        preds.append((fc1, fc2))
    freqs, orders, stats_from = neuron_stats(src, [n] * n_layers)
    types = {src.file_tensor_info(name).tensor_type.name for i in range(len(preds)) for name in pi.predictor_names(i)}
    fmt = _FLOAT_FORMATS.get(types.pop(), "q8") if len(types) == 1 else "q8"
    layers = []
    for i, (freq, order) in enumerate(zip(freqs, orders)):
        stats = {"density": float(freq.mean())}
        if not used:  # the predictors are not mapped for this family: the exact first projection instead
            layers.append(LayerPack(0.0, freq, order, None, 0.0, stats, "first"))
            continue
        fc1, fc2 = preds[i]
        r = fc1.shape[0]
        stats["hidden"] = r
        w1 = fc1.float()
        if norm is not None:
            g = src.tensor(norm.format(i)).float()
            if bool((g == 0).any()):
                raise _fail(src, f"layer {i}'s FFN norm has weights equal to 0, so its PowerInfer predictor (which "
                                 "reads the input before that norm) cannot be mapped onto the normalized input")
            w1 = w1 / g
        state = {"w1": w1, "b1": torch.zeros(r), "w2": fc2.index_select(0, order), "b2": torch.zeros(len(order))}
        lp = LayerPack(0.0, freq, order, state, threshold or 0.0, stats, "predictor", predictor_format=fmt,
                       predictor_reads="ffn_input" if norm is not None else "residual")
        lp.stats["predictor_bytes"] = lp.predictor_nbytes
        layers.append(lp)
    pack = SparsityPack(
        fingerprint=src.fingerprint(),
        model={"name": Path(src.path).name, "family": c.family, "hidden_act": c.hidden_act, "n_layers": n_layers,
               "d_model": d, "n_neurons": n},
        activation_source="relu", layers=layers,
        calibration={"source": "PowerInfer file", "neuron_stats": stats_from},
        info={"powerinfer": {"sparse_threshold": threshold, "predictor_format": fmt,
                             "predictors_used": used}},
        path=Path(src.path))
    pack.validate()
    return pack


def describe(src) -> list[str]:
    """`sparseinfer inspect`'s lines about a PowerInfer file: its threshold, its predictors,
    where neuron statistics come from and whether decode uses the predictors."""
    c = src.config
    threshold = pi.threshold(src.metadata, src.path)
    hidden, nbytes, types, missing = [], 0, set(), []
    for i in range(c.num_hidden_layers):
        for name in pi.predictor_names(i):
            t = src.file_tensor_info(name)
            if t is None:
                missing.append(name)
                continue
            nbytes += int(t.n_bytes)
            types.add(t.tensor_type.name)
            if name.endswith("fc1.weight"):
                hidden.append(int(t.shape[1]))
    lines = [f"PowerInfer:   PWRI file (GGUF v{src.reader.version}), architecture {src.metadata.get('general.architecture')}; "
             f"sparse threshold {threshold if threshold is not None else '0 (powerinfer.sparse_threshold not set)'}"]
    if hidden:
        span = f"{min(hidden)}" if min(hidden) == max(hidden) else f"{min(hidden)}..{max(hidden)}"
        lines.append(f"predictors:   {len(hidden)} layers, hidden {span}, {', '.join(sorted(types))}, "
                     f"{nbytes / 2**20:.2f} MiB in the file")
    if missing:
        lines.append(f"predictors:   missing {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: "
                     "runs only with --dense or a pack from `sparseinfer prepare`")
    elif c.family not in _FFN_NORM:
        lines.append("predictors:   not used: decode computes the first projection densely and ReLU picks the "
                     "rows (exact)")
    elif _FFN_NORM[c.family] is None:
        lines.append("predictors:   used on the residual stream before the FFN's LayerNorm, as PowerInfer runs them")
    n_neurons = [c.intermediate_size] * c.num_hidden_layers
    try:
        _, _, stats_from = neuron_stats(src, n_neurons)
    except Exception as e:  # shown, not raised: inspect describes what is there
        stats_from = f"unreadable ({e})"
    lines.append(f"neuron stats: {stats_from}")
    return lines
