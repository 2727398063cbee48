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


def compare(model, dense: list, sparse: list, prompt: torch.Tensor, tokens: int = 16, rounds: int = 8,
            heads: tuple | None = None) -> dict:
    """Decode speed with the FFN modules `dense` and with `sparse` in the model's FFN slots, in
    `rounds` pairs of bursts of `tokens` one-token steps (after one prefill of `prompt`, each
    burst from the same cache length, with teacher-forced tokens: decode speed does not depend
    on which tokens are fed).  The speed-up is the median of the pairs' ratios: the two bursts
    of a pair run within a second or two, so a machine whose speed drifts between minutes moves
    both alike.  `heads`: (dense head, sparse head) swapped along with the FFNs.  `sparse` (and
    its head) stays in."""
    from .apply import restore

    feed = prompt.tolist()
    cache = model.new_cache(len(feed) + tokens + 2)
    with torch.inference_mode():
        restore(model, dense)
        model(prompt[None], cache, last_only=True)
        start = cache.length

        def burst(ffns, head) -> float:
            restore(model, ffns)
            if head is not None:
                model.head = head
            cache.truncate(start)
            model(torch.tensor([[feed[-1]]]), cache)  # untimed: builds the decode plans
            t0 = time.perf_counter()
            for i in range(tokens):
                model(torch.tensor([[feed[i % len(feed)]]]), cache)
            return (time.perf_counter() - t0) / tokens

        hd, hs = heads or (None, None)
        pairs = [(burst(dense, hd), burst(sparse, hs)) for _ in range(rounds)]
    restore(model, sparse)
    if hs is not None:
        model.head = hs
    med = statistics.median_high
    return {**machine(), "threads": cpu.get_num_threads(), "tokens": tokens, "rounds": rounds,
            "dense_tok_s": round(1.0 / med([d for d, _ in pairs]), 2),
            "sparse_tok_s": round(1.0 / med([s for _, s in pairs]), 2),
            "speedup": round(med([d / s for d, s in pairs]), 3)}


def measure(model, pack, prompt: torch.Tensor, tokens: int = 16, rounds: int = 8) -> dict:
    """Decode speed of the dense `model` and of `model` sparsified with `pack` (`compare`); the
    model is left dense."""
    from .apply import ffn_slots, replace_ffns, restore, sparsify

    from .head import PreviewHead

    mlps = replace_ffns(model, lambda i, m: m)  # the dense MLPs, to put back
    exact = model.head
    try:
        sparsify(model, pack)  # once; the rounds swap the two sets of FFNs (and heads)
        heads = (exact, PreviewHead(exact, pack.head)) if pack.head is not None else None
        return compare(model, mlps, [getattr(p, n) for p, n in ffn_slots(model)], prompt, tokens, rounds, heads)
    finally:
        restore(model, mlps)
        model.head = exact


def measure_head(model, hp, prompt: torch.Tensor, tokens: int = 16, rounds: int = 8) -> dict:
    """Decode speed of the dense `model` with its exact head and with the head preview `hp`
    (`sparse.head`), the FFNs as they are (`compare`); the model keeps its exact head."""
    from .apply import ffn_slots
    from .head import PreviewHead

    exact = model.head
    ffns = [getattr(p, n) for p, n in ffn_slots(model)]
    try:
        return compare(model, ffns, ffns, prompt, tokens, rounds, (exact, PreviewHead(exact, hp)))
    finally:
        model.head = exact


def measured_speedup(pack) -> float | None:
    """The pack's recorded speed-up over dense (or that of a `compare` record) when it was
    measured on this CPU and kernel level, else None.  A malformed record counts as no record."""
    if isinstance(pack, dict):
        rec = pack
    else:
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


def head_speedup_here(pack) -> float | None:
    """The recorded speed-up of the pack's head preview alone (dense FFNs) when measured on
    this CPU and kernel level, else None."""
    hp = pack.head
    rec = hp.stats.get("speed") if hp is not None and isinstance(hp.stats, dict) else None
    return measured_speedup(rec) if isinstance(rec, dict) else None


def parts_here(pack) -> tuple[bool, bool, str | None]:
    """(use the FFN sparsity, use the head preview, a one-line note or None) for a pack found
    next to its model, from what `prepare` measured on this machine: the whole pack when it
    decoded at least as fast as dense and as the head preview alone; else the head preview
    alone when that was faster than dense; else nothing.  No measurement here: everything."""
    s, sh = measured_speedup(pack), head_speedup_here(pack)
    if s is None or (s >= 1.0 and (sh is None or s >= sh)):
        return True, True, None
    rec = pack.info["speed"]
    what = (f"{rec.get('sparse_tok_s')} vs {rec.get('dense_tok_s')} tok/s when it was made, {s:.2f}x")
    if sh is not None and sh >= 1.0:
        return False, True, (f"sparsity pack {pack.path}: its FFN sparsity decodes no faster than its output head "
                             f"preview alone on this CPU ({s:.2f}x against {sh:.2f}x over dense): running dense FFNs "
                             f"with the head preview; --sparse {pack.path} uses the whole pack anyway")
    return False, False, (f"sparsity pack {pack.path} decodes slower than the dense model on this CPU ({what}): "
                          f"running dense; --sparse {pack.path} uses it anyway")
