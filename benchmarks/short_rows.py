"""Products on short rows (the output head preview's A: vocabulary x rank), row-major against
row-tiled; not a test.

    python benchmarks/short_rows.py [-t 2] [--rounds 5] [--json FILE]
    python benchmarks/short_rows.py --model-shapes [--levels avx512vnni,avx2] [--json FILE]

For each shape (Qwen2.5's and SmolLM2's vocabulary at the ranks `prepare` tries, and one
long-row matrix for comparison), times
`cpu.gemv` on row-major q8 and q4 and on the same q4 values in row tiles (tq4),
alternated in each round, the caches flushed (64 MB written) before every call; reports the
median over rounds of each one's median time and the bytes it read per second.

`--model-shapes` instead compares row-major q4 and q6 with the same values in row tiles on a model's
own shapes, per kernel level: one token and 64 tokens on one thread from the cache (the
kernels' instruction-bound speed), and one token on `-t` threads from memory (8960x1536, 8
copies rotated so they do not fit the last-level cache); medians of alternated runs.
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


def _median_seconds(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def model_shapes(levels: list[str], threads: int, rounds: int) -> list[dict]:
    out = []
    old = cpu.simd_level()
    try:
        for lvl, fmt in [(lv, f) for lv in levels for f in ("q4", "q6")]:
            cpu._cpu.set_simd_level(lvl)
            cpu.set_num_threads(1)
            for n, k in [(512, 1536), (256, 8960)]:
                w = from_float(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), fmt)
                tw, x, xs = cpu.tile(w), torch.randn(k), torch.randn(64, k)
                for what, fn, reps in (("1 token, 1 thread, cache", cpu.gemv, 200), ("64 tokens, 1 thread", cpu.matmul, 20)):
                    arg = x if fn is cpu.gemv else xs
                    r, t = [], []
                    for _ in range(rounds):
                        r.append(_median_seconds(lambda: fn(w, arg), reps))
                        t.append(_median_seconds(lambda: fn(tw, arg), reps))
                    out.append({"level": lvl, "format": fmt, "shape": f"{n}x{k}", "case": what,
                                "rows_s": statistics.median(r), "tiles_s": statistics.median(t)})
            cpu.set_num_threads(threads)
            ws = [from_float(torch.randn(8960, 1536), fmt) for _ in range(8)]
            ts_ = [cpu.tile(w) for w in ws]
            x = torch.randn(1536)

            def cycle(lst):
                i = [0]

                def f():
                    cpu.gemv(lst[i[0] % len(lst)], x)
                    i[0] += 1
                return f
            r, t = [], []
            for _ in range(rounds):
                r.append(_median_seconds(cycle(ws), 40))
                t.append(_median_seconds(cycle(ts_), 40))
            out.append({"level": lvl, "format": fmt, "shape": "8960x1536", "case": f"1 token, {threads} threads, memory",
                        "rows_s": statistics.median(r), "tiles_s": statistics.median(t)})
    finally:
        cpu._cpu.set_simd_level(old)
    for rec in out:
        print(f"{rec['level']:>11} {rec['shape']:>9} {rec['case']:<28} {rec['format']} rows {rec['rows_s'] * 1e6:9.1f} us  "
              f"t{rec['format']} {rec['tiles_s'] * 1e6:9.1f} us  ({rec['rows_s'] / rec['tiles_s']:.2f}x)", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15, help="calls per kernel per round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model-shapes", action="store_true", help="q4 rows against tq4 on a model's shapes, per level")
    ap.add_argument("--levels", default=None, help="kernel levels for --model-shapes (default: every supported x86 one)")
    a = ap.parse_args(argv)
    if a.model_shapes:
        levels = a.levels.split(",") if a.levels else [lv for lv in cpu._cpu.supported_levels() if lv != "scalar"]
        recs = model_shapes(levels, a.threads, a.rounds)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({**machine(), "threads": a.threads, "rounds": a.rounds, "model_shapes": recs}, fh, indent=1)
        return
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
        kinds = {"q8 rows": (cpu.gemv, q8), "q4 rows": (cpu.gemv, q4), "q4 tiles": (cpu.gemv, to_tiles(q4))}
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
