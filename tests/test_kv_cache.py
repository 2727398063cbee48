"""KV cache types (f32, f16, q8_0; `sparseinfer.kv_cache`): the Python reference of the stored
forms, the C core's row writer and attention against it, the C decode step against the torch
layers on the same cache type, whole-model logits against the f32 cache, memory, overflow,
truncation and reuse, and the plumbing (load, CLI)."""
from __future__ import annotations

import pytest
import torch

import sparseinfer
from sparseinfer.errors import ContextOverflowError, SparseInferError
from sparseinfer.io.weights import SafetensorsSource
from sparseinfer.kernels import cpu
from sparseinfer.kv_cache import (CACHE_TYPES, KVCache, LayerKV, decode, dequantize_q8_0, encode, quantize_q8_0,
                                  row_bytes)
from sparseinfer.models.registry import build_model

from test_decode_step import Count, stepwise
from tiny import hf_model, save_folder

needs_core = pytest.mark.skipif(not cpu.available(), reason="needs the compiled kernels")


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------------------------ the Python reference

@pytest.mark.parametrize("D", [16, 32, 33, 64, 80, 128])
def test_q8_0_reference_layout_and_error(D):
    """34 bytes per block of 32 (the last padded with zeros); each value within half a step
    (d/2) of the input, d = amax/127 of its block (plus the f16 rounding of d)."""
    x = rand(3, 5, D, scale=3.0)
    x[0, 0, :] = 0.0  # an all-zero row: d = 0, q = 0
    rows = quantize_q8_0(x)
    nb = -(-D // 32)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 5, 34 * nb) and row_bytes("q8_0", D) == 34 * nb
    back = dequantize_q8_0(rows, D)
    assert back.shape == x.shape and torch.equal(back[0, 0], torch.zeros(D))
    pad = torch.nn.functional.pad(x, (0, 32 * nb - D)).reshape(3, 5, nb, 32)
    d = (pad.abs().amax(-1, keepdim=True) / 127).expand(-1, -1, -1, 32).reshape(3, 5, -1)[..., :D]
    assert bool(((back - x).abs() <= d * 0.5 * 1.002 + x.abs() * 1e-3).all())
    blocks = rows.reshape(3, 5, nb, 34)
    if D % 32:  # the padding of the last block holds zeros
        assert not bool(blocks[..., -1, 2 + D % 32:].any())


def test_f16_reference_is_torch_rounding():
    x = rand(4, 64, scale=100.0)
    assert torch.equal(encode("f16", x), x.half()) and torch.equal(decode("f16", encode("f16", x), 64), x.half().float())
    assert decode("f32", x, 64) is x  # f32 is stored and returned as it is


# ----------------------------------------------------------------------- the C core against it

@needs_core
@pytest.mark.parametrize("cache_type", CACHE_TYPES)
@pytest.mark.parametrize("D", [8, 16, 33, 64, 80, 128])
def test_c_row_writer_matches_reference(level, cache_type, D):
    """The bytes the decode step writes for a row are the reference's, on every kernel level
    (including halves' rounding ties, subnormals, overflow to infinity)."""
    x = rand(6, D, seed=D, scale=4.0)
    x[1] = 0.0
    x[2, : min(D, 8)] = torch.tensor([65504.0, 65519.0, 65520.0, 1e-7, -3e-8, 2.0 ** -24, 1.0 + 2.0 ** -11, -0.0])[: min(D, 8)]
    if cache_type == "q8_0":
        x[2] = x[2].clamp(-1e4, 1e4)
    assert torch.equal(cpu.kv_store(x, cache_type), encode(cache_type, x))


@needs_core
@pytest.mark.parametrize("cache_type", CACHE_TYPES)
@pytest.mark.parametrize("H,Hk,D,L", [(12, 2, 128, 300), (9, 3, 64, 1), (4, 4, 33, 17), (8, 1, 16, 13), (6, 2, 8, 9)])
def test_c_attention_over_stored_cache(level, cache_type, H, Hk, D, L):
    """Single-token attention reading f16 / q8_0 rows equals float64 attention over the same
    rows dequantized by the reference."""
    k, v, q = rand(1, Hk, L, D, seed=1, scale=2.0), rand(1, Hk, L, D, seed=2), rand(1, H, 1, D, seed=3, scale=2.0)
    ks, vs = encode(cache_type, k), encode(cache_type, v)
    kr, vr = (decode(cache_type, t, D).double().repeat_interleave(H // Hk, 1) for t in (ks, vs))
    want = torch.softmax(q.double() @ kr.transpose(-1, -2) / D ** 0.5, -1) @ vr
    got = cpu.attend1_stored(q, ks, vs, cache_type)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(v.abs().max()))


# ------------------------------------------------------------------------- whole models

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = hf_model("qwen2")
    return build_model(SafetensorsSource(save_folder(hf, tmp_path_factory.mktemp("kv") / "qwen2")))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(5))


def run(model, tokens, cache_type):
    """Prefill 4 tokens (torch layers), then decode one at a time (C steps on the CPU)."""
    return stepwise(model, tokens, model.new_cache(64, cache_type))


@needs_core
@pytest.mark.usefixtures("precise_activations")
@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_c_decode_step_matches_torch_layers_on_same_cache_type(tiny, tokens, cache_type, monkeypatch):
    """Decode runs on the C path for every cache type, and gives the torch layers' logits over a
    cache of the same type (the same stored rows, up to a rounding tie of a quantized value)."""
    count = Count(monkeypatch)
    ours, cache = run(tiny, tokens, cache_type)
    assert count.n["attn"] == len(tiny.layers) * 20
    monkeypatch.undo()
    with monkeypatch.context() as m:
        Count(m, off=True)
        ref, ref_cache = run(tiny, tokens, cache_type)
    assert cache.cache_type == ref_cache.cache_type == cache_type
    tol = {"f32": 2e-5, "f16": 5e-5, "q8_0": 2e-3}[cache_type]
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


@needs_core
@pytest.mark.usefixtures("precise_activations")
@pytest.mark.parametrize("cache_type,atol", [("f16", 5e-3), ("q8_0", 5e-2)])
def test_logits_against_f32_cache(tiny, tokens, cache_type, atol):
    """f16 and q8_0 caches against the exact f32 one: logits (range about +-1 on this random
    model) within atol, and greedy choices mostly the same."""
    ref, _ = run(tiny, tokens, "f32")
    got, _ = run(tiny, tokens, cache_type)
    err = float((got - ref).abs().max())
    assert err < atol, err
    same = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert same >= 0.9, same


def test_memory_per_type():
    """Bytes of a cache grown to the same length: f16 half of f32, q8_0 34/128 of f32 for
    heads of a multiple of 32 values."""
    sizes = {}
    for t in CACHE_TYPES:
        kv = LayerKV(1024, t)
        kv.update_and_fetch(rand(1, 2, 300, 64), rand(1, 2, 300, 64))
        sizes[t] = kv.nbytes
        assert kv.nbytes == 2 * 2 * 512 * row_bytes(t, 64)  # grown in steps of 256 positions
    assert sizes["f16"] * 2 == sizes["f32"] and sizes["q8_0"] * 128 == sizes["f32"] * 34


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_update_and_fetch_returns_float32_of_stored(cache_type):
    kv = LayerKV(16, cache_type)
    k, v = rand(1, 2, 5, 48, seed=1), rand(1, 2, 5, 48, seed=2)
    kv.update_and_fetch(k[:, :, :3], v[:, :, :3])
    gk, gv = kv.update_and_fetch(k[:, :, 3:], v[:, :, 3:])
    assert gk.dtype == gv.dtype == torch.float32 and gk.shape == (1, 2, 5, 48)
    assert torch.equal(gk, decode(cache_type, encode(cache_type, k), 48))
    assert torch.equal(gv, decode(cache_type, encode(cache_type, v), 48))


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_context_overflow(tiny, cache_type):
    cache = tiny.new_cache(6, cache_type)
    with torch.inference_mode():
        tiny(torch.tensor([[5, 6, 7, 8, 9]]), cache)
        tiny(torch.tensor([[10]]), cache)
        with pytest.raises(ContextOverflowError, match="context"):
            tiny(torch.tensor([[11]]), cache)


@needs_core
@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_truncate_and_reuse(tiny, tokens, cache_type):
    """A cache cut back to a prefix and continued (a chat turn edited, a server slot reused)
    gives the logits of a fresh cache fed the same tokens."""
    other = tokens.clone()
    other[0, 10:] = torch.flip(tokens[0, 10:], [0])
    _, cache = run(tiny, tokens, cache_type)
    cache.truncate(10)
    with torch.inference_mode():
        got = torch.cat([tiny(other[:, t: t + 1], cache) for t in range(10, other.shape[1])], dim=1)
    fresh, _ = run(tiny, other, cache_type)
    assert torch.equal(got, fresh[:, 10:])  # `run` returns every position


def test_the_cache_records_its_tokens(tiny):
    """A cache of one sequence holds its token ids in order (the head preview reads them): a
    prompt, one-token steps, a batched step, a truncation; a cache of several rows keeps none."""
    cache = tiny.new_cache(32)
    with torch.inference_mode():
        tiny(torch.tensor([[5, 6, 7]]), cache, last_only=True)
        tiny(torch.tensor([[8]]), cache)
        other = tiny.new_cache(32)
        tiny.decode_batch([9, 3], [cache, other])
        assert cache.tokens == [5, 6, 7, 8, 9] and other.tokens == [3] and cache.length == 5
        cache.truncate(2)
        tiny(torch.tensor([[4]]), cache)
        assert cache.tokens == [5, 6, 4] and cache.length == 3
        two = tiny.new_cache(8)
        tiny(torch.tensor([[1, 2], [3, 4]]), two)
        assert two.tokens == [] and two.length == 2


def test_unknown_cache_type_is_a_clear_error(tiny):
    with pytest.raises(SparseInferError, match="unknown KV cache type 'q4'; use one of f32, f16, q8_0"):
        KVCache(2, 8, "q4")
    with pytest.raises(SparseInferError, match="unknown KV cache type"):
        sparseinfer.load("nothing-loaded-first", cache_type="bf16")


# ----------------------------------------------------------------------- plumbing

@needs_core
def test_load_and_generate_with_each_type(smollm2_path):
    """`load(cache_type=...)` reaches every cache the LLM makes (generation, the server's slots
    through `LLM.new_cache`); the real model answers with each type, and its next-token logits
    after a prompt stay near the f32 cache's (the answers themselves may part: on a 135M
    model the q8_0 cache's rounding can tip a near tie between the top tokens)."""
    llm = sparseinfer.load(smollm2_path, ctx_size=128, dense=True, threads=2)
    assert llm.cache_type == "f16" and llm.new_cache().cache_type == "f16"
    prompt = "What is the capital of France?"
    logits = {}
    for t in CACHE_TYPES:
        llm = sparseinfer.load(smollm2_path, ctx_size=128, dense=True, threads=2, cache_type=t)
        cache = llm.new_cache()
        assert cache.cache_type == t and all(layer.cache_type == t for layer in cache.layers)
        answer = llm.generate(prompt, chat=True, max_tokens=12)
        assert answer.strip() and ("Paris" in answer or t != "f32"), (t, answer)
        with torch.inference_mode():
            logits[t] = llm.model(torch.tensor([llm.encode_prompt(prompt, chat=True)]), llm.new_cache())[0, -1]
    ref = logits["f32"]
    for t, got in logits.items():
        assert float((got - ref).norm() / ref.norm()) < 0.1, t
        assert int(ref.argmax()) in got.topk(3).indices.tolist(), t


@pytest.mark.parametrize("command", ["run", "chat", "bench", "ppl", "serve"])
def test_cli_flag(command):
    from sparseinfer.commands import build_parser

    a = build_parser().parse_args([command, "--cache-type", "q8_0"])
    assert a.cache_type == "q8_0"
    assert build_parser().parse_args([command]).cache_type == "f16"


@pytest.mark.usefixtures("precise_activations")
def test_accelerator_caches_take_the_type(tmp_path):
    """A placed model (torch on the CPU standing in for the GPU) keeps its device layers' K/V in
    the cache type it was planned for, counts them so (`kv_bytes`), and runs with each type."""
    from sparseinfer.hybrid import place_model
    from sparseinfer.hybrid.costs import kv_bytes
    from sparseinfer.hybrid.model import DeviceLayerKV

    from test_hybrid import budget_at, sparsify

    path = save_folder(hf_model("llama"), tmp_path / "llama")
    toks = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for t in CACHE_TYPES:
        m = build_model(SafetensorsSource(path))
        stats = sparsify(m, 0.0)
        hm, p = place_model(m, "cpu", budget_at(m, 1.0), 64, stats, use_cache=False, cache_type=t)
        assert all(p.attn_on_device)
        cache = hm.new_cache()
        assert all(isinstance(layer, DeviceLayerKV) and layer.cache_type == t for layer in cache.layers)
        assert hm.kv_pools[0].limit == kv_bytes(hm.config, 64, t)
        logits[t], _ = stepwise(hm, toks, cache)
    assert float((logits["f16"] - logits["f32"]).abs().max()) < 5e-3
    assert float((logits["q8_0"] - logits["f32"]).abs().max()) < 5e-2
