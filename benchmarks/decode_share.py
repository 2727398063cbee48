"""How much of a dense decode step the weight products take; not a test.

    python benchmarks/decode_share.py -m qwen2.5-coder-1.5b [-t 2] [--rounds 3] [--context 512] [--json FILE]

Loads the model as `sparseinfer bench --dense` does, fills a context of `--context` tokens,
then alternates bursts of (a) decoding `--burst` tokens and (b) the products of the same
weights one decoded token reads whole, in the same order, on random inputs, `--burst` times
(`--tokens` of each per round): fused q/k/v (or q, k, v), o, fused gate/up (or gate, up) and down of every layer, then
the output head.  (b) is what the weight kernels alone take; the rest of (a), the step's
"non-kernel" time, is everything else a token costs: the activation quantization, norms,
rotary, attention over the cache, the sampling-free argmax, the Python and C glue.
Reports per round the medians and the median over the pairs of bursts of the share
1 - (b) / (a) (the machine's speed drifts between minutes, less within a pair), with the
memory-bandwidth probe.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import probe_gbps  # noqa: E402

import sparseinfer  # noqa: E402
from sparseinfer.generate import decode, prefill  # noqa: E402
from sparseinfer.kernels import cpu  # noqa: E402
from sparseinfer.models.layers import MLP, Attention  # noqa: E402
from sparseinfer.sparse.speed import machine  # noqa: E402


def whole_read_weights(model) -> list:
    """The weights one dense decode step reads whole, in the order it reads them."""
    ws = []
    for m in model.modules():
        if type(m) is Attention:
            ws += [m._qkv.weight] if m._intact() else [m.q.weight, m.k.weight, m.v.weight]
            ws.append(m.o.weight)
        elif type(m) is MLP:
            if m.gate is None:
                ws.append(m.up.weight)
            else:
                ws += [m._gate_up.weight] if m._intact() else [m.gate.weight, m.up.weight]
            ws.append(m.down.weight)
    return ws + [model.head.weight]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--burst", type=int, default=8, help="tokens per burst; bursts of decode and of products alternate")
    ap.add_argument("--json")
    a = ap.parse_args()
    llm = sparseinfer.load(a.model, threads=a.threads, dense=True)
    model = llm.model
    ws = whole_read_weights(model)
    xs = [torch.randn(w.cols) for w in ws]
    outs = [torch.empty(w.rows) for w in ws]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, llm.config.vocab_size - 100, (a.context,), generator=g).tolist()
    rows = []
    with torch.inference_mode():
        for r in range(a.rounds):
            cache = model.new_cache(a.context + a.tokens + 8)
            tok = int(prefill(model, ids, cache).argmax())
            steps, prods = [], []
            for _ in range(a.tokens // a.burst):  # pairs of bursts, a second or less apart
                t0 = time.perf_counter()
                for _ in range(a.burst):
                    tok = int(decode(model, tok, cache).argmax())
                steps.append((time.perf_counter() - t0) / a.burst)
                t0 = time.perf_counter()
                for _ in range(a.burst):
                    for w, x, y in zip(ws, xs, outs):
                        cpu.gemv(w, x, out=y)
                prods.append((time.perf_counter() - t0) / a.burst)
            share = statistics.median(1 - p / s for p, s in zip(prods, steps))
            step, prod = statistics.median(steps), statistics.median(prods)
            gbps = probe_gbps(a.threads)
            rows.append({"round": r, "step_ms": round(1e3 * step, 3), "products_ms": round(1e3 * prod, 3),
                         "non_kernel_share": round(share, 4), "probe_gbps": round(gbps, 1)})
            print(f"round {r}: decode step {1e3 * step:.2f} ms, its weight products {1e3 * prod:.2f} ms (medians): "
                  f"non-kernel {100 * share:.1f}% (median of {len(steps)} pairs)  probe {gbps:.1f} GB/s", flush=True)
    nbytes = sum(w.nbytes for w in ws)
    share = statistics.median(x["non_kernel_share"] for x in rows)
    print(f"{len(ws)} products over {nbytes / 2**20:.1f} MiB of weights per token; non-kernel share of a decode step, "
          f"median of the rounds: {100 * share:.1f}%")
    if a.json:
        rec = {"model": str(llm.info.path), "threads": a.threads, "context": a.context, "tokens": a.tokens,
               "burst": a.burst, "weights_mib": round(nbytes / 2**20, 1), "products": len(ws),
               "kernels": cpu.simd_level(), "act_mode": cpu.activation_mode(), "machine": machine(), "rounds": rows,
               "non_kernel_share": round(share, 4)}
        Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
