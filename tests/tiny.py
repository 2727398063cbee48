"""Tiny random models of every family, built with transformers (the reference implementation),
saved as safetensors folders and exported to GGUF the way llama.cpp's converter lays them out."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

VOCAB = 256


def hf_model(kind: str, seed: int = 0):
    """A small random transformers causal LM of the given kind, in eval mode, float32."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)
    if kind in ("llama", "llama-relu", "mistral"):
        cls = tf.MistralConfig if kind == "mistral" else tf.LlamaConfig
        cfg = cls(**common, intermediate_size=160, num_key_value_heads=2, rms_norm_eps=1e-5,
                  hidden_act="relu" if kind == "llama-relu" else "silu", tie_word_embeddings=False,
                  rope_theta=10000.0)
        model = (tf.MistralForCausalLM if kind == "mistral" else tf.LlamaForCausalLM)(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, intermediate_size=160, num_key_value_heads=2, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, rope_theta=1000000.0)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind in ("falcon", "falcon-40b"):
        new = kind == "falcon-40b"
        cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_kv_heads=2 if new else None, new_decoder_architecture=new,
                              multi_query=not new, parallel_attn=True, bias=False, alibi=False,
                              max_position_embeddings=256, layer_norm_epsilon=1e-5)
        if new:
            cfg.num_ln_in_parallel_attn = 2
        model = tf.FalconForCausalLM(cfg)
    elif kind == "opt":
        cfg = tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           ffn_dim=160, max_position_embeddings=256, word_embed_proj_dim=64,
                           do_layer_norm_before=True, enable_bias=True, activation_function="relu",
                           pad_token_id=1, bos_token_id=2, eos_token_id=2)
        model = tf.OPTForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # make the random init less degenerate: bigger weights, non-trivial norms
        for n, p in model.named_parameters():
            if "norm" in n or "ln" in n.split(".")[-2]:
                p.copy_(1.0 + 0.2 * torch.randn_like(p)) if n.endswith("weight") else p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    return model.eval()


def save_folder(model, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


# ---------------------------------------------------------------------------- GGUF export
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "falcon": "falcon", "opt": "opt"}


def _gguf_name(arch_family: str, hf: str) -> str | None:
    from sparseinfer.io.weights import hf_to_gguf_name

    return hf_to_gguf_name(arch_family, hf)


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half -> interleaved pairs) of Q/K rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model, path: Path, qtype: str = "F32") -> Path:
    """Write a transformers model as GGUF. 2-D weights get `qtype` (F32/F16/BF16/Q8_0/Q4_0/...),
    1-D tensors stay F32, as llama.cpp's converter does."""
    cfg = model.config
    mt = cfg.model_type
    arch = GGUF_ARCH[mt]
    family = {"qwen2": "llama", "mistral": "llama"}.get(mt, mt)
    w = gguf.GGUFWriter(str(path), arch)
    c = cfg.to_dict()
    n_heads = c["num_attention_heads"]
    if mt == "falcon":
        n_kv = (c.get("num_kv_heads") or n_heads) if c.get("new_decoder_architecture") else (1 if c.get("multi_query", True) else n_heads)
    else:
        n_kv = c.get("num_key_value_heads") or n_heads
    hidden = c["hidden_size"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_embedding_length(hidden)
    w.add_context_length(c["max_position_embeddings"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_vocab_size(c["vocab_size"])
    if mt == "falcon":
        w.add_feed_forward_length(4 * hidden)
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
    elif mt == "opt":
        w.add_feed_forward_length(c["ffn_dim"])
        w.add_layer_norm_eps(1e-5)
        w.add_string(f"{arch}.hidden_act", c["activation_function"])
    else:
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        w.add_rope_freq_base(float(rope))
        if c.get("hidden_act", "silu") != "silu":
            w.add_string(f"{arch}.hidden_act", c["hidden_act"])
    sd = model.state_dict()
    for name, t in sd.items():
        gname = _gguf_name(family, name)
        if gname is None:
            continue
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and any(f"self_attn.{x}_proj" in name for x in "qk"):
            a = _permute_qk(a, n_heads if ".q_proj" in name else n_kv)
        if mt == "falcon" and "query_key_value" in name and c.get("new_decoder_architecture"):
            a = _falcon_qkv_contiguous(a, n_heads, n_kv, hidden // n_heads)
        _add_tensor(w, gname, a, qtype if a.ndim == 2 else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _falcon_qkv_contiguous(a: np.ndarray, n_heads: int, n_kv: int, d: int) -> np.ndarray:
    g = n_heads // n_kv
    x = a.reshape(n_kv, g + 2, d, *a.shape[1:])
    q = x[:, :g].reshape(n_heads * d, *a.shape[1:])
    k = x[:, g].reshape(n_kv * d, *a.shape[1:])
    v = x[:, g + 1].reshape(n_kv * d, *a.shape[1:])
    return np.concatenate([q, k, v], axis=0)


def _add_tensor(w, name: str, a: np.ndarray, qtype: str) -> None:
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == "F16":
        w.add_tensor(name, a.astype(np.float16))
    else:
        q = gguf.quants.quantize(a.astype(np.float32), qt)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)


def dequantized_reference(model, gguf_path: Path):
    """The transformers model with every weight replaced by the GGUF file's dequantized value
    (the exact function a quantized file computes), via the gguf package's own dequantizer."""
    import copy

    from sparseinfer.io.weights import GGUFSource

    src = GGUFSource(gguf_path)
    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if not src.has(name):
                continue
            x = src.tensor(name)  # gguf.quants.dequantize + undo the converter's permutations
            if ref.config.model_type == "falcon" and "query_key_value" in name and ref.config.new_decoder_architecture:
                x = torch.from_numpy(_falcon_qkv_grouped(x.numpy(), ref.config))
            t.copy_(x.view_as(t))
        if getattr(ref.config, "tie_word_embeddings", False):
            ref.tie_weights()
    return ref


def _falcon_qkv_grouped(a: np.ndarray, cfg) -> np.ndarray:
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_kv_heads
    d = cfg.hidden_size // n_heads
    g = n_heads // n_kv
    q = a[: n_heads * d].reshape(n_kv, g, d, *a.shape[1:])
    k = a[n_heads * d : (n_heads + n_kv) * d].reshape(n_kv, 1, d, *a.shape[1:])
    v = a[(n_heads + n_kv) * d :].reshape(n_kv, 1, d, *a.shape[1:])
    return np.concatenate([q, k, v], axis=1).reshape(a.shape)
