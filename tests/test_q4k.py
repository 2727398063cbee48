"""The q4k weight format (GGUF Q4_K super-blocks kept as the file stores them): its decoding
against the gguf package, its kernels at every SIMD level and activation mode against the
reference and its emulation (activations quantized per 256 values), prompt rows against
one-token results, thread-count independence, the loader's choice, and the decode steps of a
model whose projections are q4k."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sparseinfer.io import gguf as gio
from sparseinfer.kernels import cpu
from sparseinfer.kernels import reference as ref
from sparseinfer.quant import QWeight, from_float

from test_kernels import level, rand  # noqa: F401 (level: every SIMD level in every activation mode)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="compiled kernels not built")

SHAPES = [(1, 256), (5, 512), (37, 768), (70, 1536), (9, 4096)]


def weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return from_float(torch.randn(rows, cols, generator=g) + 0.3 * torch.randn(rows, 1, generator=g), "q4k")


def test_bytes_decode_as_gguf_does():
    """from_float's bytes are GGUF Q4_K blocks: the gguf package dequantizes them to exactly
    our values; and raw file blocks (random scales and codes) too."""
    w = weight(7, 512)
    theirs = gguf.quants.dequantize(w.qs.numpy().reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(7, 512)
    np.testing.assert_array_equal(w.dequantize().numpy(), theirs)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 2, 144), dtype=np.uint8)
    raw[..., :4] = rng.uniform(0.001, 0.05, size=(3, 2, 2)).astype(np.float16).view(np.uint8)
    w = QWeight("q4k", 3, 512, torch.from_numpy(raw.reshape(3, -1)))
    theirs = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(3, 512)
    np.testing.assert_array_equal(w.dequantize().numpy(), theirs)
    np.testing.assert_array_equal(cpu.dequantize_rows(w).numpy(), theirs)


def test_quantizer_error_is_a_4_bit_one():
    x = rand(16, 1024, seed=5)
    err = (from_float(x, "q4k").dequantize() - x).abs()
    step = (x.view(16, -1, 32).amax(-1) - x.view(16, -1, 32).amin(-1)) / 15
    assert bool((err.view(16, -1, 32) <= step[..., None] * 0.5 + 0.05).all())


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_gemv_matches_reference_and_emulation(level, rows, cols):
    mode = cpu.activation_mode()
    for seed in range(3):
        w, x = weight(rows, cols, seed), rand(cols, seed=seed + 10)
        y = cpu.gemv(w, x).double()
        err = (y - ref.gemv(w, x).double()).abs()
        bound = ref.error_bound(w, x, mode)
        assert bool((err <= bound).all()), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
        scale = ref.magnitude(w) @ x.double().abs() + 1e-30
        err2 = (y - ref.gemv_emulated(w, x, mode)).abs()
        assert bool((err2 <= 1e-5 * scale).all()), f"vs emulation: {(err2 / (1e-5 * scale)).max():.3g}x"


def test_activation_groups_are_super_blocks():
    """q4k's activations share one int8 scale per 256 values: the emulation with 32-value
    groups (q4's) does not reproduce the kernel, the 256-value one does."""
    x = rand(512, seed=3) * torch.linspace(0.01, 10, 512)
    q, d, s = ref.quantize_activation(x, 256)
    assert d.shape == (16,) and bool((d[:8] == d[0]).all()) and bool((d[8:] == d[8]).all()) and d[0] != d[8]
    assert torch.equal(s, d * q.view(-1, 32).sum(-1, dtype=torch.int32).float())


@pytest.mark.parametrize("rows,cols", [(37, 768), (70, 1536)])
def test_prompt_rows_equal_one_token_results(level, rows, cols):
    w, X = weight(rows, cols, 2), rand(21, cols, seed=4)
    Y = cpu.matmul(w, X)
    for t in range(X.shape[0]):
        assert torch.equal(Y[t], cpu.gemv(w, X[t])), t


def test_gemv_rows_equal_the_dense_rows(level):
    w, x = weight(300, 1536, 3), rand(1536, seed=6)
    y = cpu.gemv(w, x)
    for rows in (torch.arange(0, 300, 7), torch.tensor([0, 1, 2, 299]), torch.arange(300)):
        rows = rows.to(torch.int32)
        assert torch.equal(cpu.gemv_rows(w, x, rows), y[rows.long()])


def test_bit_identical_across_thread_counts():
    w, x, X = weight(2000, 1536, 4), rand(1536, seed=7), rand(9, 1536, seed=8)
    old = cpu.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            cpu.set_num_threads(n)
            outs.append((cpu.gemv(w, x), cpu.matmul(w, X)))
    finally:
        cpu.set_num_threads(old)
    for a, b in outs[1:]:
        assert torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1])


def test_bad_shapes_and_kernels_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        from_float(torch.randn(4, 100), "q4k")
    w = weight(4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu.gemv(QWeight("q4k", 4, 300, w.qs), torch.randn(300))
    with pytest.raises(ValueError):
        cpu.gemv(QWeight("q4k", 4, 256, w.qs[:, :100]), torch.randn(256))
    with pytest.raises(ValueError, match="q4k"):
        cpu.axpy_rows(w, torch.randn(2), torch.tensor([0, 1], dtype=torch.int32))


class FakeTensor:
    def __init__(self, rows, cols, data):
        self.name, self.tensor_type = "t", gguf.GGMLQuantizationType.Q4_K
        self.shape = np.array([cols, rows])
        self.data = data


@pytest.mark.parametrize("keep", ["0", "1"])
def test_loader_keeps_the_file_bytes_when_asked(keep, monkeypatch):
    """$SPARSEINFER_Q4K=1: a Q4_K tensor loads as q4k holding the file's bytes; 0: the q4
    repack (values within its f16 rounding of the same)."""
    monkeypatch.setenv("SPARSEINFER_Q4K", keep)
    w = weight(6, 512, 9)
    raw = w.qs.numpy().reshape(6, 2, 144)
    got = gio.tensor_to_qweight(FakeTensor(6, 512, raw))
    if keep == "1":
        assert got.fmt == "q4k" and torch.equal(got.qs, w.qs)
    else:
        assert got.fmt == "q4"
        torch.testing.assert_close(got.dequantize(), w.dequantize(), rtol=2e-3, atol=2e-3)


def test_loader_default_follows_the_tiles(monkeypatch):
    """Unset, Q4_K stays q4k on the levels that tile it (`Q4K_LEVELS`) unless row tiles are
    turned off; other levels repack to q4."""
    from sparseinfer.kernels import cpu

    monkeypatch.delenv("SPARSEINFER_Q4K", raising=False)
    monkeypatch.delenv("SPARSEINFER_TILES", raising=False)
    level = cpu.simd_level()
    assert gio.keep_q4k() == (level in gio.Q4K_LEVELS)
    assert set(gio.Q4K_LEVELS) <= {lv for lv, fmts in cpu.ROW_TILE_LEVELS.items() if "q4k" in fmts}
    monkeypatch.setenv("SPARSEINFER_TILES", "0")
    assert not gio.keep_q4k()


def test_decode_steps_on_q4k_projections(tmp_path, monkeypatch):
    """A model whose projections are q4k: the C decode steps give the Python layers' logits."""
    import transformers as tf

    from sparseinfer.io.weights import GGUFSource
    from sparseinfer.models.registry import build_model
    from test_decode_step import Count, python_path, stepwise
    from tiny import VOCAB, export_gguf

    cpu.set_activation_mode("precise")
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = build_model(GGUFSource(export_gguf(tf.Qwen2ForCausalLM(cfg).eval(), tmp_path / "m.gguf", "F32")))
    for layer in model.layers:
        for lin in (layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, layer.mlp.gate, layer.mlp.up,
                    layer.mlp.down):
            lin.weight = from_float(lin.weight.dequantize(), "q4k")
    tokens = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    count = Count(monkeypatch)
    fast, _ = stepwise(model, tokens)
    assert count.n["attn"] == count.n["mlp"] == 2 * 8
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)


def test_a_q4k_head_is_read_as_q4(tmp_path):
    """A Q4_K output head kept as stored becomes the loader's q4 repack of the same bytes (the
    row-major q4k kernels are slower; its rows stay addressable for the head preview), tied
    embedding included."""
    from sparseinfer.models.registry import interleave_head
    from test_tiles import _tiny_q4_model

    model = _tiny_q4_model(tmp_path)
    w = from_float(model.head.weight.dequantize(), "q4k")
    model.head.weight = model.embed.weight = w
    interleave_head(model)
    assert model.head.weight.fmt == "q4" and model.embed.weight is model.head.weight
    want = gio.q4k_to_q4(w)
    torch.testing.assert_close(model.head.weight.dequantize(), want.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(want.dequantize(), w.dequantize(), rtol=2e-3, atol=2e-3)
