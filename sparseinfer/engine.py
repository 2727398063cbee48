"""`LLM`: a loaded model + tokenizer + settings, and the functions the Python API exposes."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from . import catalog
from .config import ModelConfig
from .errors import ContextOverflowError, ModelFormatError, SparseInferError
from .generate import (GenerationResponse, make_sampler, presence_frequency_penalty, repetition_penalty,
                       stream_generate as _stream)
from .io.weights import WeightSource, open_source
from .kv_cache import DEFAULT_CACHE_TYPE, check_cache_type
from .models.base import CausalLM
from .models.registry import build_model, check_shapes, prefetch, tile_weights


@dataclass
class LoadInfo:
    path: Path
    seconds: float
    fingerprint: str


class LLM:
    """A model ready to generate. Make one with `sparseinfer.load(path)`.

    sparsity: the `SparsityPack` the model runs with, or None (dense); placement: the
    `Placement` of its parts on an accelerator, or None (all on the CPU); notes: one-line
    remarks about the load (e.g. a pack found but not used because it measured slower here)."""

    def __init__(self, model: CausalLM, tokenizer, source: WeightSource, ctx_size: int | None, info: LoadInfo,
                 sparsity=None, placement=None):
        self.model, self.tokenizer, self.source, self.info = model, tokenizer, source, info
        self.sparsity, self.placement = sparsity, placement
        self.notes: list[str] = []  # what the load decided that a user should know (e.g. a pack left unused)
        limit = model.config.max_position_embeddings
        self.ctx_size = min(ctx_size, limit) if ctx_size else min(limit, 4096)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def cache_type(self) -> str:
        """The KV cache type of new caches: "f32", "f16" or "q8_0" (`sparseinfer.kv_cache`)."""
        return self.model.cache_type

    def new_cache(self, max_len: int | None = None):
        """A KV cache of `cache_type` for `max_len` tokens (default: the context size)."""
        return self.model.new_cache(max_len or self.ctx_size, self.cache_type)

    # -- prompts
    def format_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    time_limit: float | None = None) -> str:
        """The conversation rendered with the model's chat template; `time_limit` (seconds) stops a
        template that runs longer (`ChatTemplateTimeout`)."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  time_limit=time_limit)

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat and self.tokenizer.chat_template:
            return self.encode_chat_text(self.format_chat([{"role": "user", "content": prompt}]))
        return self.tokenizer.encode(prompt)

    def encode_chat_text(self, text: str) -> list[int]:
        """Tokens of a rendered chat template; no second BOS when the template wrote one."""
        bos = self.tokenizer.bos_id
        has_bos = bos is not None and text.startswith(self.tokenizer.token_to_piece(bos))
        return self.tokenizer.encode(text, add_bos=False if has_bos else None)

    def check_fits(self, n_prompt: int, max_tokens: int = 0) -> None:
        if n_prompt + 1 > self.ctx_size:
            raise ContextOverflowError(
                f"prompt is {n_prompt} tokens but the context size is {self.ctx_size}; "
                "raise -c/--ctx-size (model maximum "
                f"{self.config.max_position_embeddings}) or shorten the prompt"
            )

    # -- generation
    def stream_generate(self, prompt: str | Sequence[int], max_tokens: int = 256, temp: float = 0.0,
                        top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                        repeat_last_n: int = 64, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                        seed: int | None = None, stop: Sequence[str] = (), chat: bool = False
                        ) -> Iterator[GenerationResponse]:
        """Stream a completion. `chat=True` wraps a string prompt in the model's chat template."""
        ids = self.encode_prompt(prompt, chat=chat)
        if not ids:
            raise SparseInferError("empty prompt: give at least one token of text")
        self.check_fits(len(ids), max_tokens)
        max_tokens = min(max_tokens, self.ctx_size - len(ids))
        procs = [repetition_penalty(repeat_penalty, repeat_last_n)] if repeat_penalty != 1.0 else []
        gen_procs = [presence_frequency_penalty(presence_penalty, frequency_penalty)] if (presence_penalty or frequency_penalty) else []
        sampler = make_sampler(temp, top_k, top_p, min_p, seed)
        yield from _stream(self.model, self.tokenizer, ids, max_tokens, sampler, procs, stop, self.new_cache(), gen_procs)

    def generate(self, prompt: str | Sequence[int], **kw) -> str:
        """The whole completion as a string (same arguments as `stream_generate`)."""
        return "".join(r.text for r in self.stream_generate(prompt, **kw))

    def chat(self, messages: Sequence[dict], **kw) -> Iterator[GenerationResponse]:
        """Stream a reply to a list of {"role", "content"} messages."""
        return self.stream_generate(self.encode_chat_text(self.format_chat(messages)), **kw)


def load(path: str | os.PathLike | None = None, ctx_size: int | None = None, threads: int | None = None,
         sparse: str | os.PathLike | None = "auto", dense: bool = False, density: float | None = None,
         device: str | None = "cpu", vram_budget: str | float | None = None, n_seq: int = 1,
         act_mode: str = "auto", check_tensors: bool = False, cache_type: str = DEFAULT_CACHE_TYPE,
         progress: bool = False) -> LLM:
    """Load a GGUF file, a Hugging Face folder or a catalog name (default: SmolLM2-135M-Instruct).

    sparse: "auto" uses the sparsity pack next to the model when there is one (`sparseinfer
    prepare`; for a PowerInfer file without one, its own predictors), a path names a pack, None/`dense=True` keeps the dense model.  density: force the
    FFN active fraction (speed measurements; see `sparseinfer.sparse.ffn`).  device: "cpu"
    (default: the library never takes a GPU unasked; the CLI's default is "auto"), "auto" (CUDA
    when torch sees a GPU) or "cuda[:N]"; vram_budget: GPU memory to use ("4GiB", "512MiB", a
    number of GiB; default free memory minus a margin), see `sparseinfer.hybrid`; n_seq: sequences
    alive at once (the server's slots), each with its own KV cache on the GPU; act_mode: how the
    CPU kernels round activations for 4/8-bit weights, see `set_act_mode`; check_tensors: scan
    every weight for NaN and infinities as it is read (a damaged file is an error, not garbage
    output).  Every tensor's shape is checked against the config either way.  cache_type: the
    KV cache's element type, "f16" (default), "q8_0" (about half of f16's bytes, a slightly
    larger error) or "f32" (exact, twice f16's bytes); see `sparseinfer.kv_cache`.  progress: show a
    progress bar of the tensors read on stderr (when it is a terminal and the load takes more
    than half a second)."""
    _check_act_mode(act_mode)  # before the load, which can take a while
    check_cache_type(cache_type)
    n_threads = threads or os.cpu_count() or 1
    set_threads(n_threads)
    t0 = time.perf_counter()
    p = catalog.resolve(None if path is None else str(path))
    _loading_heap()
    src = open_source(p, check_tensors=check_tensors)
    check_shapes(src)  # the model's problems before the tokenizer's
    prefetch(src)  # the matrices' conversion (worker threads) overlaps the tokenizer's build
    try:
        tok = _tokenizer(src)  # before the weights: a file's problems show before the long part
    except BaseException:
        src.end_prefetch()
        raise
    # torch's whole-matrix copies at load (fusing, permuting, transposing down projections)
    # run on every thread; decode then keeps torch at one (see `set_threads`)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    bar = _progress_bar(src, p) if progress else None
    try:
        with torch.inference_mode():
            model = build_model(src, checked=True)
        if bar is not None:
            bar.close()
            bar = src.on_read = None
        src.release_pages()  # the weights are copies in our formats: the file's pages need not stay mapped
        set_act_mode(act_mode, model)
        model.cache_type = cache_type
        pack, notes = None, []
        if not dense or density is not None:
            from .sparse.apply import apply_sparsity

            with torch.inference_mode():
                pack = apply_sparsity(model, p, src, None if dense else sparse, density, notes)
    finally:
        torch.set_num_threads(torch_threads)
        if bar is not None:
            bar.close()
    info = LoadInfo(p, time.perf_counter() - t0, src.fingerprint())
    llm = LLM(model, tok, src, ctx_size, info, sparsity=pack)
    llm.notes = notes
    from .hybrid import prepare as place_on_device

    with torch.inference_mode():
        llm.model, llm.placement = place_on_device(model, device, vram_budget, llm.ctx_size, pack, info.fingerprint,
                                                   n_seq=n_seq, cache_type=cache_type)
        tile_weights(llm.model)  # where row tiles pay: after the pack and the placement took their rows
        llm.model.build_steps()  # the decode plans, checked now rather than at the first token
    _settle_heap()
    return llm


def _progress_bar(src: WeightSource, path):
    """A tqdm bar over the tensors of `src`, advanced by its `on_read`."""
    from tqdm import tqdm

    bar = tqdm(total=src.n_tensors(), desc=f"loading {Path(path).name}", unit="tensor", delay=0.5,
               disable=None, leave=False)
    src.on_read = lambda: bar.update(1) if bar.n < bar.total else None
    return bar


def _glibc():
    """glibc's allocator controls, or None (another OS or C library, or the user set them)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ \
            or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _loading_heap() -> None:
    """While loading (glibc): allocations of 64 KB and more get their own mappings, so a
    temporary of a weight's size (repacking, permuted copies, neuron records; a small model's
    matrices are a few hundred KB) goes back to the OS when freed.  glibc's default threshold
    rises to the size of the largest block freed, after which such temporaries are carved from the heap and stay resident until the end of the load
    (on the loader threads' arenas too), raising the peak by several of them."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)


def _tokenizer(src: WeightSource):
    """The tokenizer of a GGUF file's metadata or a folder's tokenizer files.  A GGUF's token
    ids must all have embedding rows (llama.cpp's converter writes one row per token)."""
    from .io.tokenizer import Tokenizer

    if not hasattr(src, "metadata"):
        return Tokenizer.from_folder(src.path)
    tok = Tokenizer.from_gguf_metadata(src.metadata)
    if tok.vocab_size > src.config.vocab_size:
        raise ModelFormatError(
            f"{src.path}: the tokenizer has {tok.vocab_size} tokens but the model only {src.config.vocab_size} "
            "(embedding rows); the file is damaged or its tokenizer belongs to another model")
    return tok


def _settle_heap() -> None:
    """After loading (glibc; no-op elsewhere):
    - hand the heap's free pages back to the OS: loading makes and drops many weight-sized
      temporaries (repacking, permuted copies, neuron records), which would otherwise stay
      resident;
    - then serve allocations under 64 MB from the heap and let up to 128 MB of freed heap stay
      mapped: a prefill makes and frees tens of MB of activations per layer, and with glibc's
      defaults each was a fresh mmap whose pages faulted in again (slower prefill, same peak
      RSS; compare with `sparseinfer bench`).
      $MALLOC_MMAP_THRESHOLD_ / $MALLOC_TRIM_THRESHOLD_, when set, win."""
    libc = _glibc()
    if libc is None:
        return
    libc.malloc_trim(0)
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 128 << 20)


def set_threads(n: int) -> None:
    """Threads for our CPU kernels (the weight products).

    torch keeps one thread when the C kernels are available: its OpenMP workers spin after
    every small op (norms, rope, attention) and fight the kernel threads for the cores, which
    costs decode speed most when the cores are few."""
    if n < 1:
        raise SparseInferError(f"threads must be >= 1 (got {n})")
    from .kernels import cpu

    cpu.set_num_threads(n)
    torch.set_num_threads(1 if cpu.available() else n)


# "auto" picks "precise" for models under this many weight bytes: their decode is bound by
# per-token work outside the weight products, so the second activation term costs them a
# smaller share of decode time than it costs bandwidth-bound models.  A tuned boundary:
# compare `sparseinfer bench --act-mode int8` with `--act-mode precise` on small and larger
# models.
AUTO_PRECISE_MAX_BYTES = 256 << 20
ACT_MODES = ("auto", "int8", "precise")


def _check_act_mode(mode: str) -> None:
    if mode not in ACT_MODES:
        raise SparseInferError(f"act_mode must be one of {', '.join(ACT_MODES)} (got {mode!r})")


def set_act_mode(mode: str, model: torch.nn.Module | None = None) -> str:
    """How the CPU kernels round activations for 4/8-bit weights (process-wide); returns the
    mode in effect.  "int8": one int8 term per block of 32, llama.cpp's Q8 activations
    (teacher-forced KL to the f32 model on par with llama.cpp's; figures in docs/performance.md);
    "precise": a second int8 term for the rounding residual (about f32 accuracy, slower
    decode); "auto": $SPARSEINFER_ACT_MODE when set, else "precise" for models under
    AUTO_PRECISE_MAX_BYTES of weights and "int8" above."""
    from .quant import qweight_nbytes
    from .kernels import cpu

    _check_act_mode(mode)
    if mode == "auto":
        env = os.environ.get("SPARSEINFER_ACT_MODE")
        if env:
            if env not in cpu.ACTIVATION_MODES:
                raise SparseInferError(f"SPARSEINFER_ACT_MODE must be int8 or precise (got {env!r})")
            mode = env
        else:
            small = model is not None and qweight_nbytes(model) < AUTO_PRECISE_MAX_BYTES
            mode = "precise" if small else "int8"
    cpu.set_activation_mode(mode)
    return mode


def generate(llm: LLM, prompt: str | Sequence[int], **kw) -> str:
    return llm.generate(prompt, **kw)


def stream_generate(llm: LLM, prompt: str | Sequence[int], **kw) -> Iterator[GenerationResponse]:
    return llm.stream_generate(prompt, **kw)
