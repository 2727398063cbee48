"""Fast CPU kernels (sparseinfer.kernels.cpu) against the reference, on every SIMD level the
machine supports: random and edge-case shapes, every weight format, determinism across runs
and thread counts, and input validation.  The accuracy contract is documented in
sparseinfer/kernels/reference.py."""
import warnings

import pytest
import torch

from sparseinfer.kernels import cpu
from sparseinfer.kernels import reference as ref
from sparseinfer.quant import QWeight, from_float, padded

pytestmark = pytest.mark.skipif(not cpu.available(), reason="compiled kernels not built")

FORMATS = ["f32", "f16", "bf16", "q8", "q8m", "q4", "q6"]
AXPY_FORMATS = [f for f in FORMATS if f != "q6"]  # q6 has no column-sparse kernel (SparseFFN keeps down_t in q8)
LEVELS = cpu._cpu.supported_levels() if cpu.available() else []
SHAPES = [(1, 1), (5, 7), (13, 33), (37, 100), (64, 256), (9, 1000), (6, 4096 + 96)]


def make_weight(fmt, rows, cols, seed=0):
    """Random weight in `fmt`; 'q8m' is q8 with the optional per-block min m."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    if fmt != "q8m":
        return from_float(w, fmt)
    q = from_float(w, "q8")
    m = (torch.randn(q.d.shape, generator=g) * 0.1).to(torch.float16)
    return QWeight("q8", rows, cols, q.qs, q.d, m)


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=[(lv, mode) for lv in LEVELS for mode in cpu.ACTIVATION_MODES], ids=lambda p: f"{p[0]}-{p[1]}")
def level(request):
    """Every SIMD level, in every activation mode."""
    lv, mode = request.param
    old, old_mode = cpu.simd_level(), cpu.activation_mode()
    cpu._cpu.set_simd_level(lv)
    cpu.set_activation_mode(mode)
    yield lv
    cpu._cpu.set_simd_level(old)
    cpu.set_activation_mode(old_mode)


@pytest.fixture
def act_mode():
    old = cpu.activation_mode()
    yield cpu.set_activation_mode
    cpu.set_activation_mode(old)


def assert_gemv_close(w, x, y, f32_level=True):
    """y (fast) vs the exact reference within the contract; integer formats also vs the
    emulation of their activation rounding in the kernels' current mode, where only
    summation order differs."""
    mode = cpu.activation_mode()
    err = (y.double() - ref.gemv(w, x).double()).abs()
    bound = ref.error_bound(w, x, mode)
    assert bool((err <= bound).all()), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
    if w.fmt in ref.INT_FORMATS:
        scale = ref.magnitude(w) @ x.double().abs() + 1e-30
        if mode == "precise" and f32_level:
            # f32-level: the two-term activations are within ~1e-4 of sum |w x| even in the worst case
            assert bool((err <= 1e-4 * scale).all()), f"vs exact: {(err / scale).max():.3g} relative"
        err2 = (y.double() - ref.gemv_emulated(w, x, mode)).abs()
        assert bool((err2 <= 1e-5 * scale).all()), f"vs emulation: {(err2 / (1e-5 * scale)).max():.3g}x the tolerance"


# ------------------------------------------------------------------------------- gemv

@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_matches_reference(level, fmt):
    for i, (n, k) in enumerate(SHAPES):
        w = make_weight(fmt, n, k, seed=i)
        x = rand(k, seed=100 + i) * (1 + i)
        assert_gemv_close(w, x, cpu.gemv(w, x))


def test_gemv_q8_extreme_values(level):
    """int8 -128 (GGUF data may hold it), zero blocks, zero x blocks, huge range."""
    rows, cols = 8, 96
    qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8)
    qs[0] = -128
    qs[1] = 127
    d = (torch.rand(rows, 3) + 0.01).to(torch.float16)
    d[2] = 0
    w = QWeight("q8", rows, cols, qs, d, None)
    x = rand(cols)
    x[32:64] = 0
    x[0] = 1e4
    # a block holding 1e4 next to values ~1: the second term's step is ~1e4/127^2, so the small
    # values keep only ~7 bits; the contract bound (error_bound) still holds, f32-level does not
    assert_gemv_close(w, x, cpu.gemv(w, x), f32_level=False)


@pytest.mark.parametrize("fmt", ["q8", "q8m", "q4", "q6"])
def test_activation_modes_batch_equals_gemv(level, fmt):
    """In either activation mode a batched product equals per-token gemv, within the contract."""
    for i, (n, k) in enumerate(SHAPES):
        w = make_weight(fmt, n, k, seed=i)
        xs = rand(3, k, seed=300 + i) * (1 + i)
        y = cpu.matmul(w, xs)
        for t in range(3):
            assert torch.equal(y[t], cpu.gemv(w, xs[t]))
            assert_gemv_close(w, xs[t], y[t])


def test_activation_mode_default_and_env():
    """One int8 term by default; $SPARSEINFER_ACT_MODE=precise selects two at start-up."""
    import os
    import subprocess
    import sys

    code = "from sparseinfer.kernels import cpu; print(cpu.activation_mode())"
    env = {k: v for k, v in os.environ.items() if k != "SPARSEINFER_ACT_MODE"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
    assert run(env) == "int8"
    assert run({**env, "SPARSEINFER_ACT_MODE": "precise"}) == "precise"
    with pytest.raises(ValueError, match="activation mode"):
        cpu.set_activation_mode("fp8")


def test_precise_mode_is_f32_level_and_tighter(act_mode):
    """Real hidden states have a few huge channels: int8 rounding error then reaches ~1e-3 of
    sum |w x|; the two-term mode stays at f32 level, its bound far below int8's."""
    x = rand(1536, seed=7)
    x[::197] = 40 * torch.sign(x[::197]) + x[::197]
    w = make_weight("q4", 256, 1536, seed=7)
    exact = ref.gemv(w, x).double()
    scale = float((ref.magnitude(w) @ x.double().abs()).max())
    err = {}
    for mode in cpu.ACTIVATION_MODES:
        act_mode(mode)
        err[mode] = float((cpu.gemv(w, x).double() - exact).abs().max())
    assert err["precise"] <= 1e-5 * scale < err["int8"]
    assert float(ref.error_bound(w, x, "precise").max()) * 50 < float(ref.error_bound(w, x, "int8").max())


def test_single_term_mins_use_the_rounded_sums(act_mode):
    """q4 of centred weights has a per-block min m ~ -8d (GGUF Q4_1 too): the single-term error
    meets the true weights d*q + m (the mins term sums the same rounded x the products see);
    with the exact block sums it would meet the nibbles d*q alone, offset by ~8d: ~2x larger here."""
    act_mode("int8")
    g = torch.Generator().manual_seed(11)
    w = from_float(torch.randn(256, 1024, generator=g), "q4")
    x = rand(1024, seed=12)
    x[::97] *= 30  # outliers, as in real hidden states
    y = cpu.gemv(w, x).double()
    exact = ref.gemv(w, x).double()
    q, d, s = ref.quantize_activation(x)
    xr = (q.double().view(-1, 32) * d.double()[:, None]).reshape(-1)[:1024]
    assert torch.allclose(y, w.dequantize().double() @ xr, rtol=0, atol=1e-5 * float((ref.magnitude(w) @ x.double().abs()).max()))
    nibble_only = (w.dequantize().double() - w.m.double().repeat_interleave(32, 1)[:, :1024])
    err_exact_sums = (nibble_only @ (xr - x.double())).abs().mean()
    assert float((y - exact).abs().mean()) * 1.5 < float(err_exact_sums)


def test_gemv_out_and_empty_weight():
    w = make_weight("q4", 16, 64)
    x = rand(64)
    out = torch.empty(16)
    assert cpu.gemv(w, x, out=out) is out
    assert torch.equal(out, cpu.gemv(w, x))
    assert cpu.gemv(make_weight("q4", 0, 64), x).shape == (0,)


# ----------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_matches_gemv_bitwise(level, fmt):
    """Each row of matmul is computed exactly like gemv of that token."""
    # m = 2, 3, 5, 8: the few-token walk (FEW_TOKENS), 9 and 17 the many-token one
    for i, (n, k, m) in enumerate([(13, 33, 2), (50, 96, 3), (37, 100, 5), (41, 64, 8), (64, 256, 9), (9, 1000, 17)]):
        w = make_weight(fmt, n, k, seed=i)
        xs = rand(m, k, seed=200 + i)
        y = cpu.matmul(w, xs)
        assert y.shape == (m, n)
        for t in range(m):
            assert torch.equal(y[t], cpu.gemv(w, xs[t])), (t, n, k, m)
        assert_gemv_close(w, xs[m - 1], y[m - 1])


def test_matmul_edge_cases():
    w = make_weight("q4", 20, 70)
    assert cpu.matmul(w, torch.empty(0, 70)).shape == (0, 20)
    x = rand(1, 70)
    assert torch.equal(cpu.matmul(w, x)[0], cpu.gemv(w, x[0]))
    xt = rand(70, 6).T  # non-contiguous input is accepted
    assert torch.equal(cpu.matmul(w, xt), cpu.matmul(w, xt.contiguous()))


@pytest.mark.parametrize("fmt", ["q4", "q8", "q8m", "q6", "f16"])
def test_matmul_large_prefill_shape(level, fmt):
    """A prefill-sized product (on avx512amx: AMX tiles for q4/q8, with leftover rows and
    tokens on the VNNI tiles) equals per-token gemv: bit for bit where the level promises it,
    within the contract everywhere."""
    w = make_weight(fmt, 96 + 5, 640 + 20)
    xs = rand(130, 640 + 20)
    y = cpu.matmul(w, xs)
    for t in (0, 15, 16, 63, 64, 127, 128, 129):
        g = cpu.gemv(w, xs[t])
        if cpu.matmul_equals_gemv():
            assert torch.equal(y[t], g)
        else:
            scale = ref.magnitude(w) @ xs[t].double().abs() + 1e-30
            assert bool(((y[t].double() - g.double()).abs() <= 1e-5 * scale).all())
        assert_gemv_close(w, xs[t], y[t])


AMX = "avx512amx" in LEVELS


@pytest.mark.skipif(not AMX, reason="the CPU or OS offers no AMX")
@pytest.mark.parametrize("fmt", ["q4", "q8", "q8m", "q6"])
def test_amx_matmul_matches_reference_and_vnni(fmt, act_mode):
    """AMX tile products (blocks of K in steps of 64 blocks, 16 x 16 tiles, leftovers on the
    VNNI tiles) match the reference within the contract and the VNNI level to f32 rounding;
    the two-term activation mode keeps the VNNI tiles (bit-identical to gemv)."""
    old = cpu.simd_level()
    try:
        for mode in cpu.ACTIVATION_MODES:
            act_mode(mode)
            for i, (n, k, m) in enumerate([(16, 32, 16), (17, 33, 17), (48, 100, 31), (40, 2100, 20), (64, 4096 + 96, 48)]):
                w = make_weight(fmt, n, k, seed=40 + i)
                xs = rand(m, k, seed=500 + i) * (1 + i)
                cpu._cpu.set_simd_level("avx512amx")
                ya = cpu.matmul(w, xs)
                cpu._cpu.set_simd_level("avx512vnni")
                yv = cpu.matmul(w, xs)
                for t in range(m):
                    assert_gemv_close(w, xs[t], ya[t])
                    scale = ref.magnitude(w) @ xs[t].double().abs() + 1e-30
                    assert bool(((ya[t].double() - yv[t].double()).abs() <= 1e-5 * scale).all()), (fmt, n, k, m, t)
                if mode == "precise":
                    assert torch.equal(ya, yv)
    finally:
        cpu._cpu.set_simd_level(old)


@pytest.mark.skipif(not AMX, reason="the CPU or OS offers no AMX")
def test_amx_matmul_deterministic_across_threads(threads):
    old = cpu.simd_level()
    try:
        cpu._cpu.set_simd_level("avx512amx")
        for fmt in ("q4", "q8", "q6"):
            w = make_weight(fmt, 1000, 700, seed=3)
            xs = rand(77, 700, seed=9)
            outs = []
            for n in (1, 2, 3):
                threads(n)
                outs.append(cpu.matmul(w, xs))
            assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        cpu._cpu.set_simd_level(old)


# -------------------------------------------------------------------------- gemv_rows

def row_sets(n, g):
    return {
        "empty": torch.empty(0, dtype=torch.int32),
        "one": torch.tensor([n - 1], dtype=torch.int32),
        "all": torch.arange(n, dtype=torch.int32),
        "sorted_half": torch.sort(torch.randperm(n, generator=g)[: max(1, n // 2)])[0].int(),
        "unsorted_dups": torch.randint(0, n, (n + 3,), generator=g, dtype=torch.int32),
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_rows(level, fmt):
    g = torch.Generator().manual_seed(3)
    for i, (n, k) in enumerate(SHAPES):
        w = make_weight(fmt, n, k, seed=i)
        x = rand(k, seed=i)
        dense = cpu.gemv(w, x)
        for name, rows in row_sets(n, g).items():
            y = cpu.gemv_rows(w, x, rows)
            assert y.shape == rows.shape
            # a row is computed the same way whichever kernel reads it
            assert torch.equal(y, dense[rows.long()]), (name, n, k)
    rows64 = torch.tensor([0, 2, 1])
    w = make_weight(fmt, 3, 40)
    x = rand(40)
    assert torch.equal(cpu.gemv_rows(w, x, rows64), cpu.gemv_rows(w, x, rows64.int()))


# -------------------------------------------------------------------------- axpy_rows

def assert_axpy_close(wt, h, rows, y):
    r = ref.axpy_rows(wt, h, rows).double()
    scale = h.double().abs() @ ref.magnitude(wt)[rows.long()] if rows.numel() else torch.zeros(wt.cols)
    assert bool(((y.double() - r).abs() <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("fmt", AXPY_FORMATS)
def test_axpy_rows(level, fmt):
    g = torch.Generator().manual_seed(4)
    for i, (n, k) in enumerate(SHAPES + [(40, 4200), (7, 2048 + 32)]):
        wt = make_weight(fmt, n, k, seed=i)
        for name, rows in row_sets(n, g).items():
            h = rand(rows.numel(), seed=i)
            if rows.numel() > 2:
                h[1] = 0.0  # zero coefficients are skipped
            y = cpu.axpy_rows(wt, h, rows)
            assert y.shape == (k,)
            if name == "empty":
                assert torch.equal(y, torch.zeros(k))
            assert_axpy_close(wt, h, rows, y)


def test_q6_refused_where_there_is_no_kernel():
    """q6 has row kernels (gemv, gemv_rows, matmul) but no column-sparse one: axpy_rows and a
    sparse FFN with a q6 down_t say so instead of reading the bytes as another format; nor
    does it make neuron records."""
    w, x = make_weight("q6", 16, 64), rand(64)
    rows = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="q6 .*axpy"):
        cpu.axpy_rows(w, rand(4), rows)
    with pytest.raises(ValueError, match="q6 .*axpy"):
        cpu.sparse_ffn(x, make_weight("q6", 16, 64, 1), make_weight("q6", 16, 64, 2), w, rows, "silu")
    with pytest.raises(ValueError):
        cpu.neuron_records([make_weight("q6", 16, 64, 1), make_weight("q6", 16, 64, 2), make_weight("q8", 16, 64, 3)])


def test_q6_layout_round_trip_and_kernel_view():
    """pack_q6/unpack_q6 invert each other for every tail length; the C kernels read codes
    and scales where quant.py put them (the emulation decodes through unpack_q6)."""
    from sparseinfer.quant import pack_q6, unpack_q6

    from sparseinfer.quant import pack_q6_reference, unpack_q6_reference

    g = torch.Generator().manual_seed(11)
    for kp in (32, 64, 96, 128, 160, 224, 256, 4096 + 96):
        q = torch.randint(0, 64, (3, kp), generator=g, dtype=torch.uint8)
        packed = pack_q6(q)
        assert torch.equal(packed, pack_q6_reference(q))  # the sliced vector packing vs scattering
        assert torch.equal(unpack_q6(packed), q)
        assert torch.equal(unpack_q6_reference(packed), q)
        d = (torch.rand(3, kp // 16, generator=g) * 0.1).to(torch.float16)
        w = QWeight("q6", 3, kp, pack_q6(q), d, None)
        exp = ((q.float() - 32).view(3, -1, 16) * d.float()[..., None]).view(3, kp)
        assert torch.equal(w.dequantize(), exp)
        assert torch.equal(cpu.dequantize_rows(w, 0, 3), exp)


def test_q6_packing_in_slices(monkeypatch):
    """More rows than one slice of pack_q6/unpack_q6: same bytes as the reference."""
    import sparseinfer.quant as quant

    monkeypatch.setattr(quant, "_Q6_SLICE_ROWS", 5)
    g = torch.Generator().manual_seed(12)
    for rows, kp in ((13, 96), (11, 256 + 32), (5, 128)):
        q = torch.randint(0, 64, (rows, kp), generator=g, dtype=torch.uint8)
        assert torch.equal(quant.pack_q6(q), quant.pack_q6_reference(q))
        assert torch.equal(quant.unpack_q6(quant.pack_q6(q)), q)


@pytest.mark.parametrize("fmt", ["q4", "q8m", "bf16"])
def test_axpy_rows_many_rows_wide(level, fmt):
    """Many active rows take the row-partitioned path; > 4096 columns are cut per kernel call."""
    wt = make_weight(fmt, 900, 4200, seed=9)
    g = torch.Generator().manual_seed(9)
    for n in (150, 400, 900):
        rows = torch.sort(torch.randperm(900, generator=g)[:n])[0].int()
        h = rand(n, seed=n)
        assert_axpy_close(wt, h, rows, cpu.axpy_rows(wt, h, rows))


# ------------------------------------------------------------------------- sparse_ffn

def ffn_expected(x, gate, up, down_t, rows, act):
    """float64 FFN over `rows` where integer-format projections see x rounded like the kernels."""
    def proj(w):
        if w.fmt in ref.INT_FORMATS:
            return ref.gemv_emulated(w, x, cpu.activation_mode())[rows.long()]
        return w.dequantize().double()[rows.long()] @ x.double()
    u = proj(up)
    h = ref.activation(act, u) if gate is None else ref.activation(act, proj(gate)) * u
    dn = down_t.dequantize().double()[rows.long()]
    return h @ dn, h.abs() @ ref.magnitude(down_t)[rows.long()]


@pytest.mark.parametrize("fmt", FORMATS + ["q8-records", "q8m-records", "q4-records", "q4q8-records"])
@pytest.mark.parametrize("act", ["silu", "relu", "gelu", "gelu_tanh"])
def test_sparse_ffn(level, fmt, act):
    """The fused sparse FFN, on separate weights and on neuron records (`neuron_records`: one
    row of gate, up and down_t per record, which `sparse_ffn` takes in one pass)."""
    g = torch.Generator().manual_seed(5)
    records = fmt.endswith("-records")
    fmt = fmt.removesuffix("-records")
    fmts = {"q4q8": ("q4", "q8", "q8"), "q6": ("q6", "q6", "q8")}.get(fmt, (fmt,) * 3)
    # 40 x 4608: over 512 kept rows per partition, so the records pass flushes more than once
    for i, (d_model, d_ff) in enumerate([(32, 64), (100, 37), (96, 300), (40, 4608)]):
        gated = i != 1
        gate = make_weight(fmts[0], d_ff, d_model, seed=10 + i) if gated else None
        up = make_weight(fmts[1], d_ff, d_model, seed=20 + i)
        down_t = make_weight(fmts[2], d_ff, d_model, seed=30 + i)
        if records:
            _, ws = cpu.neuron_records([w for w in (gate, up, down_t) if w is not None])
            gate, up, down_t = ws if gated else (None, *ws)
        x = rand(d_model, seed=i) * 0.5
        for name, rows in row_sets(d_ff, g).items():
            y = cpu.sparse_ffn(x, gate, up, down_t, rows, act)
            assert y.shape == (d_model,)
            if name == "empty":
                assert torch.equal(y, torch.zeros(d_model))
                continue
            exp, scale = ffn_expected(x, gate, up, down_t, rows, act)
            err = (y.double() - exp).abs()
            assert bool((err <= 1e-4 * scale + 1e-6).all()), (name, float(err.max()))


def _records_with_gap(ws, gap):
    """The neuron records of `ws` (as `neuron_records` lays them out: each weight's scales,
    mins and values in a 64-byte aligned piece) with `gap` extra bytes after the first piece."""
    sizes = [sum(t.shape[1] * t.element_size() for t in (w.d, w.m, w.qs) if t is not None) for w in ws]
    piece = (max(sizes) + 63) // 64 * 64
    buf = torch.zeros(ws[0].rows, piece * len(ws) + gap, dtype=torch.uint8)
    out = []
    for i, w in enumerate(ws):
        o, views = piece * i + (gap if i else 0), {}
        for name in ("d", "m", "qs"):
            t = getattr(w, name)
            if t is None:
                views[name] = None
                continue
            nb = t.shape[1] * t.element_size()
            buf[:, o:o + nb].copy_(t.contiguous().view(torch.uint8).view(w.rows, nb))
            views[name] = buf[:, o:o + nb].view(t.dtype)
            o += nb
        out.append(QWeight(w.fmt, w.rows, w.cols, views["qs"], views["d"], views["m"]))
    return buf, out


@pytest.mark.parametrize("fmt", ["q4", "q8", "q8m"])
def test_records_pass_gate_and_up_as_one_stream(level, fmt):
    """`neuron_records` spaces each record's pieces evenly, so the keep-all records pass reads a
    neuron's gate and up rows as one stream (one dot over 'virtual rows'); the same records
    with a gap after the gate piece take two dots.  Every row's dot is the same computation,
    so the results are bit-identical."""
    d_model, d_ff = 512, 1100
    ws = [make_weight(fmt, d_ff, d_model, seed=s) for s in (1, 2, 3)]
    _, even = cpu.neuron_records(ws)
    pieces = [w.qs.data_ptr() for w in even]
    assert pieces[2] - pieces[1] == pieces[1] - pieces[0] and even[0].qs.stride(0) % (pieces[1] - pieces[0]) == 0
    _, gapped = _records_with_gap(ws, 64)
    g = torch.Generator().manual_seed(6)
    x = rand(d_model, seed=7)
    for rows in (torch.arange(d_ff, dtype=torch.int32), torch.sort(torch.randperm(d_ff, generator=g)[:300])[0].int()):
        y = cpu.sparse_ffn(x, *even, rows, "silu")
        assert torch.equal(y, cpu.sparse_ffn(x, *gapped, rows, "silu"))
        exp, scale = ffn_expected(x, *ws, rows, "silu")
        assert bool(((y.double() - exp).abs() <= 1e-4 * scale + 1e-6).all())


def test_sparse_ffn_mixed_formats():
    gate, up, down_t = make_weight("q8", 64, 96, 1), make_weight("q4", 64, 96, 2), make_weight("bf16", 64, 96, 3)
    x, rows = rand(96), torch.arange(0, 64, 3, dtype=torch.int32)
    exp, scale = ffn_expected(x, gate, up, down_t, rows, "silu")
    y = cpu.sparse_ffn(x, gate, up, down_t, rows, "silu")
    assert bool(((y.double() - exp).abs() <= 1e-4 * scale + 1e-6).all())


def test_sparse_ffn_all_rows_equals_dense_composition():
    gate, up, down_t = (make_weight("q4", 128, 64, s) for s in (1, 2, 3))
    x, rows = rand(64), torch.arange(128, dtype=torch.int32)
    y = cpu.sparse_ffn(x, gate, up, down_t, rows, "relu")
    h = torch.relu(cpu.gemv(gate, x)) * cpu.gemv(up, x)
    assert torch.equal(y, cpu.axpy_rows(down_t, h, rows))


# -------------------------------------------------------------------------- quantizer

def test_activation_quantizer_matches_reference(level):
    for k in (1, 31, 32, 100, 4096 + 17):
        x = rand(k, seed=k) * 3
        x[0] = 0.5  # includes exact ties after scaling in some blocks
        kp = padded(k)
        q, d, s = torch.empty(kp, dtype=torch.int8), torch.empty(kp // 32), torch.empty(kp // 32)
        cpu._cpu.quantize(cpu._cpu.XL_NATURAL, x.data_ptr(), k, q.data_ptr(), d.data_ptr(), s.data_ptr())
        rq, rd, rs = ref.quantize_activation(x)
        assert torch.equal(q, rq) and torch.equal(d, rd)
        assert torch.allclose(s, rs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ determinism

def all_results(seed=0):
    out = []
    g = torch.Generator().manual_seed(seed)
    for fmt in ("q4", "q8", "f16", "bf16", "f32"):
        w = make_weight(fmt, 512, 1000, seed=1)
        wt = make_weight(fmt, 512, 1000, seed=2)
        x = rand(1000, seed=3)
        rows = torch.sort(torch.randperm(512, generator=g)[:300])[0].int()
        out += [cpu.gemv(w, x), cpu.matmul(w, rand(9, 1000, seed=4)), cpu.gemv_rows(w, x, rows),
                cpu.axpy_rows(wt, rand(300, seed=5), rows), cpu.axpy_rows(wt, rand(30, seed=5), rows[:30]),
                cpu.sparse_ffn(x, w, make_weight(fmt, 512, 1000, seed=6), wt, rows, "silu")]
    return out


def test_bit_identical_across_runs_and_threads(threads):
    threads(1)
    base = all_results()
    for n in (1, 2, 3, 2):
        threads(n)
        assert cpu.get_num_threads() == n
        for a, b in zip(base, all_results()):
            assert torch.equal(a, b)


def test_concurrent_python_threads(threads):
    """Calls from several Python threads at once (the GIL is released) give the same results."""
    import threading

    threads(2)
    w, wt = make_weight("q4", 512, 1000, seed=1), make_weight("q8", 512, 1000, seed=2)
    x, rows = rand(1000), torch.arange(0, 512, 2, dtype=torch.int32)
    want = (cpu.gemv(w, x), cpu.sparse_ffn(x, w, w, wt, rows, "gelu"))
    bad = []

    def worker():
        for _ in range(30):
            got = (cpu.gemv(w, x), cpu.sparse_ffn(x, w, w, wt, rows, "gelu"))
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                bad.append(1)

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


def test_works_after_fork(threads):
    import multiprocessing as mp

    threads(2)
    w, x = make_weight("q4", 256, 512), rand(512)
    want = cpu.gemv(w, x)  # the pool is running before the fork
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(_gemv_in_child, (w, x))
    assert torch.equal(got, want)


def test_pickled_weight_gets_fresh_pointers():
    import pickle

    w, x = make_weight("q8m", 64, 96), rand(96)
    want = cpu.gemv(w, x)  # caches the descriptor on w
    w2 = pickle.loads(pickle.dumps(w))
    del w
    assert torch.equal(cpu.gemv(w2, x), want)


def _gemv_in_child(w, x):
    return cpu.gemv(w, x)


# ------------------------------------------------------------------------- validation

def test_bad_inputs_raise_value_error():
    w = make_weight("q4", 16, 64)
    x = rand(64)
    rows = torch.tensor([0, 3], dtype=torch.int32)
    bad = [
        lambda: cpu.gemv(w, rand(63)),
        lambda: cpu.gemv(w, x.double()),
        lambda: cpu.gemv(w, rand(2, 32)),
        lambda: cpu.gemv(QWeight("q5", 16, 64, w.qs, w.d, w.m), x),
        lambda: cpu.gemv(QWeight("q4", 16, 64, w.qs, w.d, None), x),
        lambda: cpu.gemv(QWeight("q4", 16, 96, w.qs, w.d, w.m), rand(96)),
        lambda: cpu.gemv(QWeight("f32", 16, 64, rand(64, 16).T, None, None), x),
        lambda: cpu.gemv(QWeight("f16", 16, 64, rand(16, 64), None, None), x),
        lambda: cpu.matmul(w, rand(3, 65)),
        lambda: cpu.matmul(w, rand(64)),
        lambda: cpu.gemv_rows(w, x, torch.tensor([0, 16], dtype=torch.int32)),
        lambda: cpu.gemv_rows(w, x, torch.tensor([-1], dtype=torch.int32)),
        lambda: cpu.gemv_rows(w, x, torch.tensor([0.0])),
        lambda: cpu.axpy_rows(w, rand(2), torch.tensor([0, 99], dtype=torch.int32)),
        lambda: cpu.axpy_rows(w, rand(3), rows),
        lambda: cpu.sparse_ffn(x, w, w, w, rows, "swish"),
        lambda: cpu.sparse_ffn(x, make_weight("q4", 8, 64), w, w, rows, "silu"),
        lambda: cpu.sparse_ffn(x, None, w, make_weight("q4", 8, 64), rows, "silu"),
        lambda: cpu.sparse_ffn(x, None, w, w, torch.tensor([16], dtype=torch.int32), "silu"),
        lambda: cpu.sparse_ffn(rand(65), None, w, w, rows, "silu"),
        lambda: cpu.set_num_threads(0),
    ]
    for i, f in enumerate(bad):
        with pytest.raises(ValueError):
            f()
            pytest.fail(f"case {i} did not raise")


def test_empty_hugepages():
    t = cpu.empty_hugepages((3, 1 << 20), torch.int8)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.int8
    t.fill_(1)
    assert int(t.sum()) == 3 << 20
    assert cpu.empty_hugepages((0,)).numel() == 0


def test_fallback_without_extension(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu", None)
    monkeypatch.setattr(cpu, "_IMPORT_ERROR", ImportError("simulated"), raising=False)
    monkeypatch.setattr(cpu, "_warned", False)
    w = make_weight("q8", 8, 40)
    x = rand(40)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert torch.equal(cpu.gemv(w, x), ref.gemv(w, x))
        cpu.gemv(w, x)
    assert len([r for r in rec if "reference" in str(r.message)]) == 1
    assert cpu.simd_level() == "reference"


@pytest.mark.parametrize("name", ["silu", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 8960])
def test_activation_matches_torch(name, n):
    """The decode steps' vectorized activation against torch's in float64 (torch's own float32
    GELU differs from it by ~1e-6 on AVX-512 hosts), over ordinary values, the tails past +-87
    (where e^-|v| underflows), zeros and a length that is no multiple of 8."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 4
    x[: min(n, 4)] = torch.tensor([-100.0, 100.0, 0.0, -0.0])[: min(n, 4)]
    if n > 8:
        x[5:8] = torch.tensor([-87.5, 87.5, -1e-8])
    want = {"silu": torch.nn.functional.silu, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[name](x.double())
    y = cpu.act(x, name)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu.act(x, name), y)  # deterministic


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 64), (2, 5, 1536), (1, 1, 4097)])
def test_rms_norm_matches_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    y = cpu.rms_norm(x, w, 1e-5)
    want = ref.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu.rms_norm(x, w, 1e-5), y)  # deterministic
    xt = x.transpose(0, -1).contiguous().transpose(0, -1)  # non-contiguous input
    assert torch.equal(cpu.rms_norm(xt, w, 1e-5), y)
    assert cpu.rms_norm(torch.zeros(0, shape[-1]), w, 1e-5).shape == (0, shape[-1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 1), (37, 70), (300, 33), (64, 96), (3, 100), (5, 200), (9, 1536)])
def test_dequantize_rows_equals_reference(fmt, shape):
    w = make_weight(fmt, *shape)
    want = w.dequantize()
    assert torch.equal(cpu.dequantize_rows(w), want)
    r0, r1 = shape[0] // 3, shape[0] - shape[0] // 4
    assert torch.equal(cpu.dequantize_rows(w, r0, r1), want[r0:r1])
    assert cpu.dequantize_rows(w, r1, r1).shape == (0, shape[1])
    with pytest.raises(ValueError):
        cpu.dequantize_rows(w, 0, shape[0] + 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 130])
def test_matmul_f32_equals_float_product(fmt, m, monkeypatch):
    monkeypatch.setattr(cpu, "_SLICE_BYTES", 4 * 70 * 16)  # several slices, one partial
    w = make_weight(fmt, 75, 70)
    x = rand(m, 70)
    want = x.double() @ w.dequantize().double().T
    y = cpu.matmul_f32(w, x)
    assert y.shape == (m, 75) and y.is_contiguous()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu.matmul_f32(w, x), y)


@pytest.mark.parametrize("fmt", FORMATS + ["q4k"])
@pytest.mark.parametrize("m", [2, 5, 130])
def test_matmul_bf16_matches_its_reference(fmt, m, monkeypatch):
    """The bfloat16 GEMM over dequantized slices against reference.matmul_bf16 (the same
    roundings in float64): equal up to one bfloat16 step of the output, which the float32 sums'
    order may move across a rounding boundary; repeatable."""
    cols = 256 if fmt == "q4k" else 70
    monkeypatch.setattr(cpu, "_SLICE_BYTES", 4 * cols * 16)  # several slices, one partial
    w, x = make_weight(fmt, 75, cols), rand(m, cols)
    want = ref.matmul_bf16(w, x)
    y = cpu.matmul_bf16(w, x)
    assert y.shape == (m, 75) and y.is_contiguous() and y.dtype == torch.float32
    mag = x.double().abs() @ w.dequantize().double().abs().T
    assert bool(((y.double() - want.double()).abs() <= 2.0 ** -7 * want.double().abs() + 1e-6 * mag).all())
    assert torch.equal(cpu.matmul_bf16(w, x), y)


def test_bf16_detection_agrees_with_the_kernel_of_the_os():
    """The compiled core's bfloat16 detection (cpuid) against the flags Linux lists."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is None or not cpu.available():
        pytest.skip("no x86 /proc/cpuinfo flags here")
    assert cpu.bf16_gemm_native() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_prefill_route_takes_bf16_gemm_only_where_it_pays(monkeypatch):
    """kernels.matmul sends long prompts of q4k (and q6) weights to the bfloat16 GEMM on CPUs
    that multiply bfloat16 natively, in the int8 activation mode, off the tile levels; never q4,
    never short prompts, never without native bfloat16."""
    import sparseinfer.kernels as K

    calls = []
    monkeypatch.setattr(cpu, "matmul_bf16", lambda w, x: calls.append(w.fmt) or torch.zeros(x.shape[0], w.rows))
    monkeypatch.setattr(cpu, "simd_level", lambda: "avx512vnni")
    old = cpu.activation_mode()
    try:
        cpu.set_activation_mode("int8")
        w4k, w4, x = make_weight("q4k", 8, 256), make_weight("q4", 8, 256), rand(K._BF16_GEMM_MIN_ROWS["q4k"], 256)
        monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: True)
        K.matmul(w4k, x), K.matmul(w4, x), K.matmul(w4k, x[:4])
        assert calls == ["q4k"]
        monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: False)
        K.matmul(w4k, x)
        assert calls == ["q4k"]
        monkeypatch.setattr(cpu, "bf16_gemm_native", lambda: True)
        cpu.set_activation_mode("precise")
        K.matmul(w4k, x)
        assert calls == ["q4k"]
    finally:
        cpu.set_activation_mode(old)


def test_dequantize_and_f32_product_without_extension(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu", None)
    monkeypatch.setattr(cpu, "_IMPORT_ERROR", ImportError("simulated"), raising=False)
    monkeypatch.setattr(cpu, "_warned", True)
    w = make_weight("q4", 20, 40)
    assert torch.equal(cpu.dequantize_rows(w, 3, 9), w.dequantize()[3:9])
    x = rand(7, 40)
    torch.testing.assert_close(cpu.matmul_f32(w, x), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- decode attention

@pytest.mark.parametrize("H,Hk,D,L", [(12, 2, 128, 600), (9, 3, 64, 1), (4, 4, 33, 17), (8, 1, 16, 13), (16, 2, 8, 9)])
def test_attend1_matches_float64_attention(level, threads, H, Hk, D, L):
    """One query per head over L cached positions held in a longer cache (views), GQA
    included, against float64 softmax attention with repeated K/V; same bits at 1 and 2
    threads."""
    g = torch.Generator().manual_seed(H * L)
    cap = L + 7
    kc, vc = torch.randn(1, Hk, cap, D, generator=g) * 2, torch.randn(1, Hk, cap, D, generator=g)
    k, v = kc[:, :, :L], vc[:, :, :L]
    q = torch.randn(1, H, 1, D, generator=g) * 2
    kr, vr = k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
    want = torch.softmax(q.double() @ kr.transpose(-1, -2) / D ** 0.5, -1) @ vr
    threads(2)
    got = cpu.attend1(q, k, v)
    assert got.shape == (1, H, 1, D)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(v.abs().max()))
    threads(1)
    assert torch.equal(cpu.attend1(q, k, v), got)


def test_attend1_falls_back_for_other_inputs():
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)  # 3 queries
    assert torch.allclose(cpu.attend1(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))


# -------------------------------------------------------------------------- strided row views

def strided_copy(w: QWeight, pad_bytes: int = 96) -> tuple[torch.Tensor, QWeight]:
    """`w` as row views into one wider buffer (values, then scales and mins, then padding per
    row), the layout of SparseFFN's neuron records; returns (buffer, view weight)."""
    parts = [(n, getattr(w, n)) for n in ("qs", "d", "m") if getattr(w, n) is not None]
    widths = [t.shape[1] * t.element_size() for _, t in parts]
    buf = torch.zeros(w.rows, sum(widths) + pad_bytes, dtype=torch.uint8)
    views, o = {}, 0
    for (n, t), nb in zip(parts, widths):
        buf[:, o:o + nb].copy_(t.contiguous().view(torch.uint8).view(w.rows, nb))
        views[n] = buf[:, o:o + nb].view(t.dtype)
        o += nb
    return buf, QWeight(w.fmt, w.rows, w.cols, views["qs"], views.get("d"), views.get("m"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_strided_row_views_equal_contiguous_weights(level, fmt):
    """Every kernel reads a weight given as row views of a wider buffer (a row stride above
    the row's width, for values and scales) exactly as the contiguous weight."""
    g = torch.Generator().manual_seed(7)
    for i, (n, k) in enumerate([(5, 7), (37, 100), (64, 256), (6, 4096 + 96)]):
        w = make_weight(fmt, n, k, seed=i)
        buf, v = strided_copy(w)
        assert not v.qs.is_contiguous() or n == 1
        x, X = rand(k, seed=i), rand(3, k, seed=i + 1)
        assert torch.equal(cpu.gemv(v, x), cpu.gemv(w, x))
        assert torch.equal(cpu.matmul(v, X), cpu.matmul(w, X))
        for rows in row_sets(n, g).values():
            assert torch.equal(cpu.gemv_rows(v, x, rows), cpu.gemv_rows(w, x, rows))
            h = rand(rows.numel(), seed=i)
            if fmt != "q6":
                assert torch.equal(cpu.axpy_rows(v, h, rows), cpu.axpy_rows(w, h, rows))


def test_strided_views_are_checked():
    """Views whose values are not contiguous within a row, or whose scales and mins have
    different row strides, are refused with a clear error."""
    w = make_weight("q8m", 8, 64)
    _, v = strided_copy(w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.gemv(QWeight("q8", 8, 64, torch.zeros(64, 8, dtype=torch.int8).t(), w.d, w.m), rand(64))
    m2 = torch.zeros(8, 8, dtype=torch.float16)[:, :2]
    with pytest.raises(ValueError, match="same row stride"):
        cpu.gemv(QWeight("q8", 8, 64, v.qs, v.d, m2), rand(64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleave_rows_keeps_results_and_puts_each_row_in_one_piece(level, fmt):
    """`interleave_rows`: each row's scales, mins and values lie in one contiguous piece of one
    buffer (scales first), and every kernel gives exactly the contiguous weight's results;
    float formats come back as they are."""
    g = torch.Generator().manual_seed(5)
    for i, (n, k) in enumerate([(1, 7), (37, 100), (64, 256), (6, 4096 + 96)]):
        w = make_weight(fmt, n, k, seed=i)
        v = cpu.interleave_rows(w)
        if w.fmt in ("f32", "f16", "bf16"):
            assert v is w
            continue
        parts = [t for t in (v.d, v.m, v.qs) if t is not None]
        assert len({t.untyped_storage().data_ptr() for t in parts}) == 1
        ends = [(t.data_ptr(), t.data_ptr() + t.shape[1] * t.element_size()) for t in parts]
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # d, m, qs back to back
        assert torch.equal(v.dequantize(), w.dequantize())
        x, X = rand(k, seed=i), rand(3, k, seed=i + 1)
        assert torch.equal(cpu.gemv(v, x), cpu.gemv(w, x))
        assert torch.equal(cpu.matmul(v, X), cpu.matmul(w, X))
        for rows in row_sets(n, g).values():
            assert torch.equal(cpu.gemv_rows(v, x, rows), cpu.gemv_rows(w, x, rows))
            if w.fmt != "q6":
                h = rand(rows.numel(), seed=i)
                assert torch.equal(cpu.axpy_rows(v, h, rows), cpu.axpy_rows(w, h, rows))


@pytest.mark.parametrize("act", ["silu", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("gated,relu_up,permuted", [(True, False, True), (True, True, False), (False, False, True)])
def test_hidden_rows_matches_torch(act, gated, relu_up, permuted):
    """Prefill's one-pass hidden activations (act, threshold mask, gating, un-permutation)
    against the torch composition, on strided rows (halves of one fused product)."""
    g = torch.Generator().manual_seed(3)
    M, n = 5, 301
    gu = torch.randn(M, 2 * n, generator=g) * 2
    gpre, u = gu[:, :n], gu[:, n:]
    order = torch.randperm(n, generator=g) if permuted else None
    f = {"silu": torch.nn.functional.silu, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act]
    for thr in (0.0, 0.3):
        a = f(gpre.double())
        h = a * (torch.relu(u.double()) if relu_up else u.double()) if gated else a
        h = h * (a.abs() > thr)
        if permuted:
            h = h.index_select(1, torch.argsort(order))
        got = cpu.hidden_rows(gpre.clone(), u if gated else None, act, thr, order, relu_up=relu_up)
        assert got.shape == (M, n)
        torch.testing.assert_close(got.double(), h, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu.available(), reason="needs the compiled kernels")
def test_interleave_head_keeps_logits_and_the_tied_embedding(level):
    """`interleave_head`: the output projection (q4/q8/q6 on the CPU, q4 up to 4096 wide, with
    the AVX-512 kernels) takes the interleaved layout, stays the embedding's weight when tied,
    and gives the same products and embeddings; wide q4 rows, float heads and the other kernel
    levels leave it as it is."""
    from types import SimpleNamespace

    from sparseinfer.models.base import Embedding
    from sparseinfer.models.layers import Linear
    from sparseinfer.models.registry import interleave_head

    for fmt, cols, tied, changes in [("q6", 96, True, True), ("q8", 100, False, True), ("q4", 256, True, True),
                                     ("q4", 4096 + 32, True, False), ("f16", 64, True, False)]:
        w = make_weight(fmt, 37, cols, seed=cols)
        embed = Embedding(w)
        head = Linear(w if tied else make_weight(fmt, 37, cols, seed=cols + 1))
        model = SimpleNamespace(embed=embed, head=head)
        x, toks = rand(cols, seed=1).view(1, 1, cols), torch.tensor([[0, 5, 36]])
        want_y, want_e, before = head(x), embed(toks), head.weight
        interleave_head(model)
        assert (head.weight is not before) == (changes and level.startswith("avx512"))
        assert (embed.weight is head.weight) == tied
        if head.weight is not before:
            assert head.weight.qs.untyped_storage().data_ptr() == head.weight.d.untyped_storage().data_ptr()
        assert torch.equal(head(x), want_y)
        assert torch.equal(embed(toks), want_e)


def test_read_rows_probe_modes():
    """The benchmark's random-row probe (`read_rows_seconds`): every read pattern (one row after
    another with or without software prefetch, 8 rows at a time) runs over the given rows, also
    when their count is not a multiple of 8, and bad arguments are refused."""
    buf = torch.ones(64 * 100, dtype=torch.uint8)
    rows = torch.tensor([0, 3, 4, 9, 17, 40, 41, 77, 98, 99, 12], dtype=torch.int32)
    for mode in (0, 1, 2):
        assert cpu._cpu.read_rows_seconds(buf.data_ptr(), 64, rows.data_ptr(), rows.numel(), 2, mode) > 0
    with pytest.raises(ValueError):
        cpu._cpu.read_rows_seconds(buf.data_ptr(), 0, rows.data_ptr(), rows.numel(), 1, 2)
