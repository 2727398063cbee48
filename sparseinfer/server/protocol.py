"""OpenAI-shaped request and response bodies (pydantic), and the error type handlers raise.

Requests are validated strictly (a string is not a number, a number is not a bool) but unknown
fields are allowed, as OpenAI clients send extras (`user`, `logprobs: false`, ...).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending top-level parameter."""
    err = e.errors()[0]
    loc = err.get("loc") or ()
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err['msg']}", None, "invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {err['msg']}", None, "invalid_request")
    where = ".".join(str(x) for x in loc if not _is_type_tag(x))
    code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
    return APIError(400, f"{where}: {err['msg']}", str(loc[0]), code)


def _is_type_tag(loc_item) -> bool:
    """pydantic names the union member that failed ('str', 'list[TextPart]'); not a field name."""
    return isinstance(loc_item, str) and (loc_item in {"str", "int", "float", "bool", "list", "dict"} or "[" in loc_item)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingRequest(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch's generator accepts
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_SamplingRequest):
    # a string, token ids, or a one-element list of either (n prompts per request are not served)
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's `logprobs` from `{"token", "logprob", "bytes", "top_logprobs"}` entries."""
    return {"content": entries, "refusal": None}


def completion_logprobs(tokens: list[str], lps: list[float | None], tops: list[dict | None],
                        offsets: list[int]) -> dict:
    """A completion choice's `logprobs` (the legacy shape: parallel lists)."""
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """choices: {"text", "finish", "logprobs"} per choice, in index order."""
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c["text"]},
                     "logprobs": c.get("logprobs"), "finish_reason": c["finish"]} for i, c in enumerate(choices)],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None,
               with_usage_field: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    out: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if with_usage_field:
        out["usage"] = None
    return out


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "text": c["text"], "logprobs": c.get("logprobs"), "finish_reason": c["finish"]}
                    for i, c in enumerate(choices)],
        "usage": use,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     with_usage_field: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    out: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }
    if with_usage_field:
        out["usage"] = None
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
