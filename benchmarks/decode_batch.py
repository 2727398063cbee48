"""Cost of one batched decode step (`CausalLM.decode_batch`) against the one-token path.

    python benchmarks/decode_batch.py -m smollm2 -t 2 --rows 1,2,4,8 --repeat 3

Each sequence gets a 50-token prompt; then, alternating the variants round by round, it times
`--steps` decode steps of the one-token path (the fused C step, what `--parallel 1` serves
with) and of `decode_batch` with each row count, and prints per variant the median step time
and the rows decoded per second.
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
    for name, ts in times.items():
        rows = 1 if name == "one-token" else int(name.split()[1])
        med = statistics.median(ts)
        print(f"{name:10s} step {med * 1e3:7.1f} ms  {rows / med:7.1f} rows/s  (runs: "
              + ", ".join(f"{x * 1e3:.1f}" for x in ts) + " ms)")


if __name__ == "__main__":
    main()
