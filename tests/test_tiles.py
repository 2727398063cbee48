"""Row-tiled q4 and q6 weights (formats tq4, tq6, `quant.to_tiles`) and the dense products on them
(`cpu.gemv` / `cpu.matmul`; `cpu.gemv_int8` for the output head preview): the layout holds
exactly the row-major values; the fast kernels on every SIMD level and in both activation
modes equal the float64 reference with the rounding of x reproduced (summation order aside),
give a prompt's rows the one-token numbers bit for bit and the same results for any thread
count.  Also the candidate selection `cpu.select_ids` against its torch reference."""
import pytest
import torch

from sparseinfer.kernels import cpu
from sparseinfer.kernels import reference as ref
from sparseinfer.quant import QWeight, from_float, from_tiles, to_tiles

pytestmark = pytest.mark.skipif(not cpu.available(), reason="compiled kernels not built")

# rows: whole tiles of 16 and a partial last tile; cols: whole and partial blocks of 32
SHAPES = [(16, 32), (17, 32), (64, 256), (200, 70), (1000, 384), (4099, 96), (5, 1)]


FMTS = ("q4", "q6")


def weight(rows, cols, seed=0, fmt="q4"):
    g = torch.Generator().manual_seed(seed)
    return from_float(torch.randn(rows, cols, generator=g), fmt)


def vec(n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_layout_holds_the_row_major_values(rows, cols, fmt):
    w = weight(rows, cols, fmt=fmt)
    tw = to_tiles(w)
    assert tw.shape == (rows, cols) and tw.fmt == "t" + fmt
    assert torch.equal(tw.dequantize(), w.dequantize())
    back = from_tiles(tw)
    assert back.fmt == fmt and torch.equal(back.qs, w.qs) and torch.equal(back.d, w.d)
    # 5 (q4) or 7 (q6) bits per weight, as the row-major format (padding aside)
    bits = 5 if fmt == "q4" else 7
    assert tw.nbytes == -(-rows // 16) * 16 * ((cols + 31) // 32 * 32) * bits // 8


def test_layout_places_one_known_code():
    """Row 16t + i, input 32b + 8l + c (+4 in the high nibble) sits in tile t, block b, line l,
    byte 4i + c (the docstring's layout, checked on one value rather than by the round trip)."""
    x = torch.zeros(40, 64)
    x[16 + 5, 32 + 8 * 2 + 4 + 3] = 1.0        # t=1, i=5, b=1, l=2, high nibble, c=3
    tw = to_tiles(from_float(x, "q4"))
    byte = int(tw.qs[1, 320 + 64 * 2 + 4 * 5 + 3])
    assert byte >> 4 == 15 and abs(float(tw.dequantize()[21, 32 + 23]) - 1.0) < 1e-3


def test_layout_from_strided_rows():
    big = weight(64, 96)
    view = type(big)("q4", 32, 96, big.qs[::2], big.d[::2], big.m[::2])
    assert torch.equal(to_tiles(view).dequantize(), view.dequantize())


def test_layout_places_one_known_q6_code():
    """tq6: the high parts of row 16t + i, input 32b + 16h + 4k + c sit in the block's high
    line h, byte 4i + c, bits 2k (the docstring's layout)."""
    x = torch.zeros(40, 64)
    x[16 + 5, 32 + 16 + 4 * 2 + 3] = 1.0     # t=1, i=5, b=1, h=1, k=2, c=3: code 63, high part 3
    x[16 + 5, 32] = -1.0                     # makes the scale 1/31: code 63 at the first value
    tw = to_tiles(from_float(x, "q6"))
    byte = int(tw.qs[1, 448 + 256 + 64 * 1 + 4 * 5 + 3])
    assert (byte >> 4) & 3 == 3 and abs(float(tw.dequantize()[21, 32 + 27]) - 1.0) < 1e-2


def test_only_q4_and_q6_convert():
    with pytest.raises(ValueError, match="q4 or q6"):
        to_tiles(from_float(torch.randn(64, 32), "q8"))


MODES = ("int8", "precise")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_gemv_matches_the_reference(level, mode, rows, cols, fmt):
    cpu.set_activation_mode(mode)
    tw = to_tiles(weight(rows, cols, fmt=fmt))
    for seed in (1, 2):
        x = vec(cols, seed)
        y = cpu.gemv(tw, x)
        emu = ref.gemv_emulated(tw, x, mode)
        # float summation order only (the reference's contract for the integer formats)
        xr = ref.activation_rounded(x, mode).reshape(-1)[:cols].abs()
        bound = 1e-5 * (ref.magnitude(tw) @ xr) + 1e-6
        assert ((y.double() - emu).abs() <= bound).all(), (level, mode, seed)
        # and within the activation rounding of the exact product
        exact = tw.dequantize().double() @ x.double()
        assert ((y.double() - exact).abs() <= ref.error_bound(tw, x, mode) + 1e-5).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
def test_matmul_rows_equal_the_gemv(level, mode, fmt):
    """A prompt's rows get exactly the one-token numbers (the kernels' determinism contract),
    for token counts that fill the kernels' groups of 4 and not, and a partial last tile."""
    cpu.set_activation_mode(mode)
    tw = to_tiles(weight(330, 200, fmt=fmt))
    for m in (1, 2, 3, 4, 5, 9, 17, 70):
        x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m))
        y = cpu.matmul(tw, x)
        for t in range(m):
            assert torch.equal(y[t], cpu.gemv(tw, x[t])), (level, mode, m, t)


def test_gemv_of_zeros(level):
    tw = to_tiles(weight(48, 64))
    assert torch.equal(cpu.gemv(tw, torch.zeros(64)), torch.zeros(48))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 40])
def test_thread_count_independent(threads, m, fmt):
    tw = to_tiles(weight(20000 if m == 1 else 3000, 256, fmt=fmt))
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(3))
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(cpu.matmul(tw, x))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("fmt", FMTS)
def test_levels_agree(level, fmt):
    """Every level sums the same exact integers per block: the results match the portable
    level to float rounding of the final multiply-adds."""
    tw = to_tiles(weight(330, 200, fmt=fmt))
    x = vec(200)
    y = cpu.gemv(tw, x)
    old = cpu.simd_level()
    cpu._cpu.set_simd_level("scalar")
    try:
        y0 = cpu.gemv(tw, x)
    finally:
        cpu._cpu.set_simd_level(old)
    assert torch.allclose(y, y0, rtol=1e-6, atol=1e-5)


def test_gemv_int8_is_one_term_in_any_mode(level):
    tw = to_tiles(weight(100, 96))
    x = vec(96)
    cpu.set_activation_mode("int8")
    y = cpu.gemv(tw, x)
    assert torch.equal(cpu.gemv_int8(tw, x), y)
    cpu.set_activation_mode("precise")
    assert torch.equal(cpu.gemv_int8(tw, x), y)
    with pytest.raises(ValueError, match="tq4"):
        cpu.gemv_int8(weight(100, 96), x)


@pytest.mark.parametrize("fmt", FMTS)
def test_float_paths_and_rows(level, fmt):
    """The prompt's float32 GEMM on dequantized slices and row selection read the same values."""
    w = weight(70, 96, fmt=fmt)
    tw = to_tiles(w)
    assert torch.equal(cpu.dequantize_rows(tw, 3, 50), w.dequantize()[3:50])
    x = torch.randn(5, 96)
    assert torch.allclose(cpu.matmul_f32(tw, x), cpu.matmul_f32(w, x))
    idx = torch.tensor([69, 0, 17, 17, 33])
    got = tw.select_rows(idx)
    assert got.fmt == fmt and torch.equal(got.dequantize(), w.select_rows(idx).dequantize())


@pytest.mark.parametrize("fmt", FMTS)
def test_row_sparse_kernels_refuse_tiles(fmt):
    tw = to_tiles(weight(64, 64, fmt=fmt))
    with pytest.raises(ValueError, match="row-tiled"):
        cpu.gemv_rows(tw, torch.randn(64), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="row-tiled"):
        cpu.axpy_rows(tw, torch.randn(2), torch.tensor([1, 2]))


def test_rejects_bad_inputs():
    tw = to_tiles(weight(40, 64))
    with pytest.raises(ValueError):
        cpu.gemv(tw, torch.randn(63))
    with pytest.raises(ValueError):
        cpu.gemv(QWeight("tq4", tw.rows, tw.cols, tw.qs[:, :-1].contiguous()), torch.randn(64))
    with pytest.raises(ValueError):
        cpu.gemv(QWeight("tq4", tw.rows + 16, tw.cols, tw.qs), torch.randn(64))
    with pytest.raises(ValueError):
        cpu.gemv(QWeight("tq4", tw.rows, tw.cols, tw.qs, torch.zeros(40, 2, dtype=torch.float16)), torch.randn(64))


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 151936])
def test_select_ids_matches_the_reference(n):
    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g)
    thr = float(torch.quantile(p, 0.97)) if n > 1 else 0.0
    for extra in (None, [], [0, n - 1, n, -5, 3, 3], torch.randint(-2, n + 2, (300,), generator=g).tolist()):
        ids, above = cpu.select_ids(p, thr, extra)
        assert ids.dtype == torch.int32
        assert torch.equal(ids.long(), ref.select_ids(p, thr, extra))
        assert above == int((p >= thr).sum())


def test_select_ids_into_a_buffer_and_refusals():
    p = torch.tensor([0.5, 2.0, -1.0, 3.0])
    buf = torch.full((4,), -7, dtype=torch.int32)
    ids, above = cpu.select_ids(p, 1.0, [2], buf)
    assert ids.tolist() == [1, 2, 3] and above == 2 and ids.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError):
        cpu.select_ids(p, 1.0, None, torch.empty(3, dtype=torch.int32))
    with pytest.raises(TypeError):
        cpu.select_ids(p, 1.0, ["a"])


@pytest.mark.parametrize("fmt", FMTS)
def test_compiled_conversion_gives_the_reference_bytes(fmt):
    for rows, cols in SHAPES + [(64, 1536)]:
        w = weight(rows, cols, fmt=fmt)
        assert torch.equal(cpu.tile(w).qs, to_tiles(w).qs), (rows, cols)
    big = weight(64, 96, fmt=fmt)
    strided = QWeight(fmt, 32, 96, big.qs[::2], big.d[::2], None if big.m is None else big.m[::2])
    assert torch.equal(cpu.tile(strided).qs, to_tiles(strided).qs)
    rec = cpu.interleave_rows(weight(48, 256, fmt=fmt))  # each row's scales next to its codes (strided views)
    assert torch.equal(cpu.tile(rec).dequantize(), rec.dequantize())


def _tiny_q4_model(tmp_path):
    import transformers as tf

    from sparseinfer.io.weights import GGUFSource
    from sparseinfer.models.registry import build_model
    from tiny import VOCAB, export_gguf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    return build_model(GGUFSource(export_gguf(tf.Qwen2ForCausalLM(cfg).eval(), tmp_path / "m.gguf", "Q4_0")))


@pytest.mark.parametrize("mode", MODES)
def test_tiled_model_decodes_as_the_row_major_one(tmp_path, monkeypatch, mode):
    """`tile_weights` turns the fused q/k/v and gate/up (parts as views of one buffer) and o into
    tq4 and a q6 down into tq6, leaves the embedding and tied head alone; the C decode steps then give the
    Python layers' logits, and the tiled model's logits equal the row-major model's up to
    float summation order."""
    from sparseinfer.models.registry import tile_weights
    from test_decode_step import Count, python_path, stepwise

    cpu.set_activation_mode(mode)
    monkeypatch.setenv("SPARSEINFER_TILES", "1")
    model = _tiny_q4_model(tmp_path)
    for layer in model.layers:  # a Q4_K_M file's mix: some projections in q6
        layer.mlp.down.weight = from_float(layer.mlp.down.weight.dequantize(), "q6")
    tokens = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    before, _ = stepwise(model, tokens)
    assert tile_weights(model) == 2 * 4
    for layer in model.layers:
        att, mlp = layer.attn, layer.mlp
        assert {lin.weight.fmt for lin in (att.q, att.k, att.v, att.o, mlp.gate, mlp.up)} == {"tq4"}
        assert mlp.down.weight.fmt == "tq6"
        assert att._intact() and mlp._intact()
        assert att.k.weight.qs.untyped_storage().data_ptr() == att._qkv.weight.qs.untyped_storage().data_ptr()
    assert model.embed.weight.fmt == "q4"
    count = Count(monkeypatch)
    fast, _ = stepwise(model, tokens)
    assert count.n["attn"] == count.n["mlp"] == 2 * 8
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)
    tol = 1e-3 if mode == "precise" else 0.15  # int8: the activations' rounding meets a different sum order
    torch.testing.assert_close(fast, before, atol=tol, rtol=tol)


def test_tiles_only_where_asked(tmp_path, monkeypatch):
    from sparseinfer.models.registry import tile_weights

    monkeypatch.setenv("SPARSEINFER_TILES", "0")
    model = _tiny_q4_model(tmp_path)
    assert tile_weights(model) == 0
    assert model.layers[0].mlp.down.weight.fmt == "q4"


@pytest.mark.parametrize("permuted", [False, True])
def test_sparse_ffn_from_a_tiled_mlp(tmp_path, monkeypatch, permuted):
    """A sparse FFN made from a tiled MLP takes row-major rows: its decode step runs and, at
    threshold 0 with every neuron kept, gives the dense MLP's output."""
    from sparseinfer.models.registry import tile_weights
    from sparseinfer.sparse.ffn import SparseFFN

    cpu.set_activation_mode("precise")
    monkeypatch.setenv("SPARSEINFER_TILES", "1")
    model = _tiny_q4_model(tmp_path)
    tile_weights(model)
    mlp = model.layers[0].mlp
    order = torch.randperm(mlp.n_neurons, generator=torch.Generator().manual_seed(0)) if permuted else None
    ffn = SparseFFN(mlp, 0.0, order, mode="threshold")
    assert {ffn.gate.fmt, ffn.up.fmt} == {"q4"}
    x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(ffn(x), mlp(x), atol=2e-3, rtol=2e-3)


def test_fused_q6_groups_tile_as_tq6(tmp_path, monkeypatch):
    """A fused group held in q6 (a file whose q, k and v are all Q6_K) becomes one tq6 weight
    with tq6 views as its parts; the decode steps still give the Python layers' logits."""
    from sparseinfer.models.layers import fuse_linears
    from sparseinfer.models.registry import tile_weights
    from test_decode_step import Count, python_path, stepwise

    cpu.set_activation_mode("precise")
    monkeypatch.setenv("SPARSEINFER_TILES", "1")
    model = _tiny_q4_model(tmp_path)
    for layer in model.layers:
        att = layer.attn
        for lin in (att.q, att.k, att.v):
            lin.weight = from_float(lin.weight.dequantize(), "q6")
        att._qkv = fuse_linears(att.q, att.k, att.v)
        att._parts = (att.q.weight, att.k.weight, att.v.weight)
    tokens = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(4))
    before, _ = stepwise(model, tokens)
    tile_weights(model)
    for layer in model.layers:
        att = layer.attn
        assert att._intact() and att._qkv.weight.fmt == "tq6"
        assert {lin.weight.fmt for lin in (att.q, att.k, att.v)} == {"tq6"}
    count = Count(monkeypatch)
    fast, _ = stepwise(model, tokens)
    assert count.n["attn"] == 2 * 6
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(fast, before, atol=1e-3, rtol=1e-3)
