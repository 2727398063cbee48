"""ModelConfig: one frozen dataclass, filled the same way from config.json or GGUF metadata.

Field names follow Hugging Face's config.json keys; GGUF metadata is first translated into
those keys (`hf_dict_from_gguf`), then both go through `ModelConfig.from_dict`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .errors import UnsupportedError

# model_type aliases -> the implementation family that runs them (see models/registry.py)
ARCH_ALIASES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "smollm": "llama", "bamboo": "llama",
    "falcon": "falcon", "RefinedWeb": "falcon", "RefinedWebModel": "falcon", "opt": "opt",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_dim: int | None = None           # rotary dims per head (partial rotary); None = head_dim
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # bias on q/k/v (qwen2: True)
    o_bias: bool = False                  # bias on the attention output projection
    mlp_bias: bool = False
    # falcon
    parallel_attn: bool = False
    new_decoder_architecture: bool = False
    num_ln_in_parallel_attn: int | None = None
    # opt
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: Any = None

    @property
    def family(self) -> str:
        try:
            return ARCH_ALIASES[self.model_type]
        except KeyError:
            raise UnsupportedError(
                f"unsupported architecture {self.model_type!r}; sparseinfer runs: "
                f"{', '.join(sorted(set(ARCH_ALIASES)))}"
            ) from None

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.d_head

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a config.json-style dict (unknown keys are ignored, family quirks normalised)."""
        d = dict(d)
        mt = d.get("model_type", "")
        if mt in ("falcon", "RefinedWeb", "RefinedWebModel"):
            d = _falcon_keys(d)
        elif mt == "opt":
            d = _opt_keys(d)
        elif mt == "qwen2":
            d.setdefault("attention_bias", True)
        if d.get("head_dim") is None and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if "rope_parameters" in d and isinstance(d["rope_parameters"], dict):  # transformers >= 5
            d.setdefault("rope_theta", d["rope_parameters"].get("rope_theta", 10000.0))
            if d["rope_parameters"].get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", d["rope_parameters"])
        names = {f.name for f in fields(cls)}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise UnsupportedError(f"model config lacks {', '.join(missing)}; is this a causal LM config.json?")
        d.setdefault("intermediate_size", 4 * d["hidden_size"])
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.family  # validate the architecture now
        _check_supported(cfg)
        return cfg


def _check_supported(cfg: ModelConfig) -> None:
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type", "default")) not in ("default", "linear", "llama3"):
        raise UnsupportedError(f"rope scaling {rs} is not supported yet")
    if cfg.model_type == "opt" and cfg.word_embed_proj_dim not in (None, cfg.hidden_size):
        raise UnsupportedError("OPT models with project_in/project_out (word_embed_proj_dim != hidden_size) are not supported")


def _falcon_keys(d: dict) -> dict:
    d = dict(d)
    d["model_type"] = "falcon"
    d.setdefault("hidden_size", d.get("n_embed"))
    d.setdefault("num_hidden_layers", d.get("n_layer"))
    d.setdefault("num_attention_heads", d.get("n_head"))
    if d.get("alibi"):
        raise UnsupportedError("Falcon with ALiBi positions is not supported (only rotary Falcon-7B/40B/180B style)")
    if d.get("new_decoder_architecture"):
        kv = d.get("num_kv_heads") or d["num_attention_heads"]
    elif d.get("multi_query", True):
        kv = 1
    else:
        kv = d["num_attention_heads"]
    d["num_key_value_heads"] = kv
    d.setdefault("intermediate_size", d.get("ffn_hidden_size") or 4 * d["hidden_size"])
    d.setdefault("hidden_act", d.get("activation", "gelu"))
    d["layer_norm_eps"] = d.get("layer_norm_epsilon", d.get("layer_norm_eps", 1e-5))
    d.setdefault("parallel_attn", True)
    bias = bool(d.get("bias", False))
    d["attention_bias"] = d["o_bias"] = d["mlp_bias"] = bias
    d["max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    return d


def _opt_keys(d: dict) -> dict:
    d = dict(d)
    d["intermediate_size"] = d.get("ffn_dim", 4 * d["hidden_size"])
    d["hidden_act"] = d.get("activation_function", "relu")
    d["max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    bias = d.get("enable_bias", True)
    d["attention_bias"] = d["o_bias"] = d["mlp_bias"] = bias
    d.setdefault("tie_word_embeddings", True)
    return d


def hf_dict_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    """Translate GGUF metadata (`{arch}.block_count` ...) into config.json keys."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise UnsupportedError("GGUF file has no general.architecture key; is it a model file?")
    g = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or None
    d: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": g("embedding_length"),
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": g("attention.head_count"),
        "num_key_value_heads": g("attention.head_count_kv"),
        "max_position_embeddings": g("context_length", 2048),
        "rope_theta": g("rope.freq_base", 10000.0),
        "vocab_size": vocab,
        "hidden_act": g("hidden_act", "gelu" if arch == "falcon" else "relu" if arch == "opt" else "silu"),
    }
    if g("attention.key_length"):
        d["head_dim"] = g("attention.key_length")
    if g("rope.dimension_count") and d["num_attention_heads"]:
        hd = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        if g("rope.dimension_count") != hd:
            d["rope_dim"] = g("rope.dimension_count")
    if g("attention.layer_norm_rms_epsilon") is not None:
        d["rms_norm_eps"] = g("attention.layer_norm_rms_epsilon")
    if g("attention.layer_norm_epsilon") is not None:
        d["layer_norm_eps"] = g("attention.layer_norm_epsilon")
        d["layer_norm_epsilon"] = g("attention.layer_norm_epsilon")
    stype = g("rope.scaling.type")
    if stype and stype != "none":
        d["rope_scaling"] = {"rope_type": stype, "factor": g("rope.scaling.factor", 1.0)}
    if arch == "falcon":
        d["n_embed"], d["num_kv_heads"] = d["hidden_size"], d["num_key_value_heads"]
        d["new_decoder_architecture"] = bool(meta.get("falcon.new_decoder_architecture", (d["num_key_value_heads"] or 1) > 1))
        d["multi_query"] = d["num_key_value_heads"] == 1
    if arch == "opt":
        d["ffn_dim"] = d["intermediate_size"]
        d["activation_function"] = d["hidden_act"]
    return {k: v for k, v in d.items() if v is not None}
