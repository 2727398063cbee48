"""Sparsity packs from files are validated like model files: each kind of damage to a real
pack (made by `build_pack` on a tiny model) gets a one-line `SparsityPackError` and leaves the
model dense and decoding as before; a bounded mutation fuzz checks the same property on
random damage (SPARSEINFER_FUZZ_EXAMPLES raises its budget)."""
from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from sparseinfer.errors import SparseInferError, SparsityPackError
from sparseinfer.io.weights import SafetensorsSource
from sparseinfer.models.registry import build_model
from sparseinfer.sparse import calibrate as cal
from sparseinfer.sparse.apply import apply_sparsity, ffn_slots, restore, sparse_ffns, sparsify
from sparseinfer.sparse.head import PreviewHead, remove as remove_head
from sparseinfer.sparse.pack import META_KEY, SparsityPack
from sparseinfer.sparse.predictor import QPredictor

from tiny import hf_model, save_folder

FUZZ_EXAMPLES = int(os.environ.get("SPARSEINFER_FUZZ_EXAMPLES", "25"))
TOKENS = torch.tensor([[5, 17, 42, 9, 100, 7]])


class Tiny:
    """A tiny llama model, its dense MLPs (to put back), its real pack as parts, and the dense
    logits of `TOKENS`."""

    def __init__(self, root):
        from sparseinfer.sparse.prepare import PrepareOptions, build_pack

        self.src = SafetensorsSource(save_folder(hf_model("llama"), root / "llama"))
        self.model = build_model(self.src)
        self.mlps = [getattr(p, n) for p, n in ffn_slots(self.model)]
        g = torch.Generator().manual_seed(0)
        cs = cal.CalibrationSet(torch.randint(3, 250, (12, 32), generator=g), torch.randint(3, 250, (2, 32), generator=g),
                                {"tokens": 384})
        with torch.inference_mode():
            pack = build_pack(self.model, self.src, cs, PrepareOptions(sizes=(16,), steps=20, target_sparsity=0.5,
                                                                       evaluate=False, progress=False))
            self.dense = self.decode()
        self.good = pack.save(root / "good.sparse")
        with safe_open(str(self.good), framework="pt") as f:
            self.meta_text = f.metadata()[META_KEY]
            self.tensors = {k: f.get_tensor(k) for k in f.keys()}

    def meta(self) -> dict:
        return json.loads(self.meta_text)

    def decode(self) -> torch.Tensor:
        """Prefill 3 tokens, then decode the rest one at a time."""
        cache = self.model.new_cache(16)
        outs = [self.model(TOKENS[:, :3], cache)] + [self.model(TOKENS[:, t: t + 1], cache)
                                                     for t in range(3, TOKENS.shape[1])]
        return torch.cat(outs, dim=1)

    def reset(self) -> None:
        restore(self.model, self.mlps)
        remove_head(self.model)
        assert not sparse_ffns(self.model)

    def apply(self, path):
        """apply_sparsity as `load` runs it."""
        with torch.inference_mode():
            return apply_sparsity(self.model, self.src.path, self.src, sparse=path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("pack"))


def write(path, meta, tensors: dict) -> str:
    """A pack file from metadata (a dict, or raw text) and tensors."""
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: text})
    return str(path)


def refused(tiny: Tiny, path, match: str) -> str:
    """The pack at `path` is refused with one line matching `match`, and the model stays dense
    and decodes exactly as before."""
    with pytest.raises(SparsityPackError, match=match) as e:
        tiny.apply(path)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert not sparse_ffns(tiny.model)
    with torch.inference_mode():
        torch.testing.assert_close(tiny.decode(), tiny.dense, atol=0, rtol=0)
    return msg


def test_the_real_pack_is_accepted(tiny):
    pack = tiny.apply(tiny.good)
    try:
        assert len(sparse_ffns(tiny.model)) == len(tiny.mlps)
        assert isinstance(tiny.model.head, PreviewHead) and pack.head is not None
        with torch.inference_mode():
            out = tiny.decode()
        assert torch.isfinite(out).all()  # the tiny vocabulary: every token a candidate, none -inf
    finally:
        tiny.reset()
    assert pack.layers[0].order.dtype == torch.long


@pytest.mark.parametrize("fmt", ["q4", None])
def test_the_head_previews_format_is_kept(tiny, tmp_path, fmt):
    """The format decode holds the preview's A in comes from the pack (q8 when a pack names none)."""
    meta = tiny.meta()
    assert meta["head"]["format"] in ("q8", "q4")
    if fmt is None:
        del meta["head"]["format"]
    else:
        meta["head"]["format"] = fmt
    pack = tiny.apply(write(tmp_path / "fmt.sparse", meta, dict(tiny.tensors)))
    try:
        held = {"q8": "q8", "q4": "tq4"}[fmt or "q8"]      # q4 previews are read in row tiles
        assert pack.head.fmt == (fmt or "q8") and tiny.model.head.a.fmt == held
        assert "format" in pack.metadata()["head"]
    finally:
        tiny.reset()


# ---------------------------------------------------------------------------- the file itself
def test_unreadable_files(tiny, tmp_path):
    raw = tiny.good.read_bytes()
    cut = tmp_path / "cut.sparse"
    cut.write_bytes(raw[: len(raw) // 2])
    refused(tiny, cut, "cannot read it .*make it again with `sparseinfer prepare`")
    garbage = tmp_path / "garbage.sparse"
    garbage.write_bytes(b"\xff" * 64)
    refused(tiny, garbage, "cannot read it")
    empty = tmp_path / "empty.sparse"
    empty.write_bytes(b"")
    refused(tiny, empty, "cannot read it")


def test_header_claiming_a_huge_tensor_is_refused_without_allocating(tiny, tmp_path):
    """A header may claim any shape; the file's size bounds what is read."""
    meta = tiny.meta()
    header = {"__metadata__": {META_KEY: json.dumps(meta)},
              "layer.0.freq": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}
    blob = json.dumps(header).encode()
    path = tmp_path / "huge.sparse"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 64)
    refused(tiny, path, "cannot read it")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pickle-ran",))


def test_a_pickle_is_never_unpickled(tiny, tmp_path, monkeypatch):
    """torch.save files (pickles) are not packs; loading one runs none of its code."""
    monkeypatch.chdir(tmp_path)
    torch.save({"x": _Payload()}, tmp_path / "pickle.sparse")
    refused(tiny, tmp_path / "pickle.sparse", "cannot read it")
    assert not (tmp_path / "pickle-ran").exists()


def test_metadata_that_is_not_a_pack(tiny, tmp_path):
    path = tmp_path / "plain.sparse"
    save_file({"x": torch.zeros(3)}, str(path))
    refused(tiny, path, "not a sparsity pack")
    refused(tiny, write(tmp_path / "notjson.sparse", "{not json", tiny.tensors), "cannot read it")
    refused(tiny, write(tmp_path / "deep.sparse", "[" * 100_000 + "]" * 100_000, tiny.tensors), "cannot read it")
    refused(tiny, write(tmp_path / "list.sparse", "[1, 2]", tiny.tensors), "metadata is not a JSON object")


@pytest.mark.parametrize("version", [2, 0, "1", True, None, 1.0])
def test_format_version(tiny, tmp_path, version):
    meta = tiny.meta()
    meta["format_version"] = version
    refused(tiny, write(tmp_path / "v.sparse", meta, tiny.tensors), "format .* is not supported")


# ---------------------------------------------------------------------------- field types
@pytest.mark.parametrize("key,value,match", [
    ("fingerprint", 12, "no 'fingerprint'"),
    ("model", [], "no 'model'"),
    ("layers", {}, "no 'layers'"),
    ("layers", [], "no layers"),
    ("activation_source", "gelu", "activation source 'gelu'"),
    ("calibration", "x", "'calibration' metadata is not an object"),
    ("info", 3, "'info' metadata is not an object"),
])
def test_top_level_fields(tiny, tmp_path, key, value, match):
    meta = tiny.meta()
    meta[key] = value
    refused(tiny, write(tmp_path / "f.sparse", meta, tiny.tensors), match)


@pytest.mark.parametrize("key,value,match", [
    ("threshold", "0.1", "threshold '0.1'; expected a finite number"),
    ("threshold", None, "threshold None"),
    ("threshold", math.nan, "threshold nan"),
    ("threshold", math.inf, "threshold inf"),
    ("threshold", -0.5, "threshold -0.5; thresholds are finite and >= 0"),
    ("threshold", True, "threshold True"),
    ("tau", math.nan, "tau nan"),
    ("tau", -math.inf, "tau -inf"),
    ("policy", "sometimes", "decode policy 'sometimes'"),
    ("stats", [1], "stats are not an object"),
])
def test_layer_fields(tiny, tmp_path, key, value, match):
    meta = tiny.meta()
    meta["layers"][1][key] = value
    refused(tiny, write(tmp_path / "l.sparse", meta, tiny.tensors), match)


@pytest.mark.parametrize("key,value", [("density_true", 1.5), ("density_predicted", -0.1), ("recall", math.nan),
                                       ("hidden", -3), ("hidden", "16")])
def test_stats(tiny, tmp_path, key, value):
    meta = tiny.meta()
    meta["layers"][0]["stats"][key] = value
    refused(tiny, write(tmp_path / "s.sparse", meta, tiny.tensors), f"layer 0 has {key} ")


def test_model_description(tiny, tmp_path):
    meta = tiny.meta()
    meta["model"]["d_model"] = "64"
    refused(tiny, write(tmp_path / "d.sparse", meta, tiny.tensors), "model d_model is '64'; expected a positive integer")
    meta = tiny.meta()
    meta["model"]["n_layers"] = 3
    refused(tiny, write(tmp_path / "n.sparse", meta, tiny.tensors), "describes 3 layers but holds 2")


def test_long_values_are_cut_short_in_messages(tiny, tmp_path):
    meta = tiny.meta()
    meta["activation_source"] = "x\n" * 10_000
    msg = refused(tiny, write(tmp_path / "long.sparse", meta, tiny.tensors), "activation source")
    assert len(msg) < 300


# ---------------------------------------------------------------------------- against the model
def test_another_models_pack(tiny, tmp_path):
    meta = tiny.meta()
    meta["fingerprint"] = "0" * 16
    refused(tiny, write(tmp_path / "fp.sparse", meta, tiny.tensors), "belongs to another model")


def test_layer_count(tiny, tmp_path):
    meta = tiny.meta()
    del meta["layers"][1]
    meta["model"].pop("n_layers")
    tensors = {k: v for k, v in tiny.tensors.items() if not k.startswith("layer.1.")}
    refused(tiny, write(tmp_path / "one.sparse", meta, tensors), "does not match the model's shape .*1 layers")


def test_neuron_count(tiny, tmp_path):
    """A self-consistent pack for a model with fewer neurons in layer 1."""
    n = tiny.tensors["layer.1.order"].numel() - 1
    t = dict(tiny.tensors)
    t["layer.1.freq"] = t["layer.1.freq"][:n]
    t["layer.1.order"] = torch.arange(n, dtype=torch.int32)
    t["layer.1.pred.w2"] = t["layer.1.pred.w2"][:n]
    t["layer.1.pred.b2"] = t["layer.1.pred.b2"][:n]
    refused(tiny, write(tmp_path / "n.sparse", tiny.meta(), t), f"layer 1 has {n} neurons, the model {n + 1}")


def test_width(tiny, tmp_path):
    """Predictors that read 65 inputs, in a pack that says d_model 65: refused by the model check."""
    meta = tiny.meta()
    meta["model"]["d_model"] = 65
    del meta["head"]  # (the head preview's width is checked in test_bad_head_preview)
    t = {k: (torch.cat([v, v[:, :1]], 1) if k.endswith("pred.w1") else v) for k, v in tiny.tensors.items()
         if not k.startswith("head.")}
    refused(tiny, write(tmp_path / "w.sparse", meta, t), "does not match the model's shape .*d_model 65")
    meta["model"]["d_model"] = 64
    refused(tiny, write(tmp_path / "w.sparse", meta, t), r"predictor w1 has shape \(16, 65\), expected \(hidden, 64\)")


def test_sparsify_checks_the_model_before_replacing_anything(tiny):
    """A pack (in memory) whose last layer fits another model: no layer is replaced."""
    pack = SparsityPack.load(tiny.good)
    lp = pack.layers[-1]
    lp.order, lp.freq, lp.predictor_state = lp.order[:-1].clone(), lp.freq[:-1], None
    lp.order[lp.order == lp.order.numel()] = 0
    with pytest.raises(SparsityPackError, match="layer 1 has 159 neurons, the model 160"):
        sparsify(tiny.model, pack)
    assert not sparse_ffns(tiny.model)


def test_a_failure_while_replacing_puts_the_mlps_back(tiny):
    """Layer 0 is replaced, layer 1 fails: layer 0 gets its MLP back."""
    pack = SparsityPack.load(tiny.good)

    def fail(for_ranking=False):
        raise RuntimeError("no memory left")

    pack.layers[1].predictor = fail
    with pytest.raises(RuntimeError, match="no memory left"):
        sparsify(tiny.model, pack)
    assert [getattr(p, n) for p, n in ffn_slots(tiny.model)] == tiny.mlps
    with torch.inference_mode():
        torch.testing.assert_close(tiny.decode(), tiny.dense, atol=0, rtol=0)


# ---------------------------------------------------------------------------- tensors
def _with(tiny: Tiny, **changes) -> dict:
    t = dict(tiny.tensors)
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            del t[k]
        else:
            t[k] = v
    return t


@pytest.mark.parametrize("case,match", [
    ("missing_order", "layer 0 is missing 'layer.0.order'"),
    ("part_predictor", "only part of a predictor .*layer.1.pred.b2"),
    ("extra_tensor", "tensors no layer uses .*layer.7.freq"),
    ("order_float", "neuron order is F32"),
    ("order_repeats", "neuron order is not a permutation of 0..159"),
    ("order_out_of_range", "neuron order is not a permutation"),
    ("order_negative", "neuron order is not a permutation"),
    ("freq_shape", r"activation frequencies are F32 \[2, 80\]"),
    ("freq_int", "activation frequencies are I32"),
    ("freq_nan", r"activation frequencies must lie in \[0, 1\]"),
    ("freq_above_one", r"activation frequencies must lie in \[0, 1\]"),
    ("w1_nan", "predictor w1 holds NaN or Inf"),
    ("w2_inf", "predictor w2 holds NaN or Inf"),
    ("b2_inf", "predictor b2 holds NaN or Inf"),
    ("w2_shape", r"predictor w2 is F16 \[160, 17\], expected a float tensor of shape \[160, 16\]"),
    ("b1_shape", r"predictor b1 is F32 \[15\]"),
    ("w1_vector", "predictor w1 is F16"),
    ("cut_overflow", "the predictor cut"),
])
def test_bad_tensors(tiny, tmp_path, case, match):
    t0 = tiny.tensors
    order = t0["layer.0.order"]
    tensors = {
        "missing_order": lambda: _with(tiny, layer__0__order=None),
        "part_predictor": lambda: _with(tiny, layer__1__pred__b2=None),
        "extra_tensor": lambda: _with(tiny, layer__7__freq=torch.zeros(3)),
        "order_float": lambda: _with(tiny, layer__0__order=order.float()),
        "order_repeats": lambda: _with(tiny, layer__0__order=torch.cat([order[:1], order[:-1]])),
        "order_out_of_range": lambda: _with(tiny, layer__0__order=torch.where(order == 0, 160, order).int()),
        "order_negative": lambda: _with(tiny, layer__0__order=torch.where(order == 0, -160, order).int()),
        "freq_shape": lambda: _with(tiny, layer__0__freq=t0["layer.0.freq"].view(2, 80)),
        "freq_int": lambda: _with(tiny, layer__0__freq=torch.zeros(160, dtype=torch.int32)),
        "freq_nan": lambda: _with(tiny, layer__0__freq=t0["layer.0.freq"].clone().index_fill_(0, torch.tensor([3]), math.nan)),
        "freq_above_one": lambda: _with(tiny, layer__0__freq=t0["layer.0.freq"] + 1.5),
        "w1_nan": lambda: _with(tiny, layer__0__pred__w1=t0["layer.0.pred.w1"].clone().fill_(math.nan)),
        "w2_inf": lambda: _with(tiny, layer__1__pred__w2=t0["layer.1.pred.w2"].clone().index_fill_(0, torch.tensor([5]), math.inf)),
        "b2_inf": lambda: _with(tiny, layer__1__pred__b2=t0["layer.1.pred.b2"].clone().index_fill_(0, torch.tensor([0]), -math.inf)),
        "w2_shape": lambda: _with(tiny, layer__0__pred__w2=torch.zeros(160, 17, dtype=torch.float16)),
        "b1_shape": lambda: _with(tiny, layer__0__pred__b1=torch.zeros(15)),
        "w1_vector": lambda: _with(tiny, layer__0__pred__w1=torch.zeros(16, dtype=torch.float16)),
        "cut_overflow": lambda: _with(tiny, layer__0__pred__b2=torch.full((160,), -3e38)),
    }[case]()
    meta = tiny.meta()
    if case == "cut_overflow":
        meta["layers"][0]["tau"] = 3e38
    refused(tiny, write(tmp_path / f"{case}.sparse", meta, tensors), match)


@pytest.mark.parametrize("case,match", [
    ("head_missing_b", "names a head preview but the tensors head.a / head.b are missing"),
    ("head_b_width", r"head preview A is .* expected float \(vocab, rank\) and \(rank, 64\)"),
    ("head_rank_mismatch", "head preview A is"),
    ("head_int", "head preview A is I32"),
    ("head_nan", "the head preview holds NaN or infinite values"),
    ("head_vocab", "its head preview has 100 tokens, the model's vocabulary"),
    ("head_candidates", "head metadata is not an object with a positive integer .candidates."),
    ("head_meta", "head metadata is not an object"),
    ("head_tensors_without_meta", "tensors no layer uses .*head.a"),
    ("head_format", "its head preview is held in 'q5'; expected one of q8, q4"),
    ("head_rank_40", "the head preview has rank 40; expected a multiple of 32"),
])
def test_bad_head_preview(tiny, tmp_path, case, match):
    """The output head's preview (`sparse.head`): refused with one line, the model unchanged
    (FFNs and head)."""
    t0, meta = tiny.tensors, tiny.meta()
    assert "head" in meta and "head.a" in t0, "the tiny pack has a head preview"
    a, b = t0["head.a"], t0["head.b"]
    if case == "head_candidates":
        meta["head"]["candidates"] = 0
    elif case == "head_meta":
        meta["head"] = [1]
    elif case == "head_vocab":
        meta["head"]["candidates"] = 50
    elif case == "head_tensors_without_meta":
        del meta["head"]
    elif case == "head_format":
        meta["head"]["format"] = "q5"
    tensors = {
        "head_missing_b": lambda: _with(tiny, head__b=None),
        "head_b_width": lambda: _with(tiny, head__b=torch.zeros(b.shape[0], b.shape[1] + 1)),
        "head_rank_mismatch": lambda: _with(tiny, head__b=torch.zeros(b.shape[0] + 1, b.shape[1])),
        "head_int": lambda: _with(tiny, head__a=torch.zeros(a.shape, dtype=torch.int32)),
        "head_nan": lambda: _with(tiny, head__b=b.clone().fill_(math.nan)),
        "head_vocab": lambda: _with(tiny, head__a=a[:100].clone()),
        "head_rank_40": lambda: _with(tiny, head__a=torch.zeros(a.shape[0], 40), head__b=torch.zeros(40, b.shape[1])),
    }.get(case, lambda: dict(t0))()
    refused(tiny, write(tmp_path / f"{case}.sparse", meta, tensors), match)
    assert not isinstance(tiny.model.head, PreviewHead)


def test_q_predictor_refuses_shapes_that_do_not_fit():
    w1, b1, w2, b2 = torch.zeros(16, 64), torch.zeros(16), torch.zeros(160, 16), torch.zeros(160)
    QPredictor(w1, b1, w2, b2, 0.0)
    for bad in ((w1, b1, w2[:, :15], b2), (w1, b1[:3], w2, b2), (w1, b1, w2, b2[:5]), (w1[0], b1, w2, b2)):
        with pytest.raises(ValueError, match="predictor shapes do not fit"):
            QPredictor(*bad, 0.0)
    with pytest.raises(ValueError, match="tau must be finite"):
        QPredictor(w1, b1, w2, b2, math.nan)


# ---------------------------------------------------------------------------- mutation fuzz
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                        st.floats(allow_nan=True, allow_infinity=True), st.just([]), st.just({}))


def _leaves(x, path=()):
    """Paths to every value in a JSON document (containers included)."""
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))


def _set(doc, path, value):
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


SPECIAL = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 2.0, 1e30, -1e30, 65504.0, 160.0, -1.0e-8]


@st.composite
def mutated_pack(draw, tiny: Tiny):
    """Metadata and tensors of the real pack with a few random changes: a metadata value
    replaced, tensor elements overwritten, a tensor's dtype changed, cut, reshaped or dropped."""
    meta, tensors = tiny.meta(), dict(tiny.tensors)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["meta", "meta", "values", "values", "dtype", "cut", "drop", "reshape"]))
        if kind == "meta":
            paths = sorted(_leaves(meta), key=repr)
            meta = _set(meta, draw(st.sampled_from(paths)), draw(JSON_LEAVES))
            continue
        name = draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        if kind == "values":
            flat = t.clone().reshape(-1)
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, flat.numel() - 1))
                v = draw(st.sampled_from(SPECIAL + [float(flat.numel())]))
                flat[i] = int(v) if not t.dtype.is_floating_point and math.isfinite(v) and abs(v) < 2**31 else (
                    v if t.dtype.is_floating_point else 0)
            tensors[name] = flat.view(t.shape)
        elif kind == "dtype":
            tensors[name] = t.to(draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                                       torch.int16, torch.uint8, torch.bool])))
        elif kind == "cut":
            tensors[name] = t.reshape(-1)[: draw(st.integers(0, t.numel()))]
        elif kind == "drop":
            del tensors[name]
        else:
            tensors[name] = t.reshape(-1, *t.shape[2:]) if t.dim() > 1 else t.reshape(1, -1)
    return meta, tensors


def _apply_or_refuse(tiny, path, same_when_refused: bool = False) -> bool:
    """Apply the pack at `path`: True when it applied and the model decoded to finite logits
    (the model is then reset); False when it was refused in one line and the model stayed
    dense (`same_when_refused`: with exactly the dense logits)."""
    try:
        tiny.apply(path)
    except SparseInferError as e:
        assert "\n" not in str(e)
        assert not sparse_ffns(tiny.model)
        if same_when_refused:
            with torch.inference_mode():
                torch.testing.assert_close(tiny.decode(), tiny.dense, atol=0, rtol=0)
        return False
    try:
        with torch.inference_mode():
            assert torch.isfinite(tiny.decode()).all()
    finally:
        tiny.reset()
    return True


def test_mutation_fuzz(tiny, tmp_path_factory):
    """Any of these packs either loads and applies, and the model then decodes to finite
    logits, or is refused with a SparseInferError and the model stays dense (same logits)."""
    where = tmp_path_factory.mktemp("fuzz")
    outcomes = {"applied": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated_pack(tiny))
    def run(case):
        meta, tensors = case
        path = where / "m.sparse"
        try:
            text = json.dumps(meta)
        except ValueError:
            return
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: text})
        outcomes["applied" if _apply_or_refuse(tiny, path, same_when_refused=True) else "refused"] += 1

    run()
    assert outcomes["refused"] > 0


def test_byte_fuzz(tiny, tmp_path_factory):
    """Bytes of the real pack file overwritten at random (header and data alike): the same
    property at the level of the file."""
    where = tmp_path_factory.mktemp("bytes")
    raw = tiny.good.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=6),
           st.booleans())
    def run(edits, in_header):
        data = bytearray(raw)
        for pos, byte in edits:
            data[pos % (hlen + 8) if in_header else pos] = byte
        path = where / "b.sparse"
        path.write_bytes(bytes(data))
        _apply_or_refuse(tiny, path)

    run()
