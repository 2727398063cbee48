"""Load-time validation: each kind of bad model file gets a one-line `ModelFormatError` that
says what is wrong, before any weight is converted, and never a hang, a traceback or garbage.

Files are built by editing tiny exported models (`gguf_spec`); the mutation fuzz over the
same files is in test_gguf_fuzz.py."""
from __future__ import annotations

import json
import struct
import time

import gguf
import numpy as np
import pytest
import torch

from sparseinfer.errors import ModelFormatError, SparseInferError, UnsupportedError
from sparseinfer.io.gguf import open_reader
from sparseinfer.io.weights import GGUFSource, SafetensorsSource, open_source
from sparseinfer.models.registry import build_model

from gguf_spec import KV, V, Spec, Tensor, add_tokenizer, read_spec, spec_bytes, write_spec
from tiny import export_gguf, hf_model, save_folder

F32, Q8_0 = int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.Q8_0)
KINDS = ("llama", "qwen2", "falcon", "falcon-40b", "opt")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {k: export_gguf(hf_model(k), d / f"{k}.gguf", "F32") for k in KINDS}


@pytest.fixture
def edit(tiny_files, tmp_path):
    """edit(kind, change) -> path of the tiny `kind` GGUF after change(spec)."""
    def make(kind: str, change) -> str:
        spec = read_spec(tiny_files[kind])
        change(spec)
        return write_spec(spec, tmp_path / f"{kind}-edited.gguf")
    return make


def load_error(path) -> str:
    """The one-line error opening and building `path` gives; building must not start."""
    with pytest.raises(ModelFormatError) as e:
        build_model(open_source(path))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def minimal(*tensors: Tensor, kvs=(), **kw) -> Spec:
    return Spec(kvs=[KV("general.architecture", V.STRING, "llama"), *kvs], tensors=list(tensors), **kw)


def f32_tensor(name="t", dims=(32, 2), offset=None) -> Tensor:
    n = int(np.prod(dims))
    return Tensor(name, list(dims), F32, np.zeros(n, np.float32).tobytes(), offset)


# --------------------------------------------------------------------------- the container
def test_truncated_inside_tensor_data(tiny_files, tmp_path):
    data = tiny_files["llama"].read_bytes()
    p = tmp_path / "t.gguf"
    p.write_bytes(data[: len(data) - 100])
    assert "truncated GGUF file: tensor" in load_error(p)


@pytest.mark.parametrize("cut", [5, 23, 40, 300])
def test_truncated_header(tiny_files, tmp_path, cut):
    p = tmp_path / "t.gguf"
    p.write_bytes(tiny_files["llama"].read_bytes()[:cut])
    msg = load_error(p)
    assert "truncated GGUF header" in msg or "bytes are left; the file is damaged or truncated" in msg


def test_huge_array_count_in_a_sparse_file_fails_at_once(tmp_path):
    """An array claiming 2**40 elements in a file whose holes read as zeros (every count
    "fits" a large enough file): refused by the count caps, not read element by element."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", V.ARRAY, V.STRING, 1 << 40)
    p = tmp_path / "sparse.gguf"
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(1 << 30)
    t0 = time.perf_counter()
    msg = load_error(p)
    assert time.perf_counter() - t0 < 5
    assert "key 'a' claims 1,099,511,627,776 array elements" in msg


def test_array_count_beyond_the_bytes_left(tmp_path):
    spec = minimal(kvs=[KV("x", V.ARRAY, [1, 2, 3], V.UINT32)])
    raw = spec_bytes(spec).replace(struct.pack("<IQ", V.UINT32, 3), struct.pack("<IQ", V.UINT32, 1000))
    p = tmp_path / "a.gguf"
    p.write_bytes(raw)
    assert "key 'x' claims 1,000 array elements (at least 4,000 bytes) but only" in load_error(p)


def test_huge_string_length(tmp_path):
    raw = spec_bytes(minimal()).replace(struct.pack("<Q", len("llama")) + b"llama", struct.pack("<Q", 1 << 62) + b"llama")
    p = tmp_path / "s.gguf"
    p.write_bytes(raw)
    assert "has a string of 4,611,686,018,427,387,904 bytes" in load_error(p)


@pytest.mark.parametrize("n_kv,n_tensors,needle", [(1 << 40, 0, "claims 1,099,511,627,776 keys"),
                                                    (1, 1 << 40, "claims 1,099,511,627,776 tensors")])
def test_huge_header_counts(tmp_path, n_kv, n_tensors, needle):
    p = write_spec(minimal(n_kv=n_kv, n_tensors=n_tensors), tmp_path / "c.gguf")
    assert needle in load_error(p)


def test_nested_arrays_too_deep(tmp_path):
    raw = spec_bytes(minimal(kvs=[KV("x", V.ARRAY, [], V.UINT8)]))
    deep = struct.pack("<IQ", V.ARRAY, 1) * 5 + struct.pack("<IQ", V.UINT8, 0)
    raw = raw.replace(struct.pack("<IIQ", V.ARRAY, V.UINT8, 0), struct.pack("<I", V.ARRAY) + deep)
    p = tmp_path / "n.gguf"
    p.write_bytes(raw)
    assert "nests arrays more than" in load_error(p)


def test_duplicate_key_and_tensor(tmp_path):
    p = write_spec(minimal(kvs=[KV("general.architecture", V.STRING, "llama")]), tmp_path / "k.gguf")
    assert "key 'general.architecture' appears twice" in load_error(p)
    p = write_spec(minimal(f32_tensor("w"), f32_tensor("w")), tmp_path / "t.gguf")
    assert "tensor 'w' appears twice" in load_error(p)


def test_unknown_value_type(tmp_path):
    raw = spec_bytes(minimal(kvs=[KV("x", V.UINT8, 0)])).replace(b"x" + struct.pack("<I", V.UINT8), b"x" + struct.pack("<I", 13))
    p = tmp_path / "v.gguf"
    p.write_bytes(raw)
    assert "key 'x' has unknown GGUF value type 13" in load_error(p)


def test_more_than_four_dims(tmp_path):
    p = write_spec(minimal(f32_tensor("w", (32, 1, 1, 1, 2))), tmp_path / "d.gguf")
    assert "tensor 'w' has 5 dimensions (GGUF tensors have 1 to 4)" in load_error(p)


def test_zero_dim(tmp_path):
    p = write_spec(minimal(f32_tensor("w", (32, 0))), tmp_path / "z.gguf")
    assert "tensor 'w' has a zero dimension (shape [32, 0])" in load_error(p)


def test_overflowing_dims(tmp_path):
    """2**32 x 2**32 elements: a uint64 product wraps to 0 (and a file of 0 bytes "fits")."""
    t = Tensor("w", [1 << 32, 1 << 32], F32, b"")
    p = write_spec(minimal(t), tmp_path / "o.gguf")
    assert "elements overflow a 64-bit count" in load_error(p)


def test_unknown_tensor_type_and_partial_block(tmp_path):
    p = write_spec(minimal(Tensor("w", [32], 99, b"\0" * 32)), tmp_path / "u.gguf")
    assert "tensor 'w' has unknown GGML type id 99" in load_error(p)
    p = write_spec(minimal(Tensor("w", [48, 2], Q8_0, b"\0" * 68)), tmp_path / "b.gguf")
    assert "tensor 'w' has 48 columns, not a multiple of the Q8_0 block of 32" in load_error(p)


def test_offset_outside_the_file(tmp_path):
    p = write_spec(minimal(f32_tensor("w", offset=1 << 40)), tmp_path / "f.gguf")
    assert "truncated GGUF file: tensor 'w' needs bytes up to" in load_error(p)


def test_overlapping_tensors(tmp_path):
    p = write_spec(minimal(f32_tensor("a", (32, 4)), f32_tensor("b", offset=512)), tmp_path / "ok.gguf")
    assert [t.name for t in open_reader(p).tensors] == ["a", "b"]  # a: bytes 0-512, b after it
    p = write_spec(minimal(f32_tensor("a", (32, 4)), f32_tensor("b", offset=128)), tmp_path / "ov.gguf")
    assert "tensor 'b' starts at byte" in load_error(p) and "inside tensor 'a'" in load_error(p)


def test_misaligned_offset(tmp_path):
    p = write_spec(minimal(f32_tensor("a"), f32_tensor("b", offset=260)), tmp_path / "m.gguf")
    assert "tensor 'b' starts at data offset 260, not a multiple of the alignment 32" in load_error(p)


@pytest.mark.parametrize("align", [0, 3])
def test_bad_alignment(tmp_path, align):
    p = write_spec(minimal(kvs=[KV("general.alignment", V.UINT32, align)]), tmp_path / "al.gguf")
    assert f"general.alignment is {align}; it must be a power of two" in load_error(p)


@pytest.mark.parametrize("key,vtype,value,needle", [
    ("general.alignment", V.STRING, "x", "key 'general.alignment' holds a string; it must hold an integer"),
    ("general.architecture", V.UINT32, 7, "key 'general.architecture' holds an integer; it must hold a string"),
    ("tokenizer.ggml.tokens", V.UINT32, 0, "key 'tokenizer.ggml.tokens' holds an integer; it must hold an array of strings"),
    ("tokenizer.ggml.token_type", V.FLOAT32, 1.0, "holds a number; it must hold an array of integers"),
    ("tokenizer.ggml.bos_token_id", V.STRING, "1", "key 'tokenizer.ggml.bos_token_id' holds a string; it must hold an integer"),
])
def test_metadata_of_the_wrong_type(tmp_path, key, vtype, value, needle):
    spec = minimal()
    spec.kvs = [k for k in spec.kvs if k.key != key] + [KV(key, vtype, value)]
    assert needle in load_error(write_spec(spec, tmp_path / "kt.gguf"))


def test_metadata_array_of_the_wrong_element_type(tmp_path):
    p = write_spec(minimal(kvs=[KV("tokenizer.ggml.merges", V.ARRAY, [1, 2], V.INT32)]), tmp_path / "kt.gguf")
    assert "key 'tokenizer.ggml.merges' holds other values; it must hold an array of strings" in load_error(p)


# --------------------------------------------------------------------------- config vs tensors
@pytest.mark.parametrize("kind,tensor,needs", [
    ("llama", "blk.0.attn_norm.weight", (64,)),
    ("llama", "output_norm.weight", (64,)),
    ("qwen2", "blk.1.attn_q.bias", (64,)),
    ("qwen2", "blk.0.attn_k.bias", (32,)),
    ("falcon", "blk.0.attn_norm.bias", (64,)),
    ("falcon-40b", "blk.1.attn_norm_2.weight", (64,)),
    ("opt", "blk.0.ffn_norm.bias", (64,)),
    ("opt", "blk.1.attn_output.bias", (64,)),
    ("opt", "blk.0.ffn_up.bias", (160,)),
])
def test_one_element_norm_or_bias(edit, kind, tensor, needs):
    p = edit(kind, lambda s: s.set_f32(tensor, np.ones(1)))
    assert load_error(p) == (f"{p}: {tensor} has shape (1,), the config needs {needs}: "
                             "the file is damaged or not a supported model")


@pytest.mark.parametrize("kind,tensor,bad,needs", [
    ("llama", "blk.0.attn_q.weight", (48, 64), (64, 64)),
    ("llama", "blk.1.attn_k.weight", (64, 64), (32, 64)),
    ("llama", "blk.0.attn_v.weight", (32, 60), (32, 64)),
    ("llama", "blk.0.ffn_down.weight", (64, 128), (64, 160)),
    ("falcon", "blk.0.attn_qkv.weight", (64 * 3, 64), (96, 64)),
    ("opt", "blk.0.attn_k.weight", (64, 32), (64, 64)),
    ("opt", "position_embd.weight", (100, 64), (258, 64)),
])
def test_wrong_shape_matrix(edit, kind, tensor, bad, needs):
    p = edit(kind, lambda s: s.set_f32(tensor, np.zeros(bad)))
    assert f"{tensor} has shape {bad}, the config needs {needs}" in load_error(p)


def test_vocabulary_not_the_embedding(edit):
    p = edit("llama", lambda s: s.set("llama.vocab_size", 300))
    assert "token_embd.weight has shape (256, 64), the config needs (300, 64)" in load_error(p)


def test_missing_tensor_found_before_any_weight_is_read(edit, monkeypatch):
    p = edit("llama", lambda s: s.tensors.remove(s.tensor("blk.1.ffn_up.weight")))
    read = []
    monkeypatch.setattr(GGUFSource, "qweight", lambda self, name: read.append(name))
    monkeypatch.setattr(GGUFSource, "prefetch", lambda self: read.append("prefetch"))
    assert "tensor blk.1.ffn_up.weight is missing" in load_error(p)
    assert read == []


def test_shape_check_before_any_weight_is_read(edit, monkeypatch):
    p = edit("llama", lambda s: s.set_f32("blk.1.ffn_norm.weight", np.ones(3)))
    read = []
    monkeypatch.setattr(GGUFSource, "qweight", lambda self, name: read.append(name))
    monkeypatch.setattr(GGUFSource, "tensor", lambda self, name: read.append(name))
    load_error(p)
    assert read == []


@pytest.mark.parametrize("key,value,needle", [
    ("llama.attention.head_count", 0, "llama.attention.head_count is 0; it must be an integer > 0"),
    ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv is 0; it must be an integer > 0"),
    ("llama.attention.head_count_kv", 3, "llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
    ("llama.attention.head_count", 5, "llama.embedding_length 64 is not a multiple of llama.attention.head_count 5"),
    ("llama.block_count", 0, "llama.block_count is 0"),
    ("llama.embedding_length", 0, "llama.embedding_length is 0"),
    ("llama.vocab_size", 0, "llama.vocab_size is 0"),
    ("llama.feed_forward_length", 0, "llama.feed_forward_length is 0"),
    ("llama.rope.dimension_count", 15, "15 rotary dimensions per head of 16"),
    ("llama.rope.dimension_count", 32, "32 rotary dimensions per head of 16"),
])
def test_bad_config_values(edit, key, value, needle):
    p = edit("llama", lambda s: s.set(key, value))
    msg = load_error(p)
    assert msg.startswith(f"{p}: model config: ") and needle in msg


def test_config_value_of_the_wrong_type(edit):
    p = edit("llama", lambda s: s.set("llama.attention.head_count", "four", V.STRING))
    assert "llama.attention.head_count is 'four'; it must be an integer > 0" in load_error(p)
    p = edit("llama", lambda s: s.set("llama.rope.freq_base", float("nan"), V.FLOAT32))
    assert "llama.rope.freq_base is nan; it must be a finite number > 0" in load_error(p)


def test_per_layer_head_counts_are_unsupported(edit):
    p = edit("llama", lambda s: s.kvs.__setitem__(
        [k.key for k in s.kvs].index("llama.attention.head_count"), KV("llama.attention.head_count", V.ARRAY, [4, 4], V.UINT32)))
    with pytest.raises(UnsupportedError, match="one value per layer"):
        open_source(p)


def test_tokenizer_larger_than_the_embedding(edit):
    import sparseinfer

    p = edit("llama", lambda s: (add_tokenizer(s), s.set("llama.vocab_size", 256)))
    sparseinfer.load(p, dense=True)  # 256 tokens, 256 rows: fine
    p = edit("llama", lambda s: (add_tokenizer(s), s.kv("tokenizer.ggml.tokens").value.append("x"),
                                 s.kv("tokenizer.ggml.token_type").value.append(1)))
    with pytest.raises(ModelFormatError, match="the tokenizer has 257 tokens but the model only 256"):
        sparseinfer.load(p, dense=True)


# --------------------------------------------------------------------------- --check-tensors
def test_nan_weight_refused_with_check_tensors(edit):
    import sparseinfer

    def poison(s):
        add_tokenizer(s)
        a = np.frombuffer(s.tensor("blk.1.ffn_gate.weight").data, np.float32).copy()
        a[7] = np.nan
        a[9] = np.inf
        s.set_f32("blk.1.ffn_gate.weight", a.reshape(160, 64))

    p = edit("llama", poison)
    sparseinfer.load(p, dense=True)  # without the check the file loads (as llama.cpp does)
    with pytest.raises(ModelFormatError) as e:
        sparseinfer.load(p, dense=True, check_tensors=True)
    assert str(e.value) == (f"{p}: tensor blk.1.ffn_gate.weight has 2 NaN or infinite values; "
                            "the file is damaged: re-download or re-convert it")


def test_nan_block_scale_refused_with_check_tensors(tmp_path):
    """In a quantized tensor only the block scales can be NaN (the codes are integers)."""
    spec = read_spec(export_gguf(hf_model("llama"), tmp_path / "q.gguf", "Q8_0"))
    t = spec.tensor("blk.0.attn_v.weight")
    raw = bytearray(t.data)
    raw[34:36] = np.array([np.nan], np.float16).tobytes()  # the f16 scale of the 2nd block
    t.data = bytes(raw)
    p = write_spec(spec, tmp_path / "nan.gguf")
    build_model(open_source(p))
    with pytest.raises(ModelFormatError, match="tensor blk.0.attn_v.weight has 1 NaN or infinite block scales"):
        build_model(open_source(p, check_tensors=True))


def test_nan_norm_in_a_safetensors_folder(tmp_path):
    hf = hf_model("opt")
    with torch.no_grad():
        hf.model.decoder.layers[1].final_layer_norm.bias[3] = float("nan")
    path = save_folder(hf, tmp_path / "opt")
    build_model(open_source(path))
    with pytest.raises(ModelFormatError, match=r"tensor model\.decoder\.layers\.1\.final_layer_norm\.bias has 1 NaN"):
        build_model(open_source(path, check_tensors=True))


def test_cli_check_tensors(edit):
    from test_cli import run_cli

    def poison(s):
        a = np.frombuffer(s.tensor("output_norm.weight").data, np.float32).copy()
        a[0] = np.nan
        s.set_f32("output_norm.weight", a)

    p = edit("llama", poison)
    assert run_cli("inspect", str(p)).returncode == 0
    r = run_cli("inspect", str(p), "--check-tensors")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: {p}: tensor output_norm.weight has 1 NaN or infinite values; "
                                "the file is damaged: re-download or re-convert it")


def test_cli_wrong_shape_is_one_line(edit):
    from test_cli import run_cli

    p = edit("qwen2", lambda s: s.set_f32("blk.0.attn_v.bias", np.zeros(1)))
    for cmd in (["inspect", str(p)], ["run", "-m", str(p), "-p", "hi"]):
        r = run_cli(*cmd)
        assert r.returncode == 1 and r.stderr.strip() == (
            f"error: {p}: blk.0.attn_v.bias has shape (1,), the config needs (32,): "
            "the file is damaged or not a supported model"), cmd


# --------------------------------------------------------------------------- safetensors folders
def _folder(tmp_path, kind="llama"):
    return save_folder(hf_model(kind), tmp_path / kind)


def test_safetensors_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _folder(tmp_path)
    f = path / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.0.input_layernorm.weight"] = torch.ones(1)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError) as e:
        build_model(SafetensorsSource(path))
    assert str(e.value) == (f"{path}: model.layers.0.input_layernorm.weight has shape (1,), the config needs (64,): "
                            "the file is damaged or not a supported model")


@pytest.mark.parametrize("key,value,needle", [
    ("num_attention_heads", 0, "num_attention_heads is 0; it must be an integer > 0"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("hidden_size", "64", "hidden_size is '64'; it must be an integer > 0"),
    ("num_hidden_layers", None, "model config lacks num_hidden_layers"),
    ("rms_norm_eps", -1.0, "rms_norm_eps is -1.0; it must be a finite number >= 0"),
    ("rope_scaling", "yes", "rope_scaling is 'yes'; it must be a mapping"),
])
def test_safetensors_bad_config(tmp_path, key, value, needle):
    path = _folder(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SparseInferError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        open_source(path)


def test_safetensors_integer_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _folder(tmp_path)
    f = path / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(160, 64, dtype=torch.int32)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="tensor model.layers.1.mlp.up_proj.weight has dtype I32"):
        build_model(SafetensorsSource(path))


def test_safetensors_damaged_index(tmp_path):
    path = _folder(tmp_path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(ModelFormatError, match="not a safetensors index"):
        open_source(path)


def test_trailing_unit_dims_are_the_same_tensor(edit, tiny_files):
    """ggml pads shapes with 1s: a norm stored as [64, 1] is the (64,) norm, as llama.cpp reads it."""
    def pad(s):
        s.tensor("blk.0.attn_norm.weight").dims = [64, 1]
        s.tensor("output_norm.weight").dims = [64, 1, 1, 1]

    padded, plain = build_model(open_source(edit("llama", pad))), build_model(open_source(tiny_files["llama"]))
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(padded(x, padded.new_cache(8)), plain(x, plain.new_cache(8)))


def test_progress_counts_every_tensor_read(tiny_files, tmp_path):
    """Load progress (`WeightSource.on_read`) advances once per tensor the builder reads, every
    tensor of the file is read at least once, and `load(progress=True)` leaves no hook behind."""
    import sparseinfer

    path = tiny_files["llama"]
    src = open_source(path)
    reads = []
    src.on_read = lambda: reads.append(1)
    with torch.inference_mode():
        build_model(src)
    assert len(reads) >= src.n_tensors() == len(open_reader(path).tensors)
    with_tokenizer = write_spec(add_tokenizer(read_spec(path)), tmp_path / "tok.gguf")
    llm = sparseinfer.load(with_tokenizer, threads=1, progress=True)
    assert llm.source.on_read is None
