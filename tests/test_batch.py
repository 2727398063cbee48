"""`CausalLM.decode_batch`: B sequences of different lengths decoded in one step, each row over
its own KV cache.  Rows equal the one-token path within the accuracy contract, and equal
themselves bit for bit whatever else is in the batch (the server's greedy identity)."""
from __future__ import annotations

import pytest
import torch

from sparseinfer.io.weights import GGUFSource
from sparseinfer.kernels import cpu
from sparseinfer.models.registry import build_model

from tiny import export_gguf, hf_model

PROMPTS = [[5, 9, 11, 3], [7, 8], [20, 21, 22, 23, 24, 25, 26], [4]]


def _model(tmp_path, kind="llama", qtype="Q8_0"):
    return build_model(GGUFSource(export_gguf(hf_model(kind), tmp_path / f"{kind}.gguf", qtype)))


def _prefilled(model, prompts, cache_type):
    caches = []
    for p in prompts:
        c = model.new_cache(64, cache_type)
        model(torch.tensor([p]), c)
        caches.append(c)
    return caches


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_batched_logits_equal_one_token_logits(tmp_path, kind, cache_type):
    """Mixed lengths: each row of a batched step matches a one-token forward of that sequence
    alone, over three steps (the caches grow as they would alone)."""
    model = _model(tmp_path, kind)
    with torch.inference_mode():
        batched = _prefilled(model, PROMPTS, cache_type)
        alone = _prefilled(model, PROMPTS, cache_type)
        toks = [30, 31, 32, 33]
        for step in range(3):
            got = model.decode_batch(toks, batched)
            want = torch.stack([model(torch.tensor([[t]]), c)[0, -1] for t, c in zip(toks, alone)])
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
            toks = [int(t) for t in got.argmax(-1)]
        for a, b in zip(batched, alone):
            assert a.length == b.length


@pytest.mark.skipif(not cpu.matmul_equals_gemv(), reason="multi-row products differ from one-row ones at this level")
@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_a_row_does_not_depend_on_its_neighbours(tmp_path, qtype):
    """Bit-identical rows: a sequence decoded alone (B=1) or beside others (B=4, any position)."""
    model = _model(tmp_path, "llama", qtype)
    with torch.inference_mode():
        together = model.decode_batch([30, 31, 32, 33], _prefilled(model, PROMPTS, "f16"))
        for b, p in enumerate(PROMPTS):
            alone = model.decode_batch([30 + b], _prefilled(model, [p], "f16"))
            assert torch.equal(alone[0], together[b])
        swapped = model.decode_batch([33, 30], _prefilled(model, [PROMPTS[3], PROMPTS[0]], "f16"))
        assert torch.equal(swapped[0], together[3]) and torch.equal(swapped[1], together[0])


def assert_rows_equal_alone(model):
    """Three batched steps of PROMPTS' sequences (greedy): each row equals, bit for bit, the
    one-token path on that sequence alone."""
    with torch.inference_mode():
        batched = _prefilled(model, PROMPTS, "f16")
        alone = _prefilled(model, PROMPTS, "f16")
        toks = [30, 31, 32, 33]
        for _ in range(3):
            got = model.decode_batch(toks, batched)
            for b, (t, c) in enumerate(zip(toks, alone)):
                assert torch.equal(got[b], model(torch.tensor([[t]]), c)[0, -1]), b
            toks = [int(t) for t in got.argmax(-1)]


@pytest.mark.skipif(not cpu.matmul_equals_gemv(), reason="multi-row products differ from one-row ones at this level")
@pytest.mark.parametrize("kind,qtype", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("llama", "F16")])
def test_batched_rows_equal_the_one_token_path_bitwise(tmp_path, kind, qtype):
    """The batched C steps (`decode_layers` with B caches) give each row exactly what the
    one-token step gives that sequence alone: `serve --parallel N` and `--parallel 1` decode
    the same tokens."""
    model = _model(tmp_path, kind, qtype)
    assert_rows_equal_alone(model)


@pytest.mark.skipif(not cpu.matmul_equals_gemv(), reason="multi-row products differ from one-row ones at this level")
def test_batched_rows_with_a_sparse_ffn_equal_the_one_token_path(tmp_path):
    """With an activation-sparse FFN each row of a batched step runs the FFN's one-token sparse
    step (its own active neurons): the rows still equal each sequence decoded alone."""
    from sparseinfer.sparse.ffn import SparseFFN
    from sparseinfer.sparse.apply import ffn_slots

    model = _model(tmp_path, "llama", "Q8_0")
    g = torch.Generator().manual_seed(0)
    for parent, name in ffn_slots(model):
        mlp = getattr(parent, name)
        setattr(parent, name, SparseFFN(mlp, 0.05, torch.randperm(mlp.n_neurons, generator=g)))
    assert_rows_equal_alone(model)
    assert all(getattr(p, n).step(p.ffn_norm).stats.tokens > 0 for p, n in ffn_slots(model))


def test_decode_batch_checks_its_arguments(tmp_path):
    model = _model(tmp_path)
    with pytest.raises(ValueError, match="one cache per token"):
        model.decode_batch([1, 2], [model.new_cache(8)])
    c = model.new_cache(8)
    with pytest.raises(ValueError, match="a different cache for every row"):
        model.decode_batch([1, 2], [c, c])
    full = model.new_cache(2)
    with torch.inference_mode():
        model(torch.tensor([[3, 4]]), full)
    from sparseinfer.errors import ContextOverflowError
    with pytest.raises(ContextOverflowError):
        model.decode_batch([5], [full])


@pytest.mark.skipif(not cpu.available(), reason="needs the compiled kernels")
@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_attend1_rows_is_attend1_stored_per_row(cache_type):
    """The batched attention call: row b equals the one-sequence kernel on that row's cache,
    bit for bit, and both follow the reference attention (torch SDPA over the decoded cache)."""
    from sparseinfer.kv_cache import decode, encode

    g = torch.Generator().manual_seed(0)
    H, Hk, D, cap = 4, 2, 64, 40
    q = torch.randn(3, H, 1, D, generator=g)
    kvs = []
    for L in (1, 17, 40):
        k = encode(cache_type, torch.randn(1, Hk, cap, D, generator=g))
        v = encode(cache_type, torch.randn(1, Hk, cap, D, generator=g))
        kvs.append((k, v, L))
    out = cpu.attend1_rows(q, kvs, cache_type)
    for b, (k, v, L) in enumerate(kvs):
        one = cpu.attend1_stored(q[b: b + 1], k[:, :, :L], v[:, :, :L], cache_type)
        assert torch.equal(out[b: b + 1], one)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b: b + 1], decode(cache_type, k[:, :, :L], D), decode(cache_type, v[:, :, :L], D), enable_gqa=True)
        torch.testing.assert_close(out[b: b + 1], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="holding at least"):
        cpu.attend1_rows(q[:1], [(kvs[0][0], kvs[0][1], cap + 1)], cache_type)
