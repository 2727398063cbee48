"""The OpenAI-compatible server, in-process on a loopback port, with SmolLM2 and 2 slots.

References come from the Python API (`LLM.generate`) on a second copy of the model, so the
server's worker thread is the only user of its own copy.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import sparseinfer  # noqa: E402
from sparseinfer.server.app import Settings, create_app  # noqa: E402
from sparseinfer.server.background import BackgroundServer  # noqa: E402
from sparseinfer.server.engine import Engine  # noqa: E402
from sparseinfer.server.limits import Limits  # noqa: E402
from sparseinfer.server.prepare import longest_token_chars  # noqa: E402

pytestmark = pytest.mark.slow

CTX = 512
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ref(smollm2_path):
    return sparseinfer.load(smollm2_path, ctx_size=CTX)


@pytest.fixture(scope="module")
def server(smollm2_path):
    llm = sparseinfer.load(smollm2_path, ctx_size=CTX)
    settings = Settings.for_model(llm, api_key=KEY)
    engine = Engine(llm, parallel=2)
    with BackgroundServer(create_app(settings, engine)) as s:
        s.settings, s.engine = settings, engine
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_ids(llm, messages):
    return llm.encode_chat_text(llm.format_chat(messages))


def reference(llm, prompt, max_tokens):
    """(text, generation_tokens, finish_reason) of greedy generation through the Python API."""
    rs = list(llm.stream_generate(prompt, max_tokens=max_tokens, temp=0))
    return "".join(r.text for r in rs), rs[-1].generation_tokens, rs[-1].finish_reason


def post(server, path, body=None, raw=None, headers=AUTH, timeout=120):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=timeout)


def sse_payloads(lines):
    """JSON payloads of a stream's `data:` lines; asserts it ends with [DONE] and nothing follows."""
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    assert all(ln.startswith("data: ") or ln == "" for ln in lines), lines
    return [json.loads(d) for d in data[:-1]]


def stream_lines(server, path, body, on_line=None):
    lines = []
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for ln in r.iter_lines():
            lines.append(ln)
            if on_line:
                on_line(ln)
    return lines


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(server.url + "/health").json()
        if h["active_slots"] == 0 and h["queue_depth"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"slots still busy after {timeout}s: {h}")


# ----------------------------------------------------------------------------- happy paths
def test_health_and_models(server, client):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["slots"] == 2
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.settings.model_id]
    assert httpx.get(server.url + "/").text.lstrip().startswith("<!doctype html>")


def test_chat_matches_python_api(server, client, ref):
    want, n_gen, finish = reference(ref, chat_ids(ref, CHAT), 12)
    r = client.chat.completions.create(model=server.settings.model_id, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(chat_ids(ref, CHAT))
    assert r.usage.completion_tokens == n_gen
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_gen


def test_chat_stream_with_usage(server, client, ref):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    want, n_gen, finish = reference(ref, chat_ids(ref, messages), 8)
    # the file name is accepted as the model name too
    chunks = list(client.chat.completions.create(
        model=ref.info.path.name, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_gen
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(ref, messages))
    assert len({c.id for c in chunks}) == 1


def test_completion_plain_and_stream(server, client, ref):
    prompt = "The three primary colors are"
    want, n_gen, finish = reference(ref, prompt, 10)
    r = client.completions.create(model=server.settings.model_id, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == finish == "length"
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt)) and r.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=server.settings.model_id, prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_parameters_and_stop(server, client, ref):
    prompt = "1, 2, 3, 4,"
    want, _, _ = reference(ref, prompt, 12)
    stop = want.strip().split(",")[1].strip()  # a number the greedy continuation will write
    r = client.completions.create(model=server.settings.model_id, prompt=prompt, max_tokens=12, temperature=0,
                                  stop=[stop, "zzz"])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert want.startswith(r.choices[0].text)
    kw = dict(model=server.settings.model_id, prompt=prompt, max_tokens=6, temperature=0.9, top_p=0.9,
              seed=7, presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 20, "min_p": 0.05})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample


@pytest.mark.parametrize("prompt,temp,extra", [
    ("Once upon a time", 1.5, {"min_p": 0.3}), ("Once upon a time", 1.5, {"top_k": 3}),
    ("Once upon a time", 1.5, {"top_p": 0.5}), ("1, 1, 1, 1, 1, 1,", 0.7, {"presence_penalty": 2.0}),
    ("1, 1, 1, 1, 1, 1,", 0.7, {"frequency_penalty": 2.0})])
def test_every_sampling_parameter_reaches_the_sampler(server, ref, prompt, temp, extra):
    """A seeded sample equals the Python API's with the same settings, and differs from the
    sample without the setting (so a parameter the server drops shows)."""
    base = dict(max_tokens=16, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    sample = lambda **kw: "".join(r.text for r in ref.stream_generate(prompt, temp=temp, **(base | kw)))  # noqa: E731
    want = sample(**extra)
    assert want != sample(), "this setting does not change the sample here: pick another prompt"
    # all of the prompt computed afresh, as the API does: an earlier case's cached prefix would
    # leave only the last prompt token to run, on the one-token path, whose logits differ from
    # the prefill's in the last bits, which a temperature of 1.5 can turn into another sample
    server.engine.prefix_cache.clear()
    r = post(server, "/v1/completions", dict(prompt=prompt, temperature=temp, **(base | extra)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


# ----------------------------------------------------------------------------- bad input
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/chat/completions", None, "{not json", 400, "invalid_json", None),
    ("/v1/chat/completions", None, "[1, 2]", 400, None, None),
    ("/v1/chat/completions", {"messages": []}, None, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {}, None, 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, None, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, None, 400, None, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "5"}, None, 400, None, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -3}, None, 400, None, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, None, 400, None, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**9}, None, 400, "context_length_exceeded",
     "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": CTX + 1}, None, 400,
     "context_length_exceeded", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}, None, 400, "unsupported_value", "n"),
    ("/v1/chat/completions", {"messages": MSG, "n": 17}, None, 400, "unsupported_value", "n"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, None, 400, "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None, 400, None,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, None, 400, None, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "stop": 5}, None, 400, None, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, None, 400, None, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "top_k": -1}, None, 400, None, "top_k"),
    ("/v1/chat/completions", {"messages": MSG, "seed": 2**70}, None, 400, None, "seed"),
    ("/v1/chat/completions", {"messages": MSG, "model": "gpt-4o"}, None, 404, "model_not_found", "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * (CTX + 10)}]}, None, 400,
     "context_length_exceeded", "messages"),
    ("/v1/completions", {"prompt": "word " * (CTX + 10)}, None, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "other"}, None, 404, "model_not_found", "model"),
    ("/v1/completions", {"prompt": 42}, None, 400, None, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, None, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, None, 400, "unsupported_value", "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, None, 400, None, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, None, 400, "unsupported_parameter", "suffix"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, None, 400, "array_above_max_length", "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": "x" * 257}, None, 400, "string_above_max_length", "stop"),
]


@pytest.mark.parametrize("path,body,raw,status,code,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_an_openai_error(server, path, body, raw, status, code, param):
    r = post(server, path, body, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param


def test_bad_api_key_and_unknown_route(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # only /v1/* is guarded
    r = httpx.get(server.url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()


def test_huge_body_is_refused(server):
    r = post(server, "/v1/completions", raw='{"prompt": "' + "a" * (9 << 20) + '"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_serving_continues_after_errors(server, client):
    for path, body, raw, *_ in BAD[:4]:
        post(server, path, body, raw)
    r = client.chat.completions.create(model=server.settings.model_id, messages=MSG, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# ----------------------------------------------------------------------------- concurrency
def test_two_concurrent_streams_match_sequential(server, ref):
    prompts = ["The capital of Germany is", "def fibonacci(n):"]
    n = 16
    want = [reference(ref, p, n)[0] for p in prompts]
    results, first, last = [None, None], [None, None], [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        def seen(ln):
            if ln.startswith("data: {"):
                first[i] = first[i] or time.monotonic()
        barrier.wait()
        body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "stream": True}
        results[i] = stream_lines(server, "/v1/completions", body, seen)
        last[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(2):
        chunks = sse_payloads(results[i])
        assert "".join(c["choices"][0]["text"] for c in chunks) == want[i]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert len({c["id"] for c in chunks}) == 1
    assert first[0] < last[1] and first[1] < last[0], "the two sequences did not decode together"
    wait_idle(server)


def _cancelled(server) -> float:
    m = re.search(r'^sparseinfer_sequences_total\{reason="cancelled"\} (\S+)$',
                  httpx.get(server.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_stream_disconnect_frees_the_slot(server, client):
    before = _cancelled(server)
    body = {"prompt": "Once upon a time", "max_tokens": CTX - 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        got = 0
        for ln in r.iter_lines():
            got += ln.startswith("data: {")
            if got == 2:
                break  # leave mid-stream: closing the response drops the connection
    assert wait_idle(server, timeout=5)["active_slots"] == 0
    assert _cancelled(server) == before + 1
    r = client.completions.create(model=server.settings.model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_non_stream_disconnect_frees_the_slot(server):
    before = _cancelled(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": CTX - 16, "temperature": 0},
             timeout=1.0)
    assert wait_idle(server, timeout=8)["active_slots"] == 0
    assert _cancelled(server) == before + 1


# ----------------------------------------------------------------------------- metrics
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> dict[str, float]:
    """A strict reader of the text format: every line is HELP, TYPE or a sample of a typed family."""
    typed, samples = set(), {}
    for ln in text.splitlines():
        if ln.startswith("# HELP "):
            continue
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split(" ")
            assert kind in {"counter", "gauge", "summary", "histogram", "untyped"}
            typed.add(name)
            continue
        m = SAMPLE.match(ln)
        assert m, f"not a Prometheus sample: {ln!r}"
        name = m.group(1)
        assert any(name == t or name.startswith(t + "_") for t in typed), f"untyped sample {name}"
        samples[name + (m.group(2) or "")] = float(m.group(4))
    return samples


def test_metrics(server, client):
    client.completions.create(model=server.settings.model_id, prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    s = parse_prometheus(text)
    assert s['sparseinfer_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert s['sparseinfer_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 1
    assert s["sparseinfer_prompt_tokens_total"] > 0 and s["sparseinfer_generation_tokens_total"] >= 3
    assert s["sparseinfer_generation_tokens_per_second"] >= 0
    assert s["sparseinfer_slots"] == 2 and s["sparseinfer_queue_depth"] == 0
    assert "sparseinfer_active_slots" in s
    assert s["sparseinfer_queue_time_seconds_count"] >= 1
    assert s['sparseinfer_decode_batch_size_bucket{le="+Inf"}'] == s["sparseinfer_decode_batch_size_count"] >= 1
    assert s['sparseinfer_prefix_cache_lookups_total{result="hit"}'] + \
        s['sparseinfer_prefix_cache_lookups_total{result="miss"}'] == s["sparseinfer_queue_time_seconds_count"]
    assert s["sparseinfer_prefix_cache_bytes"] >= 0 and "sparseinfer_prefix_cache_tokens_total" in s


# ----------------------------------------------------------------------------- limits and hardening
@contextmanager
def limits(server, **kw):
    """The server's limits changed for the duration (they are read per request)."""
    old = server.settings.limits
    server.settings.limits = replace(old, **kw)
    try:
        yield
    finally:
        server.settings.limits = old


def raw_request(server, head: bytes, body: bytes = b"") -> socket.socket:
    """A connection that has sent `head` (request line and headers) and `body`, left open."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(head + body)
    return sock


def partial_post_head(server, length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def request_count(server, status: int, endpoint="/v1/completions") -> float:
    s = parse_prometheus(httpx.get(server.url + "/metrics").text)
    return s.get(f'sparseinfer_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0.0)


def assert_still_serving(server, client):
    r = client.completions.create(model=server.settings.model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_tiny_temperature_is_greedy(server, ref):
    """A temperature too small for float32 logits samples greedily, in the Python API and the server."""
    prompt = "The capital of France is"
    greedy = ref.generate(prompt, max_tokens=8, temp=0)
    for temp in (1e-6, 1e-39, 5e-324):
        assert ref.generate(prompt, max_tokens=8, temp=temp, seed=3) == greedy
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": temp, "seed": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy


def test_stop_limits_are_inclusive(server, ref):
    prompt = "1, 2, 3, 4,"
    want, _, _ = reference(ref, prompt, 6)
    stops = ["z" * 256] * 16  # at the limits, never matched
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stop": stops})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    with limits(server, max_stops=2):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "stop": ["a", "b", "c"]})
        assert r.status_code == 400 and "--max-stops" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_long_prompt_refused_before_tokenizing(server, path, field):
    """Over context x longest-token characters the prompt cannot fit: refused by its length, with
    the tokenizer never called."""
    llm = server.engine.llm
    bound = CTX * longest_token_chars(llm.tokenizer)
    text = "a" * (bound + 1)
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    calls, encode = [], llm.tokenizer.encode
    llm.tokenizer.encode = lambda *a, **kw: calls.append(1) or encode(*a, **kw)
    try:
        r = post(server, path, body)
    finally:
        del llm.tokenizer.encode
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == field
    assert "characters" in err["message"] and calls == []
    with limits(server, max_prompt_chars=10):
        r = post(server, "/v1/completions", {"prompt": "a" * 11, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_foreign_host_is_refused(server, client):
    body = {"prompt": "Hi", "max_tokens": 1}
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example"):
        r = post(server, "/v1/completions", body, headers={**AUTH, "Host": host})
        assert r.status_code == 403, host
        assert r.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/", headers={"Host": host}).status_code == 403
    for host in (f"localhost:{server.port}", f"[::1]:{server.port}", "127.0.0.1", "10.1.2.3:80", "app.localhost"):
        assert post(server, "/v1/completions", body, headers={**AUTH, "Host": host}).status_code == 200, host
    with limits(server, allowed_hosts=("evil.example",)):
        assert post(server, "/v1/completions", body, headers={**AUTH, "Host": "Evil.Example:1"}).status_code == 200
    with limits(server, allowed_hosts=("*",)):
        assert post(server, "/v1/completions", body, headers={**AUTH, "Host": "any.example"}).status_code == 200
    assert_still_serving(server, client)


def test_cross_origin_request_is_refused(server):
    body = {"prompt": "Hi", "max_tokens": 1}
    for origin in ("http://evil.example", "null", f"http://localhost:{server.port + 1}"):
        r = post(server, "/v1/completions", body, headers={**AUTH, "Origin": origin})
        assert r.status_code == 403, origin
        assert r.json()["error"]["code"] == "origin_not_allowed" and "--allowed-origins" in r.json()["error"]["message"]
    # the chat page's own origin (its POSTs carry it), and an allowed one
    assert post(server, "/v1/completions", body, headers={**AUTH, "Origin": server.url}).status_code == 200
    with limits(server, allowed_origins=("http://evil.example",)):
        r = post(server, "/v1/completions", body, headers={**AUTH, "Origin": "http://evil.example"})
        assert r.status_code == 200


def test_allowed_origin_gets_cors_preflight(server):
    from starlette.testclient import TestClient

    origin = "http://localhost:3000"
    settings = Settings.for_model(server.engine.llm, api_key=KEY, limits=Limits(allowed_origins=(origin,)))
    app = create_app(settings, Engine(server.engine.llm))  # never started: preflights do not generate
    tc = TestClient(app, base_url="http://127.0.0.1:8080")
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    r = tc.options("/v1/chat/completions", headers={"Origin": origin, **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = tc.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_body_of_many_small_values_is_refused_unparsed(server, client):
    """Parsing costs memory per JSON value: a body of more values than a fitting request has is
    refused before parsing (default 8 x context + 4096)."""
    many = [{"role": "user", "content": "hi"}] * (4 * CTX + 2048)
    r = post(server, "/v1/chat/completions", {"messages": many, "max_tokens": 1})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-json-values" in err["message"]
    ids = server.engine.llm.tokenizer.encode("hello " * (CTX // 2))[: CTX - 8]  # token ids that fit pass
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "stop": ["a", "b"]})
    assert r.status_code == 200, r.text
    with limits(server, max_json_values=3):
        r = post(server, "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 1})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_still_serving(server, client)


def test_post_must_be_json(server, client):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(server.url + "/v1/completions", content=body.encode(), headers=headers)
        assert r.status_code == 415, ctype
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(server.url + "/v1/completions", content=body.encode(),
                   headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_client_leaving_mid_body_is_a_quiet_499(server, client):
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "sparseinfer.server", "")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        before, before_500 = request_count(server, 499), request_count(server, 500)
        raw_request(server, partial_post_head(server, 1000), b'{"prompt": "Hel').close()
        deadline = time.monotonic() + 10
        while request_count(server, 499) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert request_count(server, 499) == before + 1
        assert request_count(server, 500) == before_500
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert not errors, [e.getMessage() for e in errors]
    assert_still_serving(server, client)


def test_slow_body_times_out(server, client):
    with limits(server, body_timeout_s=0.5):
        sock = raw_request(server, partial_post_head(server, 1000), b'{"prompt": "Hel')
        t0 = time.monotonic()
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
    assert time.monotonic() - t0 < 10
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(payload)["error"]
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"]
    assert_still_serving(server, client)


def test_looping_chat_template_is_stopped(server, client):
    """A template that runs for hours on a long message is stopped at --chat-template-timeout."""
    tok = server.engine.llm.tokenizer
    saved = tok.chat_templates, tok.chat_template, tok._compiled_templates
    src = ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}{% endfor %}"
           "{{ m.content }}{% endfor %}")
    tok.chat_templates, tok.chat_template, tok._compiled_templates = {"default": src}, src, {}
    try:
        with limits(server, chat_template_timeout_s=0.3):
            t0 = time.monotonic()
            r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 50_000}],
                                                      "max_tokens": 1})
            assert time.monotonic() - t0 < 10
    finally:
        tok.chat_templates, tok.chat_template, tok._compiled_templates = saved
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "chat_template_timeout" and err["param"] == "messages"
    assert "--chat-template-timeout" in err["message"]
    assert_still_serving(server, client)


def test_host_and_origin_rules():
    from sparseinfer.server.limits import count_json_values, host_allowed, host_name, origin_allowed

    assert [host_name(h) for h in ("Example.COM:8080", "[::1]:80", "::1", "localhost.", "10.0.0.1")] == \
        ["example.com", "::1", "::1", "localhost", "10.0.0.1"]
    assert host_allowed(None, ()) and host_allowed("sub.localhost:1", ()) and host_allowed("[fe80::1]:8080", ())
    assert not host_allowed("localhost.evil.example", ()) and not host_allowed("2130706433", ())
    assert host_allowed("gpu-box.lan:8080", ("gpu-box.lan",)) and host_allowed("x", ("*",))
    assert origin_allowed(None, "evil.example", ())
    assert origin_allowed("https://chat.example", "chat.example:443", ())  # default ports
    assert origin_allowed("http://[::1]:8080", "[::1]:8080", ())
    assert not origin_allowed("http://127.0.0.1:8081", "127.0.0.1:8080", ())
    assert not origin_allowed("null", "127.0.0.1:8080", ()) and origin_allowed("null", "x", ("null",))
    assert origin_allowed("HTTP://App.Example:3000", "127.0.0.1", ("http://app.example:3000/",))
    body = b'{"a": "x,\\", [{", "b": [1, 2, {}]}'
    assert count_json_values(body) == 6 and count_json_values(body, 100) == 10  # in strings too, under a bound


def test_serve_options_make_limits():
    import argparse

    from sparseinfer.commands.serve import add_arguments, limits_from_args
    from sparseinfer.errors import SparseInferError

    p = argparse.ArgumentParser()
    add_arguments(p)
    got = limits_from_args(p.parse_args(["--allowed-hosts", "a.lan, b", "--allowed-origins", "HTTP://X:3000/",
                                         "--max-body", "0.5", "--max-stops", "4"]))
    assert got.allowed_hosts == ("a.lan", "b") and got.allowed_origins == ("http://x:3000",)
    assert got.max_body_bytes == 1 << 19 and got.max_stops == 4 and got == replace(
        Limits(), allowed_hosts=got.allowed_hosts, allowed_origins=got.allowed_origins, max_body_bytes=1 << 19,
        max_stops=4)
    for bad in (["--body-timeout", "0"], ["--max-stops", "-1"], ["--allowed-origins", "localhost:3000"],
                ["--max-json-values", "0"]):
        with pytest.raises(SparseInferError, match=bad[0]):
            limits_from_args(p.parse_args(bad))
