"""`sparseinfer serve`: argparse options and the function that runs the server."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import time

from ..errors import SparseInferError


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--dense", action="store_true", help="ignore the sparsity pack next to the model")
    g.add_argument("--sparse", default=None, metavar="PACK", help="use this sparsity pack (default: MODEL.sparse if present)")
    p.add_argument("--act-mode", default="auto", choices=("auto", "int8", "precise"),
                   help="activation rounding for 4/8-bit weights (see `sparseinfer run --help`)")
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug logs")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the main CLI's subparsers; it dispatches to `serve(args)`."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page at /")
    add_serve_arguments(p)
    p.set_defaults(func=serve)
    return p


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    try:
        import uvicorn

        from .app import Settings, create_app
        from .engine import Engine
    except ImportError as e:
        raise SparseInferError(f"the server needs extra packages ({e.name}): pip install 'sparseinfer[server]'")
    from .. import load

    if args.parallel < 1:
        raise SparseInferError(f"--parallel must be >= 1 (got {args.parallel})")
    t0 = time.perf_counter()
    llm = load(args.model, ctx_size=args.ctx_size, threads=args.threads, device=args.device,
               vram_budget=args.vram_budget, n_seq=args.parallel, dense=args.dense, sparse=args.sparse or "auto",
               act_mode=getattr(args, "act_mode", "auto"))
    settings = Settings.for_model(llm, args.model, args.alias, args.api_key)
    print(f"loaded {settings.model_id} ({llm.info.path}) in {time.perf_counter() - t0:.1f}s; "
          f"{args.parallel} slot(s) x {llm.ctx_size} tokens", file=sys.stderr)
    if not settings.api_key and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    app = create_app(settings, Engine(llm, args.parallel, args.max_queue))
    print(f"chat page and API at http://{_url_host(args.host)}:{args.port}/", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="debug" if args.verbose else "info",
                timeout_graceful_shutdown=5)
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparseinfer.server", description="sparseinfer OpenAI-compatible server")
    add_serve_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return serve(args)
    except SparseInferError as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
