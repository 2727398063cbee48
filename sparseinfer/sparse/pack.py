"""`SparsityPack`: the sidecar file `sparseinfer prepare` writes next to a model.

A safetensors file.  Tensors per layer i: ``layer.{i}.freq`` (f32, per-neuron activation
frequency, original neuron order), ``layer.{i}.order`` (int32, hotness order: original id of
the k-th hottest neuron) and the predictor ``layer.{i}.pred.{w1,b1,w2,b2}`` (f16/f32; W2 rows
and b2 in hotness order, input standardization folded into W1/b1).  The JSON metadata under
the header key ``sparseinfer.pack`` holds the format version, the model fingerprint
(`WeightSource.fingerprint()`), the activation source, per-layer thresholds, predictor cut
(tau), measured recall/precision/density per layer, and the calibration data description.
Optionally the output head's preview (`sparse.head`): ``head.a`` (vocab x rank, f16/f32) and
``head.b`` (rank x d_model, f32), with its candidate count, the format decode holds A in and
measurements under ``head`` in the metadata.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import SparsityPackError
from .predictor import READS

if TYPE_CHECKING:
    from .head import HeadPreview

FORMAT_VERSION = 1
META_KEY = "sparseinfer.pack"
PRED_KEYS = ("w1", "b1", "w2", "b2")
POLICIES = ("predictor", "first")
ACTIVATION_SOURCES = ("relu", "threshold")


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
    # the predictor's weight format at run time: "q8" (trained predictors), or a float format
    # that keeps a PowerInfer file's predictor values (`sparse.powerinfer`): W2 in it, W1 (the
    # file's divided by the norm weight) in f32
    predictor_format: str = "q8"
    # what the predictor reads (`predictor.READS`): the FFN's input, or the residual stream
    # before the FFN's norm (a PowerInfer Falcon or OPT file's predictors, `sparse.powerinfer`)
    predictor_reads: str = "ffn_input"

    @property
    def n_neurons(self) -> int:
        return int(self.order.numel())

    def predictor(self, for_ranking: bool = False):
        """The runtime predictor decode uses (in `predictor_format`; None under the "first"
        policy); with `for_ranking` (forced density) whenever one was trained."""
        if self.predictor_state is None or (self.policy != "predictor" and not for_ranking):
            return None
        from .predictor import QPredictor

        s = self.predictor_state
        return QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], self.tau, fmt=self.predictor_format,
                          w1_fmt=None if self.predictor_format == "q8" else "f32", reads=self.predictor_reads)

    @property
    def predictor_nbytes(self) -> int:
        if self.predictor_state is None:
            return 0
        from .predictor import predictor_bytes

        r, d = self.predictor_state["w1"].shape
        return predictor_bytes(d, r, self.n_neurons, self.predictor_format)


@dataclass
class SparsityPack:
    fingerprint: str
    model: dict                 # name, family, hidden_act, n_layers, d_model, n_neurons, bytes
    activation_source: str      # "relu" (active = nonzero) or "threshold" (|act(gate x)| > t)
    layers: list[LayerPack]
    calibration: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)   # targets, measured perplexities, timings
    path: Path | None = None
    head: HeadPreview | None = None          # the output head's preview (`sparse.head`), if any

    # ------------------------------------------------------------------ (de)serialization
    def metadata(self) -> dict:
        return {
            "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint, "model": self.model,
            "activation_source": self.activation_source, "calibration": self.calibration, "info": self.info,
            "layers": [{"threshold": lp.threshold, "tau": lp.tau, "policy": lp.policy, "stats": lp.stats,
                        **({} if lp.predictor_reads == "ffn_input" else {"reads": lp.predictor_reads})}
                       for lp in self.layers],
            **({"head": {"candidates": self.head.candidates, "format": self.head.fmt, "stats": self.head.stats}}
               if self.head else {}),
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
        if self.head is not None:
            a = self.head.a.float()
            out["head.a"] = (a.half() if a.abs().max() < HALF_SAFE else a).contiguous()
            out["head.b"] = self.head.b.float().contiguous()
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
        """Read and validate a pack (see `validate_parts`): a file that is not a well-formed pack
        raises `SparsityPackError`.  Reading runs no code from the file (safetensors, JSON) and
        allocates no more than the file holds: the header's names, types and shapes are checked
        before any tensor is read."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get(META_KEY)
                if raw is None:
                    raise SparsityPackError(f"{path} is a safetensors file but not a sparsity pack (no {META_KEY!r} "
                                            "metadata); make one with `sparseinfer prepare MODEL`")
                meta = json.loads(raw)
                _check_meta(meta, path)
                header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
                _check_header(meta, header, path)
                tensors = {k: f.get_tensor(k) for k in header}
        except SparsityPackError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError, RecursionError, OverflowError, RuntimeError) as e:
            # JSONDecodeError is a ValueError; RecursionError: absurdly nested JSON
            raise _bad(path, f"cannot read it ({_one_line(e)})") from None
        pack = cls._from_parts(meta, tensors, path)
        pack.validate()
        return pack

    @classmethod
    def _from_parts(cls, meta: dict, tensors: dict, path: Path) -> "SparsityPack":
        """A pack from checked metadata (`_check_meta`) and tensors (`_check_header`)."""
        layers = []
        for i, lm in enumerate(meta["layers"]):
            pred = None
            if f"layer.{i}.pred.w1" in tensors:
                pred = {k: tensors[f"layer.{i}.pred.{k}"].float() for k in PRED_KEYS}
            layers.append(LayerPack(float(lm["threshold"]), tensors[f"layer.{i}.freq"].float(),
                                    tensors[f"layer.{i}.order"].long(), pred, float(lm["tau"]), lm.get("stats", {}),
                                    lm.get("policy", "predictor"), predictor_reads=lm.get("reads", "ffn_input")))
        head = None
        if "head" in meta:
            from .head import HeadPreview

            head = HeadPreview(tensors["head.a"].float(), tensors["head.b"].float(), meta["head"]["candidates"],
                               meta["head"].get("stats", {}), meta["head"].get("format", "q8"))
        return cls(meta["fingerprint"], meta["model"], meta["activation_source"], layers,
                   meta.get("calibration", {}), meta.get("info", {}), path, head)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Refuse (SparsityPackError) values no `sparseinfer prepare` writes: thresholds that are
        negative or not finite, a tau that is not finite, frequencies outside [0, 1], a neuron
        order that is not a permutation, predictor shapes that do not fit the layer, NaN/Inf in
        predictor weights, measured fractions outside [0, 1]."""
        where = self.path or "(in memory)"
        if not self.layers:
            raise _bad(where, "no layers")
        for i, lp in enumerate(self.layers):
            _check_layer(lp, where, f"layer {i}")
            if lp.predictor_state is not None:
                _check_predictor(lp, where, f"layer {i}", self.model.get("d_model"))
        if self.head is not None:
            h = self.head
            if h.a.dim() != 2 or h.b.dim() != 2 or h.a.shape[1] != h.b.shape[0] or h.a.shape[1] < 1:
                raise _bad(where, f"the head preview's A {list(h.a.shape)} and B {list(h.b.shape)} do not fit together")
            if self.model.get("d_model") is not None and h.b.shape[1] != self.model["d_model"]:
                raise _bad(where, f"the head preview reads {h.b.shape[1]} inputs, the model has d_model "
                                  f"{_show(self.model['d_model'])}")
            from .head import RANK_STEP

            if h.a.shape[1] % RANK_STEP:
                raise _bad(where, f"the head preview has rank {h.a.shape[1]}; expected a multiple of {RANK_STEP}")
            if type(h.candidates) is not int or not 1 <= h.candidates <= h.a.shape[0]:
                raise _bad(where, f"the head preview keeps {_show(h.candidates)} candidates; expected 1 to "
                                  f"{h.a.shape[0]}")
            if not (torch.isfinite(h.a).all() and torch.isfinite(h.b).all()):
                raise _bad(where, "the head preview holds NaN or infinite values")

    def check(self, source) -> None:
        """Refuse (SparsityPackError) a pack made for another model than `source`."""
        fp = source.fingerprint()
        if fp != self.fingerprint:
            raise SparsityPackError(
                f"sparsity pack {self.path or ''} belongs to another model ({_one_line(self.model.get('name', '?'), 60)}, "
                f"fingerprint {_one_line(self.fingerprint, 40)}), not {source.path} (fingerprint {fp}); make one for this "
                f"model with `sparseinfer prepare {source.path}` or run with --dense")
        c = source.config
        if self.head is not None and self.head.a.shape[0] != c.vocab_size:
            raise SparsityPackError(f"sparsity pack {self.path or ''}: its head preview has {self.head.a.shape[0]} "
                                    f"tokens, the model's vocabulary {c.vocab_size}; make one for this model "
                                    f"with `sparseinfer prepare {source.path}` or run with --dense")
        if len(self.layers) != c.num_hidden_layers or self.model.get("d_model") != c.hidden_size:
            raise SparsityPackError(f"sparsity pack {self.path or ''} does not match the model's shape "
                                    f"({len(self.layers)} layers, d_model {_show(self.model.get('d_model'))}; the model: "
                                    f"{c.num_hidden_layers} layers, d_model {c.hidden_size}); make one for this model "
                                    f"with `sparseinfer prepare {source.path}` or run with --dense")

    def check_model(self, mlps) -> None:
        """Refuse (SparsityPackError) a pack whose layers do not fit `mlps`, the model's dense
        FFNs in layer order: their count, each one's neurons and input width."""
        where = self.path or "(in memory)"
        fix = "make one for this model with `sparseinfer prepare MODEL` or run with --dense"
        if len(mlps) != len(self.layers):
            raise SparsityPackError(f"sparsity pack {where} has {len(self.layers)} layers, the model "
                                    f"{len(mlps)}; {fix}")
        for i, mlp in enumerate(mlps):
            self.check_layer(i, mlp.n_neurons)
            s = self.layers[i].predictor_state
            width = mlp.up.in_features
            if s is not None and s["w1"].shape[-1] != width:
                raise SparsityPackError(f"sparsity pack {where}: layer {i}'s predictor reads {s['w1'].shape[-1]} "
                                        f"inputs, the model's FFN {width}; {fix}")

    def check_layer(self, i: int, n_neurons: int) -> None:
        if self.layers[i].n_neurons != n_neurons:
            raise SparsityPackError(f"sparsity pack {self.path or ''}: layer {i} has {self.layers[i].n_neurons} "
                                    f"neurons, the model {n_neurons}; make one for this model with "
                                    "`sparseinfer prepare MODEL` or run with --dense")

    # ------------------------------------------------------------------ summaries
    @property
    def predictor_nbytes(self) -> int:
        """Bytes of the predictors decode runs (layers under the "predictor" policy)."""
        return sum(lp.predictor_nbytes for lp in self.layers if lp.policy == "predictor")

    def mean_stat(self, key: str) -> float:
        vals = [lp.stats[key] for lp in self.layers if key in lp.stats]
        return sum(vals) / len(vals) if vals else float("nan")


# ---------------------------------------------------------------------------- checks of a file's parts
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
HALF_SAFE = 60000.0  # the head preview's A is stored in f16 when every value is below this
INT_DTYPES = frozenset({"I8", "U8", "I16", "I32", "I64"})
# stats entries that are fractions (measured on held-out tokens, or profiled)
FRACTION_STATS = ("recall", "precision", "density_predicted", "density_true", "density", "hot80", "dead",
                  "max_freq")


def _one_line(e, limit: int = 160) -> str:
    """`e` as one line of at most about `limit` characters (a file can hold anything)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(x) -> str:
    """A value from the file for an error message: its repr, one short line."""
    return _one_line(repr(x), 40)


def _bad(path, what: str) -> SparsityPackError:
    return SparsityPackError(f"sparsity pack {path}: {what}; make it again with `sparseinfer prepare`")


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_meta(meta, path) -> None:
    """The JSON metadata's structure and types (values that matter for decode are checked by
    `SparsityPack.validate`)."""
    if not isinstance(meta, dict):
        raise _bad(path, "its metadata is not a JSON object")
    version = meta.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise SparsityPackError(f"{path}: sparsity pack format {_show(version)} is not supported (this version "
                                f"reads {FORMAT_VERSION}); make it again with `sparseinfer prepare`")
    for key, typ, name in (("fingerprint", str, "a string"), ("model", dict, "an object"),
                           ("activation_source", str, "a string"), ("layers", list, "a list")):
        if not isinstance(meta.get(key), typ):
            raise _bad(path, f"its metadata has no {_show(key)} ({name})")
    for key in ("calibration", "info"):
        if not isinstance(meta.get(key, {}), dict):
            raise _bad(path, f"its {_show(key)} metadata is not an object")
    if meta["activation_source"] not in ACTIVATION_SOURCES:
        raise _bad(path, f"activation source {_show(meta['activation_source'])}; expected one of "
                         f"{', '.join(ACTIVATION_SOURCES)}")
    model = meta["model"]
    for key in ("n_layers", "d_model", "n_neurons"):
        if key in model and (type(model[key]) is not int or model[key] < 1):
            raise _bad(path, f"model {key} is {_show(model[key])}; expected a positive integer")
    if not meta["layers"]:
        raise _bad(path, "no layers")
    if "n_layers" in model and model["n_layers"] != len(meta["layers"]):
        raise _bad(path, f"describes {model['n_layers']} layers but holds {len(meta['layers'])}")
    for i, lm in enumerate(meta["layers"]):
        if not isinstance(lm, dict):
            raise _bad(path, f"layer {i}'s metadata is not an object")
        for key in ("threshold", "tau"):
            if not _finite_number(lm.get(key)):
                raise _bad(path, f"layer {i} has {key} {_show(lm.get(key))}; expected a finite number")
        if lm.get("policy", "predictor") not in POLICIES:
            raise _bad(path, f"layer {i} has decode policy {_show(lm.get('policy'))}; expected one of {', '.join(POLICIES)}")
        if lm.get("reads", "ffn_input") not in READS:
            raise _bad(path, f"layer {i}'s predictor reads {_show(lm.get('reads'))}; expected one of {', '.join(READS)}")
        if not isinstance(lm.get("stats", {}), dict):
            raise _bad(path, f"layer {i}'s stats are not an object")
    if "head" in meta:
        hm = meta["head"]
        if not isinstance(hm, dict) or type(hm.get("candidates")) is not int or hm["candidates"] < 1:
            raise _bad(path, "its head metadata is not an object with a positive integer 'candidates'")
        if not isinstance(hm.get("stats", {}), dict):
            raise _bad(path, "its head stats are not an object")
        from .head import PREVIEW_FORMATS

        if hm.get("format", "q8") not in PREVIEW_FORMATS:
            raise _bad(path, f"its head preview is held in {_show(hm.get('format'))}; expected one of "
                             f"{', '.join(PREVIEW_FORMATS)}")


def _check_header(meta: dict, header: dict, path) -> None:
    """Tensor names, dtypes and shapes, before any tensor is read: every layer has its
    frequencies and order, of one length, and either no predictor or all four parts in shapes
    that fit together; no other tensors."""
    expected = set()
    width = None
    for i in range(len(meta["layers"])):
        names = [f"layer.{i}.freq", f"layer.{i}.order"] + [f"layer.{i}.pred.{k}" for k in PRED_KEYS]
        have = [k in header for k in names]
        if not all(have[:2]):
            raise _bad(path, f"layer {i} is missing {_show(names[have.index(False)])} (truncated or corrupt)")
        if any(have[2:]) and not all(have[2:]):
            raise _bad(path, f"layer {i} has only part of a predictor (missing {_show(names[2 + have[2:].index(False)])})")
        expected.update(n for n, h in zip(names, have) if h)
        (fdt, fshape), (odt, oshape) = header[names[0]], header[names[1]]
        if fdt not in FLOAT_DTYPES or len(fshape) != 1 or fshape[0] < 1:
            raise _bad(path, f"layer {i}: activation frequencies are {fdt} {list(fshape)}, expected a float vector")
        if odt not in INT_DTYPES or oshape != fshape:
            raise _bad(path, f"layer {i}: the neuron order is {odt} {list(oshape)}, expected an integer vector of "
                             f"{fshape[0]}")
        if not have[2]:
            continue
        n = fshape[0]
        (_, w1), (_, b1), (_, w2), (_, b2) = (header[k] for k in names[2:])
        r = w1[0] if len(w1) == 2 else 0
        d = w1[1] if len(w1) == 2 else 0
        want = {"w1": (r, d), "b1": (r,), "w2": (n, r), "b2": (n,)}
        for k, name in zip(PRED_KEYS, names[2:]):
            dt, shape = header[name]
            if dt not in FLOAT_DTYPES or r < 1 or d < 1 or shape != want[k]:
                raise _bad(path, f"layer {i}: predictor {k} is {dt} {list(shape)}, expected a float tensor of shape "
                                 f"{list(want[k]) if r >= 1 and d >= 1 else '(hidden, width)'}")
        if width is not None and d != width:
            raise _bad(path, f"layer {i}'s predictor reads {d} inputs, an earlier layer's {width}")
        width = d
    if "head" in meta:
        if "head.a" not in header or "head.b" not in header:
            raise _bad(path, "its metadata names a head preview but the tensors head.a / head.b are missing")
        (adt, ashape), (bdt, bshape) = header["head.a"], header["head.b"]
        d = meta["model"].get("d_model")
        if (adt not in FLOAT_DTYPES or bdt not in FLOAT_DTYPES or len(ashape) != 2 or len(bshape) != 2
                or min(ashape) < 1 or ashape[1] != bshape[0] or (d is not None and bshape[1] != d)):
            raise _bad(path, f"head preview A is {adt} {list(ashape)} and B {bdt} {list(bshape)}; expected float "
                             f"(vocab, rank) and (rank, {_show(d)})")
        expected.update(("head.a", "head.b"))
    extra = sorted(set(header) - expected)
    if extra:
        raise _bad(path, f"tensors no layer uses ({_one_line(', '.join(extra[:3]))}{', ...' if len(extra) > 3 else ''})")


def _check_layer(lp: LayerPack, where, at: str) -> None:
    if not _finite_number(lp.threshold) or lp.threshold < 0:
        raise _bad(where, f"{at} has threshold {_show(lp.threshold)}; thresholds are finite and >= 0")
    if not _finite_number(lp.tau):
        raise _bad(where, f"{at} has predictor cut (tau) {_show(lp.tau)}; it must be a finite number")
    if lp.policy not in POLICIES:
        raise _bad(where, f"{at} has decode policy {_show(lp.policy)}; expected one of {', '.join(POLICIES)}")
    if lp.predictor_reads not in READS:
        raise _bad(where, f"{at}'s predictor reads {_show(lp.predictor_reads)}; expected one of {', '.join(READS)}")
    _check_stats(lp.stats, where, at)
    n = lp.order.numel()
    if lp.order.dim() != 1 or n < 1 or lp.order.dtype.is_floating_point or lp.order.dtype == torch.bool:
        raise _bad(where, f"{at}: the neuron order must be a non-empty 1-d integer tensor")
    if not torch.equal(lp.order.long().sort().values, torch.arange(n)):
        raise _bad(where, f"{at}: the neuron order is not a permutation of 0..{n - 1}")
    if tuple(lp.freq.shape) != (n,) or not lp.freq.dtype.is_floating_point:
        raise _bad(where, f"{at}: activation frequencies have shape {tuple(lp.freq.shape)}, expected ({n},)")
    if not bool(((lp.freq >= 0) & (lp.freq <= 1)).all()):  # NaN fails both comparisons
        raise _bad(where, f"{at}: activation frequencies must lie in [0, 1]")


def _check_predictor(lp: LayerPack, where, at: str, d_model) -> None:
    s, n = lp.predictor_state, lp.n_neurons
    if set(s) != set(PRED_KEYS):
        raise _bad(where, f"{at}: the predictor has parts {sorted(s)}, expected {list(PRED_KEYS)}")
    w1 = s["w1"]
    r, d = tuple(w1.shape) if w1.dim() == 2 else (0, 0)
    if r < 1 or d < 1 or (isinstance(d_model, int) and d != d_model):
        raise _bad(where, f"{at}: predictor w1 has shape {tuple(w1.shape)}, expected (hidden, {_show(d_model)})")
    want = {"w1": (r, d), "b1": (r,), "w2": (n, r), "b2": (n,)}
    for k in PRED_KEYS:
        if tuple(s[k].shape) != want[k]:
            raise _bad(where, f"{at}: predictor {k} has shape {tuple(s[k].shape)}, expected {want[k]}")
        if not s[k].dtype.is_floating_point or not bool(torch.isfinite(s[k]).all()):
            raise _bad(where, f"{at}: predictor {k} holds NaN or Inf (or is not a float tensor)")
    if not bool(torch.isfinite(lp.tau - s["b2"].float()).all()):
        raise _bad(where, f"{at}: the predictor cut (tau - b2) overflows")


def _check_stats(stats, where, at: str) -> None:
    if not isinstance(stats, dict):
        raise _bad(where, f"{at}'s stats are not an object")
    for key in FRACTION_STATS:
        if key in stats and not (_finite_number(stats[key]) and 0 <= stats[key] <= 1):
            raise _bad(where, f"{at} has {key} {_show(stats[key])}; expected a fraction in [0, 1]")
    for key in ("hidden", "predictor_bytes"):
        if key in stats and (type(stats[key]) is not int or stats[key] < 0):
            raise _bad(where, f"{at} has {key} {_show(stats[key])}; expected a non-negative integer")
