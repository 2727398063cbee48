"""`sparseinfer serve` (also `python -m sparseinfer.server`): OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import SparseInferError
from .args import check_tensors_arg, load_from_args, sparse_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="a .gguf file, a Hugging Face folder or a catalog name (default: smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens, per sequence (default: min(model, 4096))")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("SPARSEINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPARSEINFER_API_KEY)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="sequences decoded together, round-robin, each with its own KV cache (default: 1)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (default: 64)")
    p.add_argument("--alias", default=None, help="model id to report (default: the model file's name)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:N]: where hot neurons and attention run")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="accelerator memory to use, e.g. 4GiB, 512MiB, or a number of GiB (default: free memory minus a margin)")
    sparse_args(p, density=False)
    p.add_argument("--act-mode", default="auto", choices=("auto", "int8", "precise"),
                   help="activation rounding for 4/8-bit weights (see `sparseinfer run --help`)")
    check_tensors_arg(p)
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug logs")


def add_parser(subparsers):
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page at /")
    add_arguments(p)
    return p


def run(a: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    from ..server.serve import require_extras, serve

    require_extras()
    if a.parallel < 1:
        raise SparseInferError(f"--parallel must be >= 1 (got {a.parallel})")
    from ..server.app import Settings

    t0 = time.perf_counter()
    llm = load_from_args(a, report=False, n_seq=a.parallel)
    settings = Settings.for_model(llm, a.model, a.alias, a.api_key)
    print(f"loaded {settings.model_id} ({llm.info.path}) in {time.perf_counter() - t0:.1f}s; "
          f"{a.parallel} slot(s) x {llm.ctx_size} tokens", file=sys.stderr)
    serve(llm, settings, host=a.host, port=a.port, parallel=a.parallel, max_queue=a.max_queue,
          log_level="debug" if a.verbose else "info")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparseinfer.server ...`: the same as `sparseinfer serve ...`."""
    from . import guarded

    ap = argparse.ArgumentParser(prog="python -m sparseinfer.server", description="sparseinfer OpenAI-compatible server")
    add_arguments(ap)
    return guarded(run, ap.parse_args(argv))
