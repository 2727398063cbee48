"""Weight sources: one interface over GGUF files and Hugging Face safetensors folders.

Model files ask for tensors by their Hugging Face names; the GGUF source translates names in
one place (`NAME_MAP`) and undoes llama.cpp's converter-side rewrites (the Q/K row permutation
of `llama` GGUFs) and PowerInfer's (its transposed down projections: `io.powerinfer`).
Matrices come back as `QWeight`s in their stored format.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..config import ModelConfig, config_from_gguf
from ..errors import ModelFormatError
from ..quant import Q4K_BYTES, QWeight, from_float
from . import gguf as gguf_io
from . import powerinfer

L = r"(\d+)"
# (Hugging Face name regex, GGUF name template) per family; `\1` is the layer index.
NAME_MAP: dict[str, list[tuple[str, str]]] = {
    "llama": [
        (r"model\.embed_tokens\.weight", "token_embd.weight"),
        (r"model\.norm\.weight", "output_norm.weight"),
        (r"lm_head\.weight", "output.weight"),
        (rf"model\.layers\.{L}\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
        (rf"model\.layers\.{L}\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
        (rf"model\.layers\.{L}\.self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
        (rf"model\.layers\.{L}\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
        (rf"model\.layers\.{L}\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"blk.\1.ffn_\2.\3"),
    ],
    "falcon": [
        (r"transformer\.word_embeddings\.weight", "token_embd.weight"),
        (r"transformer\.ln_f\.(weight|bias)", r"output_norm.\1"),
        (r"lm_head\.weight", "output.weight"),
        # one norm per block (7B): input_layernorm; two (40B/180B): llama.cpp's converter names
        # ln_mlp (the MLP's norm) attn_norm and ln_attn (the attention's) attn_norm_2
        (rf"transformer\.h\.{L}\.(?:input_layernorm|ln_mlp)\.(weight|bias)", r"blk.\1.attn_norm.\2"),
        (rf"transformer\.h\.{L}\.ln_attn\.(weight|bias)", r"blk.\1.attn_norm_2.\2"),
        (rf"transformer\.h\.{L}\.self_attention\.query_key_value\.(weight|bias)", r"blk.\1.attn_qkv.\2"),
        (rf"transformer\.h\.{L}\.self_attention\.dense\.(weight|bias)", r"blk.\1.attn_output.\2"),
        (rf"transformer\.h\.{L}\.mlp\.dense_h_to_4h\.(weight|bias)", r"blk.\1.ffn_up.\2"),
        (rf"transformer\.h\.{L}\.mlp\.dense_4h_to_h\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    ],
    "opt": [
        (r"model\.decoder\.embed_tokens\.weight", "token_embd.weight"),
        (r"model\.decoder\.embed_positions\.weight", "position_embd.weight"),
        (r"model\.decoder\.final_layer_norm\.(weight|bias)", r"output_norm.\1"),
        (r"lm_head\.weight", "output.weight"),
        (rf"model\.decoder\.layers\.{L}\.self_attn_layer_norm\.(weight|bias)", r"blk.\1.attn_norm.\2"),
        (rf"model\.decoder\.layers\.{L}\.self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
        (rf"model\.decoder\.layers\.{L}\.self_attn\.out_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
        (rf"model\.decoder\.layers\.{L}\.final_layer_norm\.(weight|bias)", r"blk.\1.ffn_norm.\2"),
        (rf"model\.decoder\.layers\.{L}\.fc1\.(weight|bias)", r"blk.\1.ffn_up.\2"),
        (rf"model\.decoder\.layers\.{L}\.fc2\.(weight|bias)", r"blk.\1.ffn_down.\2"),
    ],
}


def _located(path: Path, make, *args):
    """make(*args), its ModelFormatError (a config problem) prefixed with the file it is in."""
    try:
        return make(*args)
    except ModelFormatError as e:
        raise type(e)(f"{path}: {e}") from None


def hf_to_gguf_name(family: str, name: str) -> str | None:
    for pat, tmpl in NAME_MAP[family]:
        m = re.fullmatch(pat, name)
        if m:
            return m.expand(tmpl)
    return None


def llama_qk_unpermute_index(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved rope -> rotate-half).

    The converter stores row (h, i, j) of the GGUF tensor from HF row (h, j, i), i < d/2, j < 2."""
    d = n_rows // n_heads
    p = torch.arange(n_rows).view(n_heads, d // 2, 2)
    return p.transpose(1, 2).reshape(-1)


class WeightSource:
    """Tensors of one model by Hugging Face name. Subclasses: GGUFSource, SafetensorsSource."""

    config: ModelConfig
    path: Path
    falcon_qkv_grouped = False  # HF Falcon new-arch stores qkv interleaved per KV group
    check_tensors = False  # `qweight` / `tensor` refuse weights holding NaN or infinities
    on_read = None  # called with no arguments after each tensor is read (load progress)

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape (rows first, as torch), read from the file's index."""
        raise NotImplementedError

    def file_name(self, name: str) -> str:
        """The name the file gives tensor `name` (for messages)."""
        return name

    def check_readable(self, name: str) -> None:
        """Raise a ModelFormatError when tensor `name`'s data type cannot be read."""

    def qweight(self, name: str) -> QWeight:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def maybe_tensor(self, name: str) -> torch.Tensor | None:
        return self.tensor(name) if self.has(name) else None

    def _checked(self, name: str, x):
        """x (a float tensor or a QWeight, as the model will compute with it), checked for NaN
        and infinities when `check_tensors` is set; for 4/8-bit formats those can only be in
        the block scales (the codes are integers)."""
        if self.on_read is not None:
            self.on_read()
        if not self.check_tensors:
            return x
        if isinstance(x, torch.Tensor):
            parts, what = [x], "values"
        elif x.qs.is_floating_point():
            parts, what = [x.qs], "values"
        elif x.fmt == "q4k":  # each super-block's f16 d and dmin
            parts, what = [x.qs.reshape(x.rows, -1, Q4K_BYTES)[..., :4].contiguous().view(torch.float16)], "block scales"
        else:
            parts, what = [t for t in (x.d, x.m) if t is not None], "block scales"
        bad = sum(int((~torch.isfinite(t)).sum()) for t in parts)
        if bad:
            raise ModelFormatError(f"{self.path}: tensor {self.file_name(name)} has {bad:,} NaN or infinite {what}; "
                                   "the file is damaged: re-download or re-convert it")
        return x

    def prefetch(self, groups: list | None = None) -> None:
        """Start preparing the model's matrices ahead of `qweight` (GGUF: worker threads).
        `groups`: [(names, alloc)]: each group's tensors (one block type and width, one tensor
        or several) converted straight into one buffer of all their rows that
        `alloc(part, total_rows)` gives (see `io.gguf.tensor_to_qweight`), instead of
        converting, then copying; `qweight` then gives row views of it, in order."""

    def release_pages(self) -> None:
        """Drop the pages of the file this process mapped while loading (a no-op by default)."""

    def end_prefetch(self) -> None:
        """Stop `prefetch` and drop what the builder did not ask for."""

    def fingerprint(self) -> str:
        raise NotImplementedError

    def n_tensors(self) -> int:
        """How many tensors the file holds (the length of a load's progress)."""
        raise NotImplementedError


class _Group:
    """Tensors converted into one buffer (`GGUFSource.prefetch`'s groups)."""

    def __init__(self, names: list[str], alloc):
        self.names, self.alloc, self.done = names, alloc, None


def _row_slice(w: QWeight, r0: int, r1: int) -> QWeight:
    cut = lambda t: None if t is None else t[r0:r1]  # noqa: E731
    return QWeight(w.fmt, r1 - r0, w.cols, cut(w.qs), cut(w.d), cut(w.m))


class GGUFSource(WeightSource):
    """A GGUF file, or PowerInfer's variant of one (`powerinfer`: its down projections are
    stored transposed and given back in the usual layout; its predictors are `file_tensor`s)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = gguf_io.open_reader(self.path)
        self.metadata = gguf_io.read_metadata(self.reader)
        self.powerinfer = self.reader.powerinfer
        if self.powerinfer:
            pos = next((t for t in self.reader.tensors if t.name == "position_embd.weight"), None)
            rows = gguf_io.logical_shape(pos)[0] if pos is not None and len(gguf_io.logical_shape(pos)) == 2 else None
            meta = powerinfer.config_metadata(self.metadata, self.path, rows)
        else:
            meta = self.metadata
        self.config = _located(self.path, config_from_gguf, meta)
        self.family = self.config.family
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._pool = None
        self._futures: dict = {}
        self._groups: dict = {}

    def prefetch(self, groups: list | None = None, workers: int | None = None) -> None:
        """Convert every matrix of the file on worker threads (numpy and torch release the GIL
        in the conversions), so `qweight` finds most of them done."""
        if self._pool is not None:
            return
        self._groups = {}
        for names, alloc in groups or []:
            ts = [self._find(n) for n in names]
            if self._groupable(names, ts):
                g = _Group([t.name for t in ts], alloc)
                self._groups.update({t.name: g for t in ts})
        from concurrent.futures import ThreadPoolExecutor

        workers = workers or min(4, os.cpu_count() or 1)
        if workers < 2:
            return
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sparseinfer-load")
        self._futures = {}
        for t in self.reader.tensors:
            g = self._groups.get(t.name)
            if g is not None:
                if t.name == g.names[0]:
                    fut = self._pool.submit(self._convert_group, g)
                    self._futures.update({n: (fut, i) for i, n in enumerate(g.names)})
            elif len(t.shape) >= 2 and not (self.powerinfer and _NOT_PREFETCHED.search(t.name)):
                convert = self._convert_transposed if self.powerinfer and _TRANSPOSED.search(t.name) else self._convert
                self._futures[t.name] = (self._pool.submit(convert, t), None)

    def _groupable(self, names: list[str], ts: list) -> bool:
        """Whether tensors `ts` can share one buffer: present, one block type and width, no
        row permutation after conversion (llama-arch q/k)."""
        if any(t is None for t in ts) or any(self._unpermute(n) or self._transposed(n) for n in names):
            return False
        t0 = ts[0]
        return (t0.tensor_type.name in gguf_io.BLOCK_TYPES and all(len(t.shape) == 2 for t in ts)
                and all(t.tensor_type == t0.tensor_type and int(t.shape[0]) == int(t0.shape[0]) for t in ts))

    def _convert_group(self, g: "_Group") -> list[QWeight]:
        """A group's tensors converted into one buffer (`g.alloc` of all their rows), as row
        views in order; plain conversions when `g.alloc` declines."""
        ts = [self._tensors[n] for n in g.names]
        total = sum(int(t.shape[1]) for t in ts)
        state = {"buf": None, "r0": 0}

        def alloc(part: QWeight, rows: int) -> QWeight | None:
            if state["buf"] is None:
                state["buf"] = g.alloc(part, total) or False
            buf, r0 = state["buf"], state["r0"]
            return _row_slice(buf, r0, r0 + rows) if buf else None

        out = []
        for t in ts:
            out.append(gguf_io.tensor_to_qweight(t, alloc=alloc))
            state["r0"] += int(t.shape[1])
            t.release()
        return out

    def _convert(self, t):
        """The tensor in our format; the file's pages of it leave this process's memory (our
        formats are copies, so the file and the copy are not both resident)."""
        w = gguf_io.tensor_to_qweight(t)
        t.release()
        return w

    def _convert_transposed(self, t):
        """`_convert` of a matrix the file stores transposed (`_transposed_qweight`)."""
        w = _transposed_qweight(t)
        t.release()
        return w

    def release_pages(self) -> None:
        """Unmap every page of the file this process has read (header, vocabulary, tensors)."""
        gguf_io.release_pages(self.reader._mm)

    def end_prefetch(self) -> None:
        if self._pool is None:
            return
        for f, _ in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)
        self._pool, self._futures = None, {}

    def _gguf_name(self, name: str) -> str | None:
        gname = hf_to_gguf_name(self.family, name)
        if gname is not None and self.powerinfer:
            gname = gname.replace(".ffn_down.", ".ffn_down_t.")
        return gname

    def _find(self, name: str):
        gname = self._gguf_name(name)
        return None if gname is None else self._tensors.get(gname)

    def _transposed(self, name: str) -> bool:
        """Whether the file stores this matrix transposed (PowerInfer's down projections)."""
        return self.powerinfer and bool(_TRANSPOSED.search(self._gguf_name(name) or ""))

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        shape = gguf_io.logical_shape(self._get(name))
        return tuple(reversed(shape)) if self._transposed(name) else shape

    def file_name(self, name: str) -> str:
        return self._gguf_name(name) or name

    def file_tensor(self, gguf_name: str) -> torch.Tensor | None:
        """A tensor by the file's own name (PowerInfer's predictors) as float32, or None when the
        file has none of that name."""
        t = self._tensors.get(gguf_name)
        if t is None:
            return None
        if t.tensor_type.name not in gguf_io.SUPPORTED_TYPES:
            raise gguf_io.UnsupportedTensorType(t.name, t.tensor_type.name)
        return self._checked(gguf_name, gguf_io.tensor_to_float(t))

    def file_tensor_info(self, gguf_name: str):
        """A tensor's info (`io.gguf.GGUFTensor`: name, type, ggml shape, bytes) by the file's
        own name, or None."""
        return self._tensors.get(gguf_name)

    def check_readable(self, name: str) -> None:
        t = self._get(name)
        if t.tensor_type.name not in gguf_io.SUPPORTED_TYPES:
            raise gguf_io.UnsupportedTensorType(t.name, t.tensor_type.name)

    def _get(self, name: str):
        t = self._find(name)
        if t is None:
            raise ModelFormatError(
                f"{self.path}: tensor {self._gguf_name(name) or name!r} is missing "
                f"(needed for {name}); the file is incomplete or not a {self.config.model_type} model"
            )
        return t

    def _unpermute(self, name: str):
        """Row index undoing the Q/K permutation for llama-arch GGUFs, else None."""
        if self.config.model_type != "llama":
            return None
        m = re.search(r"self_attn\.([qk])_proj\.(weight|bias)$", name)
        if not m:
            return None
        heads = self.config.num_attention_heads if m.group(1) == "q" else self.config.n_kv_heads
        return heads

    def qweight(self, name: str) -> QWeight:
        t = self._get(name)
        fut, i = self._futures.pop(t.name, (None, None))
        if self._transposed(name):
            return self._checked(name, fut.result() if fut is not None else self._convert_transposed(t))
        if fut is not None:
            w = fut.result() if i is None else fut.result()[i]
        elif t.name in self._groups:  # no workers: the group's conversion, once
            g = self._groups[t.name]
            if g.done is None:
                g.done = self._convert_group(g)
            w = g.done[g.names.index(t.name)]
        else:
            w = self._convert(t)
        heads = self._unpermute(name)
        if heads:
            w = w.select_rows(llama_qk_unpermute_index(w.rows, heads))
        return self._checked(name, w)

    def tensor(self, name: str) -> torch.Tensor:
        t = self._get(name)
        x = gguf_io.tensor_to_float(t)
        if self._transposed(name):
            x = x.T.contiguous()
        heads = self._unpermute(name)
        if heads:
            x = x[llama_qk_unpermute_index(x.shape[0], heads)]
        return self._checked(name, x)

    def n_tensors(self) -> int:
        return len(self.reader.tensors)

    def fingerprint(self) -> str:
        return _fingerprint(self.path, [(t.name, t.tensor_type.name, tuple(int(s) for s in t.shape)) for t in self.reader.tensors])


# PowerInfer's transposed down projections (`_transposed_qweight`), and its predictors, which
# `prefetch` leaves alone (the sparsity code reads them)
_TRANSPOSED = re.compile(r"\.ffn_down_t\.weight$")
_NOT_PREFETCHED = re.compile(r"\.fc[12]\.weight$")


def _transposed_qweight(t) -> QWeight:
    """A matrix stored transposed, in the usual layout: float types exactly (the same type),
    block types re-quantized to q8 (the file's blocks run along the other axis)."""
    x = gguf_io.tensor_to_float(t).T.contiguous()
    return from_float(x, {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(t.tensor_type.name, "q8"))


class SafetensorsSource(WeightSource):
    """A Hugging Face model folder: config.json + *.safetensors (single or sharded with an index)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ModelFormatError(f"{self.path}: no config.json; a Hugging Face model folder needs one")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{cfg}: invalid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ModelFormatError(f"{cfg}: not a JSON object; re-download the model")
        self.config = _located(cfg, ModelConfig.from_dict, d)
        self.family = self.config.family
        self.falcon_qkv_grouped = self.family == "falcon" and bool(self.config.new_decoder_architecture)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{self.path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                wanted = set(json.loads(index.read_text())["weight_map"].values())
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ModelFormatError(f"{index}: not a safetensors index (no weight_map of tensor -> file: "
                                       f"{type(e).__name__}); re-download the model") from e
            if not all(isinstance(f, str) for f in wanted):
                raise ModelFormatError(f"{index}: weight_map values must be file names; re-download the model")
            missing = [f for f in wanted if not (self.path / f).is_file()]
            if missing:
                raise ModelFormatError(f"{self.path}: shard(s) {', '.join(sorted(missing))} listed in the index are missing")
        self._where: dict[str, object] = {}
        self._handles = []
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise ModelFormatError(f"{f}: damaged safetensors file ({e})") from e
            self._handles.append(h)
            for k in h.keys():
                self._where[k] = h

    def _key(self, name: str) -> str | None:
        if name in self._where:
            return name
        if name.startswith("model.") and name[len("model."):] in self._where:  # old OPT checkpoints
            return name[len("model."):]
        return None

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._key(name)
        return tuple(int(s) for s in self._where[key].get_slice(key).get_shape())

    def file_name(self, name: str) -> str:
        return self._key(name) or name

    def check_readable(self, name: str) -> None:
        key = self._key(name)
        dtype = str(self._where[key].get_slice(key).get_dtype())
        if dtype not in _FLOAT_DTYPES:
            raise ModelFormatError(f"{self.path}: tensor {key} has dtype {dtype}; a model's weights must be "
                                   f"{', '.join(_FLOAT_DTYPES)}: the file is damaged or not a supported model")

    def tensor(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            raise ModelFormatError(f"{self.path}: tensor {name!r} is missing from the safetensors files")
        return self._checked(name, self._where[key].get_tensor(key))

    def qweight(self, name: str) -> QWeight:
        t = self.tensor(name)
        fmt = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(t.dtype, "f32")
        return from_float(t, fmt) if fmt == "f32" else QWeight(fmt, t.shape[0], t.shape[1], t.contiguous())

    def n_tensors(self) -> int:
        return len(self._where)

    def fingerprint(self) -> str:
        items = []
        for k, h in sorted(self._where.items(), key=lambda kv: kv[0]):
            sl = h.get_slice(k)
            items.append((k, str(sl.get_dtype()), tuple(sl.get_shape())))
        return _fingerprint(self.path, items)


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _fingerprint(path: Path, tensor_infos: list) -> str:
    """Identity of a model: tensor names/types/shapes plus a hash of the first MiB of its data."""
    import hashlib

    h = hashlib.sha256()
    h.update(repr(sorted(tensor_infos)).encode())
    first = path if path.is_file() else sorted(path.glob("*.safetensors"))[0]
    with open(first, "rb") as f:
        f.seek(max(0, first.stat().st_size // 2))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def open_source(path: str | os.PathLike, check_tensors: bool = False) -> WeightSource:
    """A .gguf file or a Hugging Face folder -> its WeightSource (clear errors otherwise).
    check_tensors: refuse weights holding NaN or infinities as they are read (`_checked`)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        src = SafetensorsSource(p)
    elif not p.exists():
        raise ModelFormatError(f"{p}: no such file or folder; pass a .gguf file or a Hugging Face model folder")
    else:
        src = GGUFSource(p)
    src.check_tensors = check_tensors
    return src
