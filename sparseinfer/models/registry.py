"""model family -> builder (`config.ARCH_ALIASES` maps model_type names onto these)."""
from __future__ import annotations

from ..io.weights import WeightSource
from . import falcon, llama, opt
from .base import CausalLM

BUILDERS = {"llama": llama.build, "falcon": falcon.build, "opt": opt.build}


def build_model(src: WeightSource) -> CausalLM:
    prefetch = getattr(src, "prefetch", None)  # GGUF: convert matrices on worker threads
    if prefetch is not None:
        prefetch()
    try:
        return BUILDERS[src.config.family](src)
    finally:
        end = getattr(src, "end_prefetch", None)
        if end is not None:
            end()
