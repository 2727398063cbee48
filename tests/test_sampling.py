"""`generate.make_sampler`: draws follow the (filtered) softmax distribution; filtered tokens
are never drawn; a seed fixes the draws."""
from __future__ import annotations

import torch

from sparseinfer.generate import make_sampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])


def frequencies(sampler, n=20000, logits=LOGITS):
    counts = torch.bincount(torch.tensor([sampler(logits.clone()) for _ in range(n)]), minlength=logits.numel())
    return counts.double() / n


def test_draws_follow_the_softmax():
    for temp in (1.0, 0.5, 2.0):
        want = torch.softmax(LOGITS.double() / temp, -1)
        got = frequencies(make_sampler(temp=temp, seed=1))
        assert (got - want).abs().max() < 0.015, (temp, got, want)


def test_filtered_tokens_are_never_drawn():
    p = torch.softmax(LOGITS.double(), -1)
    assert set(frequencies(make_sampler(temp=1.0, top_k=2, seed=2), 3000).nonzero().flatten().tolist()) == {0, 1}
    # top_p: the smallest prefix of the sorted probabilities that reaches top_p
    keep = int((torch.cumsum(p, 0) - p <= 0.8).sum())
    got = frequencies(make_sampler(temp=1.0, top_p=0.8, seed=3), 3000)
    assert got[keep:].sum() == 0 and (got[:keep] > 0).all()
    got = frequencies(make_sampler(temp=1.0, min_p=0.3, seed=4), 3000)
    assert set(got.nonzero().flatten().tolist()) == {i for i in range(6) if p[i] >= 0.3 * p.max()}


def test_a_seed_fixes_the_draws_and_greedy_is_argmax():
    a, b = make_sampler(temp=0.9, seed=5), make_sampler(temp=0.9, seed=5)
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]
    assert make_sampler(temp=0.0)(LOGITS) == 0
    # a token whose probability underflows to zero in float32 is never drawn
    one_hot = torch.full((1000,), -1e4)
    one_hot[7] = 0.0
    assert {make_sampler(temp=1.0, seed=6)(one_hot) for _ in range(200)} == {7}
