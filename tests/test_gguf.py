"""GGUF block decoding against the gguf package's numpy dequantization, for every supported type,
and clear errors for bad files."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sparseinfer.errors import ModelFormatError
from sparseinfer.io import gguf as gio
from sparseinfer.io.weights import open_source

from tiny import export_gguf, hf_model


class FakeTensor:
    """Just enough of gguf's ReaderTensor for `tensor_to_qweight`."""

    def __init__(self, name, qtype, rows, cols, data):
        self.name, self.tensor_type = name, qtype
        self.shape = np.array([cols, rows])
        self.data = data


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng) -> np.ndarray:
    """Random raw blocks with sane f16 scale fields (every other byte pattern is a valid code)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    f16 = lambda n: rng.uniform(0.001, 0.05, size=(rows, cols // block, n)).astype(np.float16).view(np.uint8)  # noqa
    name = qtype.name
    if name in ("Q4_0", "Q8_0", "Q5_0"):
        raw[..., 0:2] = f16(1)
    elif name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        raw[..., 0:4] = f16(2)
    elif name == "Q6_K":
        raw[..., -2:] = f16(1)
    elif name in ("Q2_K", "Q3_K"):
        raw[..., -4 if name == "Q2_K" else -2:] = f16(2 if name == "Q2_K" else 1)
    return raw.reshape(rows, -1)


TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]


@pytest.mark.parametrize("tname", TYPES)
def test_block_decoding_matches_gguf(tname):
    rng = np.random.default_rng(0)
    qt = gguf.GGMLQuantizationType[tname]
    rows, cols = 6, 512
    raw = random_blocks(qt, rows, cols, rng)
    ref = gguf.quants.dequantize(raw, qt).reshape(rows, cols)
    w = gio.tensor_to_qweight(FakeTensor("t", qt, rows, cols, raw))
    ours = w.dequantize().numpy()
    exact = tname in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    if exact:  # repacked losslessly
        np.testing.assert_array_equal(ours, ref)
    elif tname in ("Q4_K", "Q5_K"):  # per-32 scale products rounded to f16
        np.testing.assert_allclose(ours, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    elif tname == "Q6_K":  # codes kept, per-16 scale products rounded to f16 once
        assert w.fmt == "q6"
        np.testing.assert_allclose(ours, ref, rtol=2 ** -11, atol=0)
    else:  # re-quantized to q8 per 32
        step = np.abs(ref).reshape(rows, -1, 32).max(-1, keepdims=True) / 127
        assert (np.abs(ours - ref).reshape(rows, -1, 32) <= step * 0.5 + 1e-6).all()


@pytest.mark.parametrize("tname", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 768), (33, 1536)])
def test_compiled_repack_equals_numpy_converters(tname, rows, cols):
    """The compiled Q4_K / Q6_K repack (what loading uses) gives the numpy converters' bytes
    and f16 scales bit for bit, including subnormal, zero and negative scale products."""
    from sparseinfer.kernels import cpu

    if cpu._cpu is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(rows)
    qt = gguf.GGMLQuantizationType[tname]
    raw = random_blocks(qt, rows, cols, rng).reshape(rows, cols // 256, -1)
    if tname == "Q4_K":  # a few super-blocks with tiny, zero and negative d / dmin
        raw[0, 0, 0:4] = np.array([1e-7, -3e-3], np.float16).view(np.uint8)
        raw[-1, -1, 0:4] = np.array([0.0, 6e-5], np.float16).view(np.uint8)
    else:
        raw[0, 0, -2:] = np.array([-2e-7], np.float16).view(np.uint8)
        raw[-1, -1, -2:] = np.array([0.0], np.float16).view(np.uint8)
    fast = gio._repack_c(tname, raw, rows, cols)
    slow = gio._repack_numpy(tname, raw, rows, cols)
    assert fast is not None and fast.fmt == slow.fmt and fast.shape == slow.shape
    assert torch.equal(fast.qs, slow.qs)
    assert torch.equal(fast.d.view(torch.int16), slow.d.view(torch.int16))
    if slow.m is None:
        assert fast.m is None
    else:
        assert torch.equal(fast.m.view(torch.int16), slow.m.view(torch.int16))


@pytest.mark.parametrize("tname", ["F32", "F16", "BF16"])
def test_float_types(tname):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 40)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[tname]
    data = a.astype(np.float16) if tname == "F16" else gguf.quants.quantize(a, qt) if tname == "BF16" else a
    ref = gguf.quants.dequantize(np.asarray(data), qt).reshape(5, 40)
    w = gio.tensor_to_qweight(FakeTensor("t", qt, 5, 40, data))
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)


def test_unsupported_type_is_named():
    qt = gguf.GGMLQuantizationType.IQ2_XXS
    with pytest.raises(ModelFormatError, match="IQ2_XXS"):
        gio.tensor_to_qweight(FakeTensor("blk.0.ffn_up.weight", qt, 2, 256, np.zeros((2, 66), np.uint8)))


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    return export_gguf(hf_model("llama"), tmp_path_factory.mktemp("g") / "m.gguf", "Q8_0")


def test_truncated_file(good_gguf, tmp_path):
    bad = tmp_path / "trunc.gguf"
    data = good_gguf.read_bytes()
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match="truncated"):
        open_source(bad)


def test_truncated_header(good_gguf, tmp_path):
    bad = tmp_path / "head.gguf"
    bad.write_bytes(good_gguf.read_bytes()[:200])
    with pytest.raises(ModelFormatError, match="damaged|truncated"):
        open_source(bad)


def test_wrong_magic(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        open_source(bad)


def test_missing_path(tmp_path):
    with pytest.raises(ModelFormatError, match="no such"):
        open_source(tmp_path / "nope.gguf")


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(1)
    w.add_vocab_size(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFormatError, match="unsupported architecture 'mamba'"):
        open_source(tmp_path / "m.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json"):
        open_source(tmp_path)


def _same_as_gguf_reader(path):
    ref = gguf.GGUFReader(path)
    ours = gio.open_reader(path)
    meta = gio.read_metadata(ours)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data_offset == b.data_offset and a.n_bytes == b.n_bytes
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    for k, f in ref.fields.items():
        if not k.startswith("GGUF."):
            v = f.contents()
            assert meta[k] == pytest.approx(v) if isinstance(v, float) else meta[k] == v, k


def test_parser_matches_gguf_reader_tiny(good_gguf):
    _same_as_gguf_reader(good_gguf)


def test_parser_matches_gguf_reader_smollm2(smollm2_path):
    _same_as_gguf_reader(smollm2_path)


@pytest.mark.parametrize("tname", TYPES)
def test_row_chunked_conversion_is_the_same(tname, monkeypatch):
    """A large tensor is converted in row chunks into its final buffers (bounded temporaries,
    the file's pages released behind): the result is the one-piece conversion's, byte for byte,
    and every chunk's rows are released once."""
    rng = np.random.default_rng(1)
    qt = gguf.GGMLQuantizationType[tname]
    rows, cols = 13, 512
    raw = random_blocks(qt, rows, cols, rng)
    whole = gio.tensor_to_qweight(FakeTensor("t", qt, rows, cols, raw))
    released = []
    t = FakeTensor("t", qt, rows, cols, raw)
    t.release_rows = lambda r0, r1: released.append((r0, r1))
    monkeypatch.setattr(gio, "_CHUNK_BYTES", raw[0].nbytes * 4)  # 4 rows a chunk, the last one short
    chunked = gio.tensor_to_qweight(t)
    assert (chunked.fmt, chunked.rows, chunked.cols) == (whole.fmt, whole.rows, whole.cols)
    for name in ("qs", "d", "m"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    if chunked.fmt in ("q4", "q8", "q6") and tname not in gio._REQUANT_Q8:
        assert released == [(0, 4), (4, 8), (8, 12), (12, 13)]


@pytest.mark.parametrize("tname", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K"])
@pytest.mark.parametrize("chunk_rows", [4, 100])
def test_conversion_into_row_records_equals_interleaving_after(tname, chunk_rows, monkeypatch):
    """Converting straight into row records (how the output head is loaded) gives the weight
    that converting and then `interleave_rows` gives: the same values, scales and mins."""
    from sparseinfer.kernels import cpu

    rng = np.random.default_rng(2)
    qt = gguf.GGMLQuantizationType[tname]
    rows, cols = 13, 512
    raw = random_blocks(qt, rows, cols, rng)
    monkeypatch.setattr(gio, "_CHUNK_BYTES", raw[0].nbytes * chunk_rows)
    monkeypatch.setenv("SPARSEINFER_Q4K", "0")  # Q4_K's q4 repack (kept as q4k it has no row records)
    after = cpu.interleave_rows(gio.tensor_to_qweight(FakeTensor("t", qt, rows, cols, raw)))
    direct = gio.tensor_to_qweight(FakeTensor("t", qt, rows, cols, raw), alloc=cpu.empty_records_like)
    assert cpu.is_interleaved(direct) and cpu.is_interleaved(after)
    for name in ("qs", "d", "m"):
        a, b = getattr(after, name), getattr(direct, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.stride() == b.stride() and torch.equal(a, b), name
    x = torch.randn(cols)
    assert torch.equal(cpu.gemv(direct, x), cpu.gemv(after, x))


@pytest.mark.parametrize("workers", [1, 2])
def test_fused_groups_are_loaded_into_one_buffer(tmp_path, workers, monkeypatch):
    """q/k/v and gate/up converted into one buffer each (with or without loader threads) give
    the model that converting them apart and fusing after gives, bit for bit; where the row
    layout pays, fusing then copies nothing."""
    import sparseinfer.models.registry as R
    from sparseinfer.io.weights import open_source
    from sparseinfer.kernels import cpu

    path = export_gguf(hf_model("qwen2"), tmp_path / "m.gguf", "Q8_0")
    x = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.inference_mode():
        with monkeypatch.context() as m:
            m.setattr(R, "FUSED", {})
            plain = R.build_model(open_source(path))
            ref = plain(x, plain.new_cache(16))
        copies = []
        records = cpu._records
        monkeypatch.setattr(cpu, "_records", lambda groups: copies.append(len(groups)) or records(groups))
        monkeypatch.setattr("os.cpu_count", lambda: workers)
        model = R.build_model(open_source(path))
        got = model(x, model.new_cache(16))
    assert torch.equal(got, ref)
    fused = [f for L in model.layers for f in (L.attn._qkv, L.mlp._gate_up) if f is not None]
    assert len(fused) == 2 * len(model.layers)
    if cpu.interleave_pays(model.layers[0].attn.q.weight):
        assert copies == [] and all(cpu.is_interleaved(f.weight) for f in fused)
