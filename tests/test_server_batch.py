"""The server's batching engine on SmolLM2: a request's greedy output does not depend on what
runs beside it (batched decode, chunked prefill), cancellation frees the row, prompt reuse gives
the cold run's output, and log-probabilities match a direct forward pass (through the HTTP API
and the official `openai` client)."""
from __future__ import annotations

import gc
import json
import threading
import weakref

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import sparseinfer  # noqa: E402
from sparseinfer.errors import SparseInferError  # noqa: E402
from sparseinfer.kernels import cpu  # noqa: E402
from sparseinfer.server.app import Settings, create_app  # noqa: E402
from sparseinfer.server.background import BackgroundServer  # noqa: E402
from sparseinfer.server.engine import Engine, EngineBusyError, GenParams  # noqa: E402

pytestmark = pytest.mark.slow

CTX = 256
PROMPTS = ["The capital of Germany is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return sparseinfer.load(smollm2_path, ctx_size=CTX)


def run(engine, params_list, cancel_after=None):
    """Submit every GenParams at once; (token ids, last response or error) per request. The request
    at index `cancel_after[0]` is cancelled after `cancel_after[1]` tokens."""
    outs = [[] for _ in params_list]
    done = [threading.Event() for _ in params_list]
    seqs = []

    def sink(i):
        def f(item):
            outs[i].append(item)
            if isinstance(item, Exception) or item.finish_reason or (
                    cancel_after and cancel_after[0] == i and len(outs[i]) == cancel_after[1]):
                if cancel_after and cancel_after[0] == i and not isinstance(item, Exception):
                    engine.cancel(seqs[i])
                done[i].set()
        return f
    for i, p in enumerate(params_list):
        seqs.append(engine.submit(p, sink(i)))
    for d in done:
        assert d.wait(120)
    return [([r.token for r in o if not isinstance(r, Exception)], o[-1]) for o in outs], seqs


def greedy(llm, prompt, n=12, **kw):
    return GenParams(tuple(llm.tokenizer.encode(prompt)), n, temperature=0.0, **kw)


@pytest.mark.skipif(not cpu.matmul_equals_gemv(), reason="multi-row products differ from one-row ones at this level")
def test_greedy_output_is_the_same_alone_and_batched(llm):
    """Each prompt alone, then all four together with a small prefill chunk (prompts prefilled in
    pieces while the others decode): the same tokens, and the steps were batched."""
    engine = Engine(llm, parallel=4, prefill_chunk=4, cache_ram=0).start()
    try:
        alone = [run(engine, [greedy(llm, p)])[0][0][0] for p in PROMPTS]
        together = [toks for toks, _ in run(engine, [greedy(llm, p) for p in PROMPTS])[0]]
        assert together == alone
        assert max(engine.metrics.batch_rows) == 4
        # and the C one-token path (a sequence alone, --parallel 1) agrees with the Python API's output
        ref = [[r.token for r in llm.stream_generate(p, max_tokens=12, temp=0) if r.token is not None] for p in PROMPTS]
        assert alone == ref
    finally:
        engine.stop()
    single = Engine(llm, parallel=1, cache_ram=0).start()
    try:
        assert [run(single, [greedy(llm, p)])[0][0][0] for p in PROMPTS] == ref
    finally:
        single.stop()


def test_cancellation_mid_batch_frees_the_row_and_its_cache(llm):
    engine = Engine(llm, parallel=3, cache_ram=0).start()
    try:
        alone = run(engine, [greedy(llm, PROMPTS[0], 20)])[0][0][0]
        results, seqs = run(engine, [greedy(llm, p, 20) for p in PROMPTS[:3]], cancel_after=(1, 3))
        cache = weakref.ref(seqs[1].cache) if seqs[1].cache is not None else None
        assert results[0][0] == alone
        assert len(results[1][0]) < 20 and results[2][1].finish_reason is not None
        assert engine.active == 0 and engine.metrics.sequences_finished["cancelled"] == 1
        assert seqs[1].cache is None
        gc.collect()
        assert cache is None or cache() is None
    finally:
        engine.stop()


def test_prompt_reuse_gives_the_cold_output(llm):
    """A second turn (the first prompt, its answer, a new question) starts from the first turn's
    cache and gives the same tokens as a cold run."""
    warm = Engine(llm, parallel=2, cache_ram=64 << 20).start()
    cold = Engine(llm, parallel=2, cache_ram=0).start()
    try:
        first = greedy(llm, PROMPTS[2], 16)
        (toks, _), = run(warm, [first])[0]
        second = GenParams(first.prompt_ids + tuple(toks) + tuple(llm.tokenizer.encode(" And then")), 16,
                           temperature=0.0)
        (hot, last), = run(warm, [second])[0]
        assert last.stats["cached_tokens"] == len(first.prompt_ids) + len(toks) - 1
        assert warm.metrics.prefix_hits == 1 and warm.metrics.cached_prompt_tokens == last.stats["cached_tokens"]
        (want, last_cold), = run(cold, [second])[0]
        assert last_cold.stats["cached_tokens"] == 0
        assert hot == want
    finally:
        warm.stop()
        cold.stop()


def test_engine_queue_errors_and_options(llm):
    engine = Engine(llm, parallel=1, max_queue=1, cache_ram=0).start()
    try:
        # a request that fails (its prompt does not fit) reports its error; the engine keeps serving
        (_, err), = run(engine, [GenParams(tuple(range(10, 10 + CTX + 5)), 4)])[0]
        assert isinstance(err, SparseInferError) and "context" in str(err)
        gate = threading.Event()
        first = engine.submit(greedy(llm, PROMPTS[0], 200), lambda item: gate.set())
        assert gate.wait(30)
        queued = engine.submit(greedy(llm, PROMPTS[1]), lambda item: None)
        with pytest.raises(EngineBusyError):
            engine.submit(greedy(llm, PROMPTS[2]), lambda item: None)
        engine.cancel(queued)
        assert engine.queued == 0
        engine.cancel(first)
        (toks, last), = run(engine, [greedy(llm, PROMPTS[3], 3)])[0]
        assert len(toks) == 3 and last.finish_reason == "length"
    finally:
        engine.stop()
    for kw, msg in (({"parallel": 0}, "--parallel"), ({"prefill_chunk": 0}, "--prefill-chunk"),
                    ({"cache_ram": -1}, "--cache-ram")):
        with pytest.raises(SparseInferError, match=msg):
            Engine(llm, **kw)


# ----------------------------------------------------------------------------- logprobs over HTTP
@pytest.fixture(scope="module")
def server(smollm2_path):
    llm = sparseinfer.load(smollm2_path, ctx_size=CTX)
    with BackgroundServer(create_app(Settings.for_model(llm), Engine(llm, parallel=2))) as s:
        s.model_id = Settings.for_model(llm).model_id
        yield s


def direct_logprobs(llm, ids):
    """log-softmax of one forward pass over all of `ids`: row j predicts ids[j + 1]."""
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids]), llm.new_cache(len(ids) + 1))[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_completion_echo_logprobs_match_a_forward_pass(server, llm):
    """What lm-eval's local-completions sends to score a continuation: token ids, echo, logprobs."""
    ids = llm.tokenizer.encode("The capital of France is Paris")
    body = {"prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["tokens"][: len(ids)] == [llm.tokenizer.decode([t]) for t in ids]
    assert r.json()["choices"][0]["text"].startswith(llm.tokenizer.decode(ids))
    gen = llm.tokenizer.encode(r.json()["choices"][0]["text"][len(llm.tokenizer.decode(ids)):])
    ref = direct_logprobs(llm, ids)
    want = [float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)] + [float(ref[-1].max())]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(want), atol=2e-3, rtol=0)
    top = lp["top_logprobs"][-1]
    assert len(top) == 2 and max(top.values()) == pytest.approx(lp["token_logprobs"][-1], abs=1e-6)
    assert gen and max(top, key=top.get) == llm.tokenizer.decode([int(ref[-1].argmax())])


def test_openai_client_reads_chat_logprobs(server, llm):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and r.usage.prompt_tokens_details.cached_tokens >= 0
    ids = llm.encode_chat_text(llm.format_chat(msgs))
    ref = direct_logprobs(llm, ids)
    first = content[0]
    assert first.token == llm.tokenizer.decode([int(ref[-1].argmax())])
    assert first.logprob == pytest.approx(float(ref[-1].max()), abs=2e-3)
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].logprob == pytest.approx(first.logprob, abs=1e-6)
    # streamed: every chunk with text carries the logprobs of its tokens
    chunks = list(client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices and
                                               ch.choices[0].logprobs else [])]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_n_choices(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model=server.model_id, prompt="Hello", max_tokens=5, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1  # greedy: the same text
    assert r.usage.completion_tokens > 0 and r.usage.completion_tokens % 3 == 0  # three equal choices
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.8, "seed": 1, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        data = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    finishes = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_prompt_logprobs_across_prefill_chunks(llm):
    """Echo log-probabilities of a prompt prefilled in chunks of 3 (the last position of each
    chunk predicts the first token of the next): those of forward passes over the same chunks,
    and those of one pass over the whole prompt within the accuracy contract."""
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank")
    engine = Engine(llm, parallel=2, prefill_chunk=3, cache_ram=0).start()
    try:
        (_, last), = run(engine, [GenParams(tuple(ids), 1, temperature=0.0, logprobs=1, prompt_logprobs=True)])[0]
    finally:
        engine.stop()
    got = last.stats["prompt_logprobs"]
    assert [t.token for t in got] == ids and got[0].logprob is None
    values = torch.tensor([t.logprob for t in got[1:]])
    cache = llm.new_cache(len(ids) + 1)
    with torch.inference_mode():
        chunks = torch.cat([llm.model(torch.tensor([ids[s: s + 3]]), cache)[0] for s in range(0, len(ids), 3)])
    same = torch.log_softmax(chunks.float(), dim=-1)
    torch.testing.assert_close(values, torch.tensor([float(same[j, ids[j + 1]]) for j in range(len(ids) - 1)]),
                               atol=1e-6, rtol=0)
    ref = direct_logprobs(llm, ids)
    want = torch.tensor([float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)])
    torch.testing.assert_close(values, want, atol=1e-2, rtol=0)
    assert all(len(t.top) == 1 and t.top[0][1] >= t.logprob - 1e-6 for t in got[1:])
