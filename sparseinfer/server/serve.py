"""Serve a loaded model over HTTP until interrupted (`sparseinfer serve` parses the options and
loads the model, then calls `serve`)."""
from __future__ import annotations

import ipaddress
import sys
from dataclasses import replace

from ..errors import SparseInferError


def require_extras() -> None:
    """The server's packages are an extra: say which to install, before a long model load."""
    try:
        import uvicorn  # noqa: F401

        from . import app, engine  # noqa: F401  (fastapi, pydantic)
    except ImportError as e:
        raise SparseInferError(f"the server needs extra packages ({e.name}): pip install 'sparseinfer[server]'")


def serve(llm, settings, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1, max_queue: int = 64,
          prefill_chunk: int = 256, cache_ram: int = 512 << 20, log_level: str = "info") -> None:
    """Serve `llm` (loaded with n_seq=`parallel`) as `settings` (`server.app.Settings`) on host:port;
    `prefill_chunk` and `cache_ram` (bytes) go to the `Engine`.
    The name bound is added to `settings.limits.allowed_hosts`."""
    require_extras()
    import uvicorn

    from .app import create_app
    from .engine import Engine

    if parallel < 1:
        raise SparseInferError(f"--parallel must be >= 1 (got {parallel})")
    if not settings.api_key and not _is_loopback(host):
        print(f"warning: serving on {host} without --api-key: anyone who can reach it may use it", file=sys.stderr)
    limits = settings.limits
    if host and host not in ("0.0.0.0", "::") and host not in limits.allowed_hosts:
        settings.limits = limits = replace(limits, allowed_hosts=limits.allowed_hosts + (host,))
    if not _is_loopback(host) and "*" not in limits.allowed_hosts:
        print("note: clients that reach this server by a host name (not an IP address or localhost) "
              "need it in --allowed-hosts", file=sys.stderr)
    app = create_app(settings, Engine(llm, parallel, max_queue, prefill_chunk=prefill_chunk, cache_ram=cache_ram))
    print(f"chat page and API at http://{_url_host(host)}:{port}/", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
