"""Cost of one batched decode step (`CausalLM.decode_batch`) against the one-token path.

    python benchmarks/decode_batch.py -m smollm2 -t 2 --rows 1,2,4,8 --repeat 3

Each sequence gets a 50-token prompt; then, alternating the variants round by round, it times
`--steps` decode steps of the one-token path (the fused C step, what `--parallel 1` serves
with) and of `decode_batch` with each row count, and prints per variant the median step time
and the rows decoded per second.

    python benchmarks/decode_batch.py -m qwen2.5-coder-1.5b -t 2 --rows 1,2,4,8 --products

With --products it also times each weight of one layer (`--layer`) alone, as a product over
each row count (`kernels.cpu.matmul`, the weight warm in the caches after the first call), and
prints the cost of each count relative to one row: what a batched step's products cost where
memory is not the limit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import sparseinfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--products", action="store_true", help="also time one layer's weights alone per row count")
    ap.add_argument("--layer", type=int, default=3)
    a = ap.parse_args()
    llm = sparseinfer.load(a.model, ctx_size=1024, threads=a.threads)
    model = llm.model

    def caches(n):
        out = []
        for b in range(n):
            c = llm.new_cache()
            model(torch.tensor([list(range(100 + b, 150 + b))]), c, last_only=True)
            out.append(c)
        return out

    def one_token():
        c = caches(1)[0]
        return lambda: model(torch.tensor([[11]]), c)

    def batched(n):
        cs = caches(n)
        return lambda: model.decode_batch([11] * n, cs)

    variants = {"one-token": one_token} | {f"batch {n}": (lambda n=n: batched(n)) for n in map(int, a.rows.split(","))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for _ in range(a.repeat):
            for name, make in variants.items():
                step = make()
                for _ in range(2):
                    step()
                t = time.perf_counter()
                for _ in range(a.steps):
                    step()
                times[name].append((time.perf_counter() - t) / a.steps)
    if a.products:
        products(model.layers[a.layer], [int(r) for r in a.rows.split(",")], a.repeat)
    for name, ts in times.items():
        rows = 1 if name == "one-token" else int(name.split()[1])
        med = statistics.median(ts)
        print(f"{name:10s} step {med * 1e3:7.1f} ms  {rows / med:7.1f} rows/s  (runs: "
              + ", ".join(f"{x * 1e3:.1f}" for x in ts) + " ms)")


def products(layer, counts: list[int], repeat: int) -> None:
    """Median time of each of the layer's weights as a product over each row count, and its
    ratio to one row."""
    from sparseinfer.kernels import cpu
    from sparseinfer.quant import QWeight

    seen = {}
    for name, mod in layer.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, QWeight) and id(w) not in seen:
            seen[id(w)] = (name, w)
    for name, w in seen.values():
        ts = {}
        for _ in range(repeat):
            for m in counts:
                x = torch.randn(m, w.cols)
                cpu.matmul(w, x)
                k, t = 0, time.perf_counter()
                while k < 10 or time.perf_counter() - t < 0.1:
                    cpu.matmul(w, x)
                    k += 1
                ts.setdefault(m, []).append((time.perf_counter() - t) / k)
        med = {m: statistics.median(v) for m, v in ts.items()}
        print(f"{name:10s} {w.fmt} {w.rows}x{w.cols}: " + ", ".join(
            f"{m} rows {med[m] * 1e6:.0f} us ({med[m] / med[counts[0]]:.2f}x)" for m in counts))


if __name__ == "__main__":
    main()
