"""Server-sent events that notice a client leaving, whatever ASGI spec version the server speaks.

Starlette's StreamingResponse only watches for `http.disconnect` under ASGI < 2.4; we always
watch, so a client that goes away mid-stream stops its sequence (and frees its slot) at once.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def _broken_socket(e: BaseException) -> bool:
    """An OSError, or a task group's exception group made only of them: the client is gone."""
    inner = getattr(e, "exceptions", None)
    if inner is not None:
        return all(_broken_socket(x) for x in inner)
    return isinstance(e, OSError)


def sse_data(obj) -> bytes:
    """One SSE event carrying a JSON object (or the literal `[DONE]`)."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")


class SSEResponse(Response):
    """Streams `events` (bytes); calls `on_close()` when done, failed or disconnected."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events, self.on_close = events, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self._stream(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self._wait_disconnect(receive)
                tg.cancel_scope.cancel()
        except Exception as e:
            if not _broken_socket(e):
                raise
        finally:
            self.on_close()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
