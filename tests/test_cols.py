"""Column-grouped q4 weights (`quant.ColWeight`) and the input-sparse product on them
(`cpu.gemv_cols`): the layout holds exactly the row-major q4 values; the fast kernel on every
SIMD level equals the reference with its rounding of x reproduced (summation order aside),
stays within the int8 bound of the exact masked product, reads the kept inputs only and gives
bit-identical results for any thread count."""
import pytest
import torch

from sparseinfer.kernels import cpu
from sparseinfer.kernels import reference as ref
from sparseinfer.quant import ColWeight, from_float, to_cols

pytestmark = pytest.mark.skipif(not cpu.available(), reason="compiled kernels not built")

# rows: multiples of 128, of 64 only (a 64-row last block), and neither (padding rows);
# cols: whole and partial groups of 32
SHAPES = [(64, 32), (128, 64), (192, 96), (200, 70), (576, 576), (1000, 33), (1536, 4096 + 96)]


def weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return from_float(torch.randn(rows, cols, generator=g), "q4")


def vec(n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_layout_holds_the_row_major_values(rows, cols):
    w = weight(rows, cols)
    cw = to_cols(w)
    assert cw.shape == (rows, cols)
    assert torch.equal(cw.dequantize(), w.dequantize())
    # the same bytes per weight as the row-major q4 (padding aside)
    assert cw.nbytes == (cols + 31) // 32 * 32 * cw.np * 5 // 8


def test_layout_from_strided_rows():
    """A q4 weight whose rows are views into a larger buffer (neuron records, fused q/k/v)."""
    big = weight(256, 96)
    view = type(big)("q4", 128, 96, big.qs[::2], big.d[::2], big.m[::2])
    assert torch.equal(to_cols(view).dequantize(), view.dequantize())


def test_only_q4_converts():
    with pytest.raises(ValueError, match="q4"):
        to_cols(from_float(torch.randn(64, 32), "q8"))


def _bound(cw, x, thr):
    """1e-5 of the sum of |terms| of the emulated product (float summation order only)."""
    xm = ref.input_mask(x, thr).abs()
    return 1e-5 * (cw.dequantize().abs() @ xm).double() + 1e-6


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_gemv_cols_matches_the_reference(level, rows, cols):
    cw = to_cols(weight(rows, cols))
    x = vec(cols)
    for q in (0.0, 0.3, 0.6, 0.9):
        thr = float(torch.quantile(x.abs(), q)) if q else -1.0
        y, kept = cpu.gemv_cols(cw, x, thr)
        assert kept == int((x.abs() > thr).sum())
        emu = ref.gemv_cols_emulated(cw, x, x.abs() > thr)
        assert ((y.double() - emu).abs() <= _bound(cw, x, thr)).all(), (level, q)
        # against the exact masked product: x rounded to int8 per group of 32 kept inputs
        exact, kept_ref = ref.gemv_cols(cw, x, thr)
        assert kept_ref == kept
        xm = ref.input_mask(x, thr)
        amax = torch.nn.functional.pad(xm.abs(), (0, -cols % 32)).view(-1, 32).amax(-1)
        step = (amax / 127).repeat_interleave(32)[:cols]
        assert ((y.double() - exact).abs() <= (cw.dequantize().abs() @ (step * (xm != 0))).double() / 2 + 1e-4).all()


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_gemv_cols_list_matches_the_reference(level, rows, cols):
    cw = to_cols(weight(rows, cols))
    x = vec(cols)
    g = torch.Generator().manual_seed(rows)
    for frac in (1.0, 0.5, 0.1):
        idx = torch.sort(torch.randperm(cols, generator=g)[: max(1, int(frac * cols))])[0].to(torch.int32)
        h = x[idx.long()]
        y = cpu.gemv_cols_list(cw, h, idx)
        keep = torch.zeros(cols, dtype=torch.bool)
        keep[idx.long()] = True
        emu = ref.gemv_cols_emulated(cw, x, keep)
        bound = 1e-5 * (cw.dequantize().abs() @ (x.abs() * keep)).double() + 1e-6
        assert ((y.double() - emu).abs() <= bound).all(), (level, frac)
        # the threshold form keeping the same inputs gives the same bits
        if frac == 1.0:
            assert torch.equal(y, cpu.gemv_cols(cw, x)[0])


def test_gemv_cols_list_rejects_bad_ids():
    cw = to_cols(weight(128, 64))
    for idx in ([3, 2], [1, 1], [0, 64], [-1, 5]):
        with pytest.raises(ValueError):
            cpu.gemv_cols_list(cw, torch.ones(2), torch.tensor(idx, dtype=torch.int32))
    assert torch.equal(cpu.gemv_cols_list(cw, torch.ones(0), torch.zeros(0, dtype=torch.int32)), torch.zeros(128))


def test_gemv_cols_skips_zeros_and_everything(level):
    cw = to_cols(weight(256, 128))
    x = vec(128)
    x[::3] = 0.0
    y, kept = cpu.gemv_cols(cw, x, 0.0)
    assert kept == int((x != 0).sum())
    y, kept = cpu.gemv_cols(cw, x, float(x.abs().max()))
    assert kept == 0 and torch.equal(y, torch.zeros(256))


def test_gemv_cols_thread_count_independent(threads):
    cw = to_cols(weight(1536, 4096))
    x = vec(4096)
    thr = float(torch.quantile(x.abs(), 0.5))
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(cpu.gemv_cols(cw, x, thr)[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_gemv_cols_levels_agree_bitwise_where_the_arithmetic_is_the_same(level):
    """Every level sums the same exact integers per group and scales them alike: the results
    match the portable level to float rounding of the final multiply-adds."""
    cw = to_cols(weight(320, 200))
    x = vec(200)
    y, _ = cpu.gemv_cols(cw, x, 0.2)
    old = cpu.simd_level()
    cpu._cpu.set_simd_level("scalar")
    try:
        y0, _ = cpu.gemv_cols(cw, x, 0.2)
    finally:
        cpu._cpu.set_simd_level(old)
    assert torch.allclose(y, y0, rtol=1e-6, atol=1e-5)


def test_gemv_cols_rejects_bad_inputs():
    cw = to_cols(weight(128, 64))
    with pytest.raises(ValueError):
        cpu.gemv_cols(cw, torch.randn(63))
    bad = ColWeight(cw.rows, cw.cols, cw.qs[:-1], cw.d, cw.m)
    with pytest.raises(ValueError):
        cpu.gemv_cols(bad, torch.randn(64))
    bad = ColWeight(cw.rows, cw.cols, cw.qs, cw.d.float(), cw.m)
    with pytest.raises(ValueError):
        cpu.gemv_cols(bad, torch.randn(64))
    with pytest.raises(ValueError):
        cpu.gemv_cols(weight(128, 64), torch.randn(64))
