"""Decode/prompt speed: dense vs the calibrated sparsity pack vs forced FFN densities.

    python benchmarks/sparsity_bench.py -m MODEL --pack MODEL.sparse --densities 0.5,0.25,0.1 -t 2 \
        --json sparsity_bench.jsonl

One load, then each configuration swaps the FFNs in place (same weights, same process) and runs
`sparseinfer.bench.measure` (synthetic prompt, greedy decode after warm-up), best of
--repetitions.  Records carry the `sparseinfer bench --json` fields.  `density D` uses the
pack's predictors to rank rows (top-D per token, predictor cost included); `density D (no
pack)` uses a fresh random row set per token (speed only).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import sparseinfer
from sparseinfer.bench import measure
from sparseinfer.sparse.apply import replace_ffns, restore, sparsify
from sparseinfer.sparse.pack import SparsityPack


def best_of(llm, a) -> dict:
    best = None
    for _ in range(a.repetitions):
        r = measure(llm, a.n_prompt, a.n_gen)
        if best is None or r["decode_tps"] > best["decode_tps"]:
            best = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--pack", default=None)
    ap.add_argument("--densities", default="0.5,0.25,0.1")
    ap.add_argument("--no-pack-densities", default="", help="forced densities with random rows (no pack)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads next to the kernels")
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    llm = sparseinfer.load(a.model, threads=a.threads, dense=True)
    torch.set_num_threads(a.torch_threads)
    pack = SparsityPack.load(a.pack) if a.pack else None
    if pack is not None:
        pack.check(llm.source)
    mlps = replace_ffns(llm.model, lambda i, m: m)
    configs = [("dense", None, None)]
    if pack is not None:
        configs.append(("sparse", pack, None))
        configs += [(f"density {d}", pack, float(d)) for d in a.densities.split(",") if d]
    configs += [(f"density {d} (no pack)", None, float(d)) for d in a.no_pack_densities.split(",") if d]
    name = Path(llm.info.path).name
    for label, p, d in configs:
        restore(llm.model, mlps)
        if p is not None or d is not None:
            with torch.inference_mode():
                sparsify(llm.model, p, density=d)
        r = best_of(llm, a)
        rec = {"model": name, "label": label, "mode": r["mode"], "density": round(r["density"], 4),
               "threads": a.threads, "torch_threads": a.torch_threads, "prompt_tps": round(r["prompt_tps"], 2),
               "decode_tps": round(r["decode_tps"], 2), "ffn_rows_touched_fraction": round(r["ffn_rows_touched_fraction"], 4),
               "bytes_per_token": int(r["bytes_per_token"]), "predictor_time_fraction": round(r["predictor_time_fraction"], 4),
               "n_prompt": a.n_prompt, "n_gen": a.n_gen}
        print(json.dumps(rec), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
