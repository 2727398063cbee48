"""Sparsity packs on the real default model (SmolLM2-135M, SiLU-gated): `prepare` with small
settings, predictors reaching the recall they report on other text, sparse generation and the
CLI's --sparse/--density flags, a foreign pack refused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import sparseinfer
from sparseinfer.sparse import calibrate as cal
from sparseinfer.sparse.apply import sparse_ffns, sparsify
from sparseinfer.sparse.prepare import PrepareOptions, make_pack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pack(smollm2_path, shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "smollm2.sparse"
    opts = PrepareOptions(data=str(shared_data), tokens=2048, steps=150, sizes=(32, 64), target_sparsity=0.4, output=str(out),
                          plot=False, evaluate=False, progress=False, eval_tokens=512)
    llm = sparseinfer.load(smollm2_path, threads=2, dense=True, cache_type="f32")
    return make_pack(llm.model, llm.source, llm.tokenizer, llm.info.path, opts)


@pytest.fixture(scope="module")
def held_out(smollm2_path, shared_data):
    """Text the pack never saw: the middle of WikiText-2 test (calibration uses its last quarter)."""
    llm = sparseinfer.load(smollm2_path, dense=True)
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[400_000:440_000]
    ids = llm.tokenizer.encode(text, add_bos=False)[: 4 * 256]
    return llm, torch.tensor(ids).view(4, 256)


def test_pack_contents(pack):
    assert pack.activation_source == "threshold" and len(pack.layers) == 30
    for lp in pack.layers:
        assert lp.threshold > 0 and lp.policy in ("predictor", "first")
        assert lp.stats["density_true"] == pytest.approx(0.6, abs=0.1)
        assert lp.stats["recall"] >= 0.97
        assert torch.all(lp.freq[lp.order][:-1] >= lp.freq[lp.order][1:])


def test_predictor_recall_on_held_out_text(pack, held_out):
    """Each layer's predictor, measured on other text against the sparsified model's active set,
    reaches the recall the pack reports (small margin for the change of text)."""
    llm, seqs = held_out
    model = llm.model
    sparsify(model, pack, mode="threshold", build_decode=False)
    meter = cal.RecallMeter(sparse_ffns(model), [lp.predictor(for_ranking=True) for lp in pack.layers])
    cal.forward_batches(model, seqs, 2, "recall", progress=False)
    measured = [m["recall"] for m in meter.layers()]
    reported = [lp.stats["recall"] for lp in pack.layers]
    assert sum(measured) / len(measured) >= sum(reported) / len(reported) - 0.02, (measured, reported)
    assert all(m >= r - 0.05 for m, r in zip(measured, reported)), (measured, reported)


def test_sparse_generation(pack, smollm2_path):
    # the exact cache: a greedy answer of this thresholded 135M model can turn on the rounding of K/V
    llm = sparseinfer.load(smollm2_path, sparse=pack.path, cache_type="f32")
    assert llm.sparsity is not None and sparse_ffns(llm.model)
    out = llm.generate("What is the capital of France?", chat=True, max_tokens=24, temp=0)
    assert "Paris" in out


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sparseinfer.commands", *args], capture_output=True, text=True, timeout=600)


def test_cli_bench_density_json(pack, smollm2_path, tmp_path):
    js = tmp_path / "b.jsonl"
    r = run_cli("bench", "-m", str(smollm2_path), "--sparse", str(pack.path), "--density", "0.25", "-t", "2",
                "--n-prompt", "16", "--n-gen", "8", "--json", str(js))
    assert r.returncode == 0, r.stderr
    rec = json.loads(js.read_text().splitlines()[-1])
    assert {"model", "mode", "density", "threads", "prompt_tps", "decode_tps", "ffn_rows_touched_fraction",
            "bytes_per_token"} <= set(rec)
    assert rec["mode"] == "density" and rec["density"] == pytest.approx(0.25, abs=0.01)


def test_cli_ppl_sparse(pack, smollm2_path, shared_data):
    r = run_cli("ppl", "-m", str(smollm2_path), "--sparse", str(pack.path), "-c", "128", "--chunks", "1", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "perplexity (sparse)" in r.stdout


def test_cli_refuses_foreign_pack(smollm2_path, tmp_path):
    from sparseinfer.io.weights import SafetensorsSource
    from sparseinfer.models.registry import build_model
    from test_sparse import random_pack
    from tiny import hf_model, save_folder

    src = SafetensorsSource(save_folder(hf_model("llama"), tmp_path / "tiny"))
    path = random_pack(build_model(src), src).save(tmp_path / "tiny.sparse")
    r = run_cli("run", "-m", str(smollm2_path), "--sparse", str(path), "-p", "hi", "-n", "2")
    assert r.returncode != 0 and "another model" in r.stderr and "Traceback" not in r.stderr
