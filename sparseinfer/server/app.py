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
from dataclasses import dataclass, field, replace
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
        return await _serve(request, engine, params, req, ChatStream(settings.model_id, req.include_usage(), llm.tokenizer))

    @app.post("/v1/completions")
    async def completions(request: Request):
        limits = settings.limits
        req = await _parse(request, P.CompletionRequest, limits, llm.ctx_size)
        check_supported(req, settings.model_id, names, limits)
        ids = await run_in_threadpool(completion_prompt_ids, llm, req, limits.prompt_chars(llm.ctx_size, longest))
        params = gen_params(llm, req, ids, "prompt")
        return await _serve(request, engine, params, req, TextStream(settings.model_id, req.include_usage(),
                                                                     llm.tokenizer, req.echo))


class Choice:
    """What one choice has received so far: text, finish reason and log-probabilities."""

    def __init__(self):
        self.parts: list[str] = []
        self.finish: str | None = None
        self.logprobs: list = []  # engine.TokenLogprob, prompt tokens (echo) first
        self.n_prompt = self.n_gen = self.cached = 0


class ChatStream:
    """Chunk and body shapes of /v1/chat/completions."""

    prefix, obj = "chatcmpl", "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool, tokenizer, echo: bool = False):
        self.model, self.include_usage, self.tokenizer, self.echo = model, include_usage, tokenizer, echo
        self.id, self.created = P.new_id(self.prefix), int(time.time())

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    def opening(self, index: int, prompt_ids) -> list[dict]:
        return [P.chat_chunk(self.id, self.model, self.created, {"role": "assistant", "content": ""},
                             None, self.include_usage, index)]

    def _entry(self, t) -> dict:
        s = self.token_text(t.token)
        return {"token": s, "logprob": t.logprob, "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": (a := self.token_text(i)), "logprob": v, "bytes": list(a.encode("utf-8"))}
                                 for i, v in t.top]}

    def logprobs(self, lps: list, offset: int = 0) -> dict | None:
        return P.chat_logprobs([self._entry(t) for t in lps])

    def piece(self, text: str, index: int, lps: list | None) -> dict:
        return P.chat_chunk(self.id, self.model, self.created, {"content": text}, None, self.include_usage, index,
                            None if lps is None else self.logprobs(lps))

    def closing(self, finish: str, index: int) -> dict:
        return P.chat_chunk(self.id, self.model, self.created, {}, finish, self.include_usage, index)

    def whole(self, choices: list[Choice], use: dict, with_logprobs: bool) -> dict:
        return P.chat_response(self.id, self.model, [
            {"text": "".join(c.parts), "finish": c.finish, "logprobs": self.logprobs(c.logprobs) if with_logprobs else None}
            for c in choices], use)


class TextStream(ChatStream):
    """Chunk and body shapes of /v1/completions; `echo` puts the prompt before the completion."""

    prefix, obj = "cmpl", "text_completion"

    def opening(self, index: int, prompt_ids) -> list[dict]:
        if not self.echo:
            return []
        return [P.completion_chunk(self.id, self.model, self.created, self.tokenizer.decode(list(prompt_ids)), None,
                                   self.include_usage, index)]

    def logprobs(self, lps: list, offset: int = 0) -> dict | None:
        tokens, values, tops, offsets = [], [], [], []
        for t in lps:
            s = self.token_text(t.token)
            tokens.append(s)
            values.append(t.logprob)
            tops.append(None if t.logprob is None else {self.token_text(i): v for i, v in t.top})
            offsets.append(offset)
            offset += len(s)
        return P.completion_logprobs(tokens, values, tops, offsets)

    def piece(self, text: str, index: int, lps: list | None) -> dict:
        return P.completion_chunk(self.id, self.model, self.created, text, None, self.include_usage, index,
                                  None if lps is None else self.logprobs(lps))

    def closing(self, finish: str, index: int) -> dict:
        return P.completion_chunk(self.id, self.model, self.created, "", finish, self.include_usage, index)

    def whole(self, choices: list[Choice], use: dict, with_logprobs: bool) -> dict:
        return P.completion_response(self.id, self.model, [
            {"text": "".join(c.parts), "finish": c.finish, "logprobs": self.logprobs(c.logprobs) if with_logprobs else None}
            for c in choices], use)


def _submit(engine: Engine, params: GenParams, n: int) -> tuple[list[Sequence], asyncio.Queue]:
    """n sequences of `params` (choice i with seed + i when a seed is given); their responses
    arrive on one queue as (choice index, item)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    seqs = []

    def sink_of(i):
        return lambda item: loop.call_soon_threadsafe(queue.put_nowait, (i, item))
    try:
        for i in range(n):
            p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            seqs.append(engine.submit(p, sink_of(i)))
    except (EngineBusyError, EngineStoppedError) as e:
        for seq in seqs:
            engine.cancel(seq)
        code = "server_busy" if isinstance(e, EngineBusyError) else "server_shutting_down"
        raise P.APIError(503, str(e), None, code, "server_error") from None
    return seqs, queue


def _worker_error(e: BaseException) -> P.APIError:
    if isinstance(e, SparseInferError):
        return P.APIError(400, str(e), None, "invalid_request")
    log.error("generation failed: %s: %s", type(e).__name__, e)
    return P.APIError(500, f"generation failed: {type(e).__name__}: {e}", None, "server_error", "server_error")


def _usage(choices: list[Choice]) -> dict:
    """The prompt counted once (as OpenAI does for n > 1), every choice's completion tokens."""
    return P.usage(choices[0].n_prompt, sum(c.n_gen for c in choices), choices[0].cached)


def _take(choice: Choice, r) -> list:
    """Record a response in its choice; return its log-probabilities (prompt ones first)."""
    lps = list(r.stats.get("prompt_logprobs", ())) + list(r.stats.get("logprobs", ()))
    choice.logprobs += lps
    choice.parts.append(r.text)
    choice.n_prompt, choice.n_gen = r.prompt_tokens, r.generation_tokens
    choice.cached = r.stats.get("cached_tokens", 0)
    choice.finish = r.finish_reason
    return lps


async def _serve(request: Request, engine: Engine, params: GenParams, req, shape: ChatStream):
    seqs, queue = _submit(engine, params, req.n)

    def cancel_all():
        for seq in seqs:
            engine.cancel(seq)  # a no-op once finished; frees the slot if the client went away
    if req.stream:
        return SSEResponse(_events(queue, shape, params, req.n), on_close=cancel_all)
    try:
        return await _whole(request, queue, shape, params, req.n)
    finally:
        cancel_all()


async def _events(queue: asyncio.Queue, shape: ChatStream, params: GenParams, n: int) -> AsyncIterator[bytes]:
    choices = [Choice() for _ in range(n)]
    with_lp = params.logprobs is not None
    for i in range(n):
        for chunk in shape.opening(i, params.prompt_ids):
            yield sse_data(chunk)
    try:
        left = n
        while left:
            i, r = await queue.get()
            if isinstance(r, BaseException):
                raise r
            lps = _take(choices[i], r)
            if r.text or (with_lp and lps):
                yield sse_data(shape.piece(r.text, i, lps if with_lp else None))
            if r.finish_reason is not None:
                left -= 1
                yield sse_data(shape.closing(r.finish_reason, i))
        if shape.include_usage:
            yield sse_data(P.usage_chunk(shape.id, shape.model, shape.created, shape.obj, _usage(choices)))
    except Exception as e:  # headers are sent: report the failure in-stream, as OpenAI does
        yield sse_data(_worker_error(e).body())
    yield sse_data("[DONE]")


async def _whole(request: Request, queue: asyncio.Queue, shape: ChatStream, params: GenParams, n: int):
    choices, left = [Choice() for _ in range(n)], n
    if shape.echo:
        for c in choices:
            c.parts.append(shape.tokenizer.decode(list(params.prompt_ids)))
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            item = None
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                return JSONResponse({}, 499)  # nobody is listening; the caller cancels the sequences
            next_check = time.monotonic() + DISCONNECT_POLL_S
        if item is None:
            continue
        i, r = item
        if isinstance(r, BaseException):
            raise _worker_error(r)
        _take(choices[i], r)
        if r.finish_reason is not None:
            left -= 1
            if not left:
                return shape.whole(choices, _usage(choices), params.logprobs is not None)
