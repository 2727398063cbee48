"""Row-tiled q4, q6 and q4k weights (formats tq4, tq6, tq4k, `quant.to_tiles`) and the dense products on them
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


FMTS = ("q4", "q6", "q4k")


def shape_for(fmt, rows, cols):
    """q4k rows hold whole super-blocks of 256 values: cols rounded up to them."""
    return (rows, max(256, -(-cols // 256) * 256)) if fmt == "q4k" else (rows, cols)


def weight(rows, cols, seed=0, fmt="q4"):
    g = torch.Generator().manual_seed(seed)
    return from_float(torch.randn(rows, cols, generator=g), fmt)


def vec(n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_layout_holds_the_row_major_values(rows, cols, fmt):
    rows, cols = shape_for(fmt, rows, cols)
    w = weight(rows, cols, fmt=fmt)
    tw = to_tiles(w)
    assert tw.shape == (rows, cols) and tw.fmt == "t" + fmt
    assert torch.equal(tw.dequantize(), w.dequantize())
    back = from_tiles(tw)
    assert back.fmt == fmt and torch.equal(back.qs, w.qs)
    if fmt != "q4k":
        assert torch.equal(back.d, w.d)
    # 5 (q4), 7 (q6) or 4.5 (q4k) bits per weight, as the row-major format (padding aside)
    bits = {"q4": 10, "q6": 14, "q4k": 9}[fmt]
    assert tw.nbytes == -(-rows // 16) * 16 * ((cols + 31) // 32 * 32) * bits // 16


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


def test_layout_places_one_known_q4k_scale():
    """tq4k: row 16t + i's 6-bit scale of sub-block j of super-block s sits in the tile's
    super-block s: bits 0-3 in byte 2048 + 16 (j // 2) + i (nibble j % 2), bits 4-5 in byte
    2176 + 16 (j // 4) + i, bits 2 (j % 4); its codes as tq4's lines, 256 bytes per sub-block;
    d at 2240 + 2i (the docstring's layout)."""
    w = weight(40, 512, fmt="q4k")
    qs = w.qs.clone().view(40, 2, 144)
    qs[21, 1, 4 + 8 + 1] = 0x0B | (0x0 << 4)  # row 21 = tile 1, i = 5; super-block 1, sub-block 5: low 4 bits 11
    qs[21, 1, 4 + 1] = (qs[21, 1, 4 + 1] & 63) | (2 << 6)  # its high 2 bits: 2 (scale 43)
    w = QWeight("q4k", 40, 512, qs.view(40, 288))
    tw = to_tiles(w)
    blk = tw.qs[1, 2304: 4608]
    assert int(blk[2048 + 16 * 2 + 5]) >> 4 == 11
    assert (int(blk[2176 + 16 * 1 + 5]) >> 2) & 3 == 2
    assert torch.equal(blk[2240 + 10: 2242 + 10].view(torch.float16), w.qs.view(40, 2, 144)[21, 1, :2].view(torch.float16))
    assert torch.equal(tw.dequantize(), w.dequantize())


def test_only_q4_q6_and_q4k_convert():
    with pytest.raises(ValueError, match="q4, q6 or q4k"):
        to_tiles(from_float(torch.randn(64, 32), "q8"))


MODES = ("int8", "precise")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_gemv_matches_the_reference(level, mode, rows, cols, fmt):
    rows, cols = shape_for(fmt, rows, cols)
    cpu.set_activation_mode(mode)
    tw = to_tiles(weight(rows, cols, fmt=fmt))
    for seed in (1, 2):
        x = vec(cols, seed)
        y = cpu.gemv(tw, x)
        emu = ref.gemv_emulated(tw, x, mode)
        # float summation order only (the reference's contract for the integer formats)
        xr = ref.activation_rounded(x, mode, ref.activation_group(tw.fmt)).reshape(-1)[:cols].abs()
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
    _, cols = shape_for(fmt, 330, 200)
    tw = to_tiles(weight(330, cols, fmt=fmt))
    for m in (1, 2, 3, 4, 5, 9, 17, 70):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        y = cpu.matmul(tw, x)
        for t in range(m):
            assert torch.equal(y[t], cpu.gemv(tw, x[t])), (level, mode, m, t)


@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_of_zeros(level, fmt):
    _, cols = shape_for(fmt, 48, 64)
    tw = to_tiles(weight(48, cols, fmt=fmt))
    assert torch.equal(cpu.gemv(tw, torch.zeros(cols)), torch.zeros(48))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 40])
def test_thread_count_independent(threads, m, fmt):
    tw = to_tiles(weight(20000 if m == 1 else 3000, 256, fmt=fmt))  # 256 columns: q4k's too
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
    _, cols = shape_for(fmt, 330, 200)
    tw = to_tiles(weight(330, cols, fmt=fmt))
    x = vec(cols)
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
    _, cols = shape_for(fmt, 70, 96)
    w = weight(70, cols, fmt=fmt)
    tw = to_tiles(w)
    assert torch.equal(cpu.dequantize_rows(tw, 3, 50), w.dequantize()[3:50])
    x = torch.randn(5, cols)
    assert torch.allclose(cpu.matmul_f32(tw, x), cpu.matmul_f32(w, x))
    idx = torch.tensor([69, 0, 17, 17, 33])
    got = tw.select_rows(idx)
    assert got.fmt == fmt and torch.equal(got.dequantize(), w.select_rows(idx).dequantize())


@pytest.mark.parametrize("fmt", FMTS)
def test_row_sparse_kernels_refuse_tiles(fmt):
    _, cols = shape_for(fmt, 64, 64)
    tw = to_tiles(weight(64, cols, fmt=fmt))
    with pytest.raises(ValueError, match="row-tiled"):
        cpu.gemv_rows(tw, torch.randn(cols), torch.tensor([1, 2]))
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
    tk = to_tiles(weight(40, 256, fmt="q4k"))
    with pytest.raises(ValueError, match="multiple of 256"):  # tq4k: whole super-blocks only
        cpu.gemv(QWeight("tq4k", 40, 250, tk.qs), torch.randn(250))
    with pytest.raises(ValueError):
        cpu.gemv(QWeight("tq4k", 40, 256, tk.qs[:, :-1].contiguous()), torch.randn(256))


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
        rows, cols = shape_for(fmt, rows, cols)
        w = weight(rows, cols, fmt=fmt)
        assert torch.equal(cpu.tile(w).qs, to_tiles(w).qs), (rows, cols)
    _, cols = shape_for(fmt, 64, 96)
    big = weight(64, cols, fmt=fmt)
    strided = QWeight(fmt, 32, cols, big.qs[::2], None if big.d is None else big.d[::2], None if big.m is None else big.m[::2])
    assert torch.equal(cpu.tile(strided).qs, to_tiles(strided).qs)
    if fmt != "q4k":  # q4k has no row records (its scales are inside its rows)
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


@pytest.mark.parametrize("mode", MODES)
def test_q4k_model_tiles_as_tq4k(tmp_path, monkeypatch, mode):
    """A model held in q4k (a Q4_K file loaded as stored) has its fused q/k/v, o, fused
    gate/up and down tiled as tq4k, with tq4k views as the fused parts; the C decode steps give
    the Python layers' logits, and the tiled model's logits equal the row-major q4k model's up
    to float summation order."""
    from sparseinfer.models.layers import fuse_linears
    from sparseinfer.models.registry import tile_weights
    from test_decode_step import Count, python_path, stepwise

    cpu.set_activation_mode(mode)
    monkeypatch.setenv("SPARSEINFER_TILES", "1")
    model = _tiny_q4_model(tmp_path)
    for layer in model.layers:
        att, mlp = layer.attn, layer.mlp
        for lin in (att.q, att.k, att.v, att.o, mlp.gate, mlp.up, mlp.down):
            lin.weight = from_float(lin.weight.dequantize(), "q4k")
        att._qkv = fuse_linears(att.q, att.k, att.v)
        att._parts = (att.q.weight, att.k.weight, att.v.weight)
        mlp._gate_up = fuse_linears(mlp.gate, mlp.up)
        mlp._parts = (mlp.gate.weight, mlp.up.weight)
    tokens = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(5))
    before, _ = stepwise(model, tokens)
    assert tile_weights(model) == 2 * 4
    for layer in model.layers:
        att, mlp = layer.attn, layer.mlp
        assert att._intact() and mlp._intact()
        assert att._qkv.weight.fmt == mlp._gate_up.weight.fmt == "tq4k"
        assert {lin.weight.fmt for lin in (att.q, att.k, att.v, att.o, mlp.gate, mlp.up, mlp.down)} == {"tq4k"}
    count = Count(monkeypatch)
    fast, _ = stepwise(model, tokens)
    assert count.n["attn"] == count.n["mlp"] == 2 * 6
    slow, _ = python_path(model, tokens, monkeypatch)
    torch.testing.assert_close(fast, slow, atol=1e-3, rtol=1e-3)
    tol = 1e-3 if mode == "precise" else 0.15
    torch.testing.assert_close(fast, before, atol=tol, rtol=tol)


def test_q8k_quantizer_equals_the_reference(level):
    """The XL_Q8K activations (one scale per 256 values, q4k's and tq4k's) of the level's
    quantizer equal the reference quantizer's exactly, a partial last super-block included."""
    for k in (256, 1536, 8960, 300, 32):
        x = torch.randn(k, generator=torch.Generator().manual_seed(k)) * 3
        x[k // 3] = 40.0
        kp = (k + 31) // 32 * 32
        q = torch.empty(kp, dtype=torch.int8)
        d, s = torch.empty(kp // 32), torch.empty(kp // 32)
        cpu._cpu.quantize(cpu._cpu.XL_Q8K, x.data_ptr(), k, q.data_ptr(), d.data_ptr(), s.data_ptr())
        rq, rd, rs = ref.quantize_activation(x, 256)
        assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs), k
