"""The single-token decode steps (csrc/decode.c on the plans of `kernels.decode_plan`,
`Attention.step`, `MLP.step`): the same logits and KV cache as the Python layers, and as
transformers, for batch-1 decode."""
from __future__ import annotations

import pytest
import torch

from sparseinfer.io.weights import GGUFSource, SafetensorsSource
from sparseinfer.kernels import cpu, decode_plan
from sparseinfer.models.layers import MLP, Attention, Linear, RMSNorm
from sparseinfer.models.registry import build_model
from sparseinfer.quant import from_float

from tiny import export_gguf, hf_model, save_folder

pytestmark = [pytest.mark.usefixtures("precise_activations"),
              pytest.mark.skipif(not cpu.available(), reason="needs the compiled kernels")]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 250, (1, 14), generator=torch.Generator().manual_seed(3))


def stepwise(model, tokens, cache=None):
    """Prefill 4 tokens, then decode one at a time (batch 1: the fused steps' case)."""
    cache = cache or model.new_cache(64)
    with torch.inference_mode():
        outs = [model(tokens[:, :4], cache)]
        for t in range(4, tokens.shape[1]):
            outs.append(model(tokens[:, t: t + 1], cache))
    return torch.cat(outs, dim=1), cache


class Count:
    """Counts the C decode steps that ran (or, `off`, turns them off: the layers run in Python)."""

    def __init__(self, monkeypatch, off: bool = False):
        self.n = {"attn": 0, "mlp": 0}
        if off:
            for cls in (Attention, MLP):
                monkeypatch.setattr(cls, "step", lambda *a: None)
            return
        real = cpu._cpu
        count = self.n

        class Wrapped:
            def __getattr__(self, name):
                f = getattr(real, name)
                key = {"decode_attn": "attn", "decode_ffn": "mlp"}.get(name)
                if key is None:
                    return f

                def g(*a):
                    count[key] += 1
                    return f(*a)
                return g
        monkeypatch.setattr(cpu, "_cpu", Wrapped())


def python_path(model, tokens, monkeypatch):
    with monkeypatch.context() as m:
        Count(m, off=True)
        return stepwise(model, tokens)


@pytest.mark.parametrize("kind", ["llama", "llama-relu", "mistral", "qwen2"])
def test_decode_steps_match_transformers(kind, tmp_path, tokens, monkeypatch):
    hf = hf_model(kind)
    model = build_model(SafetensorsSource(save_folder(hf, tmp_path / kind)))
    count = Count(monkeypatch)
    ours, _ = stepwise(model, tokens, model.new_cache(64, "f32"))  # transformers' K/V are float32
    layers = len(model.layers)
    assert count.n == {"attn": layers * 10, "mlp": layers * 10}
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_decode_steps_equal_python_layers(kind, qtype, tmp_path, tokens, monkeypatch):
    """Logits and the KV cache rows the C step writes equal the Python layers' to f32 rounding
    (integer formats: an f32-level difference in x can move one activation code by one step of
    the second int8 term, ~3e-5 of the block's largest value, hence the looser tolerance)."""
    hf = hf_model(kind)
    path = export_gguf(hf, tmp_path / f"{kind}.gguf", qtype)
    model = build_model(GGUFSource(path))
    fast, cache_f = stepwise(model, tokens)
    slow, cache_s = python_path(model, tokens, monkeypatch)
    tol = 2e-5 if qtype == "F32" else 1e-3
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)
    for a, b in zip(cache_f.layers, cache_s.layers):
        assert a.length == b.length == tokens.shape[1]
        torch.testing.assert_close(a.k[:, :, : a.length], b.k[:, :, : b.length], atol=tol, rtol=tol)
        torch.testing.assert_close(a.v[:, :, : a.length], b.v[:, :, : b.length], atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", ["q8", "q6"])
def test_unfused_projections_of_mixed_formats(tmp_path, tokens, monkeypatch, fmt):
    """q/k/v and gate/up in different formats (as Q4_K_M files mix Q4_K and Q6_K, which we
    hold as q4 and q6) cannot be fused; the C steps take them separately, with biases (qwen2)."""
    hf = hf_model("qwen2")
    model = build_model(GGUFSource(export_gguf(hf, tmp_path / "m.gguf", "Q4_1")))
    for layer in model.layers:
        layer.attn.v.weight = from_float(layer.attn.v.weight.dequantize(), fmt)
        layer.mlp.up.weight = from_float(layer.mlp.up.weight.dequantize(), fmt)
        layer.mlp.down.weight = from_float(layer.mlp.down.weight.dequantize(), fmt)
    count = Count(monkeypatch)
    fast, _ = stepwise(model, tokens)
    assert count.n["attn"] == count.n["mlp"] == 2 * 10
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("act", ["silu", "relu", "drelu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_mlp_step_activations(act, fmt):
    g = torch.Generator().manual_seed(7)
    n, F = 96, 200
    lin = lambda r, c: Linear(from_float(torch.randn(r, c, generator=g) * 0.1, fmt))  # noqa: E731
    mlp = MLP(lin(F, n), lin(F, n), lin(n, F), act)
    norm = RMSNorm(1 + 0.2 * torch.randn(n, generator=g), 1e-5)
    x = torch.randn(1, 1, n, generator=g)
    want = x + mlp(norm(x))
    got = x.clone().view(-1)
    mlp.step(norm).run(got, got)
    torch.testing.assert_close(got.view(1, 1, n), want, atol=1e-5, rtol=1e-5)


def test_steps_cover_plain_ffns_and_decline_other_norms():
    g = torch.Generator().manual_seed(0)
    n = 64
    w = lambda r, c: Linear(from_float(torch.randn(r, c, generator=g) * 0.1, "f32"), 0.1 * torch.randn(r, generator=g))  # noqa: E731
    plain = MLP(None, w(128, n), w(n, 128), "relu")  # OPT/Falcon MLPs, with biases
    norm = RMSNorm(torch.ones(n), 1e-5)
    x = torch.randn(1, 1, n, generator=g)
    got = x.clone().view(-1)
    plain.step(norm).run(got, got)
    torch.testing.assert_close(got.view(1, 1, n), x + plain(norm(x)), atol=1e-5, rtol=1e-5)
    assert plain.step(torch.nn.LayerNorm(n)) is None  # another norm: the block runs its modules


def test_plans_reject_inconsistent_shapes():
    g = torch.Generator().manual_seed(0)
    n, H, Hk, D = 32, 4, 2, 8
    qkv = from_float(torch.randn((H + 2 * Hk) * D, n, generator=g), "f32")
    o = from_float(torch.randn(n, H * D, generator=g), "f32")
    args = dict(norm_w=torch.ones(n), eps=1e-5, q=qkv, k=None, v=None, o=o, bq=None, bk=None, bv=None, bo=None,
                n_heads=H, n_kv_heads=Hk, d_head=D, n_rot=0)
    step = decode_plan.AttnStep(**args)
    kc = torch.zeros(1, Hk, 16, D)
    x = torch.randn(n)
    y = torch.empty(n)
    step.run(x, y, None, None, kc, torch.zeros_like(kc), 0)
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="wrong shape"):
        decode_plan.AttnStep(**{**args, "n_kv_heads": 1})
    with pytest.raises(ValueError, match="norm weight has 31 values"):
        decode_plan.AttnStep(**{**args, "norm_w": torch.ones(n - 1)})
    with pytest.raises(ValueError, match="bias"):
        decode_plan.AttnStep(**{**args, "bo": torch.ones(n + 1)})
    with pytest.raises(ValueError, match="outside the cache"):
        step.run(x, y, None, None, kc, torch.zeros_like(kc), 16)
    up = from_float(torch.randn(64, n, generator=g), "f32")
    down = from_float(torch.randn(n, 64, generator=g), "f32")
    with pytest.raises(ValueError, match="wrong shape"):
        decode_plan.dense_ffn_step(act="silu", relu_up=False, gate=up, up=up, down=from_float(torch.randn(n, 63), "f32"))
    with pytest.raises(ValueError, match="has no C kernel"):
        decode_plan.dense_ffn_step(act="tanh", relu_up=False, gate=up, up=up, down=down)


def test_decode_across_cache_growth(tmp_path, monkeypatch):
    """The KV buffers grow in steps of 256 rows; the C step writes into the grown buffers
    (decode from 250 to 262 cached tokens) exactly as the Python layers do."""
    hf = hf_model("qwen2")
    model = build_model(GGUFSource(export_gguf(hf, tmp_path / "m.gguf", "F32")))
    toks = torch.randint(3, 250, (1, 262), generator=torch.Generator().manual_seed(5))

    def run():
        cache = model.new_cache(300)
        with torch.inference_mode():
            outs = [model(toks[:, :250], cache)[:, -1:]]
            outs += [model(toks[:, t: t + 1], cache) for t in range(250, 262)]
        return torch.cat(outs, dim=1), cache

    count = Count(monkeypatch)
    fast, cache = run()
    assert count.n["attn"] == 2 * 12 and cache.layers[0].k.shape[2] == 300
    slow, _ = python_path_run(run, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=2e-5)


def python_path_run(run, monkeypatch):
    with monkeypatch.context() as m:
        Count(m, off=True)
        return run()


def test_steps_follow_replaced_weights_and_copies(tmp_path, tokens, monkeypatch):
    """The C steps' plans are rebuilt when a weight is replaced after decoding started, and a
    deep copy of the model decodes from its own tensors."""
    import copy

    hf = hf_model("qwen2")
    model = build_model(GGUFSource(export_gguf(hf, tmp_path / "m.gguf", "Q4_1")))
    stepwise(model, tokens)  # prepares the arguments
    for layer in model.layers:
        layer.attn.v.weight = from_float(layer.attn.v.weight.dequantize(), "q8")
        layer.mlp.up.weight = from_float(layer.mlp.up.weight.dequantize(), "q8")
    fast, _ = stepwise(model, tokens)
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)
    twin = copy.deepcopy(model)
    for layer in model.layers:  # stale pointers into the original would now read zeros
        layer.attn_norm.weight.zero_()
        layer.ffn_norm.weight.zero_()
    torch.testing.assert_close(stepwise(twin, tokens)[0], fast, atol=0, rtol=0)
