"""Perplexity the way llama.cpp's `llama-perplexity` computes it.

The text is tokenized whole and cut into chunks of `ctx` tokens; each chunk starts with BOS
when the model adds one; only the second half of each chunk is scored, so every scored token
sees at least ctx/2 tokens of context.  PPL = exp(mean negative log-likelihood).
"""
from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm


def chunk_tokens(tokens: list[int], ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    chunks = []
    for i in range(len(tokens) // ctx):
        c = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        chunks.append(c)
    return chunks[:n_chunks] if n_chunks else chunks


def perplexity(llm, text: str, ctx: int = 512, n_chunks: int | None = None, progress: bool = True) -> dict:
    """Score `text`; returns {"ppl", "nll", "tokens_scored", "chunks", "ctx", "seconds", "per_chunk"}."""
    tok = llm.tokenizer
    ids = tok.encode(text, add_bos=False, parse_special=False)
    bos = tok.bos_id if tok.add_bos else None
    chunks = chunk_tokens(ids, ctx, n_chunks, bos)
    if not chunks:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one chunk of {ctx}; use a smaller --ctx-size")
    first = ctx // 2
    nll, count, per_chunk = 0.0, 0, []
    t0 = time.perf_counter()
    bar = tqdm(chunks, desc="perplexity", unit="chunk", disable=not progress)
    with torch.inference_mode():
        for c in bar:
            logits = llm.model(torch.tensor([c]), llm.model.new_cache(ctx))[0]
            logp = torch.log_softmax(logits[first:-1].float(), dim=-1)
            target = torch.tensor(c[first + 1 :])
            s = -logp.gather(1, target[:, None]).sum().item()
            nll += s
            count += len(target)
            per_chunk.append(math.exp(s / len(target)))
            bar.set_postfix(ppl=f"{math.exp(nll / count):.4f}")
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens_scored": count, "chunks": len(chunks),
            "ctx": ctx, "seconds": time.perf_counter() - t0, "per_chunk": per_chunk}
