"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' own GGUF loader."""
from __future__ import annotations

import pytest
import torch

import sparseinfer


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return sparseinfer.load(smollm2_path, ctx_size=2048)


def test_teacher_forced_top1_agreement(llm, smollm2_path, shared_data):
    from transformers import AutoModelForCausalLM

    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[5000:9000]
    ids = llm.tokenizer.encode(text)[:384]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        ours = llm.model(torch.tensor([ids]), llm.model.new_cache(512))[0]
    agree = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"top-1 agreement {agree:.4f}"


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
