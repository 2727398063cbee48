"""Hybrid accelerator/CPU execution with torch-CPU standing in for the accelerator: the split
computes what the CPU-only sparse model computes (== the dense model with every neuron kept),
at every budget; the placed bytes are what the placement counted.  `test_cuda_*` run on a GPU."""
from __future__ import annotations

import threading

import pytest
import torch

from sparseinfer.hybrid import NeuronStats, place_model
from sparseinfer.kernels import torch_device as dev
from sparseinfer.hybrid.costs import cost_model, device_bytes
from sparseinfer.hybrid.ffn import HybridFFN
from sparseinfer.hybrid.model import DeviceLayerKV, HybridCausalLM
from sparseinfer.io.weights import open_source
from sparseinfer.kernels import cpu
from sparseinfer.models.registry import build_model
from sparseinfer.quant import from_float
from sparseinfer.sparse.apply import ffn_slots
from sparseinfer.sparse.ffn import SparseFFN
from sparseinfer.sparse.predictor import QPredictor

from tiny import export_gguf, hf_model, save_folder

pytestmark = pytest.mark.usefixtures("precise_activations")

CTX = 64
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(kind: str, fmt: str = "safetensors"):
        if (kind, fmt) not in made:
            root = tmp_path_factory.mktemp(kind)
            hf = hf_model(kind)
            made[kind, fmt] = save_folder(hf, root / "hf") if fmt == "safetensors" else \
                export_gguf(hf, root / f"{kind}.gguf", fmt)
        return made[kind, fmt]

    return get


def build(path):
    """The model with a float32 KV cache: an f16 cache rounds keys and values where prefill
    attends to them unrounded, which alone moves these logits by more than the tolerances here."""
    with torch.inference_mode():
        m = build_model(open_source(path))
    m.cache_type = "f32"
    return m


def random_predictor(n: int, d: int, g: torch.Generator, all_active: bool = False) -> QPredictor:
    """A (q8) predictor whose rows are hotness-order ids; `all_active` predicts every neuron.
    b1 > 0 keeps the hidden layer away from all-zero, so logits are rarely within float
    rounding of the cut (a tie there may fall either way on the CPU and the device)."""
    if all_active:
        return QPredictor(torch.zeros(8, d), torch.zeros(8), torch.zeros(n, 8), torch.full((n,), 10.0), 0.0)
    return QPredictor(torch.randn(32, d, generator=g), torch.randn(32, generator=g).abs() + 1,
                      torch.randn(n, 32, generator=g), torch.zeros(n), 0.0)


def sparsify(model, threshold: float = 0.0, predictor: str | None = None, seed: int = 0) -> NeuronStats:
    """Swap every MLP for a SparseFFN (random hotness order); predictor: None, 'random', 'all'."""
    g = torch.Generator().manual_seed(seed)
    freqs, orders = [], []
    for parent, name in ffn_slots(model):
        mlp = getattr(parent, name)
        n, d = mlp.n_neurons, mlp.up.in_features
        freq = torch.rand(n, generator=g) ** 2
        order = torch.argsort(freq, descending=True)
        pred = None if predictor is None else random_predictor(n, d, g, predictor == "all")
        setattr(parent, name, SparseFFN(mlp, threshold, order, pred))
        freqs.append(freq)
        orders.append(order)
    return NeuronStats(freqs, orders, "test")


def run(model, tokens: torch.Tensor, n_prefill: int = 9) -> torch.Tensor:
    """Prefill, then one token at a time through the cache: logits of every position."""
    with torch.inference_mode():
        cache = model.new_cache(CTX)
        outs = [model(tokens[:, :n_prefill], cache)]
        for t in range(n_prefill, tokens.shape[1]):
            outs.append(model(tokens[:, t: t + 1], cache))
    return torch.cat(outs, dim=1)


def budget_at(model, frac: float, device_type: str = "cpu") -> int:
    """Scratch plus `frac` of everything else the model could put on the device."""
    c = cost_model(model, CTX, device_type)
    rest = c.head + sum(lc.core + lc.predictor + lc.neuron * lc.n_neurons + c.ffn_overhead for lc in c.layers)
    return c.scratch + int(frac * rest)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 250, (1, 16), generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------- device operators
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8", "q4", "q6", "q4k"])
@pytest.mark.parametrize("cols", [64, 200])
@pytest.mark.parametrize("mode", ["int8", "precise"])
def test_device_ops_match_cpu_kernels(fmt, cols, mode):
    """The device path rounds activations as the CPU kernels do, in either mode."""
    cpu.set_activation_mode(mode)  # conftest restores the mode afterwards
    if fmt == "q4k":  # rows of whole super-blocks of 256 values
        cols = {64: 256, 200: 768}[cols]
    g = torch.Generator().manual_seed(0)
    w = from_float(torch.randn(70, cols, generator=g), fmt)
    torch.testing.assert_close(dev.dequant(w), w.dequantize())
    x = torch.randn(3, cols, generator=g)
    torch.testing.assert_close(dev.matmul(w, x), cpu.matmul(w, x), atol=1e-4, rtol=1e-4)
    h = torch.randn(2, 70, generator=g)
    torch.testing.assert_close(dev.matmul_t(h, w), h @ w.dequantize(), atol=1e-4, rtol=1e-4)


def test_device_ops_chunking(monkeypatch):
    monkeypatch.setattr(dev, "CHUNK_ELEMS", 64 * 5)  # 5 rows of 64 per chunk: many chunks, a short last one
    g = torch.Generator().manual_seed(1)
    w = from_float(torch.randn(23, 64, generator=g), "q4")
    x = torch.randn(2, 64, generator=g)
    torch.testing.assert_close(dev.matmul(w, x), cpu.matmul(w, x), atol=1e-4, rtol=1e-4)
    h = torch.randn(2, 23, generator=g)
    torch.testing.assert_close(dev.matmul_t(h, w), h @ w.dequantize(), atol=1e-4, rtol=1e-4)


def test_device_predictor_decides_like_the_cpu_predictor():
    g = torch.Generator().manual_seed(2)
    qp = random_predictor(160, 64, g)
    dp = qp.to(torch.device("cpu"), torch_ops=True)  # torch-CPU standing in for the accelerator
    x = torch.randn(50, 64, generator=g)
    cpu_masks = torch.zeros(50, 160, dtype=torch.bool)
    for i in range(50):
        cpu_masks[i, qp.active_rows(x[i]).long()] = True
    assert torch.equal(dp.mask_batch(x), cpu_masks)


# ---------------------------------------------------------------------------- whole models
KINDS = ["llama", "qwen2", "falcon", "opt"]


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_equals_cpu_sparse_equals_dense_all_neurons(kind, folders, tokens):
    """Every neuron kept: dense == CPU-only SparseFFN == hybrid, from no budget to everything."""
    path = folders(kind)
    dense = run(build(path), tokens)
    m = build(path)
    sparsify(m)
    torch.testing.assert_close(run(m, tokens), dense, atol=1e-4, rtol=1e-4)
    for frac in (0.0, 0.35, 0.7, 1.0):
        m = build(path)
        stats = sparsify(m)
        hm, p = place_model(m, "cpu", budget_at(m, frac), CTX, stats, group_size=16, use_cache=False)
        assert p.mode == ("neurons" if frac else "cpu") and p.bytes_used <= p.budget
        if frac == 1.0:
            assert p.n_hot == p.n_neurons and all(p.attn_on_device) and p.head_on_device
        torch.testing.assert_close(run(hm, tokens), dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind, threshold, predictor", [
    ("llama", 0.0, "random"), ("llama", 0.05, "random"), ("llama-relu", 0.0, "random"), ("opt", 0.0, "random"),
    ("falcon", 0.02, "random"),
    ("llama", 0.05, None),  # the pack's "first" policy: dense first projection, threshold picks the rows
])
def test_hybrid_equals_cpu_sparse_with_predictor(kind, threshold, predictor, folders, tokens):
    """A real (random) predictor and threshold: the hybrid split computes the CPU-only sparse
    model exactly, predictors on the CPU or on the device, at every budget."""
    path = folders(kind)
    m = build(path)
    sparsify(m, threshold, predictor)
    want = run(m, tokens)
    splits = []
    for frac in (0.3, 0.55, 0.8, 1.0):
        m = build(path)
        stats = sparsify(m, threshold, predictor)
        hm, p = place_model(m, "cpu", budget_at(m, frac), CTX, stats, group_size=16, use_cache=False)
        torch.testing.assert_close(run(hm, tokens), want, atol=1e-4, rtol=1e-4)
        splits += [f.split for f in hm.modules() if isinstance(f, HybridFFN)]
    assert any(s["hot_rows"] and s["cold_rows"] for s in splits)  # some layer really split its rows


def test_layer_offload_equals_dense(folders, tokens):
    path = folders("qwen2")
    dense = run(build(path), tokens)
    for frac, n_layers in ((0.6, 1), (1.0, 2)):
        m = build(path)
        hm, p = place_model(m, "cpu", budget_at(m, frac), CTX, mode="layers", use_cache=False)
        assert p.mode == "layers" and p.bytes_used <= p.budget and sum(p.attn_on_device) == n_layers
        torch.testing.assert_close(run(hm, tokens), dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_hybrid_quantized_model_close_to_cpu_sparse(qtype, folders, tokens):
    path = folders("llama", qtype)
    m = build(path)
    sparsify(m, 0.0, "random")
    want = run(m, tokens)
    m = build(path)
    stats = sparsify(m, 0.0, "random")
    hm, p = place_model(m, "cpu", budget_at(m, 0.85), CTX, stats, group_size=16, use_cache=False)
    assert 0 < sum(p.n_hot) < sum(p.n_neurons)
    # device matmuls round activations like the CPU kernels, but a value a float rounding away
    # from a rounding boundary may land on either side (on the CPU alone too: thread counts,
    # summation order); prefill's down projection uses the q8 neuron-major copy instead of the
    # original weight.  So: close, not equal.  Logits here are O(2).
    err = (run(hm, tokens) - want).abs()
    assert err.mean() < 0.02 and err.max() < 0.3


def test_placed_bytes_are_what_the_placement_counted(folders, tokens):
    m = build(folders("opt"))
    stats = sparsify(m, 0.0, "random")
    hm, p = place_model(m, "cpu", budget_at(m, 0.7), CTX, stats, group_size=16, use_cache=False)
    cache = hm.new_cache(CTX)
    with torch.inference_mode():
        hm(tokens[:, :4], cache)
    got = {"attention": 0, "kv": 0, "norms": 0, "predictors": 0, "ffn": 0, "head": 0}
    for i, (block, name) in enumerate((b, "mlp") for b in hm.layers):
        ffn = block.mlp
        if p.attn_on_device[i]:
            got["attention"] += device_bytes(block.attn)
            got["norms"] += sum(device_bytes(ch) for ch in block.children() if ch is not block.attn and ch is not ffn)
            assert isinstance(cache[i], DeviceLayerKV) and cache[i].k.shape[2] == CTX  # whole context at once
            got["kv"] += 2 * dev.device_nbytes(cache[i].k)
        if isinstance(ffn, HybridFFN):
            if ffn.hot is not None:
                got["ffn"] += ffn.hot.nbytes()
            if ffn.on_device_predictor:
                got["predictors"] += sum(dev.device_nbytes(t) for t in (ffn.predictor.b1, ffn.predictor.cut)) + \
                    dev.qweight_device_nbytes(ffn.predictor.w1) + dev.qweight_device_nbytes(ffn.predictor.w2t)
    if p.head_on_device:
        got["head"] = device_bytes(hm.norm) + hm.head.nbytes()
    for k, v in got.items():
        assert v <= p.bytes[k], k
        assert v >= p.bytes[k] - 64 * 1024, k  # the counts are exact up to allocator rounding slack
    assert sum(got.values()) + p.bytes["scratch"] <= p.budget


def test_cold_neurons_run_in_the_worker_thread(folders, tokens, monkeypatch):
    m = build(folders("llama"))
    stats = sparsify(m, 0.0, "random")
    hm, p = place_model(m, "cpu", budget_at(m, 0.6), CTX, stats, group_size=16, use_cache=False)
    seen = []
    orig = HybridFFN._cold_rows

    def spy(self, x, rows):
        seen.append(threading.current_thread().name)
        return orig(self, x, rows)

    monkeypatch.setattr(HybridFFN, "_cold_rows", spy)
    run(hm, tokens)
    split = [f for f in hm.modules() if isinstance(f, HybridFFN) and f.hot is not None and f.cold is not None]
    assert split and seen and all(n.startswith("sparseinfer-cold") for n in seen)
    hm.close()


def test_device_kv_stays_within_what_was_counted(folders, tokens):
    """Caches draw on per-layer pools of the counted KV bytes: a second live sequence, a batch
    or a longer cache than planned is refused, not allocated past the budget."""
    m = build(folders("llama"))
    stats = sparsify(m)
    hm, p = place_model(m, "cpu", budget_at(m, 1.0), CTX, stats, use_cache=False)
    assert isinstance(hm, HybridCausalLM)
    with torch.inference_mode():
        first = hm.new_cache()
        hm(tokens[:, :4], first)
        with pytest.raises(Exception, match="would exceed"):
            hm(tokens[:, :4], hm.new_cache())
        with pytest.raises(Exception, match="would exceed"):
            hm(tokens[:, :4], hm.new_cache(CTX * 2))
        del first  # frees its share
        hm(tokens[:, :4], hm.new_cache(CTX // 2))
        with pytest.raises(Exception, match="would exceed"):
            hm(torch.ones(2, 3, dtype=torch.long), hm.new_cache())
    m = build(folders("llama"))
    stats = sparsify(m)
    hm, p = place_model(m, "cpu", budget_at(m, 1.0), CTX, stats, use_cache=False, n_seq=2)
    with torch.inference_mode():
        a, b = hm.new_cache(), hm.new_cache()
        hm(tokens[:, :4], a)
        hm(tokens[:, :4], b)


def test_too_small_budget_runs_on_cpu_with_a_message(folders, tokens, caplog):
    path = folders("llama")
    dense = run(build(path), tokens)
    m = build(path)
    stats = sparsify(m)
    hm, p = place_model(m, "cpu", 1 << 20, CTX, stats, use_cache=False)
    assert p.mode == "cpu" and "CPU only" in caplog.text
    assert not isinstance(hm, HybridCausalLM)
    torch.testing.assert_close(run(hm, tokens), dense, atol=1e-4, rtol=1e-4)


def test_placement_cached_under_model_fingerprint(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEINFER_HOME", str(tmp_path))
    m = build(folders("llama"))
    stats = sparsify(m)
    _, p = place_model(m, "cpu", budget_at(m, 0.5), CTX, stats, fingerprint="abc")
    files = list((tmp_path / "placements").glob("*.json"))
    assert len(files) == 1 and p.key in files[0].name


# ---------------------------------------------------------------------------- on a real GPU
@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_cuda_hybrid_equals_cpu_sparse(kind, folders, tokens):
    path = folders(kind)
    m = build(path)
    sparsify(m, 0.0, "random")
    want = run(m, tokens)
    for frac in (0.3, 0.7, 1.0):
        m = build(path)
        stats = sparsify(m, 0.0, "random")
        hm, p = place_model(m, "cuda", budget_at(m, frac, "cuda"), CTX, stats, group_size=16, use_cache=False)
        torch.testing.assert_close(run(hm, tokens), want, atol=1e-3, rtol=1e-3)
        hm.close()


@needs_cuda
@pytest.mark.parametrize("mode", ["neurons", "layers"])
@pytest.mark.parametrize("frac", [0.05, 0.25, 0.5, 1.0])
def test_cuda_budget_is_a_promise(mode, frac, smollm2_path):
    """Peak allocated GPU memory over load, prefill and decode stays within the budget."""
    import gc

    from sparseinfer.hybrid.costs import cost_model as cm

    gc.collect()
    torch.cuda.empty_cache()
    m = build(smollm2_path)
    stats = sparsify(m, 0.0, "random") if mode == "neurons" else None
    ctx = 512
    c = cm(m, ctx, "cuda")
    total = c.scratch + c.head + sum(lc.core + lc.predictor + lc.neuron * lc.n_neurons for lc in c.layers)
    budget = int(frac * total)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hm, p = place_model(m, "cuda", budget, ctx, stats, mode=mode, use_cache=False)
    ids = torch.randint(100, 40000, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = hm.new_cache(ctx)
        hm(ids, cache)
        tok = ids[:, -1:]
        for _ in range(16):
            tok = hm(tok, cache)[:, -1].argmax(-1, keepdim=True)
        hm(ids[:, :150], hm.new_cache(ctx))  # full logits (perplexity-style)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    print(f"{mode} budget {budget / 2**20:.1f} MiB: planned {p.bytes_used / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB")
    assert peak <= budget
    if frac == 1.0 and mode == "neurons":
        assert sum(p.n_hot) == sum(p.n_neurons)
    hm.close() if isinstance(hm, HybridCausalLM) else None


def test_plan_command_prints_and_plots(folders, tmp_path, capsys, monkeypatch):
    from sparseinfer.hybrid.placement import Placement
    from sparseinfer.commands import main

    monkeypatch.setenv("SPARSEINFER_HOME", str(tmp_path / "home"))
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    assert main(["plan", str(folders("llama")), "--vram-budget", "200MiB", "-c", "64", "--plot", str(png),
                 "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "placement on cuda: mode layers" in out and "expected fraction" in out
    assert png.stat().st_size > 1000 and Placement.from_json(js.read_text()).mode == "layers"
