"""Products on short rows (the output head preview's A: vocabulary x rank), row-major against
row-tiled; not a test.

    python benchmarks/short_rows.py [-t 2] [--rounds 5] [--json FILE]

For each shape (Qwen2.5's and SmolLM2's vocabulary at the ranks `prepare` tries, and one
long-row matrix for comparison), times
`cpu.gemv` on row-major q8 and q4 and `cpu.gemv_tiles` on the same q4 values in row tiles,
alternated in each round, the caches flushed (64 MB written) before every call; reports the
median over rounds of each one's median time and the bytes it read per second.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparseinfer.kernels import cpu
from sparseinfer.quant import from_float, to_tiles
from sparseinfer.sparse.speed import machine

# the head preview's (vocabulary x rank), then one of Qwen2.5-1.5B's own long-row matrices for comparison
SHAPES = [(151936, 192), (151936, 256), (151936, 384), (49152, 96), (49152, 192), (49152, 288), (8960, 1536)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15, help="calls per kernel per round")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cpu.set_num_threads(a.threads)
    evict = torch.ones(16 << 20)

    def timed(fn, w, x):
        ts = []
        for _ in range(a.reps):
            evict.add_(1.0)
            t = time.perf_counter()
            fn(w, x)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    for n, r in SHAPES:
        f = torch.randn(n, r, generator=torch.Generator().manual_seed(n + r))
        q8, q4 = from_float(f, "q8"), from_float(f, "q4")
        kinds = {"q8 rows": (cpu.gemv, q8), "q4 rows": (cpu.gemv, q4), "q4 tiles": (cpu.gemv_tiles, to_tiles(q4))}
        x = torch.randn(r)
        times = {k: [] for k in kinds}
        for _ in range(a.rounds):
            for k, (fn, w) in kinds.items():
                times[k].append(timed(fn, w, x))
        rec = {"rows": n, "cols": r}
        for k, (_, w) in kinds.items():
            s = statistics.median(times[k])
            rec[k] = {"ms": round(1e3 * s, 3), "bytes": w.nbytes, "gb_s": round(w.nbytes / s / 1e9, 1)}
        rows.append(rec)
        print(f"{n} x {r}: " + ", ".join(f"{k} {rec[k]['ms']:.3f} ms ({rec[k]['gb_s']:.1f} GB/s)" for k in kinds),
              flush=True)
    out = {**machine(), "threads": a.threads, "rounds": a.rounds, "shapes": rows}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
