"""ModelConfig: one frozen dataclass, filled the same way from config.json or GGUF metadata.

Field names follow Hugging Face's config.json keys; GGUF metadata is first translated into
those keys (`hf_dict_from_gguf`), then both go through `ModelConfig.from_dict`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import ModelFormatError, UnsupportedError

# OPT's learned position table has this many rows before position 0 (models/opt.py reads row
# position + OPT_POSITION_OFFSET; a file's table has max_position_embeddings + this many rows)
OPT_POSITION_OFFSET = 2

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
    def from_dict(cls, d: dict[str, Any], key_names: dict[str, str] | None = None) -> "ModelConfig":
        """From a config.json-style dict (unknown keys are ignored, family quirks normalised),
        checked: sizes positive integers, heads consistent (`_check_sane`).  `key_names` names
        the keys in error messages as their source spells them (GGUF metadata keys)."""
        d = dict(d)
        if not isinstance(d.get("model_type", ""), str):
            raise ModelFormatError(f"model config: model_type is {d['model_type']!r}; it must be a name: {_BAD_CONFIG}")
        mt = d.get("model_type", "")
        if mt in ("falcon", "RefinedWeb", "RefinedWebModel"):
            d = _falcon_keys(d)
        elif mt == "opt":
            d = _opt_keys(d)
        elif mt == "qwen2":
            d.setdefault("attention_bias", True)
        if "rope_parameters" in d and isinstance(d["rope_parameters"], dict):  # transformers >= 5
            d.setdefault("rope_theta", d["rope_parameters"].get("rope_theta", 10000.0))
            if d["rope_parameters"].get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", d["rope_parameters"])
        names = {f.name for f in fields(cls)}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if d.get(k) is None]
        if missing:
            raise UnsupportedError(f"model config lacks {', '.join(_named(k, key_names) for k in missing)}; "
                                   "is this a causal LM config.json?")
        _check_numbers(d, key_names or {})
        if d.get("intermediate_size") is None:
            d["intermediate_size"] = 4 * d["hidden_size"]
        if d.get("head_dim") is None:
            if d["hidden_size"] % d["num_attention_heads"]:
                raise ModelFormatError(
                    f"model config: {_named('hidden_size', key_names)} {d['hidden_size']} is not a multiple of "
                    f"{_named('num_attention_heads', key_names)} {d['num_attention_heads']}; {_BAD_CONFIG}")
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.family  # validate the architecture now
        _check_sane(cfg, key_names or {})
        _check_supported(cfg)
        return cfg


_BAD_CONFIG = "the file is damaged or not a supported model"
# config fields that must be integers > 0 when present, and numbers (finite; > 0 or >= 0)
_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                  "num_key_value_heads", "head_dim", "rope_dim", "max_position_embeddings")
_POSITIVE_FLOATS = ("rope_theta",)
_NONNEGATIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps")


def _named(key: str, key_names: dict[str, str] | None) -> str:
    return (key_names or {}).get(key, key)


def _check_numbers(d: dict, key_names: dict[str, str]) -> None:
    """Sizes integers > 0, epsilons and rope base finite numbers: before any arithmetic on them."""
    for k in _POSITIVE_INTS:
        v = d.get(k)
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            raise UnsupportedError(f"model config: {_named(k, key_names)} has one value per layer ({len(v)} values); "
                                   "models whose layers differ in size are not supported")
        if type(v) is not int or v <= 0:
            raise ModelFormatError(f"model config: {_named(k, key_names)} is {v!r}; it must be an integer > 0: "
                                   f"{_BAD_CONFIG}")
    for k in _POSITIVE_FLOATS + _NONNEGATIVE_FLOATS:
        v = d.get(k)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < 0 or (v == 0 and k in _POSITIVE_FLOATS):
            need = "> 0" if k in _POSITIVE_FLOATS else ">= 0"
            raise ModelFormatError(f"model config: {_named(k, key_names)} is {v!r}; it must be a finite number {need}: "
                                   f"{_BAD_CONFIG}")
    if not isinstance(d.get("hidden_act", "silu"), str):
        raise ModelFormatError(f"model config: {_named('hidden_act', key_names)} is {d['hidden_act']!r}; "
                               f"it must be an activation name: {_BAD_CONFIG}")
    rs = d.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise ModelFormatError(f"model config: rope_scaling is {rs!r}; it must be a mapping: {_BAD_CONFIG}")


def _check_sane(cfg: ModelConfig, key_names: dict[str, str]) -> None:
    """Head counts that divide, rotary dims that fit a head."""
    n = lambda k: _named(k, key_names)  # noqa: E731
    if cfg.num_attention_heads % cfg.n_kv_heads:
        raise ModelFormatError(
            f"model config: {n('num_attention_heads')} {cfg.num_attention_heads} is not a multiple of "
            f"{n('num_key_value_heads')} {cfg.n_kv_heads}; {_BAD_CONFIG}")
    if cfg.family in ("llama", "falcon") and (cfg.n_rot % 2 or cfg.n_rot > cfg.d_head):
        raise ModelFormatError(
            f"model config: {cfg.n_rot} rotary dimensions per head of {cfg.d_head} ({n('rope_dim')}); "
            f"they must be even and at most the head size: {_BAD_CONFIG}")
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) in ("linear", "llama3"):
        f = rs.get("factor")
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not math.isfinite(f) or f <= 0:
            raise ModelFormatError(f"model config: rope scaling factor {f!r}; it must be a finite number > 0: "
                                   f"{_BAD_CONFIG}")


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
        kv = d.get("num_kv_heads") or d.get("num_attention_heads")
    elif d.get("multi_query", True):
        kv = 1
    else:
        kv = d.get("num_attention_heads")
    d["num_key_value_heads"] = kv
    d.setdefault("intermediate_size", d.get("ffn_hidden_size"))  # None: 4 * hidden_size (from_dict)
    d.setdefault("hidden_act", d.get("activation", "gelu"))
    d["layer_norm_eps"] = d.get("layer_norm_epsilon", d.get("layer_norm_eps", 1e-5))
    d.setdefault("parallel_attn", True)
    bias = bool(d.get("bias", False))
    d["attention_bias"] = d["o_bias"] = d["mlp_bias"] = bias
    d["max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    return d


def _opt_keys(d: dict) -> dict:
    d = dict(d)
    d["intermediate_size"] = d.get("ffn_dim")  # None: 4 * hidden_size (from_dict)
    d["hidden_act"] = d.get("activation_function", "relu")
    d["max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    bias = d.get("enable_bias", True)
    d["attention_bias"] = d["o_bias"] = d["mlp_bias"] = bias
    d.setdefault("tie_word_embeddings", True)
    return d


# config.json key -> GGUF metadata key (after "{arch}."), for reading and for error messages
GGUF_KEYS = {
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
    "rope_theta": "rope.freq_base", "vocab_size": "vocab_size", "hidden_act": "hidden_act",
    "head_dim": "attention.key_length", "rope_dim": "rope.dimension_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "layer_norm_eps": "attention.layer_norm_epsilon",
}


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """The checked ModelConfig of a GGUF file's metadata; errors name the GGUF keys."""
    d = hf_dict_from_gguf(meta)
    arch = meta["general.architecture"]
    return ModelConfig.from_dict(d, {k: f"{arch}.{v}" for k, v in GGUF_KEYS.items()})


def hf_dict_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    """Translate GGUF metadata (`{arch}.block_count` ...) into config.json keys."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise UnsupportedError("GGUF file has no general.architecture key; is it a model file?")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"GGUF general.architecture is {arch!r}; it must be a name: {_BAD_CONFIG}")
    g = lambda k, default=None: meta.get(f"{arch}.{GGUF_KEYS.get(k, k)}", default)  # noqa: E731
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size")
    if vocab is None and isinstance(tokens, list) and tokens:
        vocab = len(tokens)
    d: dict[str, Any] = {
        "model_type": arch,
        "max_position_embeddings": g("max_position_embeddings", 2048),
        "rope_theta": g("rope_theta", 10000.0),
        "vocab_size": vocab,
        "hidden_act": g("hidden_act", "gelu" if arch == "falcon" else "relu" if arch == "opt" else "silu"),
    }
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_dim", "rms_norm_eps", "layer_norm_eps"):
        d[k] = g(k)
    if d["layer_norm_eps"] is not None:
        d["layer_norm_epsilon"] = d["layer_norm_eps"]
    stype = g("rope.scaling.type")
    if stype and stype != "none":
        d["rope_scaling"] = {"rope_type": stype, "factor": g("rope.scaling.factor", 1.0)}
    if arch == "falcon":
        kv = d["num_key_value_heads"]
        d["n_embed"], d["num_kv_heads"] = d["hidden_size"], kv
        d["new_decoder_architecture"] = bool(meta.get("falcon.new_decoder_architecture",
                                                      type(kv) is int and kv > 1))
        d["multi_query"] = kv == 1
    if arch == "opt":
        d["ffn_dim"] = d["intermediate_size"]
        d["activation_function"] = d["hidden_act"]
    return {k: v for k, v in d.items() if v is not None}
