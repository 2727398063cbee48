"""Perplexity under input sparsity (TEAL, arXiv 2408.14690), per projection; not a test.

    python benchmarks/input_sparsity.py -m MODEL [--points qkv,o,gate_up,down] [--sparsities 0.4,0.6]
                                        [--score abs|wina] [--chunks 8] [--json FILE]

For each point (the input of q/k/v, of o, of gate/up, of down) and each sparsity s, every layer's
threshold is the s-quantile of |x| at that point on calibration text (tinyshakespeare, the first
4096 tokens), and the inputs at or below it are set to zero for every token, in the reference
(torch) path: the model `sparseinfer.kernels.cpu.gemv_cols` computes in decode.  `--score wina`
scores |x_j| * ||W[:, j]|| instead (WINA, arXiv 2505.19427).  Perplexity is llama.cpp's method on
WikiText-2 test (`sparseinfer.perplexity`), one point sparsified at a time, so the table says
which projections tolerate input sparsity.  The output head is never sparsified.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import sparseinfer
from sparseinfer.kernels.reference import input_mask
from sparseinfer.models import layers as L
from sparseinfer.perplexity import perplexity

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
POINTS = {"qkv": ("._qkv", ".q", ".k", ".v"), "o": (".o",), "gate_up": ("._gate_up", ".gate", ".up"),
          "down": (".down",)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--points", default="qkv,o,gate_up,down")
    ap.add_argument("--sparsities", default="0.4,0.6")
    ap.add_argument("--score", choices=("abs", "wina"), default="abs")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--json", help="append one record per measurement to this JSON-lines file")
    args = ap.parse_args(argv)
    llm = sparseinfer.load(args.model, dense=True, threads=args.threads)
    model = llm.model
    names, colnorm, samples, thr = {}, {}, {}, {}
    for name, mod in model.named_modules():
        names[id(mod)] = name
        for attr in ("_qkv", "_gate_up"):  # fused projections: one input, one threshold
            if getattr(mod, attr, None) is not None:
                names[id(getattr(mod, attr))] = f"{name}.{attr}"
    state = {"record": True}
    forward = L.Linear.forward

    def score(self, x):
        a = x.abs()
        if args.score == "wina":
            if id(self) not in colnorm:
                colnorm[id(self)] = self.weight.dequantize().norm(dim=0)
            a = a * colnorm[id(self)]
        return a

    def hooked(self, x):
        key = id(self)
        if self is model.head:
            return forward(self, x)
        if state["record"]:
            a = score(self, x.reshape(-1, x.shape[-1]).float()).flatten()
            pick = torch.randint(0, a.numel(), (min(a.numel(), 20000),), generator=torch.Generator().manual_seed(len(samples)))
            samples.setdefault(key, []).append(a[pick])
        elif key in thr:
            if args.score == "abs":
                x = input_mask(x, thr[key])
            else:
                x = torch.where(score(self, x) > thr[key], x, torch.zeros((), dtype=x.dtype))
        return forward(self, x)

    L.Linear.forward = hooked
    try:
        cal = open(os.path.join(args.data, "tinyshakespeare.txt")).read()[:60000]
        ids = llm.tokenizer.encode(cal, add_bos=False, parse_special=False)[:4096]
        with torch.inference_mode():
            for i in range(0, len(ids) - 1, 512):
                model(torch.tensor([ids[i:i + 512]]), model.new_cache(512))
        state["record"] = False
        values = {k: torch.cat(v) for k, v in samples.items()}
        text = open(os.path.join(args.data, "wikitext-2-raw", "wiki.test.raw")).read()
        dense = perplexity(llm, text, ctx=512, n_chunks=args.chunks, progress=False)["ppl"]
        print(f"{args.model}: dense perplexity {dense:.4f} ({args.chunks} chunks of 512)", flush=True)
        for point in args.points.split(","):
            for s in (float(v) for v in args.sparsities.split(",")):
                thr.clear()
                for k, v in values.items():
                    if names.get(k, "").endswith(POINTS[point]):
                        thr[k] = float(torch.quantile(v.float(), s))
                t0 = time.perf_counter()
                ppl = perplexity(llm, text, ctx=512, n_chunks=args.chunks, progress=False)["ppl"]
                rec = {"model": args.model, "point": point, "sparsity": s, "score": args.score, "ppl": ppl,
                       "dense_ppl": dense, "increase": ppl / dense - 1, "layers": len(thr), "chunks": args.chunks,
                       "seconds": time.perf_counter() - t0}
                print(f"  {point:8s} sparsity {s:.2f}: {ppl:.4f} ({100 * rec['increase']:+.2f}%)", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(rec) + "\n")
    finally:
        L.Linear.forward = forward


if __name__ == "__main__":
    sys.exit(main())
