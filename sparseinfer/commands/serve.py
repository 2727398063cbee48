"""`sparseinfer serve` (also `python -m sparseinfer.server`): OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

from ..errors import SparseInferError
from .args import cache_type_arg, check_tensors_arg, load_from_args, sparse_args


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
                   help="sequences decoded together in one batched step, each with its own KV cache; 1 keeps "
                        "the one-token path (activation sparsity) (default: 1)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled per engine step, so long prompts do not stall the others "
                        "(default: 256)")
    p.add_argument("--cache-ram", type=float, default=512, metavar="MIB",
                   help="KV caches kept to reuse shared prompt prefixes (chat turns, system prompts), in MiB, "
                        "least recently used dropped first; 0 turns prompt reuse off (default: 512)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot (default: 64)")
    p.add_argument("--alias", default=None, help="model id to report (default: the model file's name)")
    g = p.add_argument_group("limits and hardening (see docs/server.md)")
    g.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="comma list of host names clients may reach the server by, besides localhost, IP "
                        "addresses and --host; '*' allows any (default: none)")
    g.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma list of web origins (http://host:port) whose pages may call the API, besides the "
                        "server's own; '*' allows any (default: none)")
    g.add_argument("--max-body", type=float, default=8, metavar="MIB",
                   help="largest request body, in MiB (default: 8)")
    g.add_argument("--max-json-values", type=int, default=None, metavar="N",
                   help="JSON values a request body may hold (default: 8 x context size + 4096)")
    g.add_argument("--body-timeout", type=float, default=30, metavar="SECONDS",
                   help="time a request body may take to arrive (default: 30)")
    g.add_argument("--max-stops", type=int, default=16, metavar="N", help="stop strings per request (default: 16)")
    g.add_argument("--max-stop-chars", type=int, default=256, metavar="N",
                   help="characters per stop string (default: 256)")
    g.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="characters a prompt may have before tokenizing (default: context size x the longest "
                        "token's characters, which no fitting prompt exceeds)")
    g.add_argument("--chat-template-timeout", type=float, default=5, metavar="SECONDS",
                   help="time the model's chat template may take to render a conversation (default: 5)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:N]: where hot neurons and attention run")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="accelerator memory to use, e.g. 4GiB, 512MiB, or a number of GiB (default: free memory minus a margin)")
    sparse_args(p, density=False)
    p.add_argument("--act-mode", default="auto", choices=("auto", "int8", "precise"),
                   help="activation rounding for 4/8-bit weights (see `sparseinfer run --help`)")
    cache_type_arg(p)
    check_tensors_arg(p)
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug logs")
    r = p.add_argument_group("replicas on Ray Serve (pip install 'sparseinfer[cluster]'; see docs/cluster.md)")
    r.add_argument("--ray", action="store_true",
                   help="serve N replicas of the model behind Ray Serve's proxy instead of one process; each "
                        "loads the model with --threads threads (default 1 with --ray)")
    r.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas to run (default: 1)")
    r.add_argument("--max-replicas", type=int, default=None, metavar="M",
                   help="let Ray's autoscaler add replicas up to M while requests wait, and remove them down to "
                        "--replicas when idle (default: --replicas, no autoscaling)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to run on (e.g. auto, ray://head:10001) (default: start Ray on this machine)")


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
    if a.prefill_chunk < 1:
        raise SparseInferError(f"--prefill-chunk must be >= 1 (got {a.prefill_chunk})")
    if not a.cache_ram >= 0:
        raise SparseInferError(f"--cache-ram must be a number of MiB >= 0 (got {a.cache_ram})")
    limits = limits_from_args(a)  # before the load, which can take a while
    if a.ray:
        return run_on_ray(a, limits)
    from ..server.app import Settings

    t0 = time.perf_counter()
    llm = load_from_args(a, report=False, n_seq=a.parallel)
    settings = Settings.for_model(llm, a.model, a.alias, a.api_key, limits)
    print(f"loaded {settings.model_id} ({llm.info.path}) in {time.perf_counter() - t0:.1f}s; "
          f"{a.parallel} slot(s) x {llm.ctx_size} tokens", file=sys.stderr)
    serve(llm, settings, host=a.host, port=a.port, parallel=a.parallel, max_queue=a.max_queue,
          prefill_chunk=a.prefill_chunk, cache_ram=int(a.cache_ram * (1 << 20)), log_level="debug" if a.verbose else "info")
    return 0


def run_on_ray(a: argparse.Namespace, limits) -> int:
    """`--ray`: the replicas load the model, not this process; it runs Ray Serve until interrupted."""
    from dataclasses import asdict

    from ..server.ray_app import ReplicaOptions, serve_on_ray

    if a.device not in ("auto", "cpu") or a.vram_budget is not None or a.check_tensors:
        raise SparseInferError("--ray replicas run on CPU: drop --device, --vram-budget and --check-tensors")
    if a.host and a.host not in ("0.0.0.0", "::") and a.host not in limits.allowed_hosts:
        limits = replace(limits, allowed_hosts=limits.allowed_hosts + (a.host,))
    opts = ReplicaOptions(model=a.model, threads=a.threads or 1, ctx_size=a.ctx_size, parallel=a.parallel,
                          max_queue=a.max_queue, prefill_chunk=a.prefill_chunk, cache_ram_mib=a.cache_ram,
                          cache_type=a.cache_type, sparse=a.sparse or "auto", dense=a.dense, act_mode=a.act_mode,
                          alias=a.alias, limits=asdict(limits))
    opts.check()
    env = {opts.api_key_env: a.api_key} if a.api_key else {}  # the replicas read the key from their environment
    serve_on_ray(opts, a.replicas, a.max_replicas, host=a.host, port=a.port, address=a.ray_address, env=env)
    return 0


def limits_from_args(a: argparse.Namespace):
    """The server's `Limits` from the options; a bad value is an error naming the option."""
    from ..server.limits import Limits, split_list

    for opt, value in (("--max-body", a.max_body), ("--body-timeout", a.body_timeout),
                       ("--max-stops", a.max_stops), ("--max-stop-chars", a.max_stop_chars),
                       ("--chat-template-timeout", a.chat_template_timeout)):
        if not value > 0:
            raise SparseInferError(f"{opt} must be more than 0 (got {value})")
    for opt, value in (("--max-prompt-chars", a.max_prompt_chars), ("--max-json-values", a.max_json_values)):
        if value is not None and value < 1:
            raise SparseInferError(f"{opt} must be at least 1 (got {value})")
    origins = split_list(a.allowed_origins)
    bad = [o for o in origins if o != "*" and not o.lower().startswith(("http://", "https://"))]
    if bad:
        raise SparseInferError(f"--allowed-origins takes origins like http://localhost:3000 (got {bad[0]!r})")
    return Limits(max_body_bytes=int(a.max_body * (1 << 20)), body_timeout_s=a.body_timeout,
                  max_stops=a.max_stops, max_stop_chars=a.max_stop_chars, max_prompt_chars=a.max_prompt_chars,
                  max_json_values=a.max_json_values,
                  chat_template_timeout_s=a.chat_template_timeout, allowed_hosts=split_list(a.allowed_hosts),
                  allowed_origins=tuple(o.lower().rstrip("/") for o in origins))


def main(argv: list[str] | None = None) -> int:
    """`python -m sparseinfer.server ...`: the same as `sparseinfer serve ...`."""
    from . import guarded

    ap = argparse.ArgumentParser(prog="python -m sparseinfer.server", description="sparseinfer OpenAI-compatible server")
    add_arguments(ap)
    return guarded(run, ap.parse_args(argv))
