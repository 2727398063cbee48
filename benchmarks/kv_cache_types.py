"""Decode speed per KV cache type at a fixed context, alternated: each type's cache is filled
once (prefill), then cut back to that context before every burst of decoded tokens.

    python benchmarks/kv_cache_types.py MODEL ROUNDS TOKENS_PER_BURST CTX[,CTX...]
"""
import statistics, sys, time
import torch, sparseinfer
from sparseinfer.generate import decode, prefill
from sparseinfer.kv_cache import CACHE_TYPES

name, rounds, burst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctxs = [int(c) for c in sys.argv[4].split(",")]
llm = sparseinfer.load(name, threads=2, device="cpu", ctx_size=4096)
g = torch.Generator().manual_seed(0)
V = llm.config.vocab_size
for n in ctxs:
    ids = torch.randint(100, V - 100, (n,), generator=g).tolist()
    caches, first = {}, {}
    with torch.inference_mode():
        for t in CACHE_TYPES:
            c = llm.model.new_cache(n + burst + 1, t)
            t0 = time.perf_counter()
            first[t] = int(prefill(llm.model, ids, c).argmax())
            print(f"{name} ctx {n} {t}: prefill {n / (time.perf_counter() - t0):.1f} tok/s, cache {c.nbytes} bytes", flush=True)
            caches[t] = c
        res = {t: [] for t in CACHE_TYPES}
        for r in range(rounds):
            for t in CACHE_TYPES:
                c = caches[t]
                c.truncate(n)
                tok = first[t]
                t0 = time.perf_counter()
                for _ in range(burst):
                    tok = int(decode(llm.model, tok, c).argmax())
                res[t].append(burst / (time.perf_counter() - t0))
        for t in CACHE_TYPES:
            v = res[t]
            print(f"MEDIAN {name} ctx {n} {t}: decode {statistics.median(v):.2f} tok/s "
                  f"(min {min(v):.2f}, max {max(v):.2f}, {rounds} bursts of {burst})", flush=True)
