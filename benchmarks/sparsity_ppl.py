"""Perplexity vs activation sparsity (WikiText-2 test, llama.cpp's chunked scoring).

    python benchmarks/sparsity_ppl.py -m MODEL --sparsities 0.3,0.5,0.7 --chunks 8 \
        --packs a.sparse,b.sparse --json benchmarks/results/sparsity_ppl.jsonl
    python benchmarks/sparsity_ppl.py --json benchmarks/results/sparsity_ppl.jsonl \
        --plot docs/img/ppl_vs_sparsity.png

For each sparsity s, per-layer thresholds are the s-quantiles of |act(gate x)| on the default
calibration mix (thresholds alone: the sparsified model); for each pack, its own thresholds
alone and thresholds + predictors scored faithfully (per-token predictor x threshold masks on
whole chunks, what sparse decode computes).  Calibration text never overlaps the scored chunks
(the first N chunks of wiki.test.raw; calibration uses its last quarter).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import sparseinfer
from sparseinfer.commands.args import repo_data
from sparseinfer.perplexity import perplexity
from sparseinfer.sparse import calibrate as cal
from sparseinfer.sparse.apply import replace_ffns, restore, sparse_ffns, sparsify
from sparseinfer.sparse.ffn import SparseFFN
from sparseinfer.sparse.pack import SparsityPack


def threshold_samples(llm, tokens: int = 2048):
    cs = cal.calibration_set(llm.tokenizer, str(repo_data(flag="--data")), tokens, 256, 512, 512)
    ffns = sparse_ffns(llm.model)
    rec = cal.Recorder(ffns, sample_per_call=50_000)
    cal.forward_batches(llm.model, cs.seqs, 8, "threshold quantiles")
    rec.detach(ffns)
    return rec.sorted_samples()


def run(a) -> list[dict]:
    llm = sparseinfer.load(a.model, threads=a.threads, dense=True)
    torch.set_num_threads(1)  # small torch ops next to the kernels' pool (see sparse/prepare.py)
    text = Path(a.file or repo_data("wikitext-2-raw", "wiki.test.raw", flag="--file")).read_text(encoding="utf-8")
    name = Path(llm.info.path).name
    base = {"model": name, "chunks": a.chunks, "ctx": a.ctx}

    def ppl(tag: str) -> float:
        t0 = time.perf_counter()
        r = perplexity(llm, text, ctx=a.ctx, n_chunks=a.chunks)
        print(f"{name} {tag}: ppl {r['ppl']:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
        return r["ppl"]

    dense = ppl("dense")
    out = [{**base, "kind": "dense", "sparsity": 0.0, "ppl_dense": dense, "ppl_threshold": dense}]
    mlps = replace_ffns(llm.model, lambda i, m: SparseFFN(m, mode="threshold"))
    if a.sparsities:
        samples = threshold_samples(llm)
        for alloc in a.allocations.split(","):
            for s in (float(x) for x in a.sparsities.split(",")):
                cal.set_thresholds(sparse_ffns(llm.model), cal.thresholds_for(samples, s, alloc))
                out.append({**base, "kind": "thresholds", "allocation": alloc, "sparsity": s, "ppl_dense": dense,
                            "ppl_threshold": ppl(f"{alloc} s={s}")})
    restore(llm.model, mlps)
    for path in filter(None, (a.packs or "").split(",")):
        pack = SparsityPack.load(path)
        pack.check(llm.source)
        sparsify(llm.model, pack, mode="threshold", build_decode=False)
        rec = {**base, "kind": "pack", "pack": str(path), "sparsity": pack.info.get("target_sparsity", 0.0),
               "density_true": pack.mean_stat("density_true"), "recall": pack.mean_stat("recall"),
               "predictor_layers": sum(lp.policy == "predictor" for lp in pack.layers), "ppl_dense": dense,
               "ppl_threshold": ppl(f"{path} thresholds")}
        for f in sparse_ffns(llm.model):
            f.mode = "faithful"
        rec["ppl_sparse"] = ppl(f"{path} sparse")
        out.append(rec)
        restore(llm.model, mlps)
    return out


def plot(jsonl: Path, png: Path) -> None:
    from sparseinfer.sparse.plots import plot_ppl_vs_sparsity

    curves: dict[str, list[dict]] = {}
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        curves.setdefault(r["model"], []).append(r)
    plot_ppl_vs_sparsity(curves, png)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-f", "--file", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--sparsities", default="0.3,0.5,0.7")
    ap.add_argument("--allocations", default="uniform", help="uniform and/or error (comma-separated)")
    ap.add_argument("--packs", default=None, help="comma-separated sparsity packs to score (thresholds, + predictors)")
    ap.add_argument("--json", default=None, help="append records to this JSON-lines file")
    ap.add_argument("--plot", default=None, help="draw the curves of --json into this PNG")
    a = ap.parse_args()
    if a.model:
        recs = run(a)
        if a.json:
            with open(a.json, "a") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
    if a.plot and a.json:
        plot(Path(a.json), Path(a.plot))


if __name__ == "__main__":
    main()
