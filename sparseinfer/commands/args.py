"""What several commands share: the model, sparsity and sampling options, the one way a command
loads a model from them, and where the checkout's sample data lives."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import SparseInferError
from ..kv_cache import CACHE_TYPES, DEFAULT_CACHE_TYPE


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="a .gguf file, a Hugging Face folder or a catalog name (default: smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens (default: min(model, 4096))")
    p.add_argument("--verbose", action="store_true", help="show tracebacks and load details")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees a GPU), cpu or cuda[:N]")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="GPU memory to use: 4GiB, 512MiB, or a number of GiB (default: free memory minus 1 GiB)")
    p.add_argument("--act-mode", default="auto", choices=("auto", "int8", "precise"),
                   help="activation rounding for 4/8-bit weights: int8 (llama.cpp's), precise (two int8 terms, "
                        "~f32; slower decode), auto (precise for models under 256 MiB; default)")
    cache_type_arg(p)
    check_tensors_arg(p)


def cache_type_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-type", default=DEFAULT_CACHE_TYPE, choices=CACHE_TYPES,
                   help="KV cache element type: f16 (default), q8_0 (about half of f16's memory, slightly less "
                        "exact) or f32 (exact, twice f16's memory)")


def check_tensors_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check-tensors", action="store_true",
                   help="scan every weight for NaN and infinite values while loading (slower load)")


def sparse_args(p: argparse.ArgumentParser, density: bool = True) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--dense", action="store_true", help="ignore the sparsity pack next to the model")
    g.add_argument("--sparse", default=None, metavar="PACK", help="use this sparsity pack (default: MODEL.sparse if present)")
    if density:
        p.add_argument("--density", type=float, default=None, metavar="D",
                       help="force the FFN active fraction to D (speed measurement; top-D predicted neurons with a pack)")


def sampling_args(p: argparse.ArgumentParser, temp: float) -> None:
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default {temp:g})")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_kw(a: argparse.Namespace) -> dict:
    """`sampling_args` as keyword arguments of `LLM.stream_generate`."""
    return dict(max_tokens=a.max_tokens, temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n, seed=a.seed, stop=a.stop)


def load_from_args(a: argparse.Namespace, report: bool = True, **overrides):
    """`sparseinfer.load` with a command's options (those it lacks take `load`'s defaults, the
    device "cpu"); `overrides` win.  With --verbose (and `report`), print what was loaded."""
    from ..engine import load

    kw = dict(ctx_size=getattr(a, "ctx_size", None), threads=getattr(a, "threads", None),
              sparse=getattr(a, "sparse", None) or "auto", dense=getattr(a, "dense", False),
              density=getattr(a, "density", None), device=getattr(a, "device", "cpu"),
              vram_budget=getattr(a, "vram_budget", None), act_mode=getattr(a, "act_mode", "auto"),
              check_tensors=getattr(a, "check_tensors", False),
              cache_type=getattr(a, "cache_type", DEFAULT_CACHE_TYPE), progress=True)
    t0 = time.perf_counter()
    llm = load(getattr(a, "model", None), **(kw | overrides))
    for note in llm.notes:
        print(f"note: {note}", file=sys.stderr)
    if report and getattr(a, "verbose", False):
        print(f"loaded {llm.info.path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if llm.sparsity is not None:
            print(f"sparsity pack: {llm.sparsity.path}", file=sys.stderr)
        if llm.placement is not None:
            print(llm.placement.describe(), file=sys.stderr)
    return llm


def build_from_args(a: argparse.Namespace, sparse: str | None = "auto"):
    """The CPU model of `a.model` without tokenizer, threads or placement (what planning and
    sizing need; a model file without a tokenizer still plans): (path, source, model, pack),
    `pack` the sparsity pack applied (`sparse`: "auto", a path, or None for dense)."""
    import torch

    from .. import catalog
    from ..io.weights import open_source
    from ..models.registry import build_model
    from ..sparse.apply import apply_sparsity

    path = catalog.resolve(getattr(a, "model", None))
    src = open_source(path)
    with torch.inference_mode():
        model = build_model(src)
        notes: list[str] = []
        pack = None if sparse is None else apply_sparsity(model, path, src, sparse, notes=notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return path, src, model, pack


def repo_data(*rel: str, flag: str) -> Path:
    """`shared/data/<rel>` of the git checkout this package runs from (in the checkout or next
    to it): the CLI's default texts.  An installed package has none: ask for `flag`."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():  # a source checkout, not site-packages
        for base in (root, root.parent):
            data = base / "shared" / "data"
            if data.is_dir():
                return data.joinpath(*rel)
    raise SparseInferError(f"no default data (shared/data next to the source checkout); pass {flag}")
