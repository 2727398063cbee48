"""Request -> `GenParams`: prompt tokens and sampling settings, or an `APIError` saying what is wrong."""
from __future__ import annotations

import logging

from ..errors import SparseInferError
from ..io.chat_template import ChatTemplateTimeout
from .engine import GenParams
from .limits import Limits
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _SamplingRequest

log = logging.getLogger("sparseinfer.server")

MAX_N = 16  # choices per request (each takes a slot in turn)


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest token's text: a text of more than ctx times this cannot fit."""
    return max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)


def check_supported(req: _SamplingRequest, model_id: str, served_names: set[str], limits: Limits = Limits()) -> None:
    """The model exists, nothing asks for a feature we do not serve, and the stop strings are
    within the limits (every stop string is matched against the text at every token)."""
    if req.model is not None and req.model not in served_names:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_id!r} "
                       "(see GET /v1/models)", "model", "model_not_found")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n={req.n} is out of range: ask for 1 to {MAX_N} choices per request",
                       "n", "unsupported_value")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    extra = req.model_extra or {}
    for name in ("tools", "functions", "logit_bias"):
        if extra.get(name):
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    fmt = extra.get("response_format")
    if fmt and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "only response_format {\"type\": \"text\"} is supported", "response_format",
                       "unsupported_value")
    stops = req.stop_list()
    if not all(isinstance(s, str) for s in stops):
        raise APIError(400, "stop must be a string or a list of strings", "stop", "invalid_value")
    if len(stops) > limits.max_stops:
        raise APIError(400, f"stop has {len(stops)} strings, more than the {limits.max_stops} this server "
                       f"allows (--max-stops); send at most {limits.max_stops}", "stop", "array_above_max_length")
    longest = max(stops, key=len, default="")
    if len(longest) > limits.max_stop_chars:
        raise APIError(400, f"a stop string is {len(longest)} characters long, more than the "
                       f"{limits.max_stop_chars} this server allows (--max-stop-chars); shorten it", "stop",
                       "string_above_max_length")


def check_prompt_chars(n_chars: int, max_chars: int, ctx: int, param: str) -> None:
    """A prompt too long for the context by its characters alone, refused before tokenizing it."""
    if n_chars > max_chars:
        raise APIError(400, f"the prompt is {n_chars} characters, more than this model's context of {ctx} "
                       f"tokens can hold (this server takes at most {max_chars} characters); shorten it",
                       param, "context_length_exceeded")


def chat_prompt_ids(llm, req: ChatCompletionRequest, max_chars: int, template_seconds: float | None) -> list[int]:
    """Tokens of the conversation rendered with the model's own chat template (within
    `template_seconds`), refused before tokenizing when over `max_chars` characters."""
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
    try:
        text = llm.format_chat(messages, time_limit=template_seconds)
    except ChatTemplateTimeout as e:
        log.warning("chat template stopped: %s", e)
        raise APIError(400, f"{e} (the server's --chat-template-timeout); the conversation may be too long "
                       "for this model's template: shorten it", "messages", "chat_template_timeout") from None
    except SparseInferError as e:  # no chat template, or the template rejected the conversation
        raise APIError(400, str(e), "messages", "invalid_value") from e
    check_prompt_chars(len(text), max_chars, llm.ctx_size, "messages")
    return llm.encode_chat_text(text)


def completion_prompt_ids(llm, req: CompletionRequest, max_chars: int) -> list[int]:
    """A text prompt is tokenized as `LLM.generate(text)` does (unless it is over `max_chars`
    characters); token ids are taken as given."""
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", "suffix", "unsupported_parameter")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of is not supported by this server", "best_of", "unsupported_value")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, f"{len(prompt)} prompts given: this server takes one prompt per request",
                           "prompt", "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), max_chars, llm.ctx_size, "prompt")
        return llm.tokenizer.encode(prompt)
    vocab = llm.tokenizer.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", "prompt", "invalid_value")
    return list(prompt)


def gen_params(llm, req: _SamplingRequest, ids: list[int], prompt_param: str) -> GenParams:
    """Check the prompt and max_tokens against the context; a missing max_tokens fills the context."""
    ctx = llm.ctx_size
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token of text", prompt_param, "invalid_value")
    if len(ids) + 1 > ctx:
        raise APIError(400, f"this model's context is {ctx} tokens, but the prompt is {len(ids)} tokens; "
                       "shorten it (or restart the server with a larger -c/--ctx-size)",
                       prompt_param, "context_length_exceeded")
    want, param = req.requested_max_tokens()
    if want is not None and want > ctx:
        raise APIError(400, f"{param}={want} is more than the context size ({ctx} tokens)", param,
                       "context_length_exceeded")
    room = ctx - len(ids)
    return GenParams(
        prompt_ids=tuple(ids), max_tokens=min(want or room, room), temperature=req.temperature,
        top_k=req.top_k, top_p=req.top_p or 1e-9,  # top_p=0 keeps only the most likely token
        min_p=req.min_p, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, stop=tuple(req.stop_list()), logprobs=requested_logprobs(req),
        prompt_logprobs=bool(getattr(req, "echo", False)) and requested_logprobs(req) is not None)


def requested_logprobs(req: _SamplingRequest) -> int | None:
    """None when no log-probabilities are asked for, else how many alternatives per token."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs
