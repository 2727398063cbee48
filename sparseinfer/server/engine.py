"""One worker thread owns the model; requests wait in a queue for one of `parallel` slots.

Handlers call `submit(params, sink)`: the worker admits the sequence when a slot is free and
then, round-robin, advances every active sequence by one token per turn (the first turn is the
prefill). Every `GenerationResponse` of a sequence, and finally an exception if it fails, goes
to its `sink` (called on the worker thread; the HTTP layer hands it to its event loop). Each
sequence has its own KV cache, created at admission and dropped when it finishes or is
cancelled, so no state is ever shared between requests.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import SparseInferError
from .metrics import Metrics

log = logging.getLogger("sparseinfer.server")

Sink = Callable[[object], None]  # receives GenerationResponse objects, then possibly an Exception


class EngineBusyError(SparseInferError):
    """The wait queue is full; the client should retry later."""


class EngineStoppedError(SparseInferError):
    """The server is shutting down."""


@dataclass(frozen=True)
class GenParams:
    """A validated generation request: prompt token ids and sampling settings."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Sequence:
    """One request's life in the engine; `cancel()` it from any thread."""

    def __init__(self, params: GenParams, sink: Sink):
        self.params, self.sink = params, sink
        self.cancelled = False
        self.stream = None  # the sequence's generator (it holds the KV cache) once admitted
        self.n_generated = 0
        self.t_submit = time.monotonic()
        self.t_admit: float | None = None


class Engine:
    """The worker thread and its slots. `start()` it once; `stop()` fails what is left."""

    def __init__(self, llm, parallel: int = 1, max_queue: int = 64, metrics: Metrics | None = None):
        if parallel < 1:
            raise SparseInferError(f"--parallel must be >= 1 (got {parallel})")
        self.llm, self.parallel, self.max_queue = llm, parallel, max_queue
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._pending: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- called from handlers (any thread)
    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Engine":
        if not self.alive:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="sparseinfer-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, params: GenParams, sink: Sink) -> Sequence:
        seq = Sequence(params, sink)
        with self._cond:
            if self._stopping or not self.alive:
                raise EngineStoppedError("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise EngineBusyError(f"{len(self._pending)} requests are already waiting; retry later")
            self._pending.append(seq)
            self._cond.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence (client gone): a queued one leaves at once, an active one at its next turn."""
        if seq.cancelled:
            return
        seq.cancelled = True
        with self._cond:
            if seq in self._pending:
                self._pending.remove(seq)
                self.metrics.finished("cancelled")
            self._cond.notify_all()

    # -- the worker thread
    def _loop(self) -> None:
        with torch.inference_mode():  # for the whole thread: generators interleave their own contexts
            while self._wait_for_work():
                for seq in list(self._active):
                    self._step(seq)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._pending and not self._active:
                self._cond.wait()
            while self._pending and len(self._active) < self.parallel:
                seq = self._pending.popleft()
                seq.t_admit = time.monotonic()
                self._active.append(seq)
            return not self._stopping

    def _step(self, seq: Sequence) -> None:
        if seq.cancelled:
            self._retire(seq, "cancelled")
            return
        try:
            if seq.stream is None:
                seq.stream = self._open(seq.params)
            r = next(seq.stream)
        except Exception as e:  # a failing request must not take the worker down
            log.warning("sequence failed: %s: %s", type(e).__name__, e)
            self._send(seq, e)
            self._retire(seq, "error")
            return
        if seq.n_generated == 0:
            self.metrics.prompt_done(r.prompt_tokens, time.monotonic() - seq.t_admit)
        self.metrics.generated(r.generation_tokens - seq.n_generated)
        seq.n_generated = r.generation_tokens
        self._send(seq, r)
        if r.finish_reason is not None:
            self._retire(seq, r.finish_reason)

    def _open(self, p: GenParams):
        """The same generation path as the Python API (`LLM.stream_generate`), with a fresh cache."""
        return self.llm.stream_generate(
            list(p.prompt_ids), max_tokens=p.max_tokens, temp=p.temperature, top_k=p.top_k, top_p=p.top_p,
            min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            seed=p.seed, stop=list(p.stop))

    def _send(self, seq: Sequence, item: object) -> None:
        try:
            seq.sink(item)
        except Exception:  # the listener is gone (its event loop closed): treat as a disconnect
            seq.cancelled = True

    def _retire(self, seq: Sequence, reason: str) -> None:
        if seq.stream is not None:
            seq.stream.close()
            seq.stream = None  # drops the generator frame and with it the KV cache
        self._active.remove(seq)
        self.metrics.finished(reason)

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            left = list(self._pending) + list(self._active)
            self._pending.clear()
        for seq in left:
            self._send(seq, err)
            if seq in self._active:
                self._retire(seq, "error")
