"""model family -> builder (`config.ARCH_ALIASES` maps model_type names onto these)."""
from __future__ import annotations

from ..io.weights import WeightSource
from . import falcon, llama, opt
from .base import CausalLM

BUILDERS = {"llama": llama.build, "falcon": falcon.build, "opt": opt.build}


def build_model(src: WeightSource) -> CausalLM:
    src.prefetch()  # GGUF: matrices converted on worker threads while the builder runs
    try:
        return BUILDERS[src.config.family](src)
    finally:
        src.end_prefetch()
