"""Server counters and their Prometheus text exposition (no client library needed)."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque

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
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for the rate gauge

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def prompt_done(self, n_prompt: int, ttft_s: float) -> None:
        with self._lock:
            self.prompt_tokens += n_prompt
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
            lines += _family("sparseinfer_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
                             [({}, self.prompt_tokens)])
            lines += _family("sparseinfer_generation_tokens_total", "counter", "Tokens generated.",
                             [({}, self.generation_tokens)])
            lines += _family("sparseinfer_sequences_total", "counter", "Finished sequences by reason "
                             "(stop, length, cancelled, error).",
                             [({"reason": r}, n) for r, n in sorted(self.sequences_finished.items())])
            lines += _family("sparseinfer_time_to_first_token_seconds", "summary",
                             "Time from admission to the first token (prefill).",
                             [({}, self.ttft_sum, "_sum"), ({}, self.ttft_count, "_count")])
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
