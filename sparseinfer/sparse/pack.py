"""`SparsityPack`: the sidecar file `sparseinfer prepare` writes next to a model.

A safetensors file.  Tensors per layer i: ``layer.{i}.freq`` (f32, per-neuron activation
frequency, original neuron order), ``layer.{i}.order`` (int32, hotness order: original id of
the k-th hottest neuron) and the predictor ``layer.{i}.pred.{w1,b1,w2,b2}`` (f16/f32; W2 rows
and b2 in hotness order, input standardization folded into W1/b1).  The JSON metadata under
the header key ``sparseinfer.pack`` holds the format version, the model fingerprint
(`WeightSource.fingerprint()`), the activation source, per-layer thresholds, predictor cut
(tau), measured recall/precision/density per layer, and the calibration data description.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SparsityPackError

FORMAT_VERSION = 1
META_KEY = "sparseinfer.pack"
PRED_KEYS = ("w1", "b1", "w2", "b2")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class LayerPack:
    """One layer: its threshold, frequencies, hotness order and predictor."""

    threshold: float
    freq: torch.Tensor
    order: torch.Tensor
    predictor_state: dict[str, torch.Tensor] | None = None
    tau: float = 0.0
    stats: dict = field(default_factory=dict)
    policy: str = "predictor"  # decode: "predictor" rows, or "first": dense first projection + threshold

    @property
    def n_neurons(self) -> int:
        return int(self.order.numel())

    def predictor(self, for_ranking: bool = False):
        """The runtime (q8) predictor decode uses (None under the "first" policy); with
        `for_ranking` (forced density) whenever one was trained."""
        if self.predictor_state is None or (self.policy != "predictor" and not for_ranking):
            return None
        from .predictor import QPredictor

        s = self.predictor_state
        return QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], self.tau)

    @property
    def predictor_nbytes(self) -> int:
        if self.predictor_state is None:
            return 0
        from .predictor import predictor_bytes

        r, d = self.predictor_state["w1"].shape
        return predictor_bytes(d, r, self.n_neurons)


@dataclass
class SparsityPack:
    fingerprint: str
    model: dict                 # name, family, hidden_act, n_layers, d_model, n_neurons, bytes
    activation_source: str      # "relu" (active = nonzero) or "threshold" (|act(gate x)| > t)
    layers: list[LayerPack]
    calibration: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)   # targets, measured perplexities, timings
    path: Path | None = None

    # ------------------------------------------------------------------ (de)serialization
    def metadata(self) -> dict:
        return {
            "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint, "model": self.model,
            "activation_source": self.activation_source, "calibration": self.calibration, "info": self.info,
            "layers": [{"threshold": lp.threshold, "tau": lp.tau, "policy": lp.policy, "stats": lp.stats}
                       for lp in self.layers],
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, lp in enumerate(self.layers):
            out[f"layer.{i}.freq"] = lp.freq.float().contiguous()
            out[f"layer.{i}.order"] = lp.order.to(torch.int32).contiguous()
            if lp.predictor_state is not None:
                for k in PRED_KEYS:
                    t = lp.predictor_state[k]
                    out[f"layer.{i}.pred.{k}"] = (t.half() if k.startswith("w") else t.float()).contiguous()
        return out

    def save(self, path: str | os.PathLike) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(self.tensors(), str(tmp), metadata={META_KEY: json.dumps(self.metadata())})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; a pack is as shareable as its model
        os.replace(tmp, path)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SparsityPack":
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get(META_KEY)
                if raw is None:
                    raise SparsityPackError(f"{path} is a safetensors file but not a sparsity pack (no {META_KEY!r} metadata)")
                meta = json.loads(raw)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, json.JSONDecodeError, ValueError) as e:
            if isinstance(e, SparsityPackError):
                raise
            raise SparsityPackError(f"cannot read sparsity pack {path}: {e}; make it again with `sparseinfer prepare`") from None
        return cls._from_parts(meta, tensors, path)

    @classmethod
    def _from_parts(cls, meta: dict, tensors: dict, path: Path) -> "SparsityPack":
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise SparsityPackError(f"{path}: sparsity pack format {version} is not supported (this version "
                                    f"reads {FORMAT_VERSION}); make it again with `sparseinfer prepare`")
        layers = []
        for i, lm in enumerate(meta["layers"]):
            try:
                pred = None
                if f"layer.{i}.pred.w1" in tensors:
                    pred = {k: tensors[f"layer.{i}.pred.{k}"].float() for k in PRED_KEYS}
                layers.append(LayerPack(float(lm["threshold"]), tensors[f"layer.{i}.freq"].float(),
                                        tensors[f"layer.{i}.order"].long(), pred, float(lm["tau"]), lm.get("stats", {}),
                                        lm.get("policy", "predictor")))
            except KeyError as e:
                raise SparsityPackError(f"{path}: sparsity pack is missing {e} (truncated or corrupt)") from None
        return cls(meta["fingerprint"], meta["model"], meta["activation_source"], layers,
                   meta.get("calibration", {}), meta.get("info", {}), path)

    # ------------------------------------------------------------------ validation
    def check(self, source) -> None:
        """Refuse (SparsityPackError) a pack made for another model than `source`."""
        fp = source.fingerprint()
        if fp != self.fingerprint:
            raise SparsityPackError(
                f"sparsity pack {self.path or ''} belongs to another model ({self.model.get('name', '?')}, "
                f"fingerprint {self.fingerprint}), not {source.path} (fingerprint {fp}); make one for this "
                f"model with `sparseinfer prepare {source.path}` or run with --dense")
        c = source.config
        if len(self.layers) != c.num_hidden_layers or self.model.get("d_model") != c.hidden_size:
            raise SparsityPackError(f"sparsity pack {self.path or ''} does not match the model's shape "
                                    f"({len(self.layers)} layers, d_model {self.model.get('d_model')})")

    def check_layer(self, i: int, n_neurons: int) -> None:
        if self.layers[i].n_neurons != n_neurons:
            raise SparsityPackError(f"sparsity pack {self.path or ''}: layer {i} has {self.layers[i].n_neurons} "
                                    f"neurons, the model {n_neurons}")

    # ------------------------------------------------------------------ summaries
    @property
    def predictor_nbytes(self) -> int:
        """Bytes of the predictors decode runs (layers under the "predictor" policy)."""
        return sum(lp.predictor_nbytes for lp in self.layers if lp.policy == "predictor")

    def mean_stat(self, key: str) -> float:
        vals = [lp.stats[key] for lp in self.layers if key in lp.stats]
        return sum(vals) / len(vals) if vals else float("nan")
