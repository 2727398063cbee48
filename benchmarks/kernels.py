"""Benchmark of the CPU kernel core (sparseinfer.kernels.cpu); not a test.

    python benchmarks/kernels.py [--threads 2] [--json FILE] [--md FILE] [--plot PNG]
                                 [--formats q4,q8,...] [--quick]

Records cited by docs/performance.md (which gives the exact commands) are in benchmarks/results/.

1. A streaming-read bandwidth probe (C, same thread count) over a >= 2 GB array.
2. Dense gemv per format on FFN shapes (Qwen2.5-1.5B 8960x1536 / 1536x8960, Llama-7B
   11008x4096 / 4096x11008): GB/s, % of the best probe of the run, and % of a probe read just
   before each pass (for hosts whose bandwidth swings).  Several copies of each matrix are
   rotated so the working set (>= 1.5 GB) far exceeds the last-level cache.
   Then the same product on one thread from the cache (512 rows): its instruction-bound speed.
3. Sparse kernels on the neuron-major shapes (d_ff x d_model): gemv_rows (gate/up), axpy_rows
   (down_t) and the fused sparse_ffn at active fractions 1, 0.5, 0.25, 0.1, 0.05 (random
   sorted row ids), timed against the dense kernel reading the same bytes; sparse_ffn also on
   neuron records (q4/q8: one contiguous gate+up+down_t record per neuron).  q6 (GGUF Q6_K
   tensors) and q4k (Q4_K as stored, with --formats q4k) have row kernels only: gemv and
   gemv_rows.  tq4 / tq6 (q4 / q6 in row tiles, with --formats tq4,tq6) have dense products
   only: gemv (and matmul in the prompt section).
4. Input-sparse products on column-grouped q4 weights (`gemv_cols`, q4 only) on both shapes at
   the same kept fractions of the inputs (random x, threshold at the quantile), against the
   dense q4 gemv of the same shape.
5. For the record: torch index_select + linear, torch linear, numba Q4 gemv.

Every timing is the best of several passes (the machine may be shared).  --json writes a
list of records {kernel, format, rows, cols, active_fraction, threads, seconds, gbps,
probe_gbps}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from sparseinfer.kernels import cpu
from sparseinfer.quant import TILE_FORMATS, QWeight, from_float, from_tiles, to_cols
from sparseinfer.sparse.speed import cpu_name

FRACTIONS = (1.0, 0.5, 0.25, 0.1, 0.05)
# (d_ff, d_model): gate/up and down_t are d_ff x d_model, down is d_model x d_ff
MODELS = {"qwen2.5-1.5b": (8960, 1536), "llama-7b": (11008, 4096)}


def llc_bytes() -> int:
    """Size of the last-level cache as sysfs reports it (Linux), or 0 when unknown."""
    try:
        base = "/sys/devices/system/cpu/cpu0/cache"
        caches = []
        for d in os.listdir(base):
            if d.startswith("index"):
                with open(os.path.join(base, d, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(base, d, "size")) as f:
                    v = f.read().strip()
                caches.append((level, int(v.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(v[-1], 0)))
        return max(caches)[1] if caches else 0
    except (OSError, ValueError):
        return 0


_FLUSH: list = []


def flush_caches():
    """Evict the last-level cache: read a buffer twice its size (at least 1 GB).  A sparse pass
    touches only its active fraction of the working set (0.1 of 1.5 GB is 150 MB, less than
    this Xeon's 480 MB L3), so without this the best of several passes is partly read from L3:
    the records pass at 0.1 took 131-135 us with a 1.2 GB working set against 139-141 us with
    6 GB.  Every timed pass below starts after one."""
    if not _FLUSH:
        buf = alloc((max(1 << 30, 2 * llc_bytes()),), torch.uint8)
        buf.fill_(1)
        _FLUSH.append(buf)
    cpu._cpu.read_seconds(_FLUSH[0].data_ptr(), _FLUSH[0].numel(), 1)


def best_time(fn, reps):
    """Seconds of the fastest of `reps` calls, each after the caches are flushed."""
    best = math.inf
    for _ in range(reps):
        flush_caches()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe_gbps(threads, nbytes=2 << 30, reps=5):
    buf = alloc((nbytes,), torch.uint8)
    buf.fill_(1)
    p, n = buf.data_ptr(), buf.numel()
    cpu._cpu.read_seconds(p, n, 1)
    best = min(cpu._cpu.read_seconds(p, n, 1) for _ in range(reps))
    del buf
    return n / best / 1e9


def alloc(shape, dtype):
    """torch.empty on transparent huge pages (what a weight loader should do)."""
    return cpu.empty_hugepages(shape, dtype)


def random_rows_probe(row_bytes, frac, nbytes=1 << 30, reps=5):
    """GB/s reading a random sorted `frac` of whole rows of `row_bytes` (no compute): what
    memory gives the access pattern of the sparse kernels.  The best of three ways: whole rows
    prefetched 8 ahead in software; the hardware prefetchers alone (which read longer rows
    faster on some CPUs); and 8 rows at a time, line
    by line across them, as the one-token kernels now read (8 streams per core: faster again
    for short rows)."""
    buf = alloc((nbytes,), torch.uint8)
    buf.fill_(1)
    nrows = nbytes // row_bytes
    n = max(1, round(frac * nrows))
    rows = torch.sort(torch.randperm(nrows)[:n])[0].to(torch.int32)
    args = (buf.data_ptr(), row_bytes, rows.data_ptr(), n)
    cpu._cpu.read_rows_seconds(*args, 1, 1)

    def timed(pf):
        flush_caches()  # 10% of the 1 GB buffer would otherwise stay in a large L3
        return cpu._cpu.read_rows_seconds(*args, 1, pf)
    best = min(timed(pf) for _ in range(reps) for pf in (1, 0, 2))
    return n * row_bytes / best / 1e9


def quantized(w32: torch.Tensor, fmt: str) -> QWeight:
    """`w32` in `fmt`; tq4 / tq6: q4 / q6 in row tiles on huge pages (what `load` gives the dense
    projections on the levels that tile them)."""
    return cpu.tile(from_float(w32, fmt[1:])) if fmt in TILE_FORMATS else from_float(w32, fmt)


def copy_weight(w: QWeight, layout: str = "auto") -> QWeight:
    """A fresh copy of `w` on huge pages.  layout "rows": each row's scales next to its values
    (`cpu.interleave_rows`); "split": values, scales and mins as three separate tensors; "auto":
    as the engine lays out its fused gate+up / q+k+v weights, down_t and output projection
    (`cpu.interleave_pays`)."""
    if w.fmt in ("q4", "q8", "q6") and (layout == "rows" or (layout == "auto" and cpu.interleave_pays(w))):
        return cpu.interleave_rows(w)
    if w.fmt in TILE_FORMATS:
        return cpu.tile(from_tiles(w))

    def cl(t):
        if t is None:
            return None
        o = alloc(tuple(t.shape), t.dtype)
        o.copy_(t)
        return o
    return QWeight(w.fmt, w.rows, w.cols, cl(w.qs), cl(w.d), cl(w.m))


def weight_set(fmt, rows, cols, target_bytes, seed, layout="auto"):
    g = torch.Generator().manual_seed(seed)
    base = quantized(torch.randn(rows, cols, generator=g) * 0.02, fmt)
    n = max(2, math.ceil(target_bytes / base.nbytes))
    return [copy_weight(base, layout) for _ in range(n)]


class Bench:
    def __init__(self, args):
        self.args = args
        self.threads = args.threads
        self.records = []
        self.probes = []
        self.probe = 0.0
        self.pbuf: list = []  # the paired probe's buffer (rotate_paired)

    def add(self, kernel, fmt, rows, cols, frac, seconds, nbytes, **extra):
        rec = {"kernel": kernel, "format": fmt, "rows": rows, "cols": cols, "active_fraction": frac,
               "threads": self.threads, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
               "probe_gbps": self.probe, "layout": self.args.layout}
        rec.update(extra)
        self.records.append(rec)
        return rec

    def rotate(self, ws, fn):
        """Seconds per matrix: fn(w) over every copy, best of reps passes."""
        return best_time(lambda: [fn(w) for w in ws], self.args.reps) / len(ws)

    def rotate_paired(self, ws, fn, nbytes):
        """As `rotate`, and with each pass the streaming probe over as many bytes just before it:
        (seconds per matrix, median of pass GB/s over the probe's GB/s of the same moment).  On
        a shared host whose bandwidth swings between two levels from one minute to the next
        (seen on AMD EPYC (Zen 4) virtual machines: about 33 and 60 GB/s with two threads), the
        paired ratio says how close a kernel is to the memory it had, which the best-of-run
        probe does not."""
        if not self.pbuf or self.pbuf[0].numel() < nbytes:
            self.pbuf[:] = [alloc((int(nbytes),), torch.uint8).fill_(1)]
        p = self.pbuf[0].data_ptr()
        best, ratios = math.inf, []
        for _ in range(self.args.reps):
            flush_caches()
            tp = cpu._cpu.read_seconds(p, int(nbytes), 1)
            flush_caches()
            t = time.perf_counter()
            for w in ws:
                fn(w)
            t = time.perf_counter() - t
            best = min(best, t)
            ratios.append(tp / t)
        return best / len(ws), statistics.median(ratios)

    def reprobe(self):
        """The probe is re-measured before every format (the machine may be shared); reports
        use the highest value seen, so '% of probe' is against the best the memory gave."""
        g = probe_gbps(self.threads, reps=3)
        self.probes.append(g)
        self.probe = max(self.probes)
        for r in self.records:
            r["probe_gbps"] = self.probe

    # ------------------------------------------------------------------------- dense
    def dense(self, fmt, shapes):
        out = {}
        for rows, cols in shapes:
            ws = weight_set(fmt, rows, cols, self.args.working_set, seed=rows, layout=self.args.layout)
            x, y = torch.randn(cols), torch.empty(rows)
            cpu.gemv(ws[0], x, out=y)
            t, paired = self.rotate_paired(ws, lambda w: cpu.gemv(w, x, out=y), ws[0].nbytes * len(ws))
            r = self.add("gemv", fmt, rows, cols, 1.0, t, ws[0].nbytes, probe_paired_ratio=paired)
            log(f"  gemv {fmt:4s} {rows}x{cols}: {t * 1e3:7.3f} ms {r['gbps']:5.1f} GB/s "
                f"({100 * r['gbps'] / self.probe:3.0f}% of the best probe so far, "
                f"{100 * paired:3.0f}% of the probe read just before each pass)")
            interleaved = ws[0].d is not None and not ws[0].qs.is_contiguous()
            del ws
            if interleaved:
                # the sparse kernels are compared with the faster dense layout (interleaved rows
                # read slower on wide q4 rows, e.g. 1536x8960), so the ratios are not flattered
                ws = weight_set(fmt, rows, cols, self.args.working_set, seed=rows, layout="split")
                ts = self.rotate(ws, lambda w: cpu.gemv(w, x, out=y))
                self.add("gemv_split_layout", fmt, rows, cols, 1.0, ts, ws[0].nbytes, layout="split")
                log(f"  gemv {fmt:4s} {rows}x{cols}, split layout: {ts * 1e3:7.3f} ms")
                r["dense_reference_seconds"] = t = min(t, ts)
                del ws
            out[(rows, cols)] = t
        self.cached(fmt, *shapes[0])
        return out

    def cached(self, fmt, rows, cols, keep_rows=512):
        """The one-token product on one thread from the cache (keep_rows x cols, called over and
        over): the kernel's instruction-bound speed, which memory-bound runs cannot show."""
        w = quantized(torch.randn(keep_rows, cols) * 0.02, fmt)
        x, y = torch.randn(cols), torch.empty(keep_rows)
        old = cpu.get_num_threads()
        cpu.set_num_threads(1)
        try:
            for _ in range(50):
                cpu.gemv(w, x, out=y)
            best = math.inf
            for _ in range(20):
                t = time.perf_counter()
                for _ in range(50):
                    cpu.gemv(w, x, out=y)
                best = min(best, (time.perf_counter() - t) / 50)
        finally:
            cpu.set_num_threads(old)
        r = self.add("gemv_cached_1thread", fmt, keep_rows, cols, 1.0, best, w.nbytes,
                     gweights_per_s=keep_rows * cols / best / 1e9)
        log(f"  gemv {fmt:4s} {keep_rows}x{cols} from the cache, 1 thread: {best * 1e6:6.1f} us "
            f"{r['gbps']:5.1f} GB/s, {r['gweights_per_s']:5.1f} G weights/s")

    # ------------------------------------------------------------------------ sparse
    def sparse(self, fmt, d_ff, d_model, t_up, t_down):
        ws = weight_set(fmt, d_ff, d_model, self.args.working_set, seed=7, layout=self.args.layout)
        x, xo = torch.randn(d_model), torch.empty(d_model)
        g = torch.Generator().manual_seed(0)
        # fused FFN: three matrices per copy (gate, up, down_t) share the working set
        nffn = max(2, len(ws) // 3)
        ffn = [(ws[3 * i % len(ws)], ws[(3 * i + 1) % len(ws)], ws[(3 * i + 2) % len(ws)]) for i in range(nffn)]
        act = "silu"
        # the same triples as neuron records (one contiguous record per neuron; q4/q8 only)
        recs = [cpu.neuron_records(list(t))[1] for t in ffn] if fmt in ("q4", "q8") else None
        for frac in FRACTIONS:
            n = max(1, round(frac * d_ff))
            rows = torch.sort(torch.randperm(d_ff, generator=g)[:n])[0].to(torch.int32)
            h, yr = torch.randn(n), torch.empty(n)
            touched = n * ws[0].row_bytes()
            t = self.rotate(ws, lambda w: cpu.gemv_rows(w, x, rows, out=yr))
            self.add("gemv_rows", fmt, d_ff, d_model, frac, t, touched, vs_dense=t / t_up)
            if fmt in ("q6", "q4k"):  # row kernels only: their FFNs keep down_t in q8 (no axpy)
                log(f"  {fmt:4s} {d_ff}x{d_model} active {frac:4.2f}: gemv_rows {t * 1e3:6.3f} ms ({t_up / t:4.1f}x)")
                continue
            t2 = self.rotate(ws, lambda w: cpu.axpy_rows(w, h, rows, out=xo))
            self.add("axpy_rows", fmt, d_ff, d_model, frac, t2, touched, vs_dense=t2 / t_down)
            t3 = best_time(lambda: [cpu.sparse_ffn(x, a, b, c, rows, act, out=xo) for a, b, c in ffn],
                           self.args.reps) / nffn
            self.add("sparse_ffn", fmt, d_ff, d_model, frac, t3, 3 * touched, vs_dense=t3 / (2 * t_up + t_down))
            msg = ""
            if recs is not None:
                t4 = best_time(lambda: [cpu.sparse_ffn(x, a, b, c, rows, act, out=xo) for a, b, c in recs],
                               self.args.reps) / nffn
                self.add("sparse_ffn_records", fmt, d_ff, d_model, frac, t4, 3 * touched,
                         vs_dense=t4 / (2 * t_up + t_down))
                msg = f" records {t4 * 1e3:6.3f} ms ({(2 * t_up + t_down) / t4:4.1f}x)"
            log(f"  {fmt:4s} {d_ff}x{d_model} active {frac:4.2f}: gemv_rows {t * 1e3:6.3f} ms ({t_up / t:4.1f}x) "
                f"axpy_rows {t2 * 1e3:6.3f} ms ({t_down / t2:4.1f}x) sparse_ffn {t3 * 1e3:6.3f} ms "
                f"({(2 * t_up + t_down) / t3:4.1f}x)" + msg)
        del ws, ffn, recs

    # ------------------------------------------------------------------- input-sparse
    def cols(self, dense_times):
        for (rows, cols), t_dense in dense_times.items():
            ws = [to_cols(w) for w in weight_set("q4", rows, cols, self.args.working_set, seed=rows + 1)]
            x, y = torch.randn(cols), torch.empty(rows)
            for frac in FRACTIONS:
                thr = -1.0 if frac >= 1.0 else float(torch.quantile(x.abs(), 1.0 - frac))
                t = self.rotate(ws, lambda w: cpu.gemv_cols(w, x, thr, out=y))
                self.add("gemv_cols", "q4", rows, cols, frac, t, ws[0].nbytes, vs_dense=t / t_dense)
                log(f"  gemv_cols q4 {rows}x{cols} kept {frac:4.2f}: {t * 1e3:6.3f} ms ({t_dense / t:4.2f}x the dense gemv)")
            del ws

    # ------------------------------------------------------------------------ extras
    def extras(self, d_ff, d_model):
        """Alternatives, for the record: torch and numba."""
        torch.set_num_threads(self.threads)
        x = torch.randn(d_model)
        n = round(0.1 * d_ff)
        rows = torch.sort(torch.randperm(d_ff)[:n])[0]
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            base = (torch.randn(d_ff, d_model) * 0.02).to(dtype)
            ws = [alloc(base.shape, dtype).copy_(base) for _ in range(max(2, math.ceil(self.args.working_set / (base.numel() * base.element_size()))))]
            xd = x.to(dtype)
            t = self.rotate(ws, lambda w: torch.nn.functional.linear(xd, w))
            self.add("torch_linear", name, d_ff, d_model, 1.0, t, ws[0].numel() * ws[0].element_size())
            t2 = self.rotate(ws, lambda w: torch.nn.functional.linear(xd, w.index_select(0, rows)))
            self.add("torch_index_select_linear", name, d_ff, d_model, 0.1, t2,
                     n * d_model * ws[0].element_size(), vs_dense=t2 / t)
            log(f"  torch {name}: linear {t * 1e3:.3f} ms, index_select(10%)+linear {t2 * 1e3:.3f} ms ({t / t2:.1f}x)")
            del ws
        try:
            self.numba_q4(d_ff, d_model, x)
        except ImportError:
            log("  numba not installed (pip install 'sparseinfer[bench]')")

    def numba_q4(self, d_ff, d_model, x):
        import numba
        import numpy as np

        numba.set_num_threads(self.threads)

        @numba.njit(parallel=True, fastmath=True, cache=False)
        def q4_gemv(qs, d, m, xs, sx, y):
            # qs (N, Kp/2) uint8 in GGUF nibble order; d, m (N, nb) f32; per-lane accumulators
            nrows, nb = d.shape
            for i in numba.prange(nrows):
                acc = np.zeros(16, np.float32)
                tot = np.float32(0)
                for b in range(nb):
                    part = np.zeros(16, np.float32)
                    for j in range(16):
                        q = qs[i, b * 16 + j]
                        part[j] = np.float32(q & 15) * xs[b * 32 + j] + np.float32(q >> 4) * xs[b * 32 + 16 + j]
                    for j in range(16):
                        acc[j] += d[i, b] * part[j]
                    tot += m[i, b] * sx[b]
                y[i] = acc.sum() + tot

        w = from_float(torch.randn(d_ff, d_model) * 0.02, "q4")
        ncopy = max(2, math.ceil(self.args.working_set / w.nbytes))
        qs = [w.qs.numpy().copy() for _ in range(ncopy)]
        d, m = w.d.float().numpy(), w.m.float().numpy()
        xs = x.numpy()
        sx = xs.reshape(-1, 32).sum(-1).astype(np.float32)
        y = np.empty(d_ff, np.float32)
        q4_gemv(qs[0], d, m, xs, sx, y)
        t = best_time(lambda: [q4_gemv(q, d, m, xs, sx, y) for q in qs], self.args.reps) / ncopy
        self.add("numba_q4_gemv", "q4", d_ff, d_model, 1.0, t, w.nbytes)
        log(f"  numba q4 gemv: {t * 1e3:.3f} ms ({w.nbytes / t / 1e9:.1f} GB/s)")

    # -------------------------------------------------------------------------- gemm
    def gemm(self, d_ff, d_model, ms=(16, 128, 512)):
        """Prefill: matmul (M tokens) GOPS, against torch mm on weights dequantized in advance."""
        torch.set_num_threads(self.threads)
        level = cpu.simd_level()
        w32 = torch.randn(d_ff, d_model) * 0.02
        for m in ms:
            x = torch.randn(m, d_model)
            ops = 2 * m * d_ff * d_model
            for fmt in self.args.formats:
                w = quantized(w32, fmt)
                cpu.matmul(w, x)
                t = best_time(lambda: cpu.matmul(w, x), 3)
                self.add("matmul", fmt, d_ff, d_model, 1.0, t, w.nbytes, tokens=m, gops=ops / t / 1e9)
                if level in cpu.TILE_LEVELS and fmt in ("q4", "q8", "q6"):
                    # the same product on the vector (VNNI) tiles, for comparison
                    cpu._cpu.set_simd_level("avx512vnni")
                    try:
                        t = best_time(lambda: cpu.matmul(w, x), 3)
                    finally:
                        cpu._cpu.set_simd_level(level)
                    self.add("matmul_avx512vnni", fmt, d_ff, d_model, 1.0, t, w.nbytes, tokens=m, gops=ops / t / 1e9)
                if cpu.bf16_gemm_native() and fmt in ("q4", "q8", "q6", "q4k"):
                    # the bfloat16 GEMM on dequantized slices (kernels.matmul takes it for long
                    # prompts of some formats on such CPUs)
                    t = best_time(lambda: cpu.matmul_bf16(w, x), 3)
                    self.add("matmul_bf16", fmt, d_ff, d_model, 1.0, t, w.nbytes, tokens=m, gops=ops / t / 1e9)
            wd = w32.clone()
            t = best_time(lambda: x @ wd.T, 3)
            self.add("torch_mm_f32", "f32", d_ff, d_model, 1.0, t, wd.numel() * 4, tokens=m, gops=ops / t / 1e9)
            wb, xb = w32.bfloat16(), x.bfloat16()
            t = best_time(lambda: xb @ wb.T, 3)
            self.add("torch_mm_bf16", "bf16", d_ff, d_model, 1.0, t, wb.numel() * 2, tokens=m, gops=ops / t / 1e9)
            row = [f"{r['format']}{' bf16 GEMM' if r['kernel'] == 'matmul_bf16' else ''} {r['gops']:.0f}"
                   for r in self.records if r.get("tokens") == m and r["rows"] == d_ff]
            log(f"  matmul M={m} {d_ff}x{d_model} GOPS: " + ", ".join(row))

    def overhead(self):
        w = from_float(torch.randn(4, 64), "q4")
        x, y = torch.randn(64), torch.empty(4)
        n = 20000
        t = best_time(lambda: [cpu.gemv(w, x, out=y) for _ in range(n)], 3) / n
        self.add("call_overhead_gemv_4x64", "q4", 4, 64, 1.0, t, w.nbytes)
        log(f"  per-call time of a 4x64 q4 gemv (out=): {t * 1e6:.2f} us")


NOTES = """
## Notes

- On a shared machine other jobs take CPU time that the 2-thread kernels need and the
  memory-bound probe hardly does: compare only runs made side by side, and rerun on an idle
  machine before quoting exact figures (the load average is in the header).
- Dense gemv is bounded by the read bandwidth (the probe) when a core computes faster than
  it can stream; the percentage of the probe per format says how close each kernel comes.
- Sparse kernels read scattered rows, which memory serves slower than a stream (the
  random-row probe: whole rows, prefetched, no compute), and short rows suffer most; so at an
  active fraction f the speedup over dense gemv is bounded by (1/f) x (random-row probe /
  dense GB/s).  Rows reordered by hotness cluster, which reads better.
- Weight buffers on 2 MB pages (`cpu.empty_hugepages`, used for every weight copy here) help
  scattered reads.
- `torch index_select + linear` copies the rows first, which costs about what the dense
  product does: it is the baseline a row-sparse kernel must beat.
- What each kernel does and why is in docs/kernels.md.
"""


def llc_text() -> str:
    """Size of the last-level cache (`llc_bytes`) for the report, else 'unknown'."""
    n = llc_bytes()
    return "unknown" if not n else f"{n / (1 << 20):.0f} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------- report

def paired_text(r) -> str:
    return f"{100 * r['probe_paired_ratio']:.0f}%" if "probe_paired_ratio" in r else ""


def write_markdown(path, b: Bench, meta):
    R = b.records
    lines = [
        "# CPU kernel benchmarks",
        "",
        f"Machine: {meta['cpu']}, {meta['threads']} threads, kernels `{meta['simd']}`, "
        f"{meta.get('date', '')}, load average before/after {meta['load0']:.1f}/{meta['load1']:.1f} "
        "(the machine was shared: every number is the best of several passes).  ",
        f"Read-bandwidth probe (C, {meta['threads']} threads, 2 GiB, re-measured before each format, best kept): "
        f"**{b.probe:.1f} GB/s** (all: {', '.join(f'{g:.1f}' for g in b.probes)}).  ",
        f"Working set per measurement >= {b.args.working_set / 1e9:.1f} GB (copies rotated; last-level cache "
        f"{meta.get('llc') or llc_text()}).  A sparse kernel at active fraction f touches only f of it per pass"
        + (", so every timed pass starts after reading a buffer twice the size of the last-level cache: sparse passes "
           "read from DRAM, not from what the previous pass left in cache.  " if meta.get("flush") else
           ": when that is not far beyond the cache, part of its reads are cache hits (a large last-level cache "
           "inflates sparse speedups measured on small working sets), so quote sparse speedups from full runs.  "),
        "Integer weights are laid out " + {
            "rows": "with each row's scales (and mins) just before its values (`cpu.interleave_rows`), "
                    "dense and sparse alike.  ",
            "auto": "as the engine lays them out with these kernels: each row's scales (and mins) just "
                    "before its values where `cpu.interleave_pays`, else as separate tensors.  ",
        }.get(meta.get("layout", "split"), "as separate value, scale and min tensors.  "),
        f"Command: `python benchmarks/kernels.py {' '.join(meta['argv'])}`",
        "",
    ]
    rr = [r for r in R if r["kernel"] in ("read_rows_probe", "read_records_probe")]
    if rr:
        how = {"both": "the better of whole rows prefetched in software and none",
               "best3": "the best of whole rows prefetched in software, none, and 8 rows read line by line "
                        "across them"}.get(rr[0].get("probe_prefetch"), "whole rows prefetched")
        lines.append(f"Random-row read probe (10% of rows, sorted random ids, {how}, no compute): "
                     + ", ".join(f"{r['row_bytes']}-byte {'records' if r['kernel'] == 'read_records_probe' else 'rows'} "
                                 f"{r['probe_rows_gbps']:.1f} GB/s" for r in rr)
                     + ".  This is the ceiling for the sparse kernels' access pattern.")
    lines += [
        "",
        "## Dense gemv (decode, one token)",
        "",
        "| shape (rows x cols) | format | ms | GB/s | % of probe | % of the probe read before each pass (median) | ms, split layout |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    split = {(r["format"], r["rows"], r["cols"]): r["seconds"] for r in R if r["kernel"] == "gemv_split_layout"}
    for r in R:
        if r["kernel"] == "gemv":
            ts = split.get((r["format"], r["rows"], r["cols"]))
            lines.append(f"| {r['rows']}x{r['cols']} | {r['format']} | {r['seconds'] * 1e3:.3f} | "
                         f"{r['gbps']:.1f} | {100 * r['gbps'] / b.probe:.0f}% | {paired_text(r)} | "
                         f"{'' if ts is None else f'{ts * 1e3:.3f}'} |")
    if split:
        lines += ["", "The sparse ratios below are against the faster of the two dense layouts."]
    lines += ["", "## Sparse kernels: time relative to the dense gemv of the same bytes",
              "", "Random sorted active rows; `gemv_rows` vs dense gate/up gemv, `axpy_rows` vs dense "
              "down gemv (d_model x d_ff), `sparse_ffn` (gate+up+down fused) vs the three dense gemvs, "
              "`sparse_ffn_records` the same on neuron records (one contiguous gate+up+down_t record per neuron). "
              "Ideal = the active fraction.", ""]
    shapes = sorted({(r["rows"], r["cols"]) for r in R if r["kernel"] == "gemv_rows"})
    fmts = [f for f in b.args.formats if any(r["kernel"] == "gemv_rows" and r["format"] == f for r in R)]
    head = "| shape | format | kernel | " + " | ".join(f"{f:g}" for f in FRACTIONS) + " | speedup at 0.1 |"
    lines += [head, "|---|---|---|" + "---:|" * (len(FRACTIONS) + 1)]
    for shape in shapes:
        for fmt in fmts:
            for k in ("gemv_rows", "axpy_rows", "sparse_ffn", "sparse_ffn_records"):
                rs = {r["active_fraction"]: r for r in R if r["kernel"] == k and r["format"] == fmt
                      and (r["rows"], r["cols"]) == shape}
                if not rs:
                    continue
                cells = [f"{rs[f]['vs_dense']:.3f}" if f in rs else "" for f in FRACTIONS]
                sp = f"{1 / rs[0.1]['vs_dense']:.1f}x" if 0.1 in rs else ""
                lines.append(f"| {shape[0]}x{shape[1]} | {fmt} | {k} | " + " | ".join(cells) + f" | {sp} |")
    lines += ["", "Achieved GB/s of the sparse kernels (bytes of the active rows / time):", "",
              "| shape | format | kernel | " + " | ".join(f"{f:g}" for f in FRACTIONS) + " |",
              "|---|---|---|" + "---:|" * len(FRACTIONS)]
    for shape in shapes:
        for fmt in fmts:
            for k in ("gemv_rows", "axpy_rows", "sparse_ffn", "sparse_ffn_records"):
                rs = {r["active_fraction"]: r for r in R if r["kernel"] == k and r["format"] == fmt
                      and (r["rows"], r["cols"]) == shape}
                if rs:
                    lines.append(f"| {shape[0]}x{shape[1]} | {fmt} | {k} | "
                                 + " | ".join(f"{rs[f]['gbps']:.1f}" if f in rs else "" for f in FRACTIONS) + " |")
    probes = {(r["kernel"], r["format"], r["rows"], r["cols"]): r["probe_rows_gbps"] for r in rr}
    vs = []
    for r in R:
        if r["active_fraction"] != 0.1 or r["kernel"] not in ("gemv_rows", "sparse_ffn_records"):
            continue
        key = ("read_records_probe" if r["kernel"] == "sparse_ffn_records" else "read_rows_probe",
               r["format"], r["rows"], r["cols"])
        if key in probes:
            # the speedup a kernel reading these rows at the probe's speed, with no compute, would
            # have over the dense gemv: what the memory system allows at this fraction
            sp = 1 / r["vs_dense"]
            vs.append(f"| {r['rows']}x{r['cols']} | {r['format']} | {r['kernel']} | {r['gbps']:.1f} | "
                      f"{probes[key]:.1f} | {100 * r['gbps'] / probes[key]:.0f}% | {sp:.1f}x | "
                      f"{sp * probes[key] / r['gbps']:.1f}x |")
    if vs:
        lines += ["", "At active fraction 0.1, against the random-row probe of the same row size (a neuron "
                  "record: gate, up and down_t rows).  The last column is the speedup over dense that reading "
                  "the active rows at the probe's speed, with no compute, would give: the memory system's "
                  "bound for this pattern.", "",
                  "| shape | format | kernel | GB/s | probe GB/s | % of probe | speedup | at the probe's speed |",
                  "|---|---|---|---:|---:|---:|---:|---:|"] + vs
    gm = [r for r in R if "tokens" in r]
    if gm:
        toks = sorted({r["tokens"] for r in gm})
        names = []
        for r in gm:
            key = (r["kernel"], r["format"])
            if key not in names:
                names.append(key)
        lines += ["", f"## Prefill matmul ({gm[0]['rows']}x{gm[0]['cols']}, GOPS = 2*M*N*K / time)", "",
                  f"Ours (`matmul`, level `{meta['simd']}`) on the stored format (integer formats: activations to "
                  "int8 per 32; VNNI dot products, or on `avx512amx` AMX tiles, with `matmul_avx512vnni` the same "
                  "product on the VNNI tiles; `matmul_bf16`: torch's bfloat16 GEMM on slices dequantized on the fly, "
                  "on CPUs with native bfloat16); torch on weights dequantized beforehand (bf16: activations rounded "
                  "to bf16).", "",
                  "| kernel | format | " + " | ".join(f"M={m}" for m in toks) + " |",
                  "|---|---|" + "---:|" * len(toks)]
        for k, f in names:
            cells = []
            for m in toks:
                r = [x for x in gm if x["kernel"] == k and x["format"] == f and x["tokens"] == m]
                cells.append(f"{r[0]['gops']:.0f}" if r else "")
            lines.append(f"| {k} | {f} | " + " | ".join(cells) + " |")
    ext = [r for r in R if r["kernel"] in ("torch_linear", "torch_index_select_linear", "numba_q4_gemv",
                                           "call_overhead_gemv_4x64")]
    if ext:
        lines += ["", "## Alternatives, for the record", "",
                  "| kernel | format | shape | active | ms | GB/s |", "|---|---|---|---:|---:|---:|"]
        for r in ext:
            ms = f"{r['seconds'] * 1e3:.4f}" if r["seconds"] < 1e-3 else f"{r['seconds'] * 1e3:.3f}"
            lines.append(f"| {r['kernel']} | {r['format']} | {r['rows']}x{r['cols']} | {r['active_fraction']:g} | "
                         f"{ms} | {r['gbps']:.1f} |")
    lines += ["", NOTES.strip()]
    if b.args.plot:
        lines += ["", f"![sparse kernel time vs active fraction]({os.path.relpath(b.args.plot, os.path.dirname(path))})"]
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plot(path, b: Bench):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'sparseinfer[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["rows"], r["cols"]) for r in b.records if r["kernel"] == "gemv_rows"})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    styles = {"gemv_rows": "-", "axpy_rows": "--", "sparse_ffn": ":", "sparse_ffn_records": "-."}
    colors = dict(zip(b.args.formats, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, shape in zip(axes[0], shapes):
        for fmt in b.args.formats:
            for k, ls in styles.items():
                rs = sorted((r["active_fraction"], r["vs_dense"]) for r in b.records
                            if r["kernel"] == k and r["format"] == fmt and (r["rows"], r["cols"]) == shape)
                if rs:
                    ax.plot([a for a, _ in rs], [v for _, v in rs], ls, marker="o", ms=3, color=colors.get(fmt),
                            label=f"{fmt} {k}")
        ax.plot(FRACTIONS, FRACTIONS, color="gray", lw=3, alpha=0.4, label="ideal (= fraction)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("active fraction of neurons")
        ax.set_ylabel("time / dense gemv time (same bytes)")
        ax.set_title(f"{shape[0]}x{shape[1]}, {b.threads} threads")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def report_from_json(args):
    with open(args.from_json) as f:
        records = json.load(f)
    probe = next(r for r in records if r["kernel"] == "read_probe")
    meta = probe["run"]
    args.formats = [f for f in args.formats if any(r["format"] == f for r in records)]
    args.working_set = args.working_set if "working_set" not in meta else meta["working_set"]
    b = Bench(args)
    b.records, b.probes, b.probe, b.threads = records, probe["all_probes"], probe["probe_gbps"], probe["threads"]
    if args.plot:
        write_plot(args.plot, b)
    if args.md:
        write_markdown(args.md, b, meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the records to this file")
    ap.add_argument("--md", help="write a markdown report to this file")
    ap.add_argument("--plot", help="write the sparse plot (e.g. docs/img/kernels_sparse_amx_spread.png)")
    ap.add_argument("--formats", default="q4,q8,q6,f16,bf16,f32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=5, help="passes per measurement (best is kept)")
    ap.add_argument("--working-set", type=float, default=1.5e9, help="bytes of weight copies per measurement")
    ap.add_argument("--layout", choices=("auto", "rows", "split"), default="auto",
                    help="integer weights with each row's scales next to its values (rows) or as separate "
                         "value/scale/min tensors (split); auto: per weight, as the engine lays it out with "
                         "these kernels (`cpu.interleave_pays`)")
    ap.add_argument("--quick", action="store_true", help="q4/q8 on the small model only, fewer passes")
    ap.add_argument("--no-extras", action="store_true", help="skip the torch/numba comparisons")
    ap.add_argument("--no-gemm", action="store_true", help="skip the prefill matmul section")
    ap.add_argument("--gemm-only", action="store_true", help="only the prefill matmul section")
    ap.add_argument("--from-json", help="only rewrite --md/--plot from the records of an earlier --json run")
    args = ap.parse_args(argv)
    args.formats = args.formats.split(",")
    if args.from_json:
        return report_from_json(args)
    models = args.models.split(",")
    if args.quick:
        args.formats = [f for f in args.formats if f in ("q4", "q8", "q6")] or ["q4"]
        models, args.reps, args.working_set = models[:1], 3, min(args.working_set, 0.6e9)
    if not cpu.available():
        sys.exit("sparseinfer._cpu is not built: pip install -e . with a C compiler")
    cpu.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    meta = {"cpu": cpu_name(), "threads": args.threads, "simd": cpu.simd_level(), "llc": llc_text(),
            "load0": os.getloadavg()[0], "argv": sys.argv[1:] if argv is None else argv,
            "working_set": args.working_set, "layout": args.layout, "date": time.strftime("%Y-%m-%d %H:%M"),
            "flush": True}
    b = Bench(args)
    log(f"{meta['cpu']}: kernels {meta['simd']}, {args.threads} threads, load {meta['load0']:.1f}")
    b.reprobe()
    log(f"read-bandwidth probe: {b.probe:.1f} GB/s")
    for name in models:
        d_ff, d_model = MODELS[name]
        log(f"{name}: d_ff {d_ff}, d_model {d_model}")
        if args.gemm_only:
            if name == models[0]:
                b.gemm(d_ff, d_model)
            continue
        for fmt in [f for f in args.formats if f in ("q4", "q8", "q6", "q4k")]:
            rb = from_float(torch.zeros(1, d_model), fmt).row_bytes()
            g = random_rows_probe(rb, 0.1)
            b.add("read_rows_probe", fmt, d_ff, d_model, 0.1, 0.0, 0, row_bytes=rb, probe_rows_gbps=g,
                  probe_prefetch="best3")
            log(f"  random-row read probe, 10% of {rb}-byte rows ({fmt} row incl. scales): {g:.1f} GB/s")
            if fmt in ("q4", "q8"):  # a neuron record: gate, up and down_t rows (records pass)
                rec = (3 * rb + 63) // 64 * 64
                g = random_rows_probe(rec, 0.1)
                b.add("read_records_probe", fmt, d_ff, d_model, 0.1, 0.0, 0, row_bytes=rec, probe_rows_gbps=g,
                      probe_prefetch="best3")
                log(f"  random-row read probe, 10% of {rec}-byte rows ({fmt} neuron records): {g:.1f} GB/s")
        for fmt in args.formats:
            b.reprobe()
            t = b.dense(fmt, [(d_ff, d_model), (d_model, d_ff)])
            if fmt not in TILE_FORMATS:  # tiles have no row-sparse kernels
                b.sparse(fmt, d_ff, d_model, t[(d_ff, d_model)], t[(d_model, d_ff)])
            if fmt == "q4":
                b.cols(t)
        if not args.no_extras:
            b.extras(d_ff, d_model)
        if name == models[0] and not args.no_gemm:
            b.gemm(d_ff, d_model)
    b.overhead()
    meta["load1"] = os.getloadavg()[0]
    b.add("read_probe", "u8", 0, 0, 1.0, (2 << 30) / b.probe / 1e9, 2 << 30, all_probes=b.probes, run=meta)
    log(f"read-bandwidth probe: best {b.probe:.1f} GB/s of {', '.join(f'{g:.1f}' for g in b.probes)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(b.records, f, indent=1)
    if args.plot:
        write_plot(args.plot, b)
    if args.md:
        write_markdown(args.md, b, meta)
    log(f"done (load {meta['load1']:.1f})")


if __name__ == "__main__":
    main()
