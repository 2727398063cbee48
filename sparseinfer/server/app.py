"""HTTP routing: `create_app(settings, engine)` -> a FastAPI app speaking OpenAI's API.

Handlers validate, turn the request into `GenParams`, submit it to the engine and stream the
sequence's responses back from a per-request queue. Errors are OpenAI-shaped.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from ..errors import SparseInferError
from . import protocol as P
from .engine import Engine, EngineBusyError, EngineStoppedError, GenParams, Sequence
from .limits import Limits, count_json_values, host_allowed, host_name, origin_allowed
from .prepare import chat_prompt_ids, check_supported, completion_prompt_ids, gen_params, longest_token_chars
from .sse import SSEResponse, sse_data
from .webui import PAGE

log = logging.getLogger("sparseinfer.server")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
ENDPOINTS = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


@dataclass
class Settings:
    """What the server says about itself; `model_id` is the name clients pass as `model`.
    `limits` are read per request."""

    model_id: str
    model_aliases: tuple[str, ...] = ()  # also accepted as `model` (the file name, its path)
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    limits: Limits = field(default_factory=Limits)

    @property
    def served_names(self) -> set[str]:
        return {self.model_id, *self.model_aliases}

    @classmethod
    def for_model(cls, llm, requested: str | None = None, alias: str | None = None,
                  api_key: str | None = None, limits: Limits | None = None) -> "Settings":
        """The id is `alias` or the model file's name without extension; its file name, its path
        and the name it was loaded by (`-m`) are accepted too."""
        path = Path(llm.info.path)
        stem = path.stem if path.suffix == ".gguf" else path.name
        names = {stem, path.name, str(path), *([requested] if requested else [])}
        model_id = alias or stem
        return cls(model_id, tuple(sorted(names - {model_id})), api_key or None, limits=limits or Limits())


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    """The app; its lifespan starts the engine's worker and stops it at shutdown."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="sparseinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if settings.limits.allowed_origins:  # CORS headers and preflights for the origins allowed
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.limits.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(GateMiddleware, settings=settings, engine=engine)  # added last: runs first
    _add_error_handlers(app)
    _add_info_routes(app, settings, engine)
    _add_generation_routes(app, settings, engine)
    return app


# ----------------------------------------------------------------------------- middleware
class GateMiddleware:
    """Host and Origin checks, the API key on /v1/*, JSON bodies on POST /v1/*, and request counts
    by endpoint and status for /metrics (pure ASGI, so streaming and disconnect detection pass
    through untouched)."""

    def __init__(self, app, settings: Settings, engine: Engine):
        self.app, self.settings, self.metrics = app, settings, engine.metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            err = self._refusal(scope)
            if err is not None:
                await JSONResponse(err.body(), err.status)(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self.metrics.request(path if path in ENDPOINTS else "other", status)

    def _refusal(self, scope) -> P.APIError | None:
        """Why the request is refused before routing, or None."""
        limits, headers = self.settings.limits, Headers(scope=scope)
        path, method = scope["path"], scope["method"]
        host, origin = headers.get("host"), headers.get("origin")
        if not host_allowed(host, limits.allowed_hosts):
            name = host_name(host)
            return P.APIError(403, f"this server does not answer to the host name {name!r} (Host header); "
                              f"if that is how clients reach it, restart it with --allowed-hosts {name}",
                              None, "host_not_allowed")
        if not origin_allowed(origin, host, limits.allowed_origins):
            return P.APIError(403, f"requests from web pages of {origin} are refused (cross-origin); to let "
                              f"them use this server, restart it with --allowed-origins {origin}",
                              None, "origin_not_allowed")
        if method == "OPTIONS" or not path.startswith("/v1/"):  # a CORS preflight carries no credentials
            return None
        if not self._authorized(headers):
            return P.APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              None, "invalid_api_key")
        if method == "POST":
            ctype = headers.get("content-type")
            if ctype is None or ctype.split(";")[0].strip().lower() != "application/json":
                got = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
                return P.APIError(415, f"the request has {got}: send the body as JSON with "
                                  "'Content-Type: application/json'", None, "unsupported_media_type")
        return None

    def _authorized(self, headers: Headers) -> bool:
        key = self.settings.api_key
        if not key:
            return True
        got = headers.get("authorization", "")
        return hmac.compare_digest(got.encode("latin-1"), f"Bearer {key}".encode())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(_: Request, e: P.APIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(P.APIError(e.status_code, str(e.detail), None, code).body(), e.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect):
        log.debug("the client left before sending the whole request body")
        return Response(status_code=499)  # nobody reads it; counted in /metrics as 499

    @app.exception_handler(RequestValidationError)
    async def request_error(_: Request, e: RequestValidationError):
        return JSONResponse(P.APIError(400, str(e.errors()[0].get("msg")), None, "invalid_value").body(), 400)


# ----------------------------------------------------------------------------- info routes
def _add_info_routes(app: FastAPI, settings: Settings, engine: Engine) -> None:
    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": settings.created, "owned_by": "sparseinfer",
                "context_length": engine.llm.ctx_size}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(PAGE)

    @app.get("/health")
    async def health():
        ok = engine.alive
        body = {"status": "ok" if ok else "error", "model": settings.model_id, "slots": engine.parallel,
                "active_slots": engine.active, "queue_depth": engine.queued}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(engine.queued, engine.active, engine.parallel)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in settings.served_names:
            raise P.APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return model_card()


# ----------------------------------------------------------------------------- generation routes
async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, at most `max_body_bytes` of it, arriving within `body_timeout_s`."""
    body, cap = bytearray(), limits.max_body_bytes
    try:
        with anyio.fail_after(limits.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > cap:
                    raise P.APIError(413, f"the request body is over {cap / (1 << 20):g} MiB (the server's "
                                     "--max-body); send a shorter prompt", None, "request_too_large")
    except TimeoutError:
        raise P.APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s (the "
                         "server's --body-timeout); send the whole body at once", None, "request_timeout") from None
    return bytes(body)


def _validate(cls, body: bytes, max_values: int):
    """The request model of `body`, unless it holds more JSON values than `max_values`."""
    n = count_json_values(body, max_values)
    if n > max_values:
        raise P.APIError(413, f"the request body holds about {n} JSON values, more than the {max_values} this "
                         "server parses (--max-json-values); send fewer messages, parts or token ids", None,
                         "request_too_large")
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        raise P.validation_error(e) from None


async def _parse(request: Request, cls, limits: Limits, ctx_size: int):
    """Read and validate the body, off the event loop (a large one takes a while to parse)."""
    body = await _read_body(request, limits)
    return await run_in_threadpool(_validate, cls, body, limits.json_values(ctx_size))


def _add_generation_routes(app: FastAPI, settings: Settings, engine: Engine) -> None:
    llm, names = engine.llm, settings.served_names
    longest = longest_token_chars(llm.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        limits = settings.limits
        req = await _parse(request, P.ChatCompletionRequest, limits, llm.ctx_size)
        check_supported(req, settings.model_id, names, limits)
        ids = await run_in_threadpool(chat_prompt_ids, llm, req, limits.prompt_chars(llm.ctx_size, longest),
                                      limits.chat_template_timeout_s)
        params = gen_params(llm, req, ids, "messages")
        return await _serve(request, engine, params, req, ChatStream(settings.model_id, req.include_usage()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        limits = settings.limits
        req = await _parse(request, P.CompletionRequest, limits, llm.ctx_size)
        check_supported(req, settings.model_id, names, limits)
        ids = await run_in_threadpool(completion_prompt_ids, llm, req, limits.prompt_chars(llm.ctx_size, longest))
        params = gen_params(llm, req, ids, "prompt")
        return await _serve(request, engine, params, req, TextStream(settings.model_id, req.include_usage()))


class ChatStream:
    """Chunk and body shapes of /v1/chat/completions."""

    prefix, obj = "chatcmpl", "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool):
        self.model, self.include_usage = model, include_usage
        self.id, self.created = P.new_id(self.prefix), int(time.time())

    def opening(self) -> list[dict]:
        return [P.chat_chunk(self.id, self.model, self.created, {"role": "assistant", "content": ""},
                             None, self.include_usage)]

    def piece(self, text: str) -> dict:
        return P.chat_chunk(self.id, self.model, self.created, {"content": text}, None, self.include_usage)

    def closing(self, finish: str) -> dict:
        return P.chat_chunk(self.id, self.model, self.created, {}, finish, self.include_usage)

    def whole(self, text: str, finish: str, n_prompt: int, n_gen: int) -> dict:
        return P.chat_response(self.id, self.model, text, finish, n_prompt, n_gen)


class TextStream(ChatStream):
    """Chunk and body shapes of /v1/completions."""

    prefix, obj = "cmpl", "text_completion"

    def opening(self) -> list[dict]:
        return []

    def piece(self, text: str) -> dict:
        return P.completion_chunk(self.id, self.model, self.created, text, None, self.include_usage)

    def closing(self, finish: str) -> dict:
        return P.completion_chunk(self.id, self.model, self.created, "", finish, self.include_usage)

    def whole(self, text: str, finish: str, n_prompt: int, n_gen: int) -> dict:
        return P.completion_response(self.id, self.model, text, finish, n_prompt, n_gen)


def _submit(engine: Engine, params: GenParams) -> tuple[Sequence, asyncio.Queue]:
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    try:
        seq = engine.submit(params, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
    except EngineBusyError as e:
        raise P.APIError(503, str(e), None, "server_busy", "server_error") from None
    except EngineStoppedError as e:
        raise P.APIError(503, str(e), None, "server_shutting_down", "server_error") from None
    return seq, queue


async def _responses(queue: asyncio.Queue) -> AsyncIterator:
    """The sequence's GenerationResponses until the one with a finish_reason; raises its error."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return


def _worker_error(e: BaseException) -> P.APIError:
    if isinstance(e, SparseInferError):
        return P.APIError(400, str(e), None, "invalid_request")
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return P.APIError(500, f"generation failed: {type(e).__name__}: {e}", None, "server_error", "server_error")


async def _serve(request: Request, engine: Engine, params: GenParams, req, shape: ChatStream):
    seq, queue = _submit(engine, params)
    if req.stream:
        return SSEResponse(_events(queue, shape), on_close=lambda: engine.cancel(seq))
    try:
        return await _whole(request, queue, shape)
    finally:
        engine.cancel(seq)  # a no-op once finished; frees the slot if the client went away


async def _events(queue: asyncio.Queue, shape: ChatStream) -> AsyncIterator[bytes]:
    for chunk in shape.opening():
        yield sse_data(chunk)
    try:
        async for r in _responses(queue):
            if r.text:
                yield sse_data(shape.piece(r.text))
            if r.finish_reason is not None:
                yield sse_data(shape.closing(r.finish_reason))
                if shape.include_usage:
                    yield sse_data(P.usage_chunk(shape.id, shape.model, shape.created, shape.obj,
                                                 r.prompt_tokens, r.generation_tokens))
    except Exception as e:  # headers are sent: report the failure in-stream, as OpenAI does
        yield sse_data(_worker_error(e).body())
    yield sse_data("[DONE]")


async def _whole(request: Request, queue: asyncio.Queue, shape: ChatStream):
    parts, next_check = [], time.monotonic() + DISCONNECT_POLL_S
    while True:
        try:
            r = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            r = None
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                return JSONResponse({}, 499)  # nobody is listening; the caller cancels the sequence
            next_check = time.monotonic() + DISCONNECT_POLL_S
        if r is None:
            continue
        if isinstance(r, BaseException):
            raise _worker_error(r)
        parts.append(r.text)
        if r.finish_reason is not None:
            return shape.whole("".join(parts), r.finish_reason, r.prompt_tokens, r.generation_tokens)
