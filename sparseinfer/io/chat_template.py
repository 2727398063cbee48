"""Chat templates: the Jinja2 programs that models ship to turn a conversation into prompt text.

Rendered the way Hugging Face does it (so that a model sees exactly what it saw in training):
a sandboxed Jinja2 environment with `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension,
a `tojson` filter that does not HTML-escape, the globals `raise_exception` and `strftime_now`,
and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents`.
Templates are untrusted code from model files, hence the (immutable) sandbox, and the inputs are
rebuilt from plain JSON-like types before the template sees them. The sandbox does not bound
running time (nested loops over a long message can run for hours): `render(time_limit=...)` does.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

from ..errors import SparseInferError


class NoChatTemplateError(SparseInferError):
    """The model has no chat template; the caller should fall back to raw text prompts."""


class ChatTemplateError(SparseInferError):
    """A chat template failed to compile or render (or called `raise_exception`)."""


class ChatTemplateTimeout(ChatTemplateError):
    """A chat template ran past its time limit."""


class _OverTime(Exception):
    """Raised inside a template's code when its time is up (never escapes `render`)."""


TEMPLATE_FILENAME = "<template>"  # the file name jinja2 gives code compiled from a string


@contextmanager
def _time_limit(seconds: float):
    """Stop template code that runs past `seconds`, by tracing this thread's template frames.

    Jinja2 compiles templates to Python whose loops run lines on every pass, so a line event of a
    template frame is where an over-long render is stopped; other frames (filters, jinja2's
    runtime) are not traced line by line. The thread's previous trace function is restored.
    """
    deadline = time.monotonic() + seconds

    def in_template(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise _OverTime
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _plain(value: Any) -> Any:
    """A copy of `value` made of plain dict/list/str/int/float/bool/None only (what templates may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)  # pydantic models (e.g. from the OpenAI-compatible server)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"  # inert placeholder for anything else


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        if not isinstance(source, str) or not source.strip():
            raise NoChatTemplateError("empty chat template")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        try:
            self._template = _compile(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"the model's chat template does not compile: {type(e).__name__}: {e}") from e

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        documents: list | None = None,
        time_limit: float | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as prompt text. `time_limit` (seconds, None = no limit) stops a
        template that runs longer with `ChatTemplateTimeout`."""
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        msgs = _plain(list(messages))
        for m in msgs:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts like {{'role': ..., 'content': ...}}, got {m!r}")
        variables = {k: _plain(v) for k, v in kwargs.items()}
        variables.update(
            messages=msgs,
            add_generation_prompt=bool(add_generation_prompt),
            tools=_plain(tools),
            documents=_plain(documents),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            if time_limit is None:
                return self._template.render(**variables)
            with _time_limit(time_limit):
                return self._template.render(**variables)
        except _OverTime:
            raise ChatTemplateTimeout(f"the model's chat template did not finish within {time_limit:g} s") from None
        except Exception as e:
            raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {e}") from e


def select_template(templates: Mapping[str, str] | str | None, name: str | None = None) -> str | None:
    """Pick a template source: a plain string, or `name` (default: "default") from a name->source mapping."""
    if templates is None or isinstance(templates, str):
        return templates or None
    if name is not None:
        if name not in templates:
            raise NoChatTemplateError(f"no chat template named {name!r}; the model has {sorted(templates)}")
        return templates[name]
    return templates.get("default") or (next(iter(templates.values())) if len(templates) == 1 else None)
