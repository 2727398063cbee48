"""What a model file holds, without building the model (`sparseinfer inspect`)."""
from __future__ import annotations

from collections import Counter

from . import catalog
from .io.weights import GGUFSource, WeightSource, open_source
from .models.registry import check_shapes, tensor_shapes


def describe(model: str | None, check_tensors: bool = False) -> str:
    """What the model file holds; its tensors' shapes are checked against its config (an error
    names the first that does not fit), with `check_tensors` also their values (NaN, Inf)."""
    path = catalog.resolve(model)
    src = open_source(path, check_tensors=check_tensors)
    check_shapes(src)
    c = src.config
    lines = [
        f"model:        {path}",
        f"architecture: {c.model_type} (family {c.family})",
        f"layers:       {c.num_hidden_layers}   hidden: {c.hidden_size}   ffn: {c.intermediate_size}   act: {c.hidden_act}",
        f"heads:        {c.num_attention_heads} (kv {c.n_kv_heads}, head dim {c.d_head})   context: {c.max_position_embeddings}",
        f"vocab:        {c.vocab_size}   tied embeddings: {not src.has('lm_head.weight')}",
    ]
    if isinstance(src, GGUFSource):
        types = Counter(t.tensor_type.name for t in src.reader.tensors)
        n_params = sum(int(t.n_elements) for t in src.reader.tensors)
        n_bytes = sum(int(t.n_bytes) for t in src.reader.tensors)
        meta = src.metadata
        lines += [
            f"parameters:   {n_params / 1e6:.1f} M   tensor bytes: {n_bytes / 2**20:.1f} MiB ({8 * n_bytes / max(n_params, 1):.2f} bits/weight)",
            f"tensor types: {', '.join(f'{k} x{v}' for k, v in types.most_common())}",
            f"tokenizer:    {meta.get('tokenizer.ggml.model', 'none')} (pre: {meta.get('tokenizer.ggml.pre', '-')}), "
            f"{len(meta.get('tokenizer.ggml.tokens', []))} tokens",
            f"chat template: {'yes' if meta.get('tokenizer.chat_template') else 'no'}",
        ]
        if src.powerinfer:
            from .sparse import powerinfer

            lines += powerinfer.describe(src)
    else:
        import json

        tj = src.path / "tokenizer_config.json"
        has_tmpl = tj.is_file() and "chat_template" in json.loads(tj.read_text())
        has_tmpl = has_tmpl or (src.path / "chat_template.jinja").is_file()
        lines += [
            f"tokenizer:    {'tokenizer.json' if (src.path / 'tokenizer.json').is_file() else 'missing'}",
            f"chat template: {'yes' if has_tmpl else 'no'}",
        ]
    if check_tensors:
        lines.append(f"tensor check: {_scan(src)} tensors read, no NaN or infinite values")
    return "\n".join(lines)


def _scan(src: WeightSource) -> int:
    """Read every tensor the model uses as loading would (`src.check_tensors` raises on NaN
    or infinities); how many were read."""
    n = 0
    for name, shape, _ in tensor_shapes(src):
        if src.has(name):
            src.qweight(name) if len(shape) == 2 else src.tensor(name)
            n += 1
    return n
