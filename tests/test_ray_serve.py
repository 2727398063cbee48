"""Replicas on Ray Serve: a local Ray instance (2 CPUs, no dashboard) running 2 replicas of
SmolLM2 with 1 thread each behind Ray's HTTP proxy on a loopback port.

References: the Python API on a copy of the model in this process (answers), and the
single-process server on another copy (stream and error shapes). Ray is shut down at the end.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import sparseinfer  # noqa: E402
from sparseinfer.server.app import Settings, create_app  # noqa: E402
from sparseinfer.server.background import BackgroundServer  # noqa: E402
from sparseinfer.server.engine import Engine  # noqa: E402
from sparseinfer.server.ray_app import APP_NAME, REPLICA_HEADER, ReplicaOptions, application  # noqa: E402
from test_server import BAD, CTX, sse_payloads  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-ray-test"
KEY_ENV = "SPARSEINFER_TEST_RAY_KEY"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
VOLATILE = {"id", "created", "cached_tokens"}  # differ between two responses (cached: the server's prompt cache)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_options(path) -> ReplicaOptions:
    return ReplicaOptions(model=str(path), threads=1, ctx_size=CTX, parallel=1, api_key_env=KEY_ENV)


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    """The URL of Ray Serve's proxy in front of 2 replicas; Ray is shut down afterwards."""
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, logging_level="error",
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(replica_options(smollm2_path), replicas=2, env={KEY_ENV: KEY}), name=APP_NAME,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def ref(smollm2_path):
    return sparseinfer.load(smollm2_path, ctx_size=CTX)


@pytest.fixture(scope="module")
def single(smollm2_path):
    """The single-process server on the same model, for shapes."""
    llm = sparseinfer.load(smollm2_path, ctx_size=CTX)
    with BackgroundServer(create_app(Settings.for_model(llm, str(smollm2_path), api_key=KEY), Engine(llm))) as s:
        yield s.url


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=120)


def reference(llm, messages, max_tokens):
    ids = llm.encode_chat_text(llm.format_chat(messages))
    rs = list(llm.stream_generate(ids, max_tokens=max_tokens, temp=0))
    return "".join(r.text for r in rs), rs[-1].finish_reason


def stream(url, body, on_open=None):
    """(replica, data lines) of a streamed chat completion."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        if on_open:
            on_open(r.headers[REPLICA_HEADER])
        return r.headers[REPLICA_HEADER], list(r.iter_lines())


def stable(obj):
    """A response body without the fields that differ between any two responses."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def wait_for_running(n: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = serve.status().applications[APP_NAME].deployments["SparseInferReplica"].replica_states
        if states.get("RUNNING", 0) == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"not {n} running replicas after {timeout:g} s: {states}")


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ----------------------------------------------------------------------------- answers and streams
def test_openai_client_gets_the_python_api_answer(client, ref):
    want, finish = reference(ref, CHAT, 12)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == finish
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stream_is_the_single_process_stream(cluster, single):
    messages = [{"role": "user", "content": "Name a color."}]  # new to both: no cached prefix in either
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream_options": {"include_usage": True}}
    _, lines = stream(cluster, body)
    with httpx.stream("POST", single + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        want = list(r.iter_lines())
    assert [stable(p) for p in sse_payloads(lines)] == [stable(p) for p in sse_payloads(want)]


@pytest.mark.parametrize("path,body,raw,status,code,param", BAD[:8])
def test_errors_are_the_single_process_errors(cluster, single, path, body, raw, status, code, param):
    def ask(url):
        content = raw if raw is not None else json.dumps(body)
        r = httpx.post(url + path, content=content, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
        return r.status_code, r.json()
    assert ask(cluster) == ask(single)


def test_auth_and_unknown_route_errors_are_the_single_process_errors(cluster, single):
    for method, path, headers in [("POST", "/v1/chat/completions", {}), ("GET", "/v1/nowhere", AUTH),
                                  ("GET", "/v1/models/nope", AUTH)]:
        got = [httpx.request(method, url + path, headers=headers, json={"messages": CHAT}, timeout=60)
               for url in (cluster, single)]
        assert [(r.status_code, r.json()) for r in got][0] == [(r.status_code, r.json()) for r in got][1]


# ----------------------------------------------------------------------------- replicas
def test_requests_spread_over_both_replicas(cluster):
    """Concurrent requests land on both replicas, and each replica's own /metrics counts the
    requests it answered."""
    def ask(i):
        r = httpx.post(cluster + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 6})
        assert r.status_code == 200, r.text
        return r.headers[REPLICA_HEADER]
    with ThreadPoolExecutor(4) as ex:
        served = list(ex.map(ask, range(8)))
    assert len(set(served)) == 2, served
    seen: dict[str, str] = {}
    for _ in range(60):  # the proxy picks a replica for each scrape: scrape until both answered
        r = httpx.get(cluster + "/metrics", timeout=30)
        seen.setdefault(r.headers[REPLICA_HEADER], r.text)
        if len(seen) == 2:
            break
    assert set(seen) == set(served)
    for replica, text in seen.items():
        answered = metric(text, "sparseinfer_requests_total", '{endpoint="/v1/chat/completions",status="200"}')
        assert answered >= served.count(replica) > 0
        assert metric(text, "sparseinfer_generation_tokens_total") > 0


def test_killing_a_replica_fails_only_its_stream(cluster, client):
    """A replica dies mid-stream: that stream ends in an error at the client (never as if
    complete), the other replica's stream completes, and the next request is answered."""
    body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 200, "temperature": 0}
    replicas, opened = [], threading.Semaphore(0)

    def one():
        try:
            return stream(cluster, body, on_open=lambda rep: (replicas.append(rep), opened.release()))
        except Exception as e:  # noqa: BLE001  (what the client sees is the point)
            return e

    with ThreadPoolExecutor(2) as ex:
        victim = ex.submit(one)
        assert opened.acquire(timeout=60)
        survivor = ex.submit(one)
        assert opened.acquire(timeout=60)
        assert replicas[0] != replicas[1], replicas
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
        failed, completed = victim.result(120), survivor.result(120)
    assert not isinstance(completed, Exception), completed
    assert sse_payloads(completed[1])[-1]["choices"][0]["finish_reason"] == "length"
    # the proxy cuts the killed replica's connection before `data: [DONE]`: the client raises
    assert isinstance(failed, httpx.RemoteProtocolError), failed
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, max_tokens=4)
    assert r.choices[0].message.content


def test_replicas_being_replaced_finish_their_streams(cluster, smollm2_path):
    """Graceful draining: redeploying with 1 replica replaces both replicas while each serves a
    stream; both streams still complete (`finish_reason` and `[DONE]`), then the new replica answers.
    (Last: it leaves one replica.)"""
    body = {"messages": [{"role": "user", "content": "Write a long story about a ship."}], "max_tokens": 200,
            "temperature": 0}
    wait_for_running(2)  # the replacement of the replica killed above, known to the proxy:
    seen = set()
    for _ in range(120):
        seen.add(httpx.get(cluster + "/health", timeout=30).headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
        time.sleep(0.25)
    assert len(seen) == 2, seen
    replicas, opened = [], threading.Semaphore(0)
    with ThreadPoolExecutor(2) as ex:
        streams = [ex.submit(stream, cluster, body, lambda rep: (replicas.append(rep), opened.release()))]
        assert opened.acquire(timeout=60)
        streams.append(ex.submit(stream, cluster, body, lambda rep: (replicas.append(rep), opened.release())))
        assert opened.acquire(timeout=60)
        serve.run(application(replica_options(smollm2_path), replicas=1, env={KEY_ENV: KEY}), name=APP_NAME,
                  route_prefix="/")
        done = [f.result(120) for f in streams]
    assert len(set(replicas)) == 2
    for _, lines in done:
        assert sse_payloads(lines)[-1]["choices"][0]["finish_reason"] == "length"
    r = httpx.get(cluster + "/health", timeout=30)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] not in replicas
