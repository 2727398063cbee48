"""Activation sparsity on tiny random models: SparseFFN against the dense MLP and its own slow
reference, oracle ReLU decoding == dense, per-token decode == faithful chunk evaluation,
packs (round trip, refusal), predictors (bits, tau, q8 runtime vs reference), forced density."""
from __future__ import annotations

import itertools

import pytest
import torch

from sparseinfer.errors import SparsityPackError
from sparseinfer.io.weights import SafetensorsSource
from sparseinfer.kernels import cpu
from sparseinfer.models.layers import MLP, Linear
from sparseinfer.models.registry import build_model
from sparseinfer.quant import QWeight, from_float
from sparseinfer.sparse import calibrate as cal
from sparseinfer.sparse.apply import (bench_fields, ffn_slots, replace_ffns, reset_stats, resolve_pack, restore, set_mode,
                                      sparse_ffns, sparsify)
from sparseinfer.sparse.ffn import SparseFFN
from sparseinfer.sparse.pack import LayerPack, SparsityPack
from sparseinfer.sparse.predictor import QPredictor, metrics, pack_bits, tune_tau, unpack_bits

from tiny import hf_model, save_folder


def tiny(kind: str, tmp_path, relu: bool = False, seed: int = 0):
    hf = hf_model(kind, seed=seed)
    if relu and kind.startswith("falcon"):
        hf.config.activation = "relu"
    src = SafetensorsSource(save_folder(hf, tmp_path / f"{kind}-{seed}"))
    return build_model(src), src


def stepwise(model, tokens, n_prefill: int = 0):
    """Prefill `n_prefill` tokens (0: none), then decode one token at a time."""
    cache = model.new_cache(64)
    outs = [model(tokens[:, :n_prefill], cache)] if n_prefill else []
    outs += [model(tokens[:, t: t + 1], cache) for t in range(n_prefill, tokens.shape[1])]
    return torch.cat(outs, dim=1)


def random_predictor(d: int, n: int, tau: float, seed: int = 0, r: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(r, d, generator=g) * 0.2, "b1": torch.randn(r, generator=g) * 0.1,
            "w2": torch.randn(n, r, generator=g) * 0.5, "b2": torch.randn(n, generator=g) * 0.5}


def random_pack(model, src, thresholds=None, tau: float = 0.0, seed: int = 0, policy: str = "predictor") -> SparsityPack:
    """A pack with random hotness orders and random predictors (for mechanics, not quality)."""
    layers = []
    for i, (p, n) in enumerate(ffn_slots(model)):
        mlp = getattr(p, n)
        g = torch.Generator().manual_seed(seed + i)
        order = torch.randperm(mlp.n_neurons, generator=g)
        freq = torch.rand(mlp.n_neurons, generator=g)
        t = 0.0 if thresholds is None else thresholds
        layers.append(LayerPack(t, freq, order, random_predictor(mlp.down.out_features, mlp.n_neurons, tau, seed + i),
                                tau, {"recall": 1.0}, policy if i % 2 else "predictor"))
    return SparsityPack(src.fingerprint(), {"name": "tiny", "d_model": src.config.hidden_size}, "threshold", layers)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("kind", ["llama", "qwen2", "opt", "falcon"])
def test_every_neuron_kept_equals_dense(kind, tmp_path, tokens):
    """Threshold 0 and a predictor that selects everything: sparse decode == dense, with the
    neurons permuted into a random hotness order."""
    model, src = tiny(kind, tmp_path)
    with torch.inference_mode():
        ref = stepwise(model, tokens, 3)
        sparsify(model, random_pack(model, src, tau=-1e9))
        out = stepwise(model, tokens, 3)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama-relu", "opt", "falcon"])
def test_relu_oracle_equals_dense(kind, tmp_path, tokens):
    """ReLU models decoded on exactly their nonzero neurons (oracle rows) == dense."""
    model, src = tiny(kind, tmp_path, relu=True)
    assert all(m.act_name == "relu" for m in model.modules() if isinstance(m, MLP))
    with torch.inference_mode():
        ref = stepwise(model, tokens, 3)
        sparsify(model, random_pack(model, src), mode="oracle")
        out = stepwise(model, tokens, 3)
        st = sparse_ffns(model)[0].stats
    assert 0 < st.kept < st.tokens * sparse_ffns(model)[0].n_neurons  # really sparse
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,policy", [("llama", "predictor"), ("llama", "first"), ("llama-relu", "predictor"),
                                         ("opt", "first")])
def test_decode_equals_faithful(kind, policy, tmp_path, tokens):
    """Per-token sparse decode (predictor rows, threshold inside; or dense first projection
    for "first"-policy layers) == the faithful whole-chunk mode (predictor mask x threshold mask
    on dense activations): what perplexity evaluates."""
    model, src = tiny(kind, tmp_path)
    pack = random_pack(model, src, thresholds=0.05 if kind == "llama" else None, tau=0.3, policy=policy)
    with torch.inference_mode():
        sparsify(model, pack)
        dec = stepwise(model, tokens)
        set_mode(model, "faithful")
        whole = model(tokens, model.new_cache(64))
    torch.testing.assert_close(dec, whole, atol=1e-4, rtol=1e-4)


def _mlp(act: str, gated: bool, bias: bool, d: int = 40, n: int = 96, fmt: str = "f32") -> MLP:
    g = torch.Generator().manual_seed(3)
    lin = lambda r, c: Linear(from_float(torch.randn(r, c, generator=g) * 0.3, fmt),  # noqa: E731
                              torch.randn(r, generator=g) * 0.1 if bias else None)
    return MLP(lin(n, d) if gated else None, lin(n, d), lin(d, n), act)


@pytest.mark.parametrize("act,gated,bias,fmt", [("silu", True, False, "f32"), ("silu", True, False, "q4"),
                                                 ("drelu", True, False, "f32"), ("relu", False, True, "f32"),
                                                 ("gelu", False, True, "q8"), ("relu", True, False, "q8"),
                                                 ("silu", True, False, "q6")])
@pytest.mark.parametrize("threshold", [0.0, 0.1])
@pytest.mark.parametrize("with_predictor", [True, False])
def test_decode_matches_reference(act, gated, bias, fmt, threshold, with_predictor):
    """The fast single-token path (fused, staged, or dense-first kernels) against the slow
    per-token reference."""
    mlp = _mlp(act, gated, bias, fmt=fmt)
    n, d = mlp.n_neurons, mlp.down.out_features
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    s = random_predictor(d, n, 0.0)
    pred = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.2) if with_predictor else None
    ffn = SparseFFN(mlp, threshold, order, pred)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(4))
    ref = ffn.reference(x)
    tol = 1e-4 if fmt == "f32" else 0.05 * ref.abs().max().item()  # q8 down_t re-quantization + x rounding
    for crossover, dense_gate_up in itertools.product((0.0, 1.0), (True, False)):
        # dense-first decode: up/down dense, or sparse on the kept rows; without a predictor, gate
        # and up in one dense pass or up on the kept rows only
        ffn.dense_crossover, ffn.dense_gate_up = crossover, dense_gate_up
        with torch.inference_mode():
            out = torch.stack([ffn.decode(r) for r in x])
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    if threshold == 0.0 and fmt == "f32" and act != "drelu":  # every neuron kept == the dense MLP
        full = SparseFFN(mlp, 0.0, order, QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], -1e9))
        torch.testing.assert_close(torch.stack([full.decode(r) for r in x]), mlp(x), atol=1e-4, rtol=1e-4)


def test_threshold_mode_matches_masked_mlp():
    """Dense-with-thresholds (prefill path) == the MLP with |act(gate x)| <= t zeroed by hand."""
    mlp = _mlp("silu", True, False)
    ffn = SparseFFN(mlp, 0.15, torch.randperm(mlp.n_neurons), mode="threshold")
    x = torch.randn(7, 40)
    a = torch.nn.functional.silu(mlp.gate(x))
    h = a * mlp.up(x) * (a.abs() > 0.15)
    torch.testing.assert_close(ffn(x[None])[0], mlp.down(h), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- C decode step
needs_c = pytest.mark.skipif(not cpu.available(), reason="needs the compiled kernels")


def _stats(ffn) -> tuple:
    st = ffn.stats
    return st.tokens, st.rows, st.kept, st.bytes


def _close(fast, ref, fmt):
    """C step vs the one-token reference: f32 weights to rounding; integer formats within the
    activation rounding and the q8 re-quantization of down_t (the reference reads down_t where
    the C step may read the stored down)."""
    tol = 1e-4 if fmt == "f32" else 0.05
    torch.testing.assert_close(fast, ref, atol=tol * ref.abs().max().item(), rtol=0)


@needs_c
@pytest.mark.usefixtures("precise_activations")
@pytest.mark.parametrize("act,gated,bias,fmt", [("silu", True, False, "q4"), ("drelu", True, False, "f32"),
                                                 ("relu", False, True, "f32"), ("gelu", False, True, "q8"),
                                                 ("gelu_pytorch_tanh", True, True, "q8")])
@pytest.mark.parametrize("rows", ["predictor", "first", "first-gate-up", "top-k", "bank"])
@pytest.mark.parametrize("crossover", [0.0, 1.0, None])  # None: by bytes, up and down apart
def test_c_decode_step_equals_one_token_reference(act, gated, bias, fmt, rows, crossover):
    """The C step (`SparseFFN.step`, csrc/decode.c) == `reference_token` (the one-token
    algorithm in torch, `kernels.reference.sparse_ffn_token`) for every way of choosing rows
    (predicted, dense first projection + threshold, the same with gate and up in one dense
    pass, forced top-k by predictor score, forced random rows), on both sides of the dense
    crossover; its counters count every token, and the predictor's time when it has one."""
    mlp = _mlp(act, gated, bias, fmt=fmt)
    n, d = mlp.n_neurons, mlp.down.out_features
    s = random_predictor(d, n, 0.0)
    pred = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.2) if rows in ("predictor", "top-k") else None
    ffn = SparseFFN(mlp, 0.1, torch.randperm(n, generator=torch.Generator().manual_seed(0)), pred,
                    density=0.3 if rows in ("top-k", "bank") else None)
    ffn.dense_crossover, ffn.dense_gate_up = crossover, rows == "first-gate-up"
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert ffn.step(None) is not None
        fast = torch.stack([ffn.decode(r) for r in x])
        st = ffn.stats
        ffn._row_next[0] = 0  # the same random row sets, from the first
        ref = torch.stack([ffn.reference_token(r) for r in x])
    _close(fast, ref, fmt)
    assert st.tokens == 6 and st.rows > 0 and st.bytes > 0
    assert (st.predictor_seconds > 0) == (pred is not None)
    ffn.reset_stats()
    assert ffn.stats.tokens == 0


@needs_c
def test_c_top_k_ties_go_to_the_lowest_rows():
    """Forced density ranks by predictor score; where scores tie (here: a zero W2, so the
    scores are minus the cut, which takes three values) the C step's radix select and the
    reference's ranking both keep the lowest row ids, and agree on the output."""
    mlp = _mlp("silu", True, False, fmt="q8")
    n, d = mlp.n_neurons, mlp.down.out_features
    s = random_predictor(d, n, 0.0)
    b2 = torch.tensor([0.0, 1.0, 2.0]).repeat(n)[torch.randperm(3 * n, generator=torch.Generator().manual_seed(2))[:n]]
    pred = QPredictor(s["w1"], s["b1"], torch.zeros_like(s["w2"]), b2, 0.2)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(5))
    for density in (0.1, 0.3, 0.5, 1.0):
        ffn = SparseFFN(mlp, 0.0, None, pred, density=density)
        k = ffn._k()
        rows = pred.top_rows(x[0], k)
        want = torch.sort(b2, descending=True, stable=True).indices[:k].sort().values.to(torch.int32)
        assert torch.equal(rows, want)
        with torch.inference_mode():
            fast = torch.stack([ffn.decode(r) for r in x])
            ref = torch.stack([ffn.reference_token(r) for r in x])
        _close(fast, ref, "q8")


@needs_c
def test_gate_up_fused_views_and_their_checks():
    """SparseFFN keeps its permuted gate and up as row views of one weight (no second copy); the
    dense gate+up pass is dropped (same result) once a part is replaced, and the plan check
    refuses parts that are not adjacent rows of one buffer."""
    from sparseinfer.kernels import decode_plan

    mlp = _mlp("silu", True, False, fmt="q4")
    n, d = mlp.n_neurons, mlp.down.out_features
    ffn = SparseFFN(mlp, 0.1, torch.randperm(n, generator=torch.Generator().manual_seed(0)))
    ffn.dense_gate_up = True
    gu = ffn._gate_up
    assert gu.rows == 2 * n and ffn.gate.qs.data_ptr() == gu.qs.data_ptr()
    assert ffn.up.qs.data_ptr() == gu.qs.data_ptr() + n * gu.qs.stride(0) * gu.qs.element_size()
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = ffn.reference(x)
        assert ffn._dense_gate_up
        fused = torch.stack([ffn.decode(r) for r in x])
        ffn.up = from_float(ffn.up.dequantize(), "q4")  # replaced: no longer the fused weight's view
        assert not ffn._dense_gate_up
        apart = torch.stack([ffn.decode(r) for r in x])
    torch.testing.assert_close(fused, apart, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="not one fused weight"):  # claim a fused gate+up that is not there
        decode_plan.sparse_ffn_step(act="silu", relu_up=False, first=ffn.gate, second=ffn.up, down_t=ffn.down_t,
                                    down=ffn.down.weight, order=ffn.order, threshold=0.1, crossover=1.0,
                                    up_crossover=1.0, gate_up_fused=True)


@pytest.mark.parametrize("fmt,bias", [("f32", False), ("q4", False), ("q8", True)])
def test_prefill_hidden_through_the_fused_gate_up(fmt, bias):
    """T > 1 runs one product over the fused gate+up weight; the same activations as gate and
    up apart (parts replaced by copies: the un-fused path)."""
    mlp = _mlp("silu", True, bias, fmt=fmt)
    ffn = SparseFFN(mlp, 0.1, torch.randperm(mlp.n_neurons, generator=torch.Generator().manual_seed(0)),
                    mode="threshold")
    x = torch.randn(2, 9, mlp.down.out_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert ffn._gate_up_intact
        a, h = ffn.hidden(x.view(-1, x.shape[-1]))
        fused = ffn(x)
        ffn.gate = QWeight(ffn.gate.fmt, ffn.gate.rows, ffn.gate.cols, *(None if t is None else t.clone()
                           for t in (ffn.gate.qs, ffn.gate.d, ffn.gate.m)))
        assert not ffn._gate_up_intact
        a2, h2 = ffn.hidden(x.view(-1, x.shape[-1]))
        apart = ffn(x)
    torch.testing.assert_close(a, a2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, apart, atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("act,gated,bias,fmt", [("silu", True, False, "q4"), ("drelu", True, True, "f32"),
                                                 ("relu", False, True, "f32"), ("gelu", False, True, "q8"),
                                                 ("gelu_pytorch_tanh", True, False, "q8")])
@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_prefill_one_pass_hidden_equals_torch_composition(act, gated, bias, fmt, threshold, monkeypatch):
    """SparseFFN's T > 1 path with the threshold mask computed by `cpu.hidden_rows` == the same
    path through torch's element-wise operations (and == the slow reference)."""
    mlp = _mlp(act, gated, bias, fmt=fmt)
    n, d = mlp.n_neurons, mlp.down.out_features
    ffn = SparseFFN(mlp, threshold, torch.randperm(n, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert ffn._one_pass_hidden(x, False)
        fast = ffn(x[None])[0]
        monkeypatch.setattr(SparseFFN, "_one_pass_hidden", lambda *a: False)
        slow = ffn(x[None])[0]
        ref = ffn.reference(x)
    torch.testing.assert_close(fast, slow, atol=1e-4 * slow.abs().max().item(), rtol=1e-4)
    tol = 1e-4 if fmt == "f32" else 0.05  # the reference: dequantized weights, unrounded x
    torch.testing.assert_close(fast, ref, atol=tol * ref.abs().max().item(), rtol=0)


def test_expected_density_picks_the_dense_gate_up_pass():
    mlp = _mlp("silu", True, False)
    assert SparseFFN(mlp, 0.1, expected_density=0.95).dense_gate_up
    assert not SparseFFN(mlp, 0.1, expected_density=0.7).dense_gate_up
    assert not SparseFFN(mlp, 0.1).dense_gate_up


@needs_c
@pytest.mark.parametrize("act,gated,bias,fmt", [("silu", True, False, "q4"), ("gelu", False, True, "q8"),
                                                 ("drelu", True, True, "q8")])
@pytest.mark.parametrize("rows", ["predictor", "top-k", "bank"])
def test_neuron_records(act, gated, bias, fmt, rows):
    """Low-density layers keep each neuron's first, up and down_t rows (scales included) in one
    contiguous record; the C step's one pass over the records == the staged C step without
    records (up and down on the kept rows, same counters), is close to the one-token reference, and is
    bit-identical across thread counts.  A records flag on weights that are not records is
    refused."""
    from sparseinfer.kernels import decode_plan

    mlp = _mlp(act, gated, bias, fmt=fmt, n=300)
    n, d = mlp.n_neurons, mlp.down.out_features
    s = random_predictor(d, n, 0.0)
    pred = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.2) if rows != "bank" else None
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    density = 0.2 if rows != "predictor" else None
    mk = lambda: SparseFFN(mlp, 0.1, order, pred, density=density, expected_density=0.3)  # noqa: E731
    ffn, plain = mk(), mk()
    plain.records, plain.dense_crossover = False, 1.0  # up and down on the kept rows, as records
    assert ffn._records_wanted and not plain._records_wanted
    ffn.make_records()
    assert ffn._records_intact and ffn._gate_up is None
    rec = ffn._records
    stride = rec.stride(0)
    assert stride % 64 == 0
    parts = [ffn.first, ffn.up, ffn.down_t] if gated else [ffn.up, ffn.down_t]
    for w in parts:  # every row's values and scales lie in its record
        for t in (w.qs, w.d, w.m):
            if t is not None:
                assert t.stride(0) * t.element_size() == stride
                off = t.data_ptr() - rec.data_ptr()
                assert 0 <= off and off + t.shape[1] * t.element_size() <= stride
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert ffn.step(None).plan.flags & 4 and not plain.step(None).plan.flags & 4
        fast = torch.stack([ffn.decode(r) for r in x])
        fast_stats = _stats(ffn)
        ffn._row_next[0] = 0
        slow = torch.stack([ffn.reference_token(r) for r in x])
        staged = torch.stack([plain.decode(r) for r in x])
        staged_stats = _stats(plain)
        nt = cpu.get_num_threads()
        try:
            cpu.set_num_threads(1)
            ffn._row_next[0] = 0
            one = torch.stack([ffn.decode(r) for r in x])
        finally:
            cpu.set_num_threads(nt)
    assert torch.equal(one, fast)
    assert fast_stats[0] == staged_stats[0] == 6 and fast_stats[2] == staged_stats[2]
    torch.testing.assert_close(fast, staged, atol=1e-5 * staged.abs().max().item(), rtol=1e-5)
    _close(fast, slow, fmt)
    if rows == "predictor":
        ref = ffn.reference(x)
        torch.testing.assert_close(fast, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="not neuron records"):  # records claimed for separate weights
        decode_plan.sparse_ffn_step(act=plain.kernel_act, relu_up=act == "drelu", first=plain.first,
                                    second=plain.up if gated else None, down_t=plain.down_t, down=plain.down.weight,
                                    order=plain.order, threshold=0.1, crossover=1.0, up_crossover=1.0, records=True)


def test_records_follow_the_expected_density():
    mlp = _mlp("silu", True, False, fmt="q4")
    s = random_predictor(40, 96, 0.0)
    pred = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.2)
    assert SparseFFN(mlp, 0.1, None, pred, expected_density=0.3)._records_wanted
    assert not SparseFFN(mlp, 0.1, None, pred, expected_density=0.7)._records_wanted
    assert not SparseFFN(mlp, 0.1, None, None, expected_density=0.3)._records_wanted  # reads all rows anyway
    assert not SparseFFN(_mlp("silu", True, False), 0.1, None, pred, expected_density=0.3)._records_wanted  # f32


@needs_c
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("density", [None, 0.25])
def test_blocks_decode_sparse_ffns_in_c(kind, density, tmp_path, tokens, monkeypatch):
    """A sparsified Llama-family model decodes one token in two C calls per layer (attention,
    sparse FFN) with the logits of the Python-driven path."""
    model, src = tiny(kind, tmp_path)
    with torch.inference_mode():
        sparsify(model, random_pack(model, src, thresholds=0.05, tau=0.3, policy="first"), density=density)
    real, calls = cpu._cpu, []

    class Wrapped:
        def __getattr__(self, name):
            f = getattr(real, name)
            return (lambda *a: (calls.append(name), f(*a))[1]) if name.startswith("decode_") else f

    with monkeypatch.context() as m, torch.inference_mode():
        m.setattr(cpu, "_cpu", Wrapped())
        fast = stepwise(model, tokens, 3)
    decoded = (tokens.shape[1] - 3) * len(model.layers)
    assert calls.count("decode_attn") == decoded and calls.count("decode_ffn") == decoded
    with monkeypatch.context() as m, torch.inference_mode():
        m.setattr(SparseFFN, "step", lambda *a: None)  # the FFN as a module: its one-token reference
        for ffn in sparse_ffns(model):
            ffn._row_next[0] = 0
        slow = stepwise(model, tokens, 3)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)


@needs_c
def test_c_decode_step_rejects_bad_arguments():
    from sparseinfer.kernels import decode_plan

    mlp = _mlp("silu", True, False)
    ffn = SparseFFN(mlp, 0.1, None, None)
    with torch.inference_mode():
        step = ffn.step(None)
    x, y = torch.randn(40), torch.empty(40)
    with pytest.raises(ValueError, match="out of range"):
        step.run(x, y, torch.tensor([0, 96], dtype=torch.int32))
    with pytest.raises(ValueError, match="wrong shape"):
        decode_plan.sparse_ffn_step(act="silu", relu_up=False, first=ffn.gate, second=ffn.up, down_t=ffn.down_t,
                                    down=mlp.gate.weight, order=ffn.order, threshold=0.1, crossover=1.0,
                                    up_crossover=1.0)
    with pytest.raises(ValueError, match="neuron order"):
        decode_plan.sparse_ffn_step(act="silu", relu_up=False, first=ffn.gate, second=ffn.up, down_t=ffn.down_t,
                                    down=ffn.down.weight, order=ffn.order + 1, threshold=0.1, crossover=1.0,
                                    up_crossover=1.0)


# ---------------------------------------------------------------------------- forced density
@pytest.mark.parametrize("with_pack", [True, False])
def test_forced_density(tmp_path, tokens, with_pack):
    model, src = tiny("llama", tmp_path)
    with torch.inference_mode():
        sparsify(model, random_pack(model, src) if with_pack else None, density=0.25)
        cache = model.new_cache(64)
        model(tokens[:, :4], cache)
        reset_stats(model)
        for t in range(4, 8):
            model(tokens[:, t: t + 1], cache)
    f = bench_fields(model, 1.0)
    assert f["mode"] == "density" and f["density"] == pytest.approx(40 / 160)
    assert f["ffn_rows_touched_fraction"] == pytest.approx(40 / 160)
    assert f["predictor_time_fraction"] > 0 if with_pack else f["predictor_time_fraction"] == 0


def test_top_rows_are_highest_scores():
    s = random_predictor(40, 96, 0.0)
    q = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.0)
    x = torch.randn(40)
    rows = q.top_rows(x, 10).long()
    sc = q.scores(x)
    assert sc[rows].min() >= sc.topk(10).values.min()


# ---------------------------------------------------------------------------- predictors
def test_bits_roundtrip():
    m = torch.rand(13, 37) > 0.6
    assert torch.equal(unpack_bits(pack_bits(m), 37), m)


def test_tune_tau_reaches_recall():
    g = torch.Generator().manual_seed(0)
    target = torch.rand(200, 50, generator=g) > 0.7
    logits = target.float() + torch.randn(200, 50, generator=g)
    tau = tune_tau(logits, target, 0.95)
    m = metrics(logits > tau, target)
    assert 0.95 <= m["recall"] < 0.955


def test_q8_predictor_matches_reference():
    s = random_predictor(64, 200, 0.0, r=32)
    q = QPredictor(s["w1"], s["b1"], s["w2"], s["b2"], 0.0)
    x = torch.randn(6, 64)
    fast, ref = q.scores_batch(x), q.reference_scores(x)
    assert (fast - ref).abs().max() < 0.02 * ref.abs().max()
    torch.testing.assert_close(torch.stack([q.scores(r) for r in x]), fast, atol=1e-5, rtol=1e-5)
    rows = q.active_rows(x[0]).long()
    assert torch.equal(torch.zeros(200, dtype=torch.bool).index_fill_(0, rows, True), q.mask_batch(x[:1])[0])


# ---------------------------------------------------------------------------- packs
def test_pack_roundtrip(tmp_path):
    model, src = tiny("llama", tmp_path)
    pack = random_pack(model, src, thresholds=0.1, tau=0.2)
    path = pack.save(tmp_path / "p.sparse")
    back = resolve_pack(src.path, path, src)
    assert back.fingerprint == pack.fingerprint and len(back.layers) == len(pack.layers)
    for a, b in zip(pack.layers, back.layers):
        assert torch.equal(a.order, b.order) and a.threshold == b.threshold and a.tau == b.tau
        torch.testing.assert_close(a.predictor_state["w2"], b.predictor_state["w2"], atol=2e-3, rtol=2e-3)


def test_pack_of_another_model_is_refused(tmp_path):
    model, src = tiny("llama", tmp_path)
    other, other_src = tiny("llama", tmp_path, seed=1)  # same shapes, other weights
    path = random_pack(model, src).save(tmp_path / "llama.sparse")
    with pytest.raises(SparsityPackError, match="another model"):
        resolve_pack(other_src.path, path, other_src)


def test_not_a_pack_is_refused(tmp_path):
    bad = tmp_path / "bad.sparse"
    bad.write_bytes(b"garbage" * 20)
    with pytest.raises(SparsityPackError, match="cannot read"):
        resolve_pack(tmp_path, bad)
    with pytest.raises(SparsityPackError, match="not found"):
        resolve_pack(tmp_path, tmp_path / "missing.sparse")


def _tiny_pack(tmp_path, n_seqs, opts):
    """`build_pack` on a tiny gated model over n_seqs random calibration sequences of 32 tokens;
    checks that the model's logits are the same before and after.  (pack, model)"""
    from sparseinfer.sparse.prepare import build_pack

    model, src = tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(0)
    cs = cal.CalibrationSet(torch.randint(3, 250, (n_seqs, 32), generator=g), torch.randint(3, 250, (2, 32), generator=g),
                            {"tokens": 32 * n_seqs})
    x = torch.randint(3, 250, (1, 8), generator=g)
    with torch.inference_mode():
        before = model(x, model.new_cache(16))
        pack = build_pack(model, src, cs, opts)
        after = model(x, model.new_cache(16))
    torch.testing.assert_close(after, before)
    return pack, model


@pytest.mark.parametrize("steps", [20, 10, 1])  # few steps: the learning-rate schedule still works
def test_build_pack_tiny(tmp_path, steps):
    """The whole pipeline on a tiny gated model: thresholds hit the target sparsity, the hot
    set comes first, the reported recall is measured, and the model is left dense."""
    from sparseinfer.sparse.prepare import PrepareOptions

    pack, model = _tiny_pack(tmp_path, 20, PrepareOptions(sizes=(16,), steps=steps, target_sparsity=0.6, progress=False))
    assert not sparse_ffns(model)
    for lp in pack.layers:
        assert lp.stats["density_true"] == pytest.approx(0.4, abs=0.08)
        assert torch.all(lp.freq[lp.order][:-1] >= lp.freq[lp.order][1:])
        assert 0.9 <= lp.stats["recall"] <= 1.0
    assert set(pack.info["eval"]) >= {"ppl_dense", "ppl_threshold", "ppl_sparse"}
    restore(model, replace_ffns(model, lambda i, m: m))  # a no-op swap keeps the model intact


def test_sparsity_search_measures_decode_speed_at_each_point(tmp_path):
    """With a perplexity budget, every sparsity the search tries records its decode speed with
    the thresholds alone against dense (measured, both positive), and the model is left dense;
    the perplexity-vs-speed plot draws that history."""
    from sparseinfer.sparse.plots import plot_ppl_vs_speed
    from sparseinfer.sparse.prepare import PrepareOptions

    pack, _ = _tiny_pack(tmp_path, 12, PrepareOptions(sizes=(16,), steps=5, max_ppl_increase=0.05, progress=False))
    search = pack.info["search"]
    assert search[0]["sparsity"] == 0.0 and len(search) >= 2
    # the budget is judged against the dense FFNs, as the pack's evaluation reports it, so the
    # chosen thresholds stay within it by that evaluation too
    ev = pack.info["eval"]
    assert pack.info["search_dense_ppl"] == pytest.approx(ev["ppl_dense"], rel=1e-9)
    assert ev["ppl_threshold"] <= ev["ppl_dense"] * 1.05 * (1 + 1e-9)
    for p in search[1:]:
        assert p["speedup"] > 0 and p["dense_tok_s"] > 0 and p["sparse_tok_s"] > 0
    pytest.importorskip("matplotlib")
    speed = {"speedup": 1.1, "dense_tok_s": 10.0, "sparse_tok_s": 11.0}
    out = plot_ppl_vs_speed(search, 0.05, pack.info["eval"], speed, tmp_path / "speed.png")
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("fmt", ["q4", "q8", "q6", "f16"])
def test_transpose_neuron_major_equals_whole_matrix_requantization(fmt):
    """The load-time neuron-major copy of `down` (compiled dequantization, sliced
    re-quantization) equals the obvious whole-matrix version bit for bit, with more neurons
    than one slice."""
    from sparseinfer.sparse.ffn import transpose_neuron_major

    g = torch.Generator().manual_seed(3)
    down = from_float(torch.randn(96, 2500, generator=g) * 0.05, fmt)
    order = torch.randperm(2500, generator=g)
    fast = transpose_neuron_major(down, order)
    slow = from_float(down.dequantize().T.index_select(0, order).contiguous(), fmt if fmt == "f16" else "q8")
    assert fast.fmt == slow.fmt and fast.shape == slow.shape
    assert torch.equal(fast.qs, slow.qs)
    assert (fast.d is None) == (slow.d is None)
    if slow.d is not None:
        assert torch.equal(fast.d.view(torch.int16), slow.d.view(torch.int16))


# ---------------------------------------------------------------------- speed check
def test_speed_measure_records_both_modes_and_leaves_the_model_dense(tmp_path):
    from sparseinfer.sparse import speed

    model, src = tiny("llama", tmp_path)
    pack = random_pack(model, src, thresholds=0.1, tau=0.2)
    x = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(x, model.new_cache(16))
        rec = speed.measure(model, pack, torch.arange(3, 19), tokens=4, rounds=2)
        after = model(x, model.new_cache(16))
    torch.testing.assert_close(after, before)
    assert not sparse_ffns(model)
    assert rec["dense_tok_s"] > 0 and rec["sparse_tok_s"] > 0
    # the median of the pairs' ratios, not the ratio of the medians: close to it, not equal
    assert rec["speedup"] > 0 and (rec["tokens"], rec["rounds"]) == (4, 2)
    assert rec["cpu"] == speed.cpu_name() and rec["simd"] == cpu.simd_level() and rec["threads"] >= 1


@pytest.mark.parametrize("recorded,used", [
    ({"speedup": 0.8}, False),                      # measured slower on this CPU: dense
    ({"speedup": 1.3}, True),                       # measured faster: used
    ({"speedup": 0.8, "cpu": "another CPU"}, True),  # measured elsewhere: no verdict here
    ({"speedup": 0.8, "simd": "another level"}, True),
    ({"speedup": "0.8"}, True),                     # a malformed record counts as none
    ({"speedup": float("nan")}, True),
    (None, True),                                   # no measurement (`--no-speed-check`)
])
def test_a_pack_measured_slower_here_is_not_used_unless_named(tmp_path, recorded, used):
    from sparseinfer.sparse import speed
    from sparseinfer.sparse.apply import apply_sparsity, default_pack_path

    model, src = tiny("llama", tmp_path)
    pack = random_pack(model, src, thresholds=0.1, tau=0.2)
    if recorded is not None:
        pack.info["speed"] = {**speed.machine(), "dense_tok_s": 100.0, "sparse_tok_s": 80.0, "threads": 2, **recorded}
    path = pack.save(default_pack_path(src.path))
    notes = []
    got = apply_sparsity(model, src.path, src, "auto", notes=notes)
    assert (got is not None) == used and bool(sparse_ffns(model)) == used
    if not used:
        assert len(notes) == 1 and "slower than the dense model" in notes[0] and str(path) in notes[0]
        assert "\n" not in notes[0]
        # named explicitly, it is used anyway
        assert apply_sparsity(model, src.path, src, str(path)) is not None and sparse_ffns(model)
    else:
        assert notes == []


@pytest.mark.parametrize("pack_speedup,head_speedup,ffns,head", [
    (1.3, 1.2, True, True),     # the whole pack is fastest
    (1.1, 1.2, False, True),    # the head preview alone is faster than the whole pack
    (0.9, 1.2, False, True),    # FFN sparsity slower than dense, the head preview pays
    (0.9, 0.95, False, False),  # nothing pays: dense
    (0.9, None, False, False),  # no head measurement: as before, the pack's verdict
])
def test_a_pack_is_used_in_the_parts_measured_faster_here(tmp_path, pack_speedup, head_speedup, ffns, head):
    from sparseinfer.sparse import head as sh
    from sparseinfer.sparse import speed
    from sparseinfer.sparse.apply import apply_sparsity, default_pack_path

    model, src = tiny("llama", tmp_path)
    exact = model.head
    pack = random_pack(model, src, thresholds=0.1, tau=0.2)
    hid = torch.randn(200, src.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pack.head = sh.preview(sh.fit(exact.weight, hid), 32, 64)
    rec = {**speed.machine(), "dense_tok_s": 100.0, "threads": 2}
    pack.info["speed"] = {**rec, "sparse_tok_s": 100.0 * pack_speedup, "speedup": pack_speedup}
    if head_speedup is not None:
        pack.head.stats["speed"] = {**rec, "sparse_tok_s": 100.0 * head_speedup, "speedup": head_speedup}
    path = pack.save(default_pack_path(src.path))
    notes = []
    got = apply_sparsity(model, src.path, src, "auto", notes=notes)
    assert (got is not None) == (ffns or head)
    assert bool(sparse_ffns(model)) == ffns and isinstance(model.head, sh.PreviewHead) == head
    assert (notes == []) == ffns and all("\n" not in n and str(path) in n for n in notes)
