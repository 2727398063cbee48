"""PowerInfer's model files (`*.powerinfer.gguf`) and the files its tools keep next to them.

The format, as PowerInfer's converters write it (read from SJTU-IPADS/PowerInfer: `convert.py`,
`convert-hf-to-powerinfer-gguf.py`, `gguf-py/`, `llama.cpp`):

- a GGUF file (version 3) whose first four bytes are ``PWRI`` instead of ``GGUF``;
- architectures ``llama`` (ReLU-Llama, ProSparse-Llama-2: a ReLU gated FFN), ``bamboo`` (a Llama
  with dReLU, relu(gate x) * relu(up x)), ``falcon`` (ReLU) and ``opt``; the activation is not
  written: it follows from the architecture;
- each layer's down projection stored transposed, ``blk.{i}.ffn_down_t.weight`` of shape
  (neurons, width) rows first: one row per neuron, for the sparse axpy;
- each layer's activation predictor, ``blk.{i}.fc1.weight`` (hidden, width) and
  ``blk.{i}.fc2.weight`` (neurons, hidden): score = fc2 · relu(fc1 · x), no biases; a neuron
  is computed when its score reaches the threshold, ``powerinfer.sparse_threshold`` (float,
  optional, 0 when absent).  The predictor reads the layer's residual stream *before* the
  FFN's norm (llama, bamboo) or before the block's LayerNorm (falcon, opt).

Next to the model PowerInfer keeps ``activation/activation_{i}.pt`` (per-neuron activation
counts of layer i, a pickled torch tensor, from its profiler) and, once it has planned a GPU
split, ``MODEL.generated.gpuidx`` (a PWRI file of ``blk.{i}.gpu_idx``, int32 0/1 per neuron,
and ``blk.{i}.gpu_bucket``, the ids of the GPU neurons).  Both are optional here: they give the
neurons' hotness order and frequencies.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..config import OPT_POSITION_OFFSET
from ..errors import ModelFormatError, UnsupportedError

THRESHOLD_KEY = "powerinfer.sparse_threshold"
# PowerInfer architecture -> (our model_type, activation)
ARCHS = {"llama": ("llama", "relu"), "bamboo": ("llama", "drelu"), "falcon": ("falcon", "relu"),
         "opt": ("opt", "relu")}
ACTIVATION_DIR = "activation"
GPU_INDEX_SUFFIX = ".generated.gpuidx"


def config_metadata(meta: dict[str, Any], path: Path, position_rows: int | None = None) -> dict[str, Any]:
    """A PowerInfer file's metadata as our GGUF config reader expects it: ``bamboo.*`` keys as
    ``llama.*``, and the activation its architecture implies (``{arch}.hidden_act``).  OPT:
    PowerInfer's converter writes a fixed ``opt.context_length`` (2050, the position table of
    its OPT checkpoints), so the context is taken from the table's rows (`position_rows`)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedError(f"{path}: PowerInfer file of architecture {arch!r}; sparseinfer runs PowerInfer's "
                               f"{', '.join(ARCHS)} files")
    ours, act = ARCHS[arch]
    out = dict(meta)
    if ours != arch:
        prefix = f"{arch}."
        for k, v in meta.items():
            if k.startswith(prefix):
                out[f"{ours}.{k[len(prefix):]}"] = v
        out["general.architecture"] = ours
    out[f"{ours}.hidden_act"] = act
    if arch == "opt" and position_rows is not None and position_rows > OPT_POSITION_OFFSET:
        out["opt.context_length"] = position_rows - OPT_POSITION_OFFSET
    return out


def threshold(meta: dict[str, Any], path: Path) -> float | None:
    """The file's ``powerinfer.sparse_threshold`` (None when it has none); checked."""
    t = meta.get(THRESHOLD_KEY)
    if t is None:
        return None
    if type(t) not in (int, float) or not float("-inf") < float(t) < float("inf"):
        raise ModelFormatError(f"{path}: {THRESHOLD_KEY} is {t!r}; it must be a finite number: the file is "
                               "damaged, re-convert it")
    return float(t)


def predictor_names(layer: int) -> tuple[str, str]:
    return f"blk.{layer}.fc1.weight", f"blk.{layer}.fc2.weight"


def activation_counts(model_path: str | os.PathLike, n_layers: int, n_neurons: list[int]) -> tuple[list[torch.Tensor], Path] | None:
    """PowerInfer's per-neuron activation counts (``activation/activation_{i}.pt`` next to the
    model), one float tensor per layer, or None when the folder is absent.  Read as tensors
    only (no code from the files runs) and checked: one file per layer, a vector of the layer's
    neurons, finite and non-negative."""
    folder = Path(model_path).parent / ACTIVATION_DIR
    if not folder.is_dir():
        return None
    counts = []
    for i in range(n_layers):
        f = folder / f"activation_{i}.pt"
        if not f.is_file():
            raise ModelFormatError(f"{folder}: PowerInfer activation statistics without {f.name} (layer {i} of "
                                   f"{n_layers}); restore the folder, or move it away to run without them")
        try:
            t = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # any damage: unpickling refused or failed
            raise ModelFormatError(f"{f}: not a PowerInfer activation file ({type(e).__name__}); restore it, or "
                                   "move the activation folder away to run without it") from None
        if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n_neurons[i]
                or not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64))):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ModelFormatError(f"{f}: expected a vector of {n_neurons[i]} activation counts (layer {i}), found "
                                   f"{shape}; these statistics belong to another model")
        t = t.double()
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ModelFormatError(f"{f}: activation counts must be finite and non-negative; restore the file")
        counts.append(t)
    return counts, folder


def gpu_index_path(model_path: str | os.PathLike) -> Path:
    p = Path(model_path)
    return p.with_name(p.name + GPU_INDEX_SUFFIX)


def gpu_index(model_path: str | os.PathLike, n_layers: int, n_neurons: list[int]) -> tuple[list[torch.Tensor], Path] | None:
    """The neurons PowerInfer's solver put on the GPU (``MODEL.generated.gpuidx``), one bool
    mask per layer, or None when there is no such file.  Checked: a layer count and masks of
    0/1 of the layer's neurons."""
    from . import gguf as gguf_io

    path = gpu_index_path(model_path)
    if not path.is_file():
        return None
    reader = gguf_io.open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    masks = []
    for i in range(n_layers):
        t = tensors.get(f"blk.{i}.gpu_idx")
        if t is None:
            raise ModelFormatError(f"{path}: no blk.{i}.gpu_idx (the split has {len(tensors) // 2} layers, the model "
                                   f"{n_layers}); delete the file, PowerInfer makes it again for this model")
        if t.tensor_type.name != "I32" or gguf_io.logical_shape(t) != (n_neurons[i],):
            raise ModelFormatError(f"{path}: blk.{i}.gpu_idx is {t.tensor_type.name} {list(gguf_io.logical_shape(t))}, "
                                   f"expected I32 [{n_neurons[i]}]; delete the file, it belongs to another model")
        m = torch.from_numpy(t.data.view("<i4").copy()).view(-1)
        if bool(((m != 0) & (m != 1)).any()):
            raise ModelFormatError(f"{path}: blk.{i}.gpu_idx holds values other than 0 and 1; delete the file")
        masks.append(m.bool())
    return masks, path
