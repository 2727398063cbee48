"""Server counters and their Prometheus text exposition (no client library needed)."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # decode batch size histogram bounds
RATE_WINDOW_S = 10.0  # tokens/s gauge: generated tokens over the last this many seconds


class Metrics:
    """Thread-safe counters: the worker adds tokens, handlers add requests."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.sequences_finished: Counter[str] = Counter()  # finish reason -> count
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.queue_sum = 0.0  # seconds from submission to admission
        self.queue_count = 0
        self.batch_rows: Counter[int] = Counter()  # decode steps by the number of sequences in them
        self.prefix_hits = 0
        self.prefix_misses = 0
        self.cached_prompt_tokens = 0
        self.prefix_entries = 0
        self.prefix_bytes = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for the rate gauge

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def admitted(self, queue_s: float) -> None:
        with self._lock:
            self.queue_sum += queue_s
            self.queue_count += 1

    def batch(self, rows: int) -> None:
        with self._lock:
            self.batch_rows[rows] += 1

    def prefix_lookup(self, cached_tokens: int) -> None:
        with self._lock:
            if cached_tokens:
                self.prefix_hits += 1
                self.cached_prompt_tokens += cached_tokens
            else:
                self.prefix_misses += 1

    def prefix_cache_size(self, entries: int, nbytes: int) -> None:
        with self._lock:
            self.prefix_entries, self.prefix_bytes = entries, nbytes

    def prompt_done(self, n_prompt: int, cached: int, ttft_s: float) -> None:
        with self._lock:
            self.prompt_tokens += n_prompt - cached
            self.ttft_sum += ttft_s
            self.ttft_count += 1

    def generated(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.sequences_finished[reason] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, queue_depth: int, active: int, slots: int) -> str:
        """Prometheus text format 0.0.4."""
        tps = self.tokens_per_second()
        with self._lock:
            lines = _family("sparseinfer_requests_total", "counter", "HTTP requests by endpoint and status.",
                            [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
            lines += _family("sparseinfer_prompt_tokens_total", "counter", "Prompt tokens prefilled (not counting those taken from the prefix cache).",
                             [({}, self.prompt_tokens)])
            lines += _family("sparseinfer_generation_tokens_total", "counter", "Tokens generated.",
                             [({}, self.generation_tokens)])
            lines += _family("sparseinfer_sequences_total", "counter", "Finished sequences by reason "
                             "(stop, length, cancelled, error).",
                             [({"reason": r}, n) for r, n in sorted(self.sequences_finished.items())])
            lines += _family("sparseinfer_time_to_first_token_seconds", "summary",
                             "Time from admission to the first token (prefill).",
                             [({}, self.ttft_sum, "_sum"), ({}, self.ttft_count, "_count")])
            lines += _family("sparseinfer_queue_time_seconds", "summary",
                             "Time from submission to admission (waiting for a slot).",
                             [({}, self.queue_sum, "_sum"), ({}, self.queue_count, "_count")])
            steps = sum(self.batch_rows.values())
            lines += _family("sparseinfer_decode_batch_size", "histogram",
                             "Sequences decoded together per engine step.",
                             [({"le": str(b)}, sum(n for r, n in self.batch_rows.items() if r <= b), "_bucket")
                              for b in BATCH_BUCKETS]
                             + [({"le": "+Inf"}, steps, "_bucket"),
                                ({}, sum(r * n for r, n in self.batch_rows.items()), "_sum"), ({}, steps, "_count")])
            lines += _family("sparseinfer_prefix_cache_lookups_total", "counter",
                             "Admitted sequences by whether a cached prompt prefix was reused.",
                             [({"result": "hit"}, self.prefix_hits), ({"result": "miss"}, self.prefix_misses)])
            lines += _family("sparseinfer_prefix_cache_tokens_total", "counter",
                             "Prompt tokens taken from the prefix cache instead of prefilled.",
                             [({}, self.cached_prompt_tokens)])
            lines += _family("sparseinfer_prefix_cache_entries", "gauge", "KV caches kept for prompt reuse.",
                             [({}, self.prefix_entries)])
            lines += _family("sparseinfer_prefix_cache_bytes", "gauge",
                             "Bytes of the KV caches kept for prompt reuse (--cache-ram bounds them).",
                             [({}, self.prefix_bytes)])
        lines += _family("sparseinfer_generation_tokens_per_second", "gauge",
                         f"Tokens generated per second over the last {RATE_WINDOW_S:.0f} s.", [({}, tps)])
        lines += _family("sparseinfer_queue_depth", "gauge", "Requests waiting for a slot.", [({}, queue_depth)])
        lines += _family("sparseinfer_active_slots", "gauge", "Sequences decoding now.", [({}, active)])
        lines += _family("sparseinfer_slots", "gauge", "Sequences that may decode together (--parallel).",
                         [({}, slots)])
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str, samples: list[tuple]) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for sample in samples:
        labels, value = sample[0], sample[1]
        suffix = sample[2] if len(sample) > 2 else ""
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{suffix}{{{lab}}} {_number(value)}" if lab else f"{name}{suffix} {_number(value)}")
    return out


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"
