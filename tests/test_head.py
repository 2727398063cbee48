"""The output head's preview (sparseinfer/sparse/head.py): candidates scored exactly, the
fallback to the exact head, the candidate selection, the fitted basis, and a pack's head in
decode."""
from __future__ import annotations

import pytest
import torch

from sparseinfer.kernels import cpu
from sparseinfer.models.layers import Linear
from sparseinfer.quant import from_float
from sparseinfer.sparse import head as sh


def _hidden(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few strong directions, as a final norm's outputs have."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[:3] = torch.tensor([8.0, 4.0, 2.0])
    return torch.randn(n, d, generator=g) * scale


def _head(vocab: int, d: int, fmt: str = "q8", rank: int | None = None, seed: int = 1) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, d, generator=g) * 0.1
    if rank is not None:  # a head of exactly this rank
        w = (torch.randn(vocab, rank, generator=g) @ torch.randn(rank, d, generator=g)) * 0.05
    return Linear(from_float(w, fmt))


def test_select_keeps_the_top_and_about_k():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(50000, generator=g)
    ids, sure = sh.select(p, 1024)
    assert ids is not None and 256 <= ids.numel() <= 4096
    assert torch.equal(ids, ids.sort().values)
    top = torch.topk(p, 200).indices
    assert torch.isin(top, ids).all()              # the true top 200 are candidates
    assert sure >= float(p[ids].min())
    # a vocabulary smaller than the sample: every token
    ids, _ = sh.select(p[:100], 256)
    assert torch.equal(ids, torch.arange(100))
    # a preview with no spread (all equal): the estimate is off, so no candidates
    assert sh.select(torch.zeros(50000), 1024)[0] is None


def test_select_adds_the_context():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(50000, generator=g)
    base, sure = sh.select(p, 1024)
    low = torch.topk(-p, 3).indices.tolist()                 # the three lowest previews
    ids, sure2 = sh.select(p, 1024, low + [low[0], -1, 50000])  # repeated and out-of-range ids are ignored
    assert sure2 == sure and torch.equal(ids, ids.sort().values)
    assert set(ids.tolist()) == set(base.tolist()) | set(low)
    # only the last CONTEXT_WINDOW tokens count
    old = low[:1] + [int(base[0])] * sh.CONTEXT_WINDOW
    assert set(sh.select(p, 1024, old)[0].tolist()) == set(base.tolist())


def test_a_context_token_the_preview_misses_is_scored_exactly():
    """A token whose preview is hopeless (its row of A very negative) but whose exact logit is the
    largest: without the context the greedy token is wrong; with the token in the context it is
    a candidate, so the greedy token and its logit are the exact head's."""
    vocab, d = 4096, 64
    exact = _head(vocab, d)
    hid = _hidden(500, d)
    hp = sh.preview(sh.fit(exact.weight, hid), 32, 256)
    for h in hid[:50]:
        want = int(exact(h[None])[0].argmax())
        a = hp.a.clone()
        a[want] = -100.0 * a.abs().max()
        ph = sh.PreviewHead(exact, sh.HeadPreview(a, hp.b, hp.candidates))
        if int(ph.row(h).argmax()) != want and ph.fallbacks == 0:
            break
    else:
        pytest.fail("no row where the hopeless preview misses the exact top token")
    out = ph.row(h, [7, want, 11])
    assert int(out.argmax()) == want and ph.fallbacks == 0
    torch.testing.assert_close(out[want], exact(h[None])[0][want], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt,preview_fmt", [("q8", "q8"), ("q6", "q8"), ("q4", "q8"), ("q6", "q4")])
def test_candidates_get_the_exact_heads_logits(fmt, preview_fmt):
    vocab, d = 8192, 128
    exact = _head(vocab, d, fmt)
    hid = _hidden(600, d)
    hp = sh.preview(sh.fit(exact.weight, hid[:500]), 64, 512, preview_fmt)
    ph = sh.PreviewHead(exact, hp)
    for h in hid[500:520]:
        out = ph(h[None, None])[0, 0]
        want = exact(h[None])[0]
        kept = torch.isfinite(out)
        if ph.fallbacks:
            break
        assert 128 <= int(kept.sum()) <= 2048
        # the candidates' logits are the head's rows (gemv_rows), within the rows kernel's equality to gemv
        ids = kept.nonzero().view(-1)
        torch.testing.assert_close(out[kept], cpu.gemv_rows(exact.weight, h, ids), atol=0, rtol=0)
        torch.testing.assert_close(out[kept], want[kept], atol=1e-4, rtol=1e-4)
        assert (out[~kept] == float("-inf")).all()


def test_full_rank_preview_agrees_with_the_exact_head():
    """At full rank the preview is W h up to q8 rounding: greedy tokens equal the exact head's."""
    vocab, d = 4096, 64
    exact = _head(vocab, d)
    hid = _hidden(700, d)
    hp = sh.preview(sh.fit(exact.weight, hid[:500]), d, 256)
    st = sh.agreement(sh.PreviewHead(exact, hp), hid[500:])
    assert st["agreement"] == 1.0 and st["tokens"] == 200


def test_a_low_rank_head_is_found_at_its_rank():
    """A head of rank 32: the fitted preview at rank 32 ranks tokens as the exact head does."""
    vocab, d = 4096, 128
    exact = _head(vocab, d, rank=32)
    hid = _hidden(700, d)
    basis = sh.fit(exact.weight, hid[:500])
    st = sh.agreement(sh.PreviewHead(exact, sh.preview(basis, 32, 256)), hid[500:])
    assert st["agreement"] == 1.0 and st["fallback"] < 0.05


def test_uncertain_rows_fall_back_to_the_exact_head():
    vocab, d = 4096, 64
    exact = _head(vocab, d)
    useless = sh.HeadPreview(torch.zeros(vocab, 32), torch.zeros(32, d), 256)  # every preview logit 0
    ph = sh.PreviewHead(exact, useless)
    h = _hidden(1, d)[0]
    torch.testing.assert_close(ph(h[None])[0], exact(h[None])[0], atol=0, rtol=0)
    assert (ph.tokens, ph.fallbacks) == (1, 1)


def test_many_rows_and_shapes():
    vocab, d = 2048, 64
    exact = _head(vocab, d)
    hid = _hidden(300, d)
    ph = sh.PreviewHead(exact, sh.preview(sh.fit(exact.weight, hid), 32, 256))
    x = hid[:6].view(2, 3, d)
    torch.testing.assert_close(ph(x), exact(x), atol=0, rtol=0)   # several rows: the exact head
    assert ph.tokens == 0
    assert ph(hid[:1].view(1, 1, d)).shape == (1, 1, vocab)
    with pytest.raises(ValueError, match="does not fit"):
        sh.PreviewHead(exact, sh.HeadPreview(torch.zeros(vocab + 1, 32), torch.zeros(32, d), 256))
    with pytest.raises(ValueError, match="hidden states must be"):
        sh.fit(exact.weight, hid[:, :10])


def test_choose_keeps_the_fastest_preview_that_agrees():
    vocab, d = 4096, 256
    exact = _head(vocab, d, rank=40)

    class M(torch.nn.Module):
        head = exact

    hp, tried = sh.choose(M(), _hidden(1200, d), target=0.999, progress=False)
    # ranks d/8 .. d/2 in multiples of 32 (32, 64, 96, 128), each in q8 and q4, tried by their measured time
    assert {(t["rank"], t["format"]) for t in tried} <= {(r, f) for r in (32, 64, 96, 128) for f in ("q8", "q4")}
    assert [t["preview_ms"] for t in tried] == sorted(t["preview_ms"] for t in tried)
    assert hp is not None and (hp.rank, hp.fmt) == (tried[-1]["rank"], tried[-1]["format"])
    assert hp.stats["agreement"] >= 0.999 and hp.stats["fallback"] <= sh.MAX_FALLBACK
    assert all(t["agreement"] < 0.999 or t["fallback"] > sh.MAX_FALLBACK for t in tried[:-1])
    # with the rows' tokens (12 sequences of 100): held out whole sequences, each row with its context
    ids = torch.randint(0, vocab, (12, 100), generator=torch.Generator().manual_seed(3))
    hp2, tried2 = sh.choose(M(), _hidden(1200, d), target=0.999, progress=False, tokens=ids)
    assert tried2[0]["tokens"] == 300 and hp2 is not None
    with pytest.raises(ValueError, match="not whole sequences"):
        sh.choose(M(), _hidden(1150, d), progress=False, tokens=ids)


def test_a_models_decode_with_the_preview(tmp_path):
    """A tiny model: greedy decode with the preview installed gives the exact head's tokens;
    the benchmark fields name the head and count the preview's bytes instead of the head's."""
    from sparseinfer.generate import decode, prefill
    from sparseinfer.io.weights import SafetensorsSource
    from sparseinfer.models.registry import build_model
    from sparseinfer.sparse.apply import bench_fields, reset_stats, weight_bytes

    from tiny import hf_model, save_folder

    src = SafetensorsSource(save_folder(hf_model("llama"), tmp_path / "llama"))
    model = build_model(src)
    d = src.config.hidden_size

    def run(n=12):
        cache = model.new_cache(32)
        with torch.inference_mode():
            tok = int(prefill(model, [5, 17, 42], cache).argmax())
            out = [tok]
            for _ in range(n):
                tok = int(decode(model, tok, cache).argmax())
                out.append(tok)
        return out

    want = run()
    dense_other, _ = weight_bytes(model)
    w = model.head.weight
    ph = sh.install(model, sh.preview(sh.fit(w, _hidden(300, d)), 32, 64))
    assert sh.install(model, ph.hp).exact is ph.exact          # installing again replaces, never nests
    reset_stats(model)
    assert run() == want
    f = bench_fields(model, 1.0)
    assert f["head"] == "preview rank 32" and 0.0 <= f["head_fallback_fraction"] <= 1.0
    other, _ = weight_bytes(model)
    ph = model.head
    assert other == dense_other + ph.a.nbytes - w.nbytes + ph.k * (w.nbytes // w.rows)
    # a head placed on a GPU is the exact one: the preview (CPU only) costs no device memory
    from sparseinfer.hybrid.costs import cost_model

    with_preview = cost_model(model, 32).head
    sh.remove(model)
    assert model.head is ph.exact and bench_fields(model, 1.0)["head"] == "exact"
    assert cost_model(model, 32).head == with_preview
