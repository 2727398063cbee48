"""`sparseinfer bench`: prompt (prefill) and decode throughput on synthetic tokens, after warm-up."""
from __future__ import annotations

import sys
import time

import torch

from .generate import decode, prefill
from .sparse.apply import bench_fields, reset_stats


def measure(llm, n_prompt: int = 512, n_gen: int = 128, seed: int = 0) -> dict:
    """Time a prefill of `n_prompt` tokens and `n_gen` single-token decode steps."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.vocab_size
    ids = torch.randint(100, max(vocab - 100, 101), (n_prompt,), generator=g).tolist()
    need = n_prompt + n_gen + 1
    cache = llm.model.new_cache(max(need, 16))
    with torch.inference_mode():
        warm = llm.model.new_cache(16)  # warm-up: first-call costs of prefill and of decode
        decode(llm.model, int(prefill(llm.model, ids[:8], warm).argmax()), warm)
        t0 = time.perf_counter()
        logits = prefill(llm.model, ids, cache)
        t1 = time.perf_counter()
        tok = int(logits.argmax())
        reset_stats(llm.model)
        td = time.perf_counter()
        for _ in range(n_gen):
            tok = int(decode(llm.model, tok, cache).argmax())
        t2 = time.perf_counter()
    return {"n_prompt": n_prompt, "n_gen": n_gen, "prompt_tps": n_prompt / (t1 - t0), "decode_tps": n_gen / (t2 - td),
            **bench_fields(llm.model, t2 - td)}


def bench_record(llm, n_prompt: int = 512, n_gen: int = 128, repetitions: int = 1) -> dict:
    """The best of `repetitions` runs of `measure` (by decode speed), as the record that
    `sparseinfer bench --json` writes."""
    from .kernels import cpu

    threads = cpu.get_num_threads() if cpu.available() else torch.get_num_threads()  # the weight-product threads
    best = None
    for _ in range(max(1, repetitions)):
        r = measure(llm, n_prompt, n_gen)
        if best is None or r["decode_tps"] > best["decode_tps"]:
            best = r
    return {"model": str(llm.info.path), "mode": best["mode"], "density": round(best["density"], 4),
            "load_s": round(llm.info.seconds, 3), "peak_rss_mib": peak_rss_mib(),
            "threads": threads, "prompt_tps": round(best["prompt_tps"], 2), "decode_tps": round(best["decode_tps"], 2),
            "ffn_rows_touched_fraction": round(best["ffn_rows_touched_fraction"], 4),
            "bytes_per_token": int(best["bytes_per_token"]),
            "predictor_time_fraction": round(best["predictor_time_fraction"], 4),
            "head": best["head"], "head_fallback_fraction": round(best["head_fallback_fraction"], 4),
            "act_mode": cpu.activation_mode(), "kernels": cpu.simd_level()}


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far (MiB): the loaded model, the caches and the
    Python runtime with torch; None where the OS does not say."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS, KiB elsewhere


def format_record(rec: dict, n_prompt: int, n_gen: int) -> str:
    """`bench_record`'s result for people."""
    rss = "" if rec.get("peak_rss_mib") is None else f", peak memory {rec['peak_rss_mib']:.0f} MiB"
    return (f"model: {rec['model']}\nloaded in {rec['load_s']:.2f} s{rss}\nthreads: {rec['threads']}, kernels: {rec['kernels']}, activations: {rec['act_mode']}\n"
            f"mode: {rec['mode']} (density {rec['density']:.3f}, "
            f"FFN rows touched {rec['ffn_rows_touched_fraction']:.3f})\n"
            f"prompt ({n_prompt} tokens): {rec['prompt_tps']:.1f} tok/s\n"
            f"decode ({n_gen} tokens):  {rec['decode_tps']:.1f} tok/s, {rec['bytes_per_token'] / 2**20:.1f} MiB/token, "
            f"predictor {100 * rec['predictor_time_fraction']:.1f}% of decode time"
            + (f"\nhead: {rec['head']}, the exact head for {100 * rec['head_fallback_fraction']:.1f}% of tokens"
               if rec.get("head", "exact") != "exact" else ""))
