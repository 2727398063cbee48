"""Side by side: sparseinfer vs llama.cpp (llama-cpp-python) on the same GGUF file and threads.

    python benchmarks/compare_llamacpp.py -m qwen2.5-coder-1.5b -t 2 [--rounds 2] [--json out.json]
    python benchmarks/compare_llamacpp.py -m qwen2.5-coder-1.5b --sparse-args "--density 0.1"

Measures prompt (512 tokens) and decode (128 tokens) tok/s for each engine, alternating the
engines over `--rounds` to spread this machine's 5-10% drift, and prints the best of each.
llama-cpp-python is a benchmark-only dependency: `pip install llama-cpp-python` (compiles).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np


def bench_llamacpp(path: str, threads: int, n_prompt: int, n_gen: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=n_prompt + n_gen + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=n_prompt, verbose=False, logits_all=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, llm.n_vocab() - 100, n_prompt).tolist()
    llm.eval(ids[:8])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    # decode speed does not depend on which token is fed: feed fixed random ids (no sampling cost)
    for tok in rng.integers(100, llm.n_vocab() - 100, n_gen).tolist():
        llm.eval([tok])
    t2 = time.perf_counter()
    import llama_cpp

    # which SIMD paths this llama.cpp build uses (e.g. "AVX2 = 1 | AVX512 = 1 | ...")
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return {"engine": "llama.cpp", "prompt_tps": n_prompt / (t1 - t0), "decode_tps": n_gen / (t2 - t1),
            "version": llama_cpp.__version__, "system_info": info}


def bench_ours(model: str, threads: int, n_prompt: int, n_gen: int, extra: list[str]) -> dict:
    """Run `sparseinfer bench` in a subprocess (a fresh process, like llama.cpp's)."""
    out = subprocess.run([sys.executable, "-m", "sparseinfer.commands", "bench", "-m", model, "-t", str(threads),
                          "--n-prompt", str(n_prompt), "--n-gen", str(n_gen), "--json", "/dev/stdout", *extra],
                         capture_output=True, text=True, check=True).stdout
    rec = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    return {"engine": "sparseinfer " + " ".join(extra) if extra else "sparseinfer", **rec}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ours-args", action="append", default=[],
                    help="extra `sparseinfer bench` arguments for one configuration (repeatable)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from sparseinfer.catalog import resolve

    path = str(resolve(a.model))
    configs = [s.split() for s in a.ours_args] or [[]]
    best: dict[str, dict] = {}
    for r in range(a.rounds):
        runs = [lambda: bench_llamacpp(path, a.threads, a.n_prompt, a.n_gen)]
        runs += [lambda c=c: bench_ours(path, a.threads, a.n_prompt, a.n_gen, c) for c in configs]
        for run in (runs if r % 2 == 0 else runs[::-1]):
            rec = run()
            key = rec["engine"]
            print(f"round {r}: {key:40s} prompt {rec['prompt_tps']:8.1f} tok/s  decode {rec['decode_tps']:7.2f} tok/s", flush=True)
            if key not in best or rec["decode_tps"] > best[key]["decode_tps"]:
                best[key] = rec
    base = best["llama.cpp"]["decode_tps"]
    print(f"\nmodel {path}, {a.threads} threads, prompt {a.n_prompt}, decode {a.n_gen} (best of {a.rounds})")
    print(f"{'engine':40s} {'prompt tok/s':>12s} {'decode tok/s':>12s} {'vs llama.cpp':>12s}")
    for k, v in best.items():
        print(f"{k:40s} {v['prompt_tps']:12.1f} {v['decode_tps']:12.2f} {v['decode_tps'] / base:11.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": path, "threads": a.threads, "results": list(best.values())}, f, indent=1)


if __name__ == "__main__":
    main()
