"""One worker thread owns the model; requests wait in a queue for one of `parallel` slots.

Handlers call `submit(params, sink)`. The worker runs steps; each step

1. admits waiting sequences while a slot is free (a sequence may start from a cached prefix of
   its prompt, see `PrefixCache`),
2. prefills prompts in chunks of `prefill_chunk` tokens, at most that many tokens per step over
   all sequences, so a long prompt does not stall the others (a prompt's chunks always start at
   multiples of `prefill_chunk` from where its prefill starts, whatever runs beside it),
3. decodes every sequence that has a token to feed, together: two or more in one batched step
   (`CausalLM.decode_batch`: the weights are read once per step for all rows, and a row's
   numbers do not depend on the others), one alone through the one-token path (the same C
   steps, and the activation-sparse FFN of a sparsity pack with its predictor).

Every `GenerationResponse` of a sequence, and finally an exception if it fails, goes to its
`sink` (called on the worker thread; the HTTP layer hands it to its event loop). Each sequence
has its own KV cache; when it ends the cache goes to the prefix cache (or is dropped), so no
state is shared between live requests.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SparseInferError
from ..generate import (GenerationResponse, TextAssembler, TokenChooser, make_sampler, presence_frequency_penalty,
                        token_logprobs)
from ..kv_cache import KVCache
from .metrics import Metrics

log = logging.getLogger("sparseinfer.server")

Sink = Callable[[object], None]  # receives GenerationResponse objects, then possibly an Exception

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens prefilled per engine step (all sequences together)
DEFAULT_CACHE_RAM_MIB = 512  # KV caches kept for prompt reuse


class EngineBusyError(SparseInferError):
    """The wait queue is full; the client should retry later."""


class EngineStoppedError(SparseInferError):
    """The server is shutting down."""


@dataclass(frozen=True)
class GenParams:
    """A validated generation request: prompt token ids, sampling settings and what to report.
    `logprobs`: None, or how many alternatives to report with each generated token's
    log-probability; `prompt_logprobs`: report the prompt tokens' log-probabilities too (echo)."""

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
    logprobs: int | None = None
    prompt_logprobs: bool = False


@dataclass
class TokenLogprob:
    """One token's log-probability under the model and the most likely alternatives."""

    token: int
    logprob: float | None  # None: the first prompt token (nothing before it)
    top: list[tuple[int, float]] = field(default_factory=list)


class Sequence:
    """One request's life in the engine; `cancel()` it from any thread."""

    def __init__(self, params: GenParams, sink: Sink):
        self.params, self.sink = params, sink
        self.cancelled = False
        self.cache: KVCache | None = None  # set at admission
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.fed = 0  # prompt tokens in the cache
        self.chooser: TokenChooser | None = None
        self.text: TextAssembler | None = None
        self.pending: int | None = None  # the last token sampled, to be decoded next
        self.n_generated = 0
        self.prompt_logprobs: list[TokenLogprob] = []
        self.t_submit = time.monotonic()
        self.t_admit: float | None = None
        self.t_first: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.params.prompt_ids)


class PrefixCache:
    """KV caches of finished sequences keyed by their tokens, within `budget` bytes, least
    recently used evicted first. `take(prompt)` hands out the entry sharing the longest prefix
    with `prompt` (removed from the pool: one user at a time), cut to that prefix."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: OrderedDict[int, tuple[tuple[int, ...], KVCache]] = OrderedDict()
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for _, c in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: tuple[int, ...], cache: KVCache) -> None:
        if not tokens or self.budget <= 0 or cache.nbytes > self.budget:
            return
        self._entries[self._next] = (tokens, cache)
        self._next += 1
        while self.nbytes > self.budget:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()

    def take(self, prompt: tuple[int, ...]) -> tuple[KVCache | None, int]:
        """(a cache holding the first n tokens of `prompt`, n), n < len(prompt) so that at least one
        prompt token is left to run; (None, 0) when no entry shares a prefix."""
        best, best_n = None, 0
        for key, (tokens, _) in self._entries.items():
            n = _common_prefix(tokens, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        _, cache = self._entries.pop(best)
        n = min(best_n, len(prompt) - 1, cache.length)
        if n <= 0:
            return None, 0
        cache.truncate(n)
        return cache, n


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    """The worker thread and its slots. `start()` it once; `stop()` fails what is left.
    `prefill_chunk`: prompt tokens per step; `cache_ram`: bytes of KV caches kept for prompt
    reuse (0: none)."""

    def __init__(self, llm, parallel: int = 1, max_queue: int = 64, metrics: Metrics | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cache_ram: int = DEFAULT_CACHE_RAM_MIB << 20):
        if parallel < 1:
            raise SparseInferError(f"--parallel must be >= 1 (got {parallel})")
        if prefill_chunk < 1:
            raise SparseInferError(f"--prefill-chunk must be >= 1 (got {prefill_chunk})")
        if cache_ram < 0:
            raise SparseInferError(f"--cache-ram must be >= 0 (got {cache_ram})")
        self.llm, self.parallel, self.max_queue = llm, parallel, max_queue
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(cache_ram)
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
        """Stop a sequence (client gone): a queued one leaves at once, an active one at the next step."""
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
        with torch.inference_mode():
            while self._wait_for_work():
                self._step()
        self._fail_all(EngineStoppedError("the server is shutting down"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._pending and not self._active:
                self._cond.wait()
            admitted = []
            while self._pending and len(self._active) < self.parallel:
                seq = self._pending.popleft()
                seq.t_admit = time.monotonic()
                self._active.append(seq)
                admitted.append(seq)
            stopping = self._stopping
        for seq in admitted:
            self.metrics.admitted(seq.t_admit - seq.t_submit)
            self._guard(seq, self._open, seq)
        return not stopping

    def _step(self) -> None:
        for seq in list(self._active):
            if seq.cancelled:
                self._retire(seq, "cancelled")
        budget = self.prefill_chunk
        for seq in list(self._active):
            if budget <= 0:
                break
            if seq in self._active and seq.prefilling:
                budget -= self._guard(seq, self._prefill_chunk, seq) or 0
        rows = [s for s in self._active if s.pending is not None and not s.cancelled]
        if rows:
            try:
                logits = self._decode(rows)
            except Exception as e:  # a failing step fails its rows, not the worker
                for seq in rows:
                    self._fail(seq, e)
                return
            self.metrics.batch(len(rows))
            for seq, lg in zip(rows, logits):
                self._guard(seq, self._advance, seq, lg)

    def _guard(self, seq: Sequence, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # a failing request must not take the worker down
            self._fail(seq, e)
            return None

    def _fail(self, seq: Sequence, e: Exception) -> None:
        log.warning("sequence failed: %s: %s", type(e).__name__, e)
        self._send(seq, e)
        if seq in self._active:
            self._retire(seq, "error", keep_cache=False)

    def _open(self, seq: Sequence) -> None:
        """Give an admitted sequence its cache (from the prefix cache where one shares its
        prompt), its sampler and its detokenizer."""
        p, llm = seq.params, self.llm
        cache, n = (None, 0) if p.prompt_logprobs else self.prefix_cache.take(p.prompt_ids)
        if cache is None:
            cache = llm.new_cache()
        cache.check_room(len(p.prompt_ids) + 1)
        seq.cache, seq.cached, seq.fed = cache, n, n
        self.metrics.prefix_lookup(n)
        procs = [presence_frequency_penalty(p.presence_penalty, p.frequency_penalty)] \
            if (p.presence_penalty or p.frequency_penalty) else []
        sampler = make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, p.seed)
        seq.chooser = TokenChooser(p.prompt_ids, sampler, (), procs)
        seq.text = TextAssembler(llm.tokenizer, p.stop)

    def _prefill_chunk(self, seq: Sequence) -> int:
        """Run the next chunk of the prompt; after the last, sample the first token. Returns the
        number of prompt tokens run."""
        ids = seq.params.prompt_ids
        start = seq.fed
        end = min(len(ids), start + self.prefill_chunk)
        chunk = torch.tensor(ids[start:end], dtype=torch.long)[None]
        want_all = seq.params.prompt_logprobs
        logits = self.llm.model(chunk, seq.cache, last_only=not want_all)[0]
        seq.fed = end
        if want_all:
            top = seq.params.logprobs or 0
            if start == 0:
                seq.prompt_logprobs.append(TokenLogprob(ids[0], None))
            for j in range(end - start - 1):
                lp, alts = token_logprobs(logits[j], ids[start + j + 1], top)
                seq.prompt_logprobs.append(TokenLogprob(ids[start + j + 1], lp, alts))
        if seq.prefilling:
            if want_all and seq.fed < len(ids):
                lp, alts = token_logprobs(logits[-1], ids[seq.fed], seq.params.logprobs or 0)
                seq.prompt_logprobs.append(TokenLogprob(ids[seq.fed], lp, alts))
            return end - start
        self.metrics.prompt_done(len(ids), seq.cached, time.monotonic() - seq.t_admit)
        self._advance(seq, logits[-1])
        return end - start

    def _decode(self, rows: list[Sequence]) -> torch.Tensor:
        model = self.llm.model
        if len(rows) == 1:  # the one-token path: fused C steps, the activation-sparse FFN's predictor
            s = rows[0]
            return model(torch.tensor([[s.pending]]), s.cache)[:, -1]
        return model.decode_batch([s.pending for s in rows], [s.cache for s in rows])

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token from `logits` and send what it adds."""
        seq.pending = None
        if seq.cancelled:
            self._retire(seq, "cancelled")
            return
        tok = seq.chooser(logits)
        seq.n_generated += 1
        now = time.monotonic()
        seq.t_first = seq.t_first or now
        self.metrics.generated(1)
        lp = None
        if seq.params.logprobs is not None:
            v, alts = token_logprobs(logits, tok, seq.params.logprobs)
            lp = TokenLogprob(tok, v, alts)
        text, ended = seq.text.add(tok)
        finish = "stop" if ended else ("length" if seq.n_generated >= seq.params.max_tokens else None)
        if finish is not None:
            text += seq.text.flush()
        self._send(seq, self._response(seq, text, tok, finish, lp, now))
        if finish is not None:
            self._retire(seq, finish)
        else:
            seq.cache.check_room(1)
            seq.pending = tok

    def _response(self, seq: Sequence, text: str, tok: int, finish: str | None, lp: TokenLogprob | None,
                  now: float) -> GenerationResponse:
        n_prompt, n = len(seq.params.prompt_ids), seq.n_generated
        prompt_s = max(seq.t_first - seq.t_admit, 1e-9)
        gen_s = now - seq.t_first
        stats = {"prompt_seconds": prompt_s, "generation_seconds": gen_s, "cached_tokens": seq.cached}
        if lp is not None:
            stats["logprobs"] = [lp]
        if n == 1 and seq.params.prompt_logprobs:
            stats["prompt_logprobs"] = seq.prompt_logprobs
        return GenerationResponse(
            text=text, token=tok, prompt_tokens=n_prompt, generation_tokens=n,
            prompt_tps=(n_prompt - seq.cached) / prompt_s,
            generation_tps=(n - 1) / gen_s if n > 1 and gen_s > 0 else 0.0, finish_reason=finish, stats=stats)

    def _send(self, seq: Sequence, item: object) -> None:
        try:
            seq.sink(item)
        except Exception:  # the listener is gone (its event loop closed): treat as a disconnect
            seq.cancelled = True

    def _retire(self, seq: Sequence, reason: str, keep_cache: bool = True) -> None:
        if seq in self._active:
            self._active.remove(seq)
        cache, seq.cache, seq.pending = seq.cache, None, None
        if cache is not None and keep_cache and not seq.prefilling:
            tokens = (tuple(seq.params.prompt_ids) + tuple(seq.chooser.generated))[: cache.length]
            self.prefix_cache.put(tokens, cache)
        self.metrics.finished(reason)
        self.metrics.prefix_cache_size(len(self.prefix_cache), self.prefix_cache.nbytes)

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            left = list(self._pending) + list(self._active)
            self._pending.clear()
        for seq in left:
            self._send(seq, err)
            if seq in self._active:
                self._retire(seq, "error", keep_cache=False)
