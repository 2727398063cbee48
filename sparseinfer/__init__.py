"""sparseinfer: local LLM inference that exploits activation locality.

    import sparseinfer
    llm = sparseinfer.load()                      # default model: SmolLM2-135M-Instruct (Q4_1 GGUF)
    print(sparseinfer.generate(llm, "What is the capital of France?", chat=True, max_tokens=32))
    for piece in sparseinfer.stream_generate(llm, "Once upon a time", max_tokens=64):
        print(piece.text, end="", flush=True)
"""
from .engine import LLM, generate, load, set_threads, stream_generate
from .errors import SparseInferError

__version__ = "0.1.0"
__all__ = ["LLM", "load", "generate", "stream_generate", "set_threads", "SparseInferError"]
