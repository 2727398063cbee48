"""model family -> builder (`config.ARCH_ALIASES` maps model_type names onto these)."""
from __future__ import annotations

from ..io.weights import WeightSource
from ..quant import QWeight
from . import falcon, llama, opt
from .base import CausalLM

BUILDERS = {"llama": llama.build, "falcon": falcon.build, "opt": opt.build}


def build_model(src: WeightSource) -> CausalLM:
    src.prefetch()  # GGUF: matrices converted on worker threads while the builder runs
    try:
        model = BUILDERS[src.config.family](src)
    finally:
        src.end_prefetch()
    interleave_head(model)
    return model


def interleave_head(model: CausalLM) -> None:
    """The output projection with each row's scales next to its values (`interleave_rows`),
    shared with the embedding when the two are tied.  It is the largest single read of a
    decode step (Qwen2.5-1.5B: a 200 MB q6 matrix, over half the bytes per token at density
    0.1), so sparse decode gains from reading it as whole rows (`interleave_pays` says where)."""
    from ..kernels import cpu

    w = model.head.weight
    if not isinstance(w, QWeight) or not cpu.interleave_pays(w):
        return
    new = cpu.interleave_rows(w)
    if model.embed.weight is w:
        model.embed.weight = new
    model.head.weight = new
