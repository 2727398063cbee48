"""The output head's preview alone (dense FFNs): greedy agreement with the exact head on real
prompts, and decode speed against the exact head, alternated in one process.

    python benchmarks/sparse_head.py -m qwen2.5-coder-1.5b --pack PACK -t 2 --prompts 100 \
        --json benchmarks/results/sparse_head_qwen15.json

With --fit instead of a pack, the preview is chosen here as `sparseinfer prepare` chooses it
(`sparse.head.choose`, the default calibration mix), fitted on the dense model's head inputs
(a pack fits it on those of its sparsified model); the record's `tried` lists each preview
`choose` tried (rank, format, its product's time here, held-out agreement and fallback).

Agreement, over the first --prompts prompts of shared/data/prompts.jsonl (chat template, greedy,
--n-gen tokens each):
  - identical: the fraction of generated positions whose token equals the exact head's run
    (a run that diverges keeps counting its later positions as they fall);
  - per-token: at every step of the exact run (the same context), whether the preview's greedy
    token is the exact head's, and how often it fell back to the exact head.
Speed: --rounds pairs of (exact head, preview) decodes of --n-gen tokens after a --n-prompt
token prefill of a real prompt; the speed-up is the median of the pairs' ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import sparseinfer
from sparseinfer.generate import decode, prefill
from sparseinfer.sparse.apply import default_pack_path
from sparseinfer.sparse.head import PreviewHead
from sparseinfer.sparse.pack import SparsityPack
from sparseinfer.sparse.speed import machine

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def prompts(llm, n: int) -> list[list[int]]:
    out = []
    with open(DATA / "prompts.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            text = "\n\n".join(str(r[k]) for k in ("prompt", "context") if r.get(k))
            out.append(llm.tokenizer.encode(llm.format_chat([{"role": "user", "content": text}]),
                                            add_bos=False, parse_special=True))
            if len(out) == n:
                break
    return out


def greedy(model, ids: list[int], n: int, check: PreviewHead | None = None) -> tuple[list[int], int]:
    """n greedy tokens after `ids`; with `check` (the exact head in the model), how many of the
    steps' preview tokens equal the exact ones."""
    cache = model.new_cache(len(ids) + n + 1)
    same = 0
    with torch.inference_mode():
        logits = prefill(model, ids, cache)
        out = []
        for _ in range(n):
            if check is not None:  # the preview on the same hidden state (and context) as the exact head
                same += int(logits.argmax()) == int(check.row(check.last, ids + out).argmax())
            tok = int(logits.argmax())
            out.append(tok)
            logits = decode(model, tok, cache)
    return out, same


class Tap(torch.nn.Module):
    """The exact head, keeping its last input row for the per-token comparison."""

    def __init__(self, exact, ph: PreviewHead):
        super().__init__()
        self.exact, self.ph = exact, ph

    def forward(self, x):
        self.ph.last = x.reshape(-1, x.shape[-1])[-1].float().clone()
        return self.exact(x)


def fit_here(llm):
    """The head preview `prepare` would choose, fitted on the dense model's head inputs over the
    default calibration mix."""
    from sparseinfer.sparse.calibrate import calibration_set, forward_batches
    from sparseinfer.sparse.head import HiddenRecorder, choose
    from sparseinfer.sparse.prepare import PrepareOptions

    o = PrepareOptions()
    cs = calibration_set(llm.tokenizer, DATA, o.tokens, o.seq_len, o.eval_tokens, o.seq_len * 2, o.seed)
    rec = HiddenRecorder(llm.model)
    try:
        forward_batches(llm.model, cs.seqs, o.batch, "head inputs")
    finally:
        hidden = rec.detach()
    hp, tried = choose(llm.model, hidden, o.head_agreement, tokens=cs.seqs)
    if hp is None:
        raise SystemExit("no head preview agrees with the exact head on the held-out calibration tokens")
    return hp, tried


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--pack", default=None, help="default: the pack next to the model")
    ap.add_argument("--fit", action="store_true", help="choose and fit the preview here instead of reading a pack")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--n-prompt", type=int, default=512, help="prefill length of the speed runs")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    llm = sparseinfer.load(a.model, threads=a.threads, dense=True)
    torch.set_num_threads(1)
    model, exact = llm.model, llm.model.head
    tried = []
    if a.fit:
        hp, tried = fit_here(llm)
    else:
        pack = SparsityPack.load(a.pack or default_pack_path(llm.info.path))
        pack.check(llm.source)
        if pack.head is None:
            raise SystemExit(f"{pack.path} has no head preview (made with --no-head, or none agreed / paid)")
        hp = pack.head
    ph = PreviewHead(exact, hp)
    ps = prompts(llm, a.prompts)

    same_pos = same_tok = total = 0
    t0 = time.perf_counter()
    for i, ids in enumerate(ps):
        model.head = Tap(exact, ph)
        ref, agree = greedy(model, ids, a.n_gen, ph)
        model.head = ph
        got, _ = greedy(model, ids, a.n_gen)
        model.head = exact
        same_tok += agree
        same_pos += sum(x == y for x, y in zip(ref, got))
        total += len(ref)
        print(f"\rprompt {i + 1}/{len(ps)}: identical {same_pos / total:.4f}, per-token {same_tok / total:.5f}",
              end="", flush=True)
    print(f" ({time.perf_counter() - t0:.0f} s)")
    fell = ph.fallbacks / max(ph.tokens, 1)

    long = [t for ids in ps for t in ids]
    while len(long) < a.n_prompt:
        long += long
    long = long[: a.n_prompt]
    cache = model.new_cache(a.n_prompt + a.n_gen + 2)
    pairs = []
    with torch.inference_mode():
        prefill(model, long, cache)
        start = cache.length

        def run(head) -> float:
            model.head = head
            cache.truncate(start)
            tok = int(decode(model, long[-1], cache).argmax())
            t = time.perf_counter()
            for _ in range(a.n_gen):
                tok = int(decode(model, tok, cache).argmax())
            return a.n_gen / (time.perf_counter() - t)

        for r in range(a.rounds):
            pairs.append((run(exact), run(ph)))
            print(f"round {r + 1}: exact {pairs[-1][0]:.2f} tok/s, preview {pairs[-1][1]:.2f} tok/s", flush=True)
    model.head = exact
    w = exact.weight
    rec = {**machine(), "model": Path(llm.info.path).name, "threads": a.threads, "rank": hp.rank,
           "format": hp.fmt, "candidates": hp.candidates, "fitted_here": a.fit, "prompts": len(ps), "n_gen": a.n_gen,
           "identical": round(same_pos / total, 5), "per_token": round(same_tok / total, 5),
           "fallback": round(fell, 5), "n_prompt": a.n_prompt, "rounds": a.rounds,
           **({"exact_tok_s": round(statistics.median(p[0] for p in pairs), 2),
               "preview_tok_s": round(statistics.median(p[1] for p in pairs), 2),
               "speedup": round(statistics.median(p[1] / p[0] for p in pairs), 3)} if pairs else {}),
           "head_bytes": w.nbytes, "preview_bytes": ph.preview_bytes + ph.k * (w.nbytes // w.rows),
           "tried": tried}
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
