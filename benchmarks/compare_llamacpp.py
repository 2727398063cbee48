"""Side by side: sparseinfer vs llama.cpp (llama-cpp-python) on the same GGUF file and threads.

    python benchmarks/compare_llamacpp.py -m qwen2.5-coder-1.5b -t 2 [--rounds 2] [--json out.json]
    python benchmarks/compare_llamacpp.py -m qwen2.5-coder-1.5b --ours-args "--density 0.1"
    python benchmarks/compare_llamacpp.py -m qwen2.5-coder-1.5b --ours-args "--dense SPARSEINFER_Q4K=0"
    python benchmarks/compare_llamacpp.py -m SmolLM2 --memory [--ctx 4096]

Measures prompt (512 tokens) and decode (128 tokens) tok/s for each engine, alternating the
engines over `--rounds` to spread the machine's drift, and prints the best of each.

`--memory` instead starts each engine in a fresh process (alternated, `--rounds` times) that
loads the model with a `--ctx` context, reads a short prompt and generates 8 tokens, and
records its peak RSS, the time from process start to the first token (imports included: the
Python runtime and torch are part of what a user waits for) and to the end; then two processes
of the same engine on the same file at once, and their PSS (proportional set size: pages shared
between the two count half in each), which shows whether the weights are shared.
llama-cpp-python is a benchmark-only dependency: `pip install llama-cpp-python` (compiles).
"""
from __future__ import annotations

import argparse
import json
import os
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
    """Run `sparseinfer bench` in a subprocess (a fresh process, like llama.cpp's).  Words of
    `extra` of the form NAME=value are environment variables for that run (e.g. SPARSEINFER_Q4K=0)."""
    env = dict(os.environ)
    env.update(e.split("=", 1) for e in extra if "=" in e and not e.startswith("-"))
    args = [e for e in extra if not ("=" in e and not e.startswith("-"))]
    out = subprocess.run([sys.executable, "-m", "sparseinfer.commands", "bench", "-m", model, "-t", str(threads),
                          "--n-prompt", str(n_prompt), "--n-gen", str(n_gen), "--json", "/dev/stdout", *args],
                         capture_output=True, text=True, check=True, env=env).stdout
    rec = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    return {"engine": "sparseinfer " + " ".join(extra) if extra else "sparseinfer", **rec}


_START_CHILD = r"""
import json, os, resource, sys, time
t_spawn = float(sys.argv[1]); engine, path, threads, ctx, hold = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
prompt = "Write a function that checks whether a number is prime."
if engine == "llama.cpp":
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    t_load = time.time()
    stream = (c["choices"][0]["text"] for c in llm(prompt, max_tokens=8, temperature=0.0, stream=True))
else:
    import sparseinfer
    llm = sparseinfer.load(path, ctx_size=ctx, threads=threads)
    t_load = time.time()
    stream = (r.text for r in llm.stream_generate(prompt, max_tokens=8))
t_first = None
for _ in stream:
    t_first = t_first or time.time()
t_end = time.time()
def pss_mib():
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return None
if hold != "-":  # wait until the sibling process has loaded too, then report PSS
    open(hold + f".{os.getpid()}", "w").close()
    deadline = time.time() + 120
    while len([n for n in os.listdir(os.path.dirname(hold)) if n.startswith(os.path.basename(hold) + ".")]) < 2 \
            and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "pss_mib": pss_mib(),
                  "load_s": t_load - t_spawn, "first_token_s": t_first - t_spawn, "total_s": t_end - t_spawn}))
"""


def start_child(engine: str, path: str, threads: int, ctx: int, hold: str = "-") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _START_CHILD, repr(time.time()), engine, path, str(threads), str(ctx), hold],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    if p.returncode:
        raise SystemExit(f"a benchmark process failed:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def memory(path: str, threads: int, ctx: int, rounds: int) -> dict:
    """Peak RSS, start-up times and two-process PSS of each engine (see the module docstring)."""
    import tempfile

    engines = ["llama.cpp", "sparseinfer"]
    best: dict[str, dict] = {}
    for r in range(rounds):
        for e in (engines if r % 2 == 0 else engines[::-1]):
            rec = child_result(start_child(e, path, threads, ctx))
            print(f"round {r}: {e:12s} peak RSS {rec['peak_rss_mib']:7.0f} MiB  load {rec['load_s']:5.2f} s  "
                  f"first token {rec['first_token_s']:5.2f} s", flush=True)
            old = best.get(e)
            best[e] = rec if old is None else {k: min(v, old[k]) if isinstance(v, float) else v for k, v in rec.items()}
    for e in engines:
        with tempfile.TemporaryDirectory() as d:
            hold = os.path.join(d, "ready")
            ps = [start_child(e, path, threads, ctx, hold) for _ in range(2)]
            recs = [child_result(p) for p in ps]
        best[e]["two_process_pss_mib"] = [round(x["pss_mib"], 1) for x in recs if x["pss_mib"] is not None]
    print(f"\nmodel {path}, {threads} threads, context {ctx}, 8 tokens (best of {rounds}; "
          "times from process start)")
    print(f"{'engine':12s} {'peak RSS MiB':>12s} {'load s':>7s} {'1st token s':>11s} {'PSS of 2 procs MiB':>20s}")
    for e, v in best.items():
        print(f"{e:12s} {v['peak_rss_mib']:12.0f} {v['load_s']:7.2f} {v['first_token_s']:11.2f} "
              f"{' + '.join(f'{x:.0f}' for x in v['two_process_pss_mib']):>20s}")
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ours-args", action="append", default=[],
                    help="extra `sparseinfer bench` arguments for one configuration (repeatable); "
                         "NAME=value words set environment variables for it")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true", help="peak RSS, load time and sharing instead of speed")
    ap.add_argument("--ctx", type=int, default=4096, help="context size for --memory")
    a = ap.parse_args()
    from sparseinfer.catalog import resolve

    path = str(resolve(a.model))
    if a.memory:
        best = memory(path, a.threads, a.ctx, a.rounds)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"model": path, "threads": a.threads, "ctx": a.ctx, "results": best}, f, indent=1)
        return
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
