"""sparseinfer: local LLM inference that exploits activation locality."""
__version__ = "0.1.0"
