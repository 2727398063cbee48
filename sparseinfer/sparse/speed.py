"""Does a sparsity pack pay on this machine?  `sparseinfer prepare` decodes with and without
the pack, alternated, and records the two speeds and the CPU in the pack (`info["speed"]`).
A pack found next to the model is then used only where it was not measured slower than the
dense model on the same CPU and kernel level (`slower_here`); `--sparse PACK` uses it anyway.

Why measured rather than predicted: whether skipping rows pays depends on the kept fraction,
on how the CPU reads scattered rows and on the kernels of its level, which a byte count does
not capture (on gated models a pack within +3% perplexity can read nearly as many bytes as
dense, in scattered rows)."""
from __future__ import annotations

import math
import platform
import statistics
import time

import torch

from ..kernels import cpu


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    return {"cpu": cpu_name(), "simd": cpu.simd_level()}


def compare(model, dense: list, sparse: list, prompt: torch.Tensor, tokens: int = 16, rounds: int = 8) -> dict:
    """Decode speed with the FFN modules `dense` and with `sparse` in the model's FFN slots, in
    `rounds` pairs of bursts of `tokens` one-token steps (after one prefill of `prompt`, each
    burst from the same cache length, with teacher-forced tokens: decode speed does not depend
    on which tokens are fed).  The speed-up is the median of the pairs' ratios: the two bursts
    of a pair run within a second or two, so a machine whose speed drifts between minutes moves
    both alike.  `sparse` stays in."""
    from .apply import restore

    feed = prompt.tolist()
    cache = model.new_cache(len(feed) + tokens + 2)
    with torch.inference_mode():
        restore(model, dense)
        model(prompt[None], cache, last_only=True)
        start = cache.length

        def burst(ffns) -> float:
            restore(model, ffns)
            cache.truncate(start)
            model(torch.tensor([[feed[-1]]]), cache)  # untimed: builds the decode plans
            t0 = time.perf_counter()
            for i in range(tokens):
                model(torch.tensor([[feed[i % len(feed)]]]), cache)
            return (time.perf_counter() - t0) / tokens

        pairs = [(burst(dense), burst(sparse)) for _ in range(rounds)]
    restore(model, sparse)
    med = statistics.median_high
    return {**machine(), "threads": cpu.get_num_threads(), "tokens": tokens, "rounds": rounds,
            "dense_tok_s": round(1.0 / med([d for d, _ in pairs]), 2),
            "sparse_tok_s": round(1.0 / med([s for _, s in pairs]), 2),
            "speedup": round(med([d / s for d, s in pairs]), 3)}


def measure(model, pack, prompt: torch.Tensor, tokens: int = 16, rounds: int = 8) -> dict:
    """Decode speed of the dense `model` and of `model` sparsified with `pack` (`compare`); the
    model is left dense."""
    from .apply import ffn_slots, replace_ffns, restore, sparsify

    mlps = replace_ffns(model, lambda i, m: m)  # the dense MLPs, to put back
    try:
        sparsify(model, pack)  # once; the rounds swap the two sets of FFNs
        return compare(model, mlps, [getattr(p, n) for p, n in ffn_slots(model)], prompt, tokens, rounds)
    finally:
        restore(model, mlps)


def measured_speedup(pack) -> float | None:
    """The pack's recorded speed-up over dense when it was measured on this CPU and kernel
    level, else None.  A malformed record counts as no record."""
    rec = pack.info.get("speed") if isinstance(pack.info, dict) else None
    if not isinstance(rec, dict):
        return None
    s = rec.get("speedup")
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s <= 0:
        return None
    here = machine()
    if rec.get("cpu") != here["cpu"] or rec.get("simd") != here["simd"]:
        return None
    return float(s)


def slower_here(pack) -> str | None:
    """A one-line note when the pack was measured slower than dense on this machine, else None."""
    s = measured_speedup(pack)
    if s is None or s >= 1.0:
        return None
    rec = pack.info["speed"]
    return (f"sparsity pack {pack.path} decodes slower than the dense model on this CPU "
            f"({rec.get('sparse_tok_s')} vs {rec.get('dense_tok_s')} tok/s when it was made, {s:.2f}x): "
            f"running dense; --sparse {pack.path} uses it anyway")
