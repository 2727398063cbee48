"""The OpenAI-compatible app in N replicas on Ray Serve (the `[cluster]` extra: `ray[serve]`).

Each replica is a Ray actor that loads the model (and its sparsity pack) once, with its own
thread count, and runs the same app as `sparseinfer serve` (`create_app`: one engine, its slots
and queue); Ray's HTTP proxy spreads requests over the replicas and its autoscaler adds or
removes replicas from the requests each one has in hand. Ray is imported only here, and this
module only by `sparseinfer serve --ray` and by Ray itself (`serve run`, a config file's
`import_path: sparseinfer.server.ray_app:build`).

`build(args)` is the application builder; `args` are a config file's `args:` (see
`ReplicaOptions`). `serve_on_ray(...)` runs it until interrupted (the CLI's `--ray`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from ..errors import SparseInferError

APP_NAME = "sparseinfer"
DEPLOYMENT_NAME = "SparseInferReplica"
REPLICA_HEADER = "x-sparseinfer-replica"  # on every response: the Ray replica that answered
HEALTH_CHECK_PERIOD_S = 10.0
GRACEFUL_SHUTDOWN_TIMEOUT_S = 120.0  # a draining replica's requests have this long to finish


@dataclass(frozen=True)
class ReplicaOptions:
    """What each replica loads and serves: the options of `sparseinfer serve` that a replica
    needs, by the names a config file's `args:` uses. `limits` holds `server.limits.Limits`
    fields (`allowed_hosts: ["*"]`, `max_body_bytes: ...`)."""

    model: str | None = None
    threads: int = 1
    ctx_size: int | None = None
    parallel: int = 1
    max_queue: int = 64
    prefill_chunk: int = 256
    cache_ram_mib: float = 512
    cache_type: str = "f16"
    sparse: str | None = "auto"
    dense: bool = False
    act_mode: str = "auto"
    alias: str | None = None
    api_key_env: str = "SPARSEINFER_API_KEY"  # the key is read from this variable on each replica
    limits: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: dict | None) -> "ReplicaOptions":
        """Options from a config file's `args:`; an unknown key or limit is a one-line error."""
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise SparseInferError(f"unknown sparseinfer application args {unknown}; known: {sorted(known)}")
        opts = cls(**args)
        opts.check()
        return opts

    def check(self) -> None:
        from .limits import Limits

        for name in ("threads", "parallel", "max_queue", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SparseInferError(f"sparseinfer application arg {name} must be an integer >= 1 (got {value!r})")
        if not isinstance(self.cache_ram_mib, (int, float)) or self.cache_ram_mib < 0:
            raise SparseInferError("sparseinfer application arg cache_ram_mib must be >= 0 "
                                   f"(got {self.cache_ram_mib!r})")
        bad = sorted(set(self.limits) - {f.name for f in dataclasses.fields(Limits)})
        if bad:
            raise SparseInferError(f"unknown limits {bad} in the sparseinfer application args; "
                                   f"known: {sorted(f.name for f in dataclasses.fields(Limits))}")

    def to_args(self) -> dict:
        return dataclasses.asdict(self)

    def server_limits(self):
        from .limits import Limits

        kw = dict(self.limits)
        for name in ("allowed_hosts", "allowed_origins"):  # lists in YAML, tuples in Limits
            if name in kw:
                kw[name] = tuple(kw[name])
        return Limits(**kw)


def deployment_options(opts: ReplicaOptions, replicas: int = 1, max_replicas: int | None = None,
                       env: dict | None = None) -> dict:
    """Ray Serve options of the replica deployment: `replicas` fixed, or autoscaled between
    `replicas` and `max_replicas` on the requests each replica has in hand (target: its slots,
    `parallel`). Each replica reserves `threads` CPUs, so Ray places no more per machine than its
    cores allow; `env`: environment variables of the replicas."""
    if replicas < 1:
        raise SparseInferError(f"--replicas must be >= 1 (got {replicas})")
    if max_replicas is not None and max_replicas < replicas:
        raise SparseInferError(f"--max-replicas must be >= --replicas (got {max_replicas} < {replicas})")
    actor = {"num_cpus": opts.threads} | ({"runtime_env": {"env_vars": dict(env)}} if env else {})
    out = dict(ray_actor_options=actor,
               max_ongoing_requests=opts.parallel + opts.max_queue,
               health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=30.0,
               graceful_shutdown_wait_loop_s=1.0, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S)
    if max_replicas is None or max_replicas == replicas:
        out["num_replicas"] = replicas
    else:
        out["autoscaling_config"] = {"min_replicas": replicas, "initial_replicas": replicas,
                                     "max_replicas": max_replicas, "target_ongoing_requests": opts.parallel}
    return out


def replica_app(opts: ReplicaOptions, replica: str):
    """The app of one replica: the model loaded once, one engine, `create_app`'s routes; every
    response names the replica (`REPLICA_HEADER`)."""
    from .. import load
    from .app import Settings, create_app
    from .engine import Engine

    llm = load(opts.model, ctx_size=opts.ctx_size, threads=opts.threads, sparse=opts.sparse, dense=opts.dense,
               n_seq=opts.parallel, act_mode=opts.act_mode, cache_type=opts.cache_type)
    for note in llm.notes:  # the replica's log, as the CLI prints them
        print(f"note: {note}", file=sys.stderr)
    settings = Settings.for_model(llm, opts.model, opts.alias, os.environ.get(opts.api_key_env) or None,
                                  opts.server_limits())
    engine = Engine(llm, opts.parallel, opts.max_queue, prefill_chunk=opts.prefill_chunk,
                    cache_ram=int(opts.cache_ram_mib * (1 << 20)))
    app = create_app(settings, engine)
    app.add_middleware(ReplicaHeader, name=replica)
    app.state.engine = engine
    return app


class ReplicaHeader:
    """Adds `REPLICA_HEADER: name` to every response (pure ASGI: streams pass through)."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named if scope["type"] == "http" else send)


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise SparseInferError(f"serving on Ray needs extra packages ({e.name}): pip install 'sparseinfer[cluster]'")
    return ray, serve


def replica_deployment(opts: ReplicaOptions):
    """The Ray Serve deployment (a class made here, so that each replica builds its app from
    `opts` when Ray starts it)."""
    _, serve = _ray()

    def build_replica_app():  # run by Ray inside each replica, after the class's __init__
        return replica_app(opts, serve.get_replica_context().replica_id.to_full_id_str())

    @serve.deployment(name=DEPLOYMENT_NAME)
    @serve.ingress(build_replica_app)
    class SparseInferReplica:
        """One replica: the model, its engine and the HTTP app. Ray calls `check_health`
        periodically (what `GET /health` reports: the engine's worker is running) and replaces
        a replica that fails it; a replica being removed gets no new requests and has
        `graceful_shutdown_timeout_s` for those it has before its engine stops."""

        def check_health(self) -> None:
            engine = self.app.state.engine
            if not engine.alive:
                raise RuntimeError("the engine's worker thread is not running")

    return SparseInferReplica


def build(args: dict | None = None):
    """Application builder for Ray Serve (`import_path: sparseinfer.server.ray_app:build`);
    `args`: `ReplicaOptions` fields. The config file's `deployments:` entry for
    `SparseInferReplica` sets the replicas, autoscaling and CPUs."""
    opts = ReplicaOptions.from_args(args)
    return replica_deployment(opts).options(**deployment_options(opts)).bind()


def application(opts: ReplicaOptions, replicas: int = 1, max_replicas: int | None = None, env: dict | None = None):
    """The application with `replicas` (autoscaled up to `max_replicas` when that is larger)."""
    return replica_deployment(opts).options(**deployment_options(opts, replicas, max_replicas, env)).bind()


def serve_on_ray(opts: ReplicaOptions, replicas: int = 1, max_replicas: int | None = None, host: str = "127.0.0.1",
                 port: int = 8080, address: str | None = None, env: dict | None = None) -> None:
    """Run the application on Ray until interrupted: on the cluster at `address`, or on a Ray
    instance started here (this machine's cores). Ctrl-C deletes the application (its replicas
    drain first) and stops a Ray started here."""
    ray, serve = _ray()
    app = application(opts, replicas, max_replicas, env)  # bad options fail before Ray starts
    started = address is None
    cores = os.cpu_count() or 1
    if started and replicas * opts.threads > cores:  # Ray would wait for CPUs that never come
        raise SparseInferError(f"{replicas} replica(s) x {opts.threads} thread(s) need {replicas * opts.threads} "
                               f"CPUs; this machine has {cores}: use fewer --replicas or --threads")
    ray.init(address=address, include_dashboard=False, logging_level="warning")
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"{replicas if max_replicas in (None, replicas) else f'{replicas}-{max_replicas}'} replica(s) of "
              f"{opts.model or 'smollm2'} on Ray; API at http://{host}:{port}/", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        if started:
            serve.shutdown()
            ray.shutdown()
