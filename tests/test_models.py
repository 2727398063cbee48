"""Every family against transformers: safetensors and GGUF (float and quantized), full forward,
token-by-token decode with the KV cache, and batch 2."""
from __future__ import annotations

import pytest
import torch

from sparseinfer.io.weights import GGUFSource, SafetensorsSource
from sparseinfer.models.registry import build_model

from tiny import dequantized_reference, export_gguf, hf_model, save_folder

pytestmark = pytest.mark.usefixtures("precise_activations")

KINDS = ["llama", "llama-relu", "mistral", "qwen2", "falcon", "falcon-40b", "opt"]


# transformers keeps K/V in float32: these comparisons use the exact f32 cache
def ours_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, model.new_cache(64, "f32"))


def ours_stepwise(model, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill the first 5 tokens, then decode the rest one at a time through the cache."""
    cache = model.new_cache(64, "f32")
    with torch.inference_mode():
        outs = [model(tokens[:, :5], cache)]
        for t in range(5, tokens.shape[1]):
            outs.append(model(tokens[:, t : t + 1], cache))
    return torch.cat(outs, dim=1)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits.float()


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 250, (2, 12), generator=g)


@pytest.mark.parametrize("kind", KINDS)
def test_safetensors_matches_transformers(kind, tmp_path, tokens):
    hf = hf_model(kind)
    model = build_model(SafetensorsSource(save_folder(hf, tmp_path / kind)))
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours_logits(model, tokens), ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ours_stepwise(model, tokens), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_gguf_float_matches_transformers(kind, qtype, tmp_path, tokens):
    hf = hf_model(kind)
    path = export_gguf(hf, tmp_path / f"{kind}.gguf", qtype)
    model = build_model(GGUFSource(path))
    ref = hf_logits(hf, tokens) if qtype == "F32" else hf_logits(dequantized_reference(hf, path), tokens)
    tol = 2e-4 if qtype == "F32" else 2e-3
    torch.testing.assert_close(ours_logits(model, tokens), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(ours_stepwise(model, tokens), ref, atol=tol, rtol=tol)


def _assert_close_quant(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Integer kernels quantize activations to 8 bits per block of 32: allow ~1% of the logit scale,
    and require the same argmax nearly everywhere."""
    scale = ref.std().item()
    err = (ours - ref).abs().max().item()
    assert err < 0.03 * scale + 1e-3, f"max |diff| {err:.4g} vs logit std {scale:.4g}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"argmax agreement {agree:.2f}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "falcon-40b", "opt"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quantized_matches_dequantized_reference(kind, qtype, tmp_path, tokens):
    hf = hf_model(kind)
    path = export_gguf(hf, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    model = build_model(GGUFSource(path))
    ref = hf_logits(dequantized_reference(hf, path), tokens)
    _assert_close_quant(ours_logits(model, tokens), ref)
    _assert_close_quant(ours_stepwise(model, tokens), ref)


def test_batch_rows_are_independent(tmp_path, tokens):
    """Row 0 of a batch-2 forward equals the batch-1 forward of the same tokens."""
    hf = hf_model("llama")
    model = build_model(SafetensorsSource(save_folder(hf, tmp_path / "m")))
    both = ours_logits(model, tokens)
    one = ours_logits(model, tokens[:1])
    torch.testing.assert_close(both[:1], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_fused_projections_equal_separate_ones(kind, qtype, tmp_path, tokens):
    """The CPU path's fused q/k/v and gate/up products give the same logits as the separate
    products (the hybrid/device path), and the parts are views of the fused weight."""
    from sparseinfer.models.layers import MLP, Attention

    hf = hf_model(kind)
    model = build_model(GGUFSource(export_gguf(hf, tmp_path / f"{kind}.gguf", qtype)))
    mods = [m for m in model.modules() if isinstance(m, (Attention, MLP))]
    assert all(m._parts is not None for m in mods)
    attn = mods[0]
    assert attn.q.weight.qs.untyped_storage().data_ptr() == attn.k.weight.qs.untyped_storage().data_ptr()
    fused = ours_logits(model, tokens), ours_stepwise(model, tokens)
    for m in mods:
        m._parts = None
    separate = ours_logits(model, tokens), ours_stepwise(model, tokens)
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(12, 2), (9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_attention_equals_repeated_kv(heads, batch):
    """Single-token attention (grouped query rows per KV head) == repeat_kv + plain attention."""
    from sparseinfer.models.layers import attend

    H, Hk = heads
    g = torch.Generator().manual_seed(H * 10 + Hk)
    q = torch.randn(batch, H, 1, 16, generator=g)
    k, v = torch.randn(2, batch, Hk, 37, 16, generator=g)
    kr, vr = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
    want = torch.softmax((q @ kr.transpose(-1, -2)) / 4.0, dim=-1) @ vr
    torch.testing.assert_close(attend(q, k, v, 36), want, rtol=1e-5, atol=1e-5)
    qt = torch.randn(batch, 1, H, 16, generator=g).transpose(1, 2)  # non-contiguous, as the fused path makes
    kr_out = torch.softmax((qt @ kr.transpose(-1, -2)) / 4.0, dim=-1) @ vr
    torch.testing.assert_close(attend(qt, k, v, 36), kr_out, rtol=1e-5, atol=1e-5)
