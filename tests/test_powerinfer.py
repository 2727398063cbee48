"""PowerInfer's model files (tests/fixtures/powerinfer: tiny random models converted by
PowerInfer's own converters, with the weights they read as safetensors).

References: transformers' dense ReLU / dReLU model on the same weights (every neuron active),
and the same model with PowerInfer's predicted masks applied per token, computed from the
predictor weights the converter read, on the input PowerInfer's predictor reads (the residual
stream before the FFN norm; for Falcon, the block's input before its LayerNorm; for OPT, the
stream before the FFN's LayerNorm)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sparseinfer
from sparseinfer.errors import ModelFormatError, SparsityPackError
from sparseinfer.hybrid import NeuronStats, place_model
from sparseinfer.io.weights import open_source
from sparseinfer.sparse.apply import sparse_ffns
from sparseinfer.sparse.ffn import SparseFFN

FIXTURES = Path(__file__).parent / "fixtures" / "powerinfer"
KINDS = ["llama-relu", "bamboo", "falcon-relu", "falcon40b-relu", "opt-relu"]
RESIDUAL_READERS = ["falcon-relu", "falcon40b-relu", "opt-relu"]  # predictors read the stream before a LayerNorm
CTX = 64

pytestmark = pytest.mark.usefixtures("precise_activations")


def model_file(kind: str) -> Path:
    return FIXTURES / kind / "model.powerinfer.gguf"


def hf_reference(kind: str, masks: bool = False, dequantized: Path | None = None):
    """transformers' model on the fixture's weights (float32).  bamboo: up also through ReLU.
    masks: each FFN's hidden activations multiplied per token by PowerInfer's predicted mask,
    fc2 · relu(fc1 · x) > 0 with x the FFN's residual input (before its norm; Falcon: the
    block's input, before the LayerNorm the FFN reads through).  dequantized: a
    quantized copy of the fixture, whose dequantized weights and predictors replace them."""
    import transformers as tf
    from safetensors.torch import load_file

    folder = FIXTURES / kind / "hf"
    cfg = json.loads((folder / "config.json").read_text())
    sd = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    if kind.startswith("falcon"):
        model = tf.FalconForCausalLM(tf.FalconConfig(**cfg))
    elif kind == "opt-relu":
        model = tf.OPTForCausalLM(tf.OPTConfig(**cfg))
    else:
        cfg["model_type"] = "llama"
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    if kind == "opt-relu":
        model.config.dropout = 0.0
    model.float().eval()
    if dequantized is not None:
        src = open_source(dequantized)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if src.has(name):
                    t.copy_(src.tensor(name).view_as(t))
    preds = {k: v.float() for k, v in load_file(str(FIXTURES / kind / "predictors.safetensors")).items()}
    if dequantized is not None:
        preds = {k: src.file_tensor(k.replace("layer.", "blk.")) for k in preds}
    if kind.startswith("falcon"):
        for i, layer in enumerate(model.transformer.h):
            mlp, seen = layer.mlp, {}
            # the block's input: what its LayerNorm(s) read
            ln = layer.ln_attn if hasattr(layer, "ln_attn") else layer.input_layernorm
            ln.register_forward_pre_hook(lambda m, args, seen=seen: seen.update(x=args[0]))
            fc1, fc2 = preds[f"layer.{i}.fc1.weight"], preds[f"layer.{i}.fc2.weight"]

            def forward(xn, mlp=mlp, seen=seen, fc1=fc1, fc2=fc2):
                h = torch.relu(mlp.dense_h_to_4h(xn))
                if masks:
                    h = h * ((torch.relu(seen["x"] @ fc1.T) @ fc2.T) > 0)
                return mlp.dense_4h_to_h(h)

            mlp.forward = forward
        return model
    if kind == "opt-relu":
        for i, layer in enumerate(model.model.decoder.layers):
            seen = {}
            # the stream before the FFN's LayerNorm, and the mask on what fc2 mixes
            layer.final_layer_norm.register_forward_pre_hook(lambda m, args, seen=seen: seen.update(x=args[0]))
            fc1, fc2 = preds[f"layer.{i}.fc1.weight"], preds[f"layer.{i}.fc2.weight"]
            if masks:
                layer.fc2.register_forward_pre_hook(
                    lambda m, args, seen=seen, fc1=fc1, fc2=fc2:
                    (args[0] * ((torch.relu(seen["x"] @ fc1.T) @ fc2.T) > 0).view_as(args[0]),))
        return model
    for i, layer in enumerate(model.model.layers):
        mlp, seen = layer.mlp, {}
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args, seen=seen: seen.update(x=args[0]))
        fc1, fc2 = preds[f"layer.{i}.fc1.weight"], preds[f"layer.{i}.fc2.weight"]

        def forward(xn, mlp=mlp, seen=seen, fc1=fc1, fc2=fc2):
            up = mlp.up_proj(xn)
            h = torch.relu(mlp.gate_proj(xn)) * (torch.relu(up) if kind == "bamboo" else up)
            if masks:
                h = h * ((torch.relu(seen["x"] @ fc1.T) @ fc2.T) > 0)
            return mlp.down_proj(h)

        mlp.forward = forward
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def run(model, tokens: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Prefill `n_prefill` tokens, then one token at a time: the logits of every position."""
    with torch.inference_mode():
        cache = model.new_cache(CTX)
        outs = [model(tokens[:, :n_prefill], cache)]
        for t in range(n_prefill, tokens.shape[1]):
            outs.append(model(tokens[:, t: t + 1], cache))
    return torch.cat(outs, dim=1)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(7))


def load(kind: str, **kw):
    return sparseinfer.load(model_file(kind), act_mode="precise", cache_type="f32", **kw)


# ---------------------------------------------------------------------------- the format
@pytest.mark.parametrize("kind", KINDS)
def test_recognised_with_transposed_down_and_predictors(kind):
    src = open_source(model_file(kind))
    assert src.powerinfer and src.reader.version == 3
    c = src.config
    assert c.hidden_act == ("drelu" if kind == "bamboo" else "relu")
    down = ("transformer.h.0.mlp.dense_4h_to_h.weight" if kind.startswith("falcon") else
            "model.decoder.layers.0.fc2.weight" if kind == "opt-relu" else "model.layers.0.mlp.down_proj.weight")
    assert src.file_name(down) == "blk.0.ffn_down_t.weight"
    assert src.shape(down) == (c.hidden_size, c.intermediate_size)
    assert src.file_tensor_info("blk.0.ffn_down_t.weight").shape.tolist() == [c.hidden_size, c.intermediate_size]
    assert src.file_tensor("blk.1.fc2.weight").shape == (c.intermediate_size, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_dense_equals_transformers(kind, tokens):
    """Every neuron active (the dense model, and the sparse FFNs without predictors): the
    transformers ReLU / dReLU model on the same weights."""
    want = hf_logits(hf_reference(kind), tokens)
    llm = load(kind, dense=True)
    torch.testing.assert_close(run(llm.model, tokens, 5), want, atol=2e-3, rtol=2e-3)
    llm = load(kind)
    for f in sparse_ffns(llm.model):
        f.predictor = None
    torch.testing.assert_close(run(llm.model, tokens, 1), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_file_predictors_equal_masked_reference(kind, tokens):
    """The file's predictors decide per token as PowerInfer's (fc2 · relu(fc1 · x) > 0 on the
    residual before the FFN norm; Falcon: on the block's input): every token decoded alone
    equals the masked reference, which differs from the dense model (the masks matter)."""
    llm = load(kind)
    ffns = sparse_ffns(llm.model)
    assert llm.sparsity is not None and all(f.predictor is not None for f in ffns)
    assert all(f.reads_residual == (kind in RESIDUAL_READERS) for f in ffns)
    got = run(llm.model, tokens, 1)
    want = hf_logits(hf_reference(kind, masks=True), tokens)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    dense = hf_logits(hf_reference(kind), tokens)
    assert (dense - want).abs().max() > 0.05


@pytest.mark.parametrize("kind", RESIDUAL_READERS)
def test_whole_chunks_apply_the_same_masks(kind, tokens):
    """Perplexity's per-token masks on whole chunks (`faithful`) and batched decode read the
    same residual stream: the masked reference again, for the prompt as one chunk."""
    from sparseinfer.sparse.apply import set_mode

    llm = load(kind)
    set_mode(llm.model, "faithful")
    want = hf_logits(hf_reference(kind, masks=True), tokens)
    torch.testing.assert_close(run(llm.model, tokens, tokens.shape[1]), want, atol=2e-3, rtol=2e-3)


def test_residual_predictor_decode_equals_its_reference():
    """One Falcon FFN: the C step on the rows the residual-reading predictor picks equals the
    slow reference (`reference_token`, `reference`); the rows come from the residual stream,
    not the FFN input, and calling it without that stream is an error."""
    llm = load("falcon-relu")
    block = llm.model.layers[0]
    ffn = block.mlp
    g = torch.Generator().manual_seed(3)
    differ = 0
    for _ in range(5):
        x = torch.randn(1, 1, 32, generator=g)
        xn = block.ln_attn(x)
        got = ffn(xn, residual=x)
        torch.testing.assert_close(got.view(-1), ffn.reference_token(xn.view(-1), x.view(-1)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, ffn.reference(xn, x), atol=1e-5, rtol=1e-5)
        differ += not torch.equal(got, ffn(xn, residual=xn))  # the same FFN input, another stream read
    assert differ
    with pytest.raises(ValueError, match="reads the residual stream"):
        ffn(xn)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_across_thread_counts(kind):
    outs = []
    for threads in (1, 2):
        llm = load(kind, threads=threads)
        outs.append([r.token for r in llm.stream_generate([1, 5, 9, 20], max_tokens=10, temp=0.0) if r.token is not None])
    assert outs[0] == outs[1] and outs[0]


# ---------------------------------------------------------------------------- neuron order
def test_neuron_order_from_activation_counts():
    """llama-relu has PowerInfer's activation profile: hottest neurons first."""
    llm = load("llama-relu")
    for i, f in enumerate(sparse_ffns(llm.model)):
        counts = torch.load(FIXTURES / "llama-relu" / "activation" / f"activation_{i}.pt", weights_only=True)
        assert torch.equal(f.order, torch.sort(counts, descending=True, stable=True).indices)
        assert llm.sparsity.layers[i].freq.max() == 1.0


def test_neuron_order_from_gpu_split():
    """bamboo has the GPU split PowerInfer's solver exports: its GPU neurons first."""
    from sparseinfer.io.powerinfer import gpu_index

    masks, _ = gpu_index(model_file("bamboo"), 2, [96, 96])
    llm = load("bamboo")
    for m, f in zip(masks, sparse_ffns(llm.model)):
        k = int(m.sum())
        assert k == 40 and bool(m[f.order[:k]].all()) and not bool(m[f.order[k:]].any())


def half_split(llm):
    """Place `llm` on torch's CPU as a stand-in device with room for everything but the FFN
    neurons, and half of those: (the hybrid model, its placement)."""
    from sparseinfer.hybrid.costs import cost_model

    c = cost_model(llm.model, CTX, "cpu", cache_type="f32")
    budget = (c.scratch + c.head + sum(lc.core + lc.predictor + c.ffn_overhead for lc in c.layers)
              + sum(lc.neuron * lc.n_neurons for lc in c.layers) // 2)
    return place_model(llm.model, "cpu", budget, CTX, NeuronStats.from_pack(llm.sparsity), group_size=16,
                       use_cache=False, cache_type="f32")


def test_hybrid_placement_puts_hot_neurons_on_the_device(tokens):
    """Torch on the CPU standing in for the accelerator: the split computes the CPU-only model,
    and the device part of each layer is its hottest neurons."""
    llm = load("llama-relu")
    want = run(llm.model, tokens, 1)
    hm, p = half_split(llm)
    assert p.mode == "neurons" and 0 < sum(p.n_hot) < sum(p.n_neurons)
    torch.testing.assert_close(run(hm, tokens, 1), want, atol=1e-4, rtol=1e-4)
    for i, k in enumerate(p.n_hot):  # the device part (a prefix in hotness order): the most counted neurons
        counts = torch.load(FIXTURES / "llama-relu" / "activation" / f"activation_{i}.pt", weights_only=True)
        order = llm.sparsity.layers[i].order
        assert k == 0 or k == len(order) or counts[order[:k]].min() >= counts[order[k:]].max()


def test_hybrid_falcon_picks_rows_by_relu(tokens):
    """A split Falcon layer does not carry the residual-reading predictor over: the split
    computes every active neuron (the dense model)."""
    llm = load("falcon-relu")
    hm, p = half_split(llm)
    assert p.mode == "neurons" and 0 < sum(p.n_hot) < sum(p.n_neurons)
    want = hf_logits(hf_reference("falcon-relu"), tokens)
    torch.testing.assert_close(run(hm, tokens, 1), want, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------- commands and errors
def test_inspect_shows_predictors_and_threshold():
    from sparseinfer.describe import describe

    text = describe(str(model_file("llama-relu")))
    assert "PowerInfer:   PWRI file (GGUF v3), architecture llama; sparse threshold 0.0" in text
    assert "predictors:   2 layers, hidden 16, F16" in text
    assert "neuron stats: activation counts" in text
    assert "sparse threshold 0 (powerinfer.sparse_threshold not set)" in describe(str(model_file("bamboo")))
    assert "GPU split" in describe(str(model_file("bamboo")))
    for kind in RESIDUAL_READERS:
        text = describe(str(model_file(kind)))
        assert "not used" not in text and "used on the residual stream before the FFN's LayerNorm" in text


@pytest.mark.parametrize("kind", ["llama-relu", "falcon-relu", "opt-relu"])
def test_cli_run_uses_the_file_predictors(kind, capsys):
    from sparseinfer.commands import main

    assert main(["run", "-m", str(model_file(kind)), "-p", "the", "-n", "4", "--temp", "0", "-t", "1"]) == 0


def test_saved_pack_keeps_what_its_predictors_read(tmp_path):
    """A pack made from a Falcon file, saved and read back, still feeds its predictors the
    residual stream; a pack claiming another input is refused with a clear error."""
    from sparseinfer.sparse.pack import SparsityPack

    pack = load("falcon-relu").sparsity
    path = pack.save(tmp_path / "falcon.sparse")
    back = SparsityPack.load(path)
    assert [lp.predictor_reads for lp in back.layers] == ["residual"] * len(pack.layers)
    assert back.layers[0].predictor().reads == "residual"
    pack.layers[0].predictor_reads = "attention"
    with pytest.raises(SparsityPackError, match="layer 0's predictor reads 'attention'; expected one of ffn_input, residual"):
        pack.validate()


def _copy_renaming(tmp_path: Path, kind: str, name: str) -> Path:
    """The fixture with tensor `name` renamed (same length: the header stays valid), so the
    file no longer has a tensor of that name."""
    data = model_file(kind).read_bytes()
    assert data.count(name.encode()) == 1
    out = tmp_path / "model.powerinfer.gguf"
    out.write_bytes(data.replace(name.encode(), name[:-6].encode() + b"xeight"))
    return out


def test_missing_predictor_is_named(tmp_path):
    path = _copy_renaming(tmp_path, "llama-relu", "blk.1.fc2.weight")
    with pytest.raises(SparsityPackError, match=r"layer 1's predictor \(tensor blk\.1\.fc2\.weight is missing\).*--dense"):
        sparseinfer.load(path)
    sparseinfer.load(path, dense=True)  # the model itself is whole


def test_missing_down_is_named(tmp_path):
    path = _copy_renaming(tmp_path, "llama-relu", "blk.0.ffn_down_t.weight")
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_down_t\.weight.*missing"):
        sparseinfer.load(path, dense=True)


def test_unknown_powerinfer_architecture(tmp_path):
    data = bytearray(model_file("llama-relu").read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key) + 12  # after the key: value type (4 bytes), length (8)
    assert bytes(data[at:at + 5]) == b"llama"
    data[at:at + 5] = b"gptj_"
    path = tmp_path / "x.powerinfer.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="PowerInfer file of architecture 'gptj_'.*llama, bamboo, falcon, opt"):
        open_source(path)


def test_damaged_activation_file(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama-relu", folder, ignore=shutil.ignore_patterns("hf"))
    torch.save(torch.zeros(5), folder / "activation" / "activation_1.pt")
    with pytest.raises(ModelFormatError, match="activation_1.pt: expected a vector of 96 activation counts"):
        sparseinfer.load(folder / "model.powerinfer.gguf")


def test_a_prepared_pack_wins(tmp_path):
    """A `.sparse` pack next to the file replaces the file's predictors (prepare refines them)."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama-relu", folder, ignore=shutil.ignore_patterns("hf"))
    llm = sparseinfer.load(folder / "model.powerinfer.gguf")
    pack = llm.sparsity
    pack.layers[0].predictor_format = "q8"
    pack.save(folder / "model.powerinfer.gguf.sparse")
    llm2 = sparseinfer.load(folder / "model.powerinfer.gguf")
    assert llm2.sparsity.path == folder / "model.powerinfer.gguf.sparse"
    assert isinstance(sparse_ffns(llm2.model)[0], SparseFFN)


def _quantized_copy(tmp_path: Path, kind: str) -> Path:
    """The fixture as PowerInfer's quantizer lays out a Q4_0 file: every 2-D weight whose rows
    split into 32-blocks in Q4_0 (predictors included), the rest as they were; PWRI magic."""
    import gguf
    import numpy as np

    from sparseinfer.io import gguf as gguf_io

    r = gguf_io.open_reader(model_file(kind))
    out = tmp_path / "model.powerinfer.gguf"
    w = gguf.GGUFWriter(str(out), r.metadata["general.architecture"])
    for k, v in r.metadata.items():
        if k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for t in r.tensors:
        a = gguf_io.tensor_to_float(t).numpy()
        if a.ndim == 2 and a.shape[1] % 32 == 0:
            q = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:  # F16 or F32, as they were
            w.add_tensor(t.name, np.asarray(t.data).reshape(a.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(out, "r+b") as f:
        f.write(b"PWRI")
    return out


def test_q4_0_file(tmp_path, tokens):
    """A Q4_0 file: the dense model is transformers' on the dequantized weights (the transposed
    down re-quantized to 8 bits: close, not equal); with its predictors (8-bit here) it decodes
    as the masked reference on those weights (here no score lies near enough to 0 to flip)."""
    path = _quantized_copy(tmp_path, "llama-relu")
    src = open_source(path)
    assert src.file_tensor_info("blk.0.ffn_down_t.weight").tensor_type.name == "Q4_0"
    assert src.qweight("model.layers.0.mlp.down_proj.weight").fmt == "q8"
    want = hf_logits(hf_reference("llama-relu", dequantized=path), tokens)
    llm = sparseinfer.load(path, dense=True, act_mode="precise", cache_type="f32")
    torch.testing.assert_close(run(llm.model, tokens, 5), want, atol=0.05, rtol=0.05)
    llm = sparseinfer.load(path, act_mode="precise", cache_type="f32")
    assert llm.sparsity.layers[0].predictor_format == "q8"
    assert all(f.predictor is not None and f.predictor.w1.fmt == "q8" for f in sparse_ffns(llm.model))
    got = run(llm.model, tokens, 1)
    masked = hf_logits(hf_reference("llama-relu", masks=True, dequantized=path), tokens)
    torch.testing.assert_close(got, masked, atol=0.05, rtol=0.05)
    assert (got - want).abs().max() > 0.2  # the masks matter


def test_prepare_refines_a_powerinfer_file(tmp_path):
    """`prepare` profiles and trains on a PowerInfer file like on any model; its pack is then
    used in place of the file's predictors."""
    import random

    from sparseinfer.commands import main

    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama-relu", folder, ignore=shutil.ignore_patterns("hf"))
    rng = random.Random(0)
    words = "the then there in inner on one re an and her here".split()
    (tmp_path / "calib.txt").write_text(" ".join(rng.choice(words) for _ in range(6000)))
    model = folder / "model.powerinfer.gguf"
    # no speed check: whether a pack pays on this tiny model is a matter of timing noise (the
    # rule that drops a slower pack has its own tests in test_sparse.py)
    assert main(["prepare", str(model), "--data", str(tmp_path / "calib.txt"), "--no-eval", "--no-plot", "-t", "1",
                 "--no-speed-check"]) == 0
    llm = sparseinfer.load(model)
    assert llm.sparsity.path == folder / "model.powerinfer.gguf.sparse" and llm.sparsity.calibration.get("source") != "PowerInfer file"
