"""Load test for `sparseinfer serve`: N concurrent streaming chat clients for a fixed time.

    # against a running server (give its pid to watch its memory)
    python benchmarks/load_test.py --url http://127.0.0.1:8080 --server-pid 1234
    # or start one for the run and stop it afterwards
    python benchmarks/load_test.py --spawn "-m smollm2 --parallel 4"
    # aggregate tokens/s with 1 and with 4 concurrent streams, alternated, twice each
    python benchmarks/load_test.py --spawn "-m smollm2 --parallel 4" --streams 1,4 --repeat 2 --duration 20
    # time to first token of a long chat's first and second turn (prompt reuse)
    python benchmarks/load_test.py --spawn "-m smollm2 --parallel 4" --turns 1000
    # the same load on llama-cpp-python's server (pip install 'llama-cpp-python[server]'), same file
    python benchmarks/load_test.py --llama-cpp ~/.cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --threads 2 --streams 1,4 --repeat 2 --duration 20

Loopback only. Bounded: no new request starts after --duration seconds, each request is capped
by --max-tokens and a timeout, then it stops by itself. Reports requests/s, generated tokens/s,
time-to-first-token, inter-token and total latency percentiles, failed requests, malformed
streams, and the server's RSS growth from the end of warm-up to the end (from /proc/PID/status).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Name four planets of the solar system.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
]


@dataclass
class Result:
    ok: bool
    start: float
    ttft: float | None = None
    total: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks
    text: str = ""
    tokens: int = 0
    malformed: str | None = None
    error: str | None = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    rss_kb: list[tuple[float, int]] = field(default_factory=list)


def check_stream(payloads: list[str], lenient: bool = False) -> tuple[int, str | None]:
    """(completion tokens from the usage chunk, None) or (0, what is wrong with the stream).
    lenient (another server, e.g. llama-cpp-python's, which sends no usage chunk): without one,
    the content chunks are counted as tokens."""
    if not payloads or payloads[-1] != "[DONE]":
        return 0, "no [DONE] at the end"
    try:
        chunks = [json.loads(p) for p in payloads[:-1]]
    except json.JSONDecodeError as e:
        return 0, f"bad JSON: {e}"
    if any("error" in c for c in chunks):
        return 0, "error event: " + json.dumps(chunks[-1])[:200]
    if len({c.get("id") for c in chunks}) != 1 or any(c.get("object") != "chat.completion.chunk" for c in chunks):
        return 0, "chunk ids/objects differ"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    if not finishes or finishes[-1] not in ("stop", "length") or any(finishes[:-1]):
        return 0, f"finish_reason sequence {finishes[-3:]}"
    usage = chunks[-1].get("usage")
    if lenient and not usage:
        return sum(bool(c["choices"][0].get("delta", {}).get("content")) for c in chunks if c.get("choices")), None
    if chunks[-1].get("choices") or not usage:
        return 0, "no usage chunk at the end"
    return int(usage["completion_tokens"]), None


async def one_request(client: httpx.AsyncClient, args, rng: random.Random, messages: list | None = None) -> Result:
    messages = messages or [{"role": "user", "content": rng.choice(PROMPTS)}]
    body = {"model": args.model, "messages": messages,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": rng.randrange(2**31),
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False, start=time.monotonic())
    payloads: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line or line.startswith(":"):  # blank, or an SSE comment (keep-alive pings)
                    continue
                if not line.startswith("data: "):
                    res.malformed = f"non-data line {line[:80]!r}"
                    continue
                payloads.append(line[6:])
                if _has_content(line[6:]):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.total = time.perf_counter() - t0
    res.tokens, problem = check_stream(payloads, lenient=args.llama_cpp is not None)
    if problem is None:
        res.text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, payloads[:-1])
                           if c.get("choices"))
    res.malformed = res.malformed or problem
    res.ok = res.malformed is None
    return res


def _has_content(payload: str) -> bool:
    """A chunk that carries generated text (any JSON spacing)."""
    if '"content"' not in payload:
        return False
    try:
        return any(c.get("delta", {}).get("content") for c in json.loads(payload).get("choices", []))
    except (json.JSONDecodeError, AttributeError):
        return False


async def client_loop(i: int, client: httpx.AsyncClient, args, deadline: float, run: Run) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < deadline:
        run.results.append(await one_request(client, args, rng))


def read_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def watch_rss(pid: int | None, run: Run, stop: asyncio.Event) -> None:
    while pid and not stop.is_set():
        kb = read_rss_kb(pid)
        if kb is not None:
            run.rss_kb.append((time.monotonic(), kb))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def load(args, pid: int | None, clients: int | None = None) -> tuple[Run, float, float]:
    clients = clients or args.clients
    run, stop = Run(), asyncio.Event()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits) as client:
        watcher = asyncio.create_task(watch_rss(pid, run, stop))
        t0 = time.monotonic()
        deadline = t0 + args.duration
        await asyncio.gather(*(client_loop(i, client, args, deadline, run) for i in range(clients)))
        elapsed = time.monotonic() - t0
        stop.set()
        await watcher
    return run, t0, elapsed


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summarize(run: Run, t0: float, elapsed: float, args, clients: int | None = None) -> dict:
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    total = [r.total for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    warm = [kb for t, kb in run.rss_kb if t >= t0 + args.warmup]
    out = {
        "clients": clients or args.clients, "duration_s": round(elapsed, 1), "max_tokens": args.max_tokens,
        "requests": len(run.results), "completed": len(ok),
        "failed": sum(r.error is not None for r in run.results),
        "malformed_streams": sum(r.malformed is not None for r in run.results),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "generated_tokens": sum(r.tokens for r in ok),
        "tokens_per_s": round(sum(r.tokens for r in ok) / elapsed, 2),
        "mean_tokens_per_request": round(statistics.mean([r.tokens for r in ok]), 1) if ok else 0,
        "ttft_s": {f"p{q}": round(pct(ttft, q), 3) for q in (50, 90, 99)},
        "inter_token_s": {f"p{q}": round(pct(gaps, q), 4) for q in (50, 90, 99)},
        "total_s": {f"p{q}": round(pct(total, q), 3) for q in (50, 90, 99)},
    }
    if warm:
        out["rss_mb"] = {"after_warmup": round(warm[0] / 1024, 1), "end": round(warm[-1] / 1024, 1),
                         "max": round(max(warm) / 1024, 1), "growth": round((warm[-1] - warm[0]) / 1024, 1)}
    errors = [r.error or r.malformed for r in run.results if not r.ok]
    if errors:
        out["first_errors"] = errors[:5]
    return out


def scaling(args, pid: int | None) -> dict:
    """Aggregate generated tokens/s for each stream count of --streams, the counts alternated
    --repeat times; medians, and each count's median over the first count's."""
    counts = [int(x) for x in args.streams.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for _ in range(args.repeat):
        for n in counts:
            run, t0, elapsed = asyncio.run(load(args, pid, n))
            runs[n].append(summarize(run, t0, elapsed, args, n))
    med = {n: statistics.median(r["tokens_per_s"] for r in runs[n]) for n in counts}
    return {"streams": {str(n): {"tokens_per_s_runs": [r["tokens_per_s"] for r in runs[n]],
                                 "tokens_per_s_median": med[n],
                                 "inter_token_p50_s": [r["inter_token_s"]["p50"] for r in runs[n]],
                                 "failed": sum(r["failed"] + r["malformed_streams"] for r in runs[n]),
                                 "first_errors": [e for r in runs[n] for e in r.get("first_errors", [])][:3]}
                        for n in counts},
            "speedup_over_first": {str(n): round(med[n] / med[counts[0]], 2) for n in counts}}


LONG_TEXT = ("The history of computing spans centuries, from the abacus to mechanical calculators, from punched "
             "cards to vacuum tubes, transistors and integrated circuits. ")


async def two_turns(args, n_tokens: int) -> dict:
    """A first chat turn of about `n_tokens` prompt tokens, then a second turn on top of it: the
    time to first token of each (the second reuses the first's KV cache where the server keeps it)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    words = max(1, n_tokens // 24)  # LONG_TEXT is about 24 tokens in common BPE vocabularies
    first = [{"role": "user", "content": f"{LONG_TEXT * words}\nSummarize the text above in one sentence."}]
    async with httpx.AsyncClient(base_url=args.url, headers=headers) as client:
        r1 = await one_request(client, args, rng, first)
        second = first + [{"role": "assistant", "content": r1.text},
                          {"role": "user", "content": "Now say it in five words."}]
        r2 = await one_request(client, args, rng, second)
        m = (await client.get("/metrics")).text
    cached = [ln for ln in m.splitlines() if ln.startswith("sparseinfer_prefix_cache_tokens_total ")]
    return {"first_turn_ttft_s": r1.ttft and round(r1.ttft, 3), "second_turn_ttft_s": r2.ttft and round(r2.ttft, 3),
            "ratio": r1.ttft and r2.ttft and round(r2.ttft / r1.ttft, 3),
            "ok": r1.ok and r2.ok, "errors": [r.error or r.malformed for r in (r1, r2) if not r.ok],
            "server_cached_tokens_total": float(cached[0].split()[1]) if cached else None}


def wait_up(proc: subprocess.Popen, url: str, name: str, hint: str = "") -> subprocess.Popen:
    """Return `proc` once GET `url` answers 200; exit if it dies or is not up in 300 s."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}{hint}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} did not come up in 300 s")


def spawn_server(spec: str, url: str) -> subprocess.Popen:
    u = urlparse(url)
    cmd = [sys.executable, "-m", "sparseinfer.server", *shlex.split(spec), "--host", u.hostname, "--port", str(u.port)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    return wait_up(subprocess.Popen(cmd, stdout=subprocess.DEVNULL), url + "/health", "the server")


def spawn_llama_cpp(path: str, url: str, threads: int, ctx: int) -> subprocess.Popen:
    """llama-cpp-python's OpenAI server on the same model file, for a side-by-side run (it
    serves one request at a time)."""
    u = urlparse(url)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", str(ctx), "--host", u.hostname, "--port", str(u.port),
           "--interrupt_requests", "False"]  # its default cuts a running stream off when the next request comes
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_up(proc, url + "/v1/models", "llama_cpp.server", " (pip install 'llama-cpp-python[server]')")


def loopback_only(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise SystemExit(f"refusing to load-test {host}: loopback addresses only")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the RSS baseline is taken")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--model", default=None, help="model name to send (default: none, the served model)")
    ap.add_argument("--api-key", default=os.environ.get("SPARSEINFER_API_KEY"))
    ap.add_argument("--server-pid", type=int, default=None, help="watch this process's RSS")
    ap.add_argument("--spawn", default=None, help="start `python -m sparseinfer.server SPAWN` for the run")
    ap.add_argument("--llama-cpp", default=None, metavar="GGUF",
                    help="start llama-cpp-python's server on this model file for the run instead")
    ap.add_argument("--threads", type=int, default=2, help="with --llama-cpp: its threads")
    ap.add_argument("--ctx-size", type=int, default=4096, help="with --llama-cpp: its context size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the summary here too")
    ap.add_argument("--streams", default=None, metavar="N,M",
                    help="instead of one load run: aggregate tokens/s for each of these stream counts")
    ap.add_argument("--repeat", type=int, default=1, help="with --streams: alternate the counts this many times")
    ap.add_argument("--turns", type=int, default=None, metavar="TOKENS",
                    help="instead of one load run: TTFT of a chat's first turn of about TOKENS prompt tokens "
                         "and of its second turn")
    args = ap.parse_args()
    loopback_only(args.url)
    if args.spawn and args.llama_cpp:
        raise SystemExit("give --spawn or --llama-cpp, not both")
    if args.llama_cpp:
        proc = spawn_llama_cpp(args.llama_cpp, args.url, args.threads, args.ctx_size)
    else:
        proc = spawn_server(args.spawn, args.url) if args.spawn else None
    pid = proc.pid if proc else args.server_pid
    try:
        if args.streams:
            summary = scaling(args, pid)
        elif args.turns:
            summary = asyncio.run(two_turns(args, args.turns))
        else:
            run, t0, elapsed = asyncio.run(load(args, pid))
            summary = summarize(run, t0, elapsed, args)
            summary["server_metrics_tokens_total"] = _server_tokens(args)
    finally:
        if proc:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.streams:
        return 0 if all(v["failed"] == 0 for v in summary["streams"].values()) else 1
    if args.turns:
        return 0 if summary["ok"] else 1
    return 0 if summary["failed"] == 0 and summary["malformed_streams"] == 0 else 1


def _server_tokens(args) -> float | None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        text = httpx.get(args.url + "/metrics", headers=headers, timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("sparseinfer_generation_tokens_total "):
            return float(line.split()[1])
    return None


if __name__ == "__main__":
    sys.exit(main())
