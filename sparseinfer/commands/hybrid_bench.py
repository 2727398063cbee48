"""Hybrid vs dense layer offload across VRAM budgets: one table.

    python -m sparseinfer.commands.hybrid_bench -m qwen2.5-coder-1.5b --budgets 0,0.25,0.5,1 -c 1024

Budgets are fractions of the model's weight bytes (or sizes like 512MiB).  Each row loads the
model afresh (placement moves parts in place), times prefill and decode with
`sparseinfer.bench.measure`, and on CUDA records the peak allocated GPU memory, which must
stay within the budget.  Modes: `neurons` (hot neurons on the GPU, needs the sparsity pack),
`layers` (dense model, whole layers on the GPU, llama.cpp's -ngl), `cpu` (no GPU at all).
"""
from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import time

from ..errors import SparseInferError
from .args import build_from_args, load_from_args


def parse_budgets(text: str, size: int) -> list[tuple[str, int]]:
    """'0,0.25,512MiB' -> [(label, bytes)]: plain numbers <= 1 are fractions of `size`."""
    from ..hybrid import parse_vram_budget

    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            f = float(part)
        except ValueError:
            out.append((part, parse_vram_budget(part)))
            continue
        if not 0 <= f <= 1:
            raise SparseInferError(f"budget {part}: give a fraction in [0, 1] of the model size or a size like 512MiB")
        out.append((f"{f:.0%}", int(f * size)))
    return out


class Skip(Exception):
    """A row that cannot run (no sparsity pack for the neurons mode)."""


def run_one(a: argparse.Namespace, mode: str, budget: int) -> dict:
    """Load `a.model` for one (mode, budget) row, measure it, and free it again."""
    import torch

    from ..bench import measure
    from ..hybrid import format_bytes

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    device = "cpu" if mode == "cpu" or budget == 0 else ("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    llm = load_from_args(a, report=False, device=device, vram_budget=f"{budget}B", dense=mode != "neurons")
    if mode == "neurons" and llm.sparsity is None:
        raise Skip(f"no sparsity pack for {a.model}: run `sparseinfer prepare {a.model}` first, or drop the "
                   "neurons mode")
    load_s = time.perf_counter() - t0
    r = measure(llm, a.n_prompt, a.n_gen)
    p = llm.placement
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    row = {"mode": mode, "budget": format_bytes(budget), "placed": p.mode if p else "cpu",
           "on_gpu": format_bytes(p.bytes_used) if p else "0 B", "gpu_frac": round(p.expected_fraction, 3) if p else 0.0,
           "prompt_tps": round(r["prompt_tps"], 1), "decode_tps": round(r["decode_tps"], 1),
           "peak_gpu": format_bytes(peak), "within": peak <= budget, "load_s": round(load_s, 1)}
    close = getattr(llm.model, "close", None)
    if close:
        close()
    del llm
    return row


def run(a: argparse.Namespace) -> int:
    import torch

    from ..hybrid import format_bytes
    from ..hybrid.plan import placement_table
    from ..quant import qweight_nbytes

    path, _, model, _ = build_from_args(a, sparse=None)
    size = qweight_nbytes(model)
    del model
    a.model = str(path)
    print(f"model: {path} ({format_bytes(size)} of weights); GPU: "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; context {a.ctx_size}; "
          f"prompt {a.n_prompt}, decode {a.n_gen} tokens", flush=True)
    rows: list[dict] = []
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` stops us: still print the rows so far
    try:
        for label, budget in parse_budgets(a.budgets, size):
            for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
                try:
                    row = run_one(a, mode, budget)
                except Skip as e:
                    print(f"skipped {mode} at {label}: {e}", file=sys.stderr)
                    continue
                row = {"budget_of_model": label, **row}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps({"model": str(path), **row}) + "\n")
    except KeyboardInterrupt:
        print(placement_table(rows) + "\n(interrupted: rows so far)", flush=True)
        return 124
    print(placement_table(rows), flush=True)
    return 0 if all(r["within"] for r in rows) else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from . import guarded

    ap = argparse.ArgumentParser(prog="python -m sparseinfer.commands.hybrid_bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--budgets", default="0,0.25,0.5,1", help="fractions of the model size, or sizes (512MiB)")
    ap.add_argument("--modes", default="neurons,layers", help="comma list of neurons, layers, cpu")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--sparse", default=None, help="sparsity pack for the neurons mode (default: MODEL.sparse)")
    ap.add_argument("--json", default=None, help="append the rows as JSON records to this file")
    return guarded(run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
