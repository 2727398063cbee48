"""Generation as a stack of generators: `generate_step` yields token ids, `stream_generate` adds
detokenization, stop strings and timings. The CLI, the server and the benchmarks all consume it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .kv_cache import KVCache

Sampler = Callable[[torch.Tensor], int]
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]

PREFILL_CHUNK = 512  # prompt tokens per forward pass: bounds activation memory on long prompts
# temperatures below this sample greedily: dividing float32 logits by a tiny temperature overflows to
# inf (then NaN probabilities), and this close to 0 a sample is the most likely token anyway
GREEDY_BELOW = 1e-5


# ----------------------------------------------------------------------------- sampling
def make_sampler(temp: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None) -> Sampler:
    """logits (vocab,) -> token id. temp < GREEDY_BELOW (0 included) is greedy; filters apply in
    llama.cpp's order."""
    if not temp >= GREEDY_BELOW:  # NaN too
        return lambda logits: int(torch.argmax(logits))
    gen = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % (2**63)))

    def sample(logits: torch.Tensor) -> int:
        logits = logits.float()
        if top_k and top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temp, dim=-1)
        if 0.0 < top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            drop = torch.cumsum(sp, 0) - sp > top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(0, si[drop], 0.0)
        if min_p > 0.0:
            probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        # an inverse-CDF draw (torch.multinomial is about ten times slower on a whole vocabulary);
        # a token of probability 0 is never drawn: its cumulative sum equals its predecessor's
        c = torch.cumsum(probs, 0, dtype=torch.float64)
        u = torch.rand((), generator=gen, dtype=torch.float64) * c[-1]
        return int(torch.searchsorted(c, u, right=True).clamp_(max=probs.numel() - 1))

    return sample


def repetition_penalty(penalty: float, last_n: int = 64) -> LogitsProcessor:
    """llama.cpp's --repeat-penalty: divide positive / multiply negative logits of recent tokens."""
    def process(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        recent = list(tokens[-last_n:])
        if not recent or penalty == 1.0:
            return logits
        idx = torch.tensor(sorted(set(recent)))
        sel = logits[idx]
        logits[idx] = torch.where(sel > 0, sel / penalty, sel * penalty)
        return logits

    return process


def presence_frequency_penalty(presence: float, frequency: float) -> LogitsProcessor:
    """OpenAI's penalties over the tokens generated so far."""
    def process(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if not tokens:
            return logits
        ids, counts = torch.unique(torch.tensor(list(tokens)), return_counts=True)
        logits[ids] -= frequency * counts.float() + presence
        return logits

    return process


# ----------------------------------------------------------------------------- generation
def prefill(model, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
    """Run the prompt through the model in chunks; return the last position's logits (vocab,)."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    cache.check_room(len(ids))
    logits = None
    for s in range(0, len(ids), PREFILL_CHUNK):
        logits = model(ids[None, s : s + PREFILL_CHUNK], cache, last_only=True)
    return logits[0, -1]


def decode(model, token: int, cache: KVCache) -> torch.Tensor:
    """One decode step: feed one token, return next-token logits (vocab,)."""
    return model(torch.tensor([[token]]), cache)[0, -1]


class TokenChooser:
    """One sequence's next-token rule: logits processors over its history, then the sampler.
    `generate_step` and the server's batched engine both pick tokens through it."""

    def __init__(self, prompt: Sequence[int], sampler: Sampler | None = None,
                 processors: Sequence[LogitsProcessor] = (),
                 generated_only_processors: Sequence[LogitsProcessor] = ()):
        self.sampler = sampler or make_sampler()
        self.processors, self.generated_only_processors = processors, generated_only_processors
        self.history = list(prompt)
        self.generated: list[int] = []

    def __call__(self, logits: torch.Tensor) -> int:
        for p in self.processors:
            logits = p(self.history, logits)
        for p in self.generated_only_processors:
            logits = p(self.generated, logits)
        tok = self.sampler(logits)
        self.history.append(tok)
        self.generated.append(tok)
        return tok


def token_logprobs(logits: torch.Tensor, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` under `logits` (vocab,) (log-softmax in float32,
    before any sampling setting), and the `top` most likely tokens with theirs, best first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        v, i = torch.topk(lp, min(top, lp.numel()))
        alts = list(zip(i.tolist(), v.tolist()))
    return float(lp[token]), alts


def generate_step(model, prompt: Sequence[int], cache: KVCache, sampler: Sampler | None = None,
                  processors: Sequence[LogitsProcessor] = (), max_tokens: int = 256,
                  generated_only_processors: Sequence[LogitsProcessor] = ()) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids (the caller decides when to stop)."""
    choose = TokenChooser(prompt, sampler, processors, generated_only_processors)
    with torch.inference_mode():
        logits = prefill(model, prompt, cache)
        for _ in range(max_tokens):
            tok = choose(logits)
            yield tok
            if len(choose.generated) == max_tokens:
                return
            cache.check_room(1)
            logits = decode(model, tok, cache)


@dataclass
class GenerationResponse:
    """One streamed piece: new text (may be empty while a stop string is pending) and counters."""

    text: str
    token: int | None
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | None while streaming
    stats: dict = field(default_factory=dict)


def _pending_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        # candidate suffixes start where `text` has the stop's first character, longest first
        i = text.find(s[0], max(len(text) - len(s) + 1, 0))
        while i != -1 and len(text) - i > best:
            if s.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return best


class TextAssembler:
    """Token ids -> text pieces of one sequence: detokenizes as tokens come, ends at an EOS id or
    a stop string (cut from the text), and holds back text that may begin a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        from .io.tokenizer import StreamDetokenizer

        self.tokenizer = tokenizer
        self.detok = StreamDetokenizer(tokenizer)
        self.stops = [s for s in stop if s]
        self.held = ""  # text not yet emitted because it may begin a stop string
        self.cut = False

    def add(self, tok: int) -> tuple[str, bool]:
        """(text to emit now, whether the sequence ended: EOS or a stop string)."""
        if tok in self.tokenizer.eos_ids:
            return "", True
        self.held += self.detok.add(tok)
        hit = min(((self.held.find(s), s) for s in self.stops if s in self.held), default=None)
        if hit is not None:
            self.held, self.cut = self.held[: hit[0]], True
            return "", True
        keep = _pending_stop_len(self.held, self.stops)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out, False

    def flush(self) -> str:
        """The text still held back (none after a stop string: it was cut)."""
        out = self.held + ("" if self.cut else self.detok.flush())
        self.held = ""
        return out


def stream_generate(model, tokenizer, prompt_tokens: Sequence[int], max_tokens: int = 256,
                    sampler: Sampler | None = None, processors: Sequence[LogitsProcessor] = (),
                    stop: Sequence[str] = (), cache: KVCache | None = None,
                    generated_only_processors: Sequence[LogitsProcessor] = ()) -> Iterator[GenerationResponse]:
    """Detokenized, stop-aware stream over `generate_step`, with prompt/decode throughput."""
    cache = cache if cache is not None else model.new_cache()
    cache.check_room(len(prompt_tokens) + 1)
    text = TextAssembler(tokenizer, stop)
    n_prompt = len(prompt_tokens)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    finish = "length"
    steps = generate_step(model, prompt_tokens, cache, sampler, processors, max_tokens, generated_only_processors)
    for tok in steps:
        n += 1
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        out, ended = text.add(tok)
        if ended:
            finish = "stop"
            break
        yield _response(out, tok, n_prompt, n, t0, t_first, now, None)
        if n >= max_tokens:
            break
    now = time.perf_counter()
    yield _response(text.flush(), None, n_prompt, n, t0, t_first or now, now, finish)


def _response(text, tok, n_prompt, n, t0, t_first, now, finish) -> GenerationResponse:
    prompt_s = max((t_first or now) - t0, 1e-9)
    gen_s = now - (t_first or now)
    return GenerationResponse(
        text=text, token=tok, prompt_tokens=n_prompt, generation_tokens=n,
        prompt_tps=n_prompt / prompt_s, generation_tps=(n - 1) / gen_s if n > 1 and gen_s > 0 else 0.0,
        finish_reason=finish, stats={"prompt_seconds": prompt_s, "generation_seconds": gen_s},
    )
