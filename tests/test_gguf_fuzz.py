"""Mutation fuzz of GGUF headers, metadata and tensor infos, seeded from tiny exported models
of each family (with a small byte-level BPE tokenizer, so a surviving file loads and decodes).

The property: `describe` (what `inspect` prints) and `load` either succeed, and the loaded
model then decodes, or raise `SparseInferError` with a one-line message from a specific check
(not the parser's last-resort catch-all); never another exception, never longer than a few
seconds, never a parse that allocates without bound.

The example budget is small and the search derandomized, so this runs the same in CI in well
under a minute; SPARSEINFER_FUZZ_EXAMPLES=5000 runs a longer search by hand."""
from __future__ import annotations

import copy
import os
import struct
import time
import tracemalloc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseinfer
from sparseinfer.describe import describe
from sparseinfer.errors import SparseInferError
from sparseinfer.io.gguf import open_reader

from gguf_spec import KV, V, add_tokenizer, read_spec, spec_bytes
from tiny import export_gguf, hf_model

EXAMPLES = int(os.environ.get("SPARSEINFER_FUZZ_EXAMPLES", "60"))
SEEDS = (("llama", "Q8_0"), ("qwen2", "F16"), ("falcon-40b", "F32"), ("opt", "Q4_0"))
BOUNDARY = [0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 63, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
PARSE_SECONDS, EXAMPLE_SECONDS = 5, 30
PARSE_BYTES = 256 << 20  # numpy/Python allocations while parsing, as tracemalloc sees them
LAST_RESORT = "damaged or truncated GGUF file ("  # open_reader's catch-all: no check claimed it


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """(spec, bytes, header length) of each seed file."""
    d = tmp_path_factory.mktemp("seeds")
    out = []
    for kind, qtype in SEEDS:
        spec = add_tokenizer(read_spec(export_gguf(hf_model(kind), d / f"{kind}.gguf", qtype)))
        raw = spec_bytes(spec)
        (d / "s.gguf").write_bytes(raw)
        out.append((spec, raw, open_reader(d / "s.gguf").data_start))
    return out


# ------------------------------------------------------------------ mutations
def _kv_values():
    ints = st.sampled_from(BOUNDARY)
    return st.one_of(
        st.tuples(st.sampled_from([V.UINT32, V.UINT64, V.INT32, V.UINT8]), ints.map(lambda v: v % 2**8)),
        st.tuples(st.just(V.UINT32), ints.map(lambda v: v % 2**32)),
        st.tuples(st.just(V.UINT64), ints.map(lambda v: v % 2**64)),
        st.tuples(st.just(V.INT64), ints.map(lambda v: v % 2**63)),
        st.tuples(st.just(V.FLOAT32), st.sampled_from([0.0, -1.0, 1e-5, 1e30, float("nan"), float("inf")])),
        st.tuples(st.just(V.BOOL), st.booleans()),
        st.tuples(st.just(V.STRING), st.sampled_from(["", "x", "llama", "opt", "falcon", "gpt2", "none"])),
        st.tuples(st.just(V.ARRAY), st.sampled_from([[], [0], [4, 4], [2**32 - 1]])),
    )


def _structured(n_kv: int, n_tensors: int):
    """One change to the spec: a key's value, a tensor's dims, type or offset, or a removal."""
    i_kv, i_t = st.integers(0, n_kv - 1), st.integers(0, n_tensors - 1)
    small = st.sampled_from(BOUNDARY[:16])
    return st.one_of(
        st.tuples(st.just("kv"), i_kv, _kv_values()),
        st.tuples(st.just("drop_kv"), i_kv),
        st.tuples(st.just("dim"), i_t, st.integers(0, 4), st.sampled_from(BOUNDARY)),
        st.tuples(st.just("ndims"), i_t, st.integers(0, 6), small),
        st.tuples(st.just("qtype"), i_t, st.integers(0, 40)),
        st.tuples(st.just("offset"), i_t, st.sampled_from(BOUNDARY + [96, 100, 4096])),
        st.tuples(st.just("drop_tensor"), i_t),
        st.tuples(st.just("rename"), i_t, i_t),
    )


def _apply(spec, change) -> None:
    kind, *args = change
    nk, nt = len(spec.kvs), len(spec.tensors)  # indices wrap: an earlier change may have removed one
    if kind == "kv":
        i, (vt, v) = args
        i %= nk
        spec.kvs[i] = KV(spec.kvs[i].key, int(vt), v, int(V.UINT32) if vt == V.ARRAY else None)
    elif kind == "drop_kv":
        del spec.kvs[args[0] % nk]
    elif kind == "drop_tensor":
        del spec.tensors[args[0] % nt]
    elif kind == "rename":
        spec.tensors[args[0] % nt].name = spec.tensors[args[1] % nt].name
    else:
        t = spec.tensors[args[0] % nt]
        if kind == "dim":
            t.dims[args[1] % len(t.dims)] = args[2]
        elif kind == "ndims":
            t.dims = (t.dims + [args[2]] * 8)[: args[1]]
        elif kind == "qtype":
            t.qtype = args[1]
        elif kind == "offset":
            t.offset = args[1]


def _bytewise(header: int, size: int):
    """One change to the bytes: a byte, a boundary u32/u64 written over the header, a cut,
    a deletion or an insertion."""
    pos = st.integers(0, header - 1)
    return st.one_of(
        st.tuples(st.just("byte"), pos, st.integers(0, 255)),
        st.tuples(st.just("u32"), pos, st.sampled_from([v % 2**32 for v in BOUNDARY])),
        st.tuples(st.just("u64"), pos, st.sampled_from([v % 2**64 for v in BOUNDARY])),
        st.tuples(st.just("cut"), st.one_of(pos, st.integers(header, size - 1))),
        st.tuples(st.just("delete"), pos, st.integers(1, 16)),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=16)),
    )


def _apply_bytes(raw: bytearray, change) -> bytearray:
    kind, pos, *rest = change
    if kind == "byte":
        raw[pos] = rest[0]
    elif kind in ("u32", "u64"):
        raw[pos:pos + (4 if kind == "u32" else 8)] = struct.pack("<I" if kind == "u32" else "<Q", rest[0])
    elif kind == "cut":
        del raw[pos:]
    elif kind == "delete":
        del raw[pos:pos + rest[0]]
    elif kind == "insert":
        raw[pos:pos] = rest[0]
    return raw


@st.composite
def mutations(draw, seeds):
    """(seed index, spec changes, byte changes, check_tensors): plain values, so a failing
    example prints short."""
    i = draw(st.integers(0, len(seeds) - 1))
    spec, raw, header = seeds[i]
    structured = draw(st.lists(_structured(len(spec.kvs), len(spec.tensors)), max_size=2))
    return i, structured, draw(st.lists(_bytewise(header, len(raw)), max_size=3)), draw(st.booleans())


def mutated(seeds, case) -> tuple[bytes, bool]:
    i, structured, bytewise, check_tensors = case
    spec, _, header = seeds[i]
    spec = copy.deepcopy(spec)
    for change in structured:
        if spec.kvs and spec.tensors:
            _apply(spec, change)
    data = bytearray(spec_bytes(spec))
    for change in bytewise:
        if len(data) > header:
            data = _apply_bytes(data, change)
    return bytes(data), check_tensors


# ------------------------------------------------------------------ the property
def _one_line_error(e: SparseInferError) -> None:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    assert LAST_RESORT not in msg, f"no specific check caught this: {msg}"


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_mutated_gguf_loads_or_fails_cleanly(seeds, fuzz_dir):
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(seeds))
    def check(case):
        data, check_tensors = mutated(seeds, case)
        path = fuzz_dir / "m.gguf"
        path.write_bytes(data)
        t0 = time.perf_counter()
        tracemalloc.start()
        try:
            describe(str(path))
        except SparseInferError as e:
            _one_line_error(e)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert time.perf_counter() - t0 < PARSE_SECONDS
        assert peak < PARSE_BYTES, f"parsing allocated {peak:,} bytes"
        try:
            llm = sparseinfer.load(path, dense=True, check_tensors=check_tensors)
        except SparseInferError as e:
            _one_line_error(e)
        else:
            try:
                llm.generate("the cat", max_tokens=2)
            except SparseInferError as e:
                _one_line_error(e)
        assert time.perf_counter() - t0 < EXAMPLE_SECONDS

    check()


def test_seeds_load_and_decode(seeds, fuzz_dir):
    """The unmutated seeds pass the property's success branch (so mutations are what fails)."""
    for spec, raw, _ in seeds:
        path = fuzz_dir / "seed.gguf"
        path.write_bytes(raw)
        describe(str(path))
        assert sparseinfer.load(path, dense=True, check_tensors=True).generate("the cat", max_tokens=2) is not None
