"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' own GGUF loader."""
from __future__ import annotations

import pytest
import torch

import sparseinfer


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return sparseinfer.load(smollm2_path, ctx_size=2048)


@pytest.fixture(scope="module")
def wiki_ids_and_reference(llm, smollm2_path, shared_data):
    """384 WikiText-2 tokens and transformers' f32 logits for them (its own GGUF loader)."""
    from transformers import AutoModelForCausalLM

    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[5000:9000]
    ids = llm.tokenizer.encode(text)[:384]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    with torch.inference_mode():
        return ids, hf(torch.tensor([ids])).logits[0].float()


def test_teacher_forced_top1_agreement(llm, wiki_ids_and_reference):
    ids, ref = wiki_ids_and_reference
    with torch.inference_mode():
        ours = llm.model(torch.tensor([ids]), llm.model.new_cache(512))[0]
    agree = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"top-1 agreement {agree:.4f}"


def test_decode_path_quality_per_activation_mode(llm, wiki_ids_and_reference):
    """Token by token (the integer kernels' decode path) against transformers' f32 logits:
    "precise" agrees on the top token almost everywhere; "int8" (llama.cpp's Q8 activations)
    stays within a small KL (llama.cpp itself: 0.0035 on these tokens)."""
    from sparseinfer.generate import decode
    from sparseinfer.kernels import cpu

    ids, ref = wiki_ids_and_reference
    ids, ref = ids[:256], ref[:256]
    lp = ref.log_softmax(-1)
    old = cpu.activation_mode()
    try:
        for mode, min_agree, max_kl in (("precise", 0.99, 1e-4), ("int8", 0.93, 0.008)):
            cpu.set_activation_mode(mode)
            cache = llm.model.new_cache(300)
            with torch.inference_mode():
                ours = torch.stack([decode(llm.model, t, cache).float().reshape(-1) for t in ids])
            kl = (lp.exp() * (lp - ours.log_softmax(-1))).sum(-1).mean().item()
            agree = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
            assert agree >= min_agree and kl <= max_kl, f"{mode}: agreement {agree:.4f}, KL {kl:.5f}"
    finally:
        cpu.set_activation_mode(old)


def test_act_mode_auto_and_explicit(smollm2_path, monkeypatch):
    from sparseinfer.errors import SparseInferError
    from sparseinfer.kernels import cpu

    monkeypatch.delenv("SPARSEINFER_ACT_MODE", raising=False)
    old = cpu.activation_mode()
    try:
        sparseinfer.load(smollm2_path, ctx_size=64)  # 92 MiB of weights: auto -> precise
        assert cpu.activation_mode() == "precise"
        sparseinfer.load(smollm2_path, ctx_size=64, act_mode="int8")
        assert cpu.activation_mode() == "int8"
        monkeypatch.setenv("SPARSEINFER_ACT_MODE", "precise")
        sparseinfer.load(smollm2_path, ctx_size=64)
        assert cpu.activation_mode() == "precise"
        with pytest.raises(SparseInferError, match="act_mode"):
            sparseinfer.load(smollm2_path, ctx_size=64, act_mode="fp4")
    finally:
        cpu.set_activation_mode(old)


def test_greedy_chat_answer(llm):
    out = llm.generate("What is the capital of France?", chat=True, max_tokens=24, temp=0)
    assert "Paris" in out


def test_stream_equals_generate(llm):
    pieces = [r.text for r in llm.stream_generate("The quick brown fox", max_tokens=16, temp=0)]
    assert "".join(pieces) == llm.generate("The quick brown fox", max_tokens=16, temp=0)


def test_stop_string_cuts_output(llm):
    full = llm.generate("List three colors:\n1.", max_tokens=24, temp=0)
    stop = full.strip()[:3]
    cut = llm.generate("List three colors:\n1.", max_tokens=24, temp=0, stop=[stop])
    assert stop not in cut and full.startswith(cut)


def test_seeded_sampling_is_reproducible(llm):
    kw = dict(max_tokens=12, temp=0.9, top_k=40, top_p=0.9, seed=123)
    assert llm.generate("Once upon a time", **kw) == llm.generate("Once upon a time", **kw)
