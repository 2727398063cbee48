"""Placement under a VRAM budget: budget strings, the priority tiers, the ILP against greedy and
brute force, budgets always respected (property tests), the on-disk cache.  No model, no GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import example, HealthCheck, given, settings
from hypothesis import example, strategies as st

from sparseinfer.errors import SparseInferError
from sparseinfer.hybrid import placement as pl
from sparseinfer.hybrid.budget import BudgetError, parse_vram_budget, resolve_device
from sparseinfer.hybrid.placement import (CostModel, LayerCosts, Placement, cached_plan, make_groups,
                                          plan_layer_offload, plan_placement, solve_brute_force, solve_greedy,
                                          solve_ilp, total_value)

GiB, MiB = 1 << 30, 1 << 20


# ---------------------------------------------------------------------------- budget strings
@pytest.mark.parametrize("text, want", [
    ("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("1.5", int(1.5 * GiB)), ("0", 0), ("2 GB", 2 * GiB),
    ("300mb", 300 * MiB), ("1024KiB", MiB), ("7b", 7), (" 3gib ", 3 * GiB), (".5", GiB // 2), ("1T", 1 << 40),
    (2, 2 * GiB), (0.25, GiB // 4),
])
def test_parse_vram_budget(text, want):
    assert parse_vram_budget(text) == want


@pytest.mark.parametrize("text", ["", "abc", "4XB", "-1", "1.2.3", "GiB", "4 GiB extra", "nan", -1, True])
def test_parse_vram_budget_rejects(text):
    with pytest.raises(BudgetError, match="VRAM budget"):
        parse_vram_budget(text)
    assert issubclass(BudgetError, ValueError) and issubclass(BudgetError, SparseInferError)


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SparseInferError, match="not supported|unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(SparseInferError, match="no CUDA GPU"):
            resolve_device("cuda")


# ---------------------------------------------------------------------------- instances
def costs_of(n_layers=3, n_neurons=100, neuron=100, attn=5000, kv=3000, norms=100, predictor=400, head=4000,
             scratch=1000) -> CostModel:
    layer = LayerCosts(attn=attn, kv=kv, norms=norms, predictor=predictor, neuron=neuron, n_neurons=n_neurons,
                       dense_ffn=neuron * n_neurons)
    return CostModel((layer,) * n_layers, head, scratch, ffn_overhead=0)


def everything(c: CostModel) -> int:
    return c.scratch + c.head + sum(lc.core + lc.predictor + lc.neuron * lc.n_neurons for lc in c.layers) + \
        c.ffn_overhead * len(c.layers)


def hot_freqs(rng, n_layers, n):
    return [np.sort(rng.beta(0.3, 2.0, n))[::-1] for _ in range(n_layers)]


@st.composite
def problems(draw):
    n_layers = draw(st.integers(1, 4))
    layers = tuple(LayerCosts(attn=draw(st.integers(0, 5000)), kv=draw(st.integers(0, 3000)),
                              norms=draw(st.integers(0, 200)), predictor=draw(st.integers(0, 600)),
                              neuron=draw(st.integers(1, 300)), n_neurons=(n := draw(st.integers(1, 200))),
                              dense_ffn=n * 100) for _ in range(n_layers))
    costs = CostModel(layers, draw(st.integers(0, 5000)), draw(st.integers(0, 3000)), draw(st.integers(0, 600)))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    freqs = [np.sort(rng.random(lc.n_neurons) ** 3)[::-1] for lc in layers]
    full = everything(costs)
    budget = draw(st.one_of(st.just(0), st.just(full), st.just(full * 2), st.integers(0, full)))
    return costs, freqs, budget


def check_placement(p: Placement, costs: CostModel, budget: int):
    assert p.bytes_used <= budget
    assert all(0 <= k <= n for k, n in zip(p.n_hot, p.n_neurons))
    expect = {"scratch": costs.scratch if p.on_device else 0,
              "attention": sum(lc.attn for lc, on in zip(costs.layers, p.attn_on_device) if on),
              "kv": sum(lc.kv for lc, on in zip(costs.layers, p.attn_on_device) if on),
              "head": costs.head if p.head_on_device else 0}
    for k, v in expect.items():
        assert p.bytes[k] == v, k
    assert 0.0 <= p.expected_fraction <= 1.0 + 1e-9
    assert p.read_bytes["gpu"] >= 0 and p.read_bytes["cpu"] >= -1e-6
    if not p.on_device:
        assert p.read_bytes["gpu"] == 0


# ---------------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from([1, 7, 32]), st.sampled_from([1, 2]))
@example(
    problem=(CostModel(layers=(LayerCosts(attn=0,
        kv=0,
        norms=0,
        predictor=0,
        neuron=1,
        n_neurons=166,
        dense_ffn=16600),
       LayerCosts(attn=0,
        kv=0,
        norms=0,
        predictor=0,
        neuron=1,
        n_neurons=1,
        dense_ffn=100)),
      head=0,
      scratch=0,
      ffn_overhead=0),
     [np.array([9.97672596e-01, 9.78554709e-01, 9.36609516e-01, 8.83468858e-01,
             8.63084051e-01, 8.45973942e-01, 8.43543609e-01, 8.36309513e-01,
             7.98519413e-01, 7.95633206e-01, 7.51166441e-01, 7.50605684e-01,
             7.46658464e-01, 7.44707170e-01, 7.31906643e-01, 6.17400117e-01,
             6.04494657e-01, 6.03309945e-01, 5.90669807e-01, 5.89086341e-01,
             5.59230251e-01, 5.48165697e-01, 5.41312011e-01, 5.22451606e-01,
             5.13006459e-01, 4.99599981e-01, 4.98591621e-01, 4.98395095e-01,
             4.85858616e-01, 4.85164435e-01, 4.66272999e-01, 4.56277782e-01,
             4.48925117e-01, 4.39270291e-01, 4.28590414e-01, 4.28068577e-01,
             4.21578431e-01, 3.94078320e-01, 3.83143983e-01, 3.82384166e-01,
             3.70385864e-01, 3.69418439e-01, 3.48818770e-01, 3.45855613e-01,
             3.41037998e-01, 3.33278862e-01, 3.31492490e-01, 3.30579351e-01,
             3.21969915e-01, 3.15927247e-01, 3.06570617e-01, 3.00634614e-01,
             2.99348179e-01, 2.84701979e-01, 2.66490216e-01, 2.61502932e-01,
             2.58527084e-01, 2.49339292e-01, 2.43982436e-01, 2.35664223e-01,
             2.26183741e-01, 2.12105415e-01, 2.07779565e-01, 2.01447516e-01,
             1.76424705e-01, 1.71381553e-01, 1.64080781e-01, 1.57549759e-01,
             1.55160900e-01, 1.51389598e-01, 1.44823532e-01, 1.43288949e-01,
             1.42173000e-01, 1.40198222e-01, 1.30167780e-01, 1.27640870e-01,
             1.24858592e-01, 1.24665327e-01, 1.18796972e-01, 1.16750378e-01,
             1.15873313e-01, 1.14861296e-01, 1.11304082e-01, 1.11254100e-01,
             1.04110057e-01, 9.73873937e-02, 8.81245172e-02, 8.69241816e-02,
             8.12958861e-02, 7.98918212e-02, 7.45150026e-02, 7.06597731e-02,
             6.76493494e-02, 6.73984317e-02, 6.71331487e-02, 6.01603425e-02,
             5.94981586e-02, 5.94174221e-02, 5.73692390e-02, 5.72013883e-02,
             5.58812061e-02, 5.08589616e-02, 5.08163592e-02, 4.65276637e-02,
             4.58199949e-02, 4.49843343e-02, 4.37511009e-02, 4.05326055e-02,
             4.00486159e-02, 3.91111441e-02, 3.49455666e-02, 3.22319759e-02,
             3.21562509e-02, 2.84745238e-02, 2.81067349e-02, 2.79536769e-02,
             2.63164521e-02, 2.28589211e-02, 2.28293577e-02, 2.26342071e-02,
             2.24943575e-02, 1.97612015e-02, 1.89442680e-02, 1.78689728e-02,
             1.44521657e-02, 1.39263052e-02, 1.38840368e-02, 1.36024790e-02,
             1.26662762e-02, 1.22179185e-02, 1.15631566e-02, 9.96394506e-03,
             8.80680270e-03, 6.94179247e-03, 6.50759524e-03, 5.97431587e-03,
             5.89290319e-03, 5.65433733e-03, 5.26796652e-03, 4.08247566e-03,
             3.74888807e-03, 3.60808849e-03, 2.98524900e-03, 2.07329950e-03,
             1.94828402e-03, 1.83110676e-03, 1.81080775e-03, 1.29080956e-03,
             1.04987628e-03, 9.59641579e-04, 7.35096048e-04, 6.17101901e-04,
             5.84911812e-04, 5.36638262e-04, 2.83910526e-04, 2.82090323e-04,
             1.38438344e-04, 8.79467437e-05, 7.68987782e-05, 6.98631315e-05,
             3.41958543e-05, 5.20852284e-06, 2.68024755e-06, 7.60545840e-07,
             3.95651159e-10, 8.32249251e-13]), np.array([0.01495194])],
     167),
    group=1,
    min_groups=2,
).via('discovered failure')
def test_neuron_placement_respects_budget(problem, group, min_groups):
    costs, freqs, budget = problem
    p = plan_placement(costs, freqs, budget, group_size=group, min_groups=min_groups, time_limit=5)
    check_placement(p, costs, budget)
    if p.on_device:
        assert p.bytes["ffn"] == sum(lc.neuron * k for lc, k in zip(costs.layers, p.n_hot)) + \
            costs.ffn_overhead * sum(1 for k in p.n_hot if k)
    total = sum(lc.attn + lc.norms + lc.predictor + lc.neuron * float(np.sum(f)) for lc, f in zip(costs.layers, freqs))
    assert p.read_bytes["gpu"] + p.read_bytes["cpu"] == pytest.approx(total + costs.head)
    if budget >= everything(costs):
        assert p.n_hot == p.n_neurons and all(p.attn_on_device) and p.head_on_device
        assert p.read_bytes["cpu"] == pytest.approx(0, abs=1e-6 * total + 1e-9)
        assert all(p.predictor_on_device[i] or not lc.predictor for i, lc in enumerate(costs.layers))
        assert p.expected_fraction == pytest.approx(1.0)
    if budget == 0:
        assert p.mode == "cpu" and p.bytes_used == 0 and not p.notes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_layer_offload_respects_budget(problem):
    costs, _, budget = problem
    p = plan_layer_offload(costs, budget)
    check_placement(p, costs, budget)
    k = sum(p.attn_on_device)
    assert p.attn_on_device == [True] * k + [False] * (len(costs.layers) - k)  # layers from the first
    assert p.n_hot == [n if on else 0 for n, on in zip(p.n_neurons, p.attn_on_device)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31), st.sampled_from([1, 2, 3]))
def test_ilp_matches_brute_force_and_beats_greedy(n_layers, n_groups, group, seed, min_groups):
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_layers):
        n = int(rng.integers(1, n_groups * group + 1))
        groups.append(make_groups(np.sort(rng.random(n))[::-1], int(rng.integers(1, 50)), group))
    budget = int(rng.integers(0, sum(int(g.cost.sum()) for g in groups) + 1))
    ilp, greedy = solve_ilp(groups, budget, min_groups), solve_greedy(groups, budget, min_groups)
    brute = solve_brute_force(groups, budget, min_groups)
    assert ilp is not None
    for counts in (ilp, greedy):
        assert pl._feasible(groups, counts, budget, min_groups)
    assert total_value(groups, ilp) == pytest.approx(total_value(groups, brute), abs=1e-9)
    assert total_value(groups, ilp) >= total_value(groups, greedy) - 1e-9


def test_ilp_beats_greedy_where_greedy_is_myopic():
    # layer 0: one group worth 10 costing 10; layer 1: groups worth 6 + 6 costing 6 each; budget 12
    g0 = make_groups(np.array([10.0]), 10, 1)
    g1 = make_groups(np.array([6.0, 6.0]), 6, 1)
    assert total_value([g0, g1], solve_greedy([g0, g1], 12)) == 10.0  # ratio 1.0 first, then nothing fits
    assert total_value([g0, g1], solve_ilp([g0, g1], 12)) == 12.0


def test_ilp_size_typical_model_solves_in_seconds():
    import time

    rng = np.random.default_rng(0)
    costs = costs_of(n_layers=28, n_neurons=8960, neuron=2600, attn=3_000_000, kv=8_000_000, head=130_000_000)
    t0 = time.perf_counter()
    p = plan_placement(costs, hot_freqs(rng, 28, 8960), everything(costs) // 2, group_size=64)
    assert time.perf_counter() - t0 < 30
    assert p.solver == "ilp" and 0 < sum(p.n_hot) < 28 * 8960


def test_greedy_fallback_when_the_solver_fails(monkeypatch, caplog):
    import scipy.optimize

    def broken(*a, **k):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(scipy.optimize, "milp", broken)
    rng = np.random.default_rng(1)
    costs = costs_of()
    p = plan_placement(costs, hot_freqs(rng, 3, 100), everything(costs) * 3 // 4, group_size=8)
    assert p.solver == "greedy" and any("greedy" in n for n in p.notes)
    assert "greedy" in caplog.text
    assert p.bytes_used <= p.budget and sum(p.n_hot) > 0


# ---------------------------------------------------------------------------- tiers and messages
def test_priority_order_attention_first_then_predictors_head_neurons():
    costs = costs_of()
    rng = np.random.default_rng(2)
    f = hot_freqs(rng, 3, 100)
    # room for scratch + two layers of attention+KV+norms only
    p = plan_placement(costs, f, costs.scratch + 2 * costs.layers[0].core + 10)
    assert p.attn_on_device == [True, True, False] and not any(p.predictor_on_device)
    assert not p.head_on_device and sum(p.n_hot) == 0
    # then predictors, then the head, then neurons
    b = costs.scratch + 3 * costs.layers[0].core + 3 * 400 + costs.head + 50 * 100
    p = plan_placement(costs, f, b, group_size=10)
    assert all(p.attn_on_device) and all(p.predictor_on_device) and p.head_on_device
    assert sum(p.n_hot) == 50
    # the hottest groups win: layer frequencies differ, so neurons go where they serve most
    assert p.expected_fraction > 50 / 300


def test_budget_too_small_gives_cpu_run_with_a_message():
    costs = costs_of()
    p = plan_placement(costs, hot_freqs(np.random.default_rng(0), 3, 100), costs.scratch // 2)
    assert p.mode == "cpu" and not p.on_device and p.bytes_used == 0
    assert "below" in p.notes[0] and "CPU only" in p.notes[0]
    p = plan_placement(costs, hot_freqs(np.random.default_rng(0), 3, 100), costs.scratch + 50)
    assert p.mode == "cpu" and "no room" in p.notes[0]


def test_no_frequencies_means_layer_offload():
    costs = costs_of()
    p = plan_placement(costs, None, everything(costs))
    assert p.mode == "layers" and "no activation frequencies" in p.notes[0]


def test_describe_and_json_roundtrip():
    costs = costs_of()
    p = plan_placement(costs, hot_freqs(np.random.default_rng(3), 3, 100), everything(costs) // 2, group_size=10)
    text = p.describe()
    assert "layer" in text and "expected fraction" in text and f"{p.n_hot[0]:>8} / 100" in text
    q = Placement.from_json(p.to_json())
    assert q == p
    assert "layers.0.attn" in p.device_tensors()


def test_cached_plan_writes_and_reuses_json(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEINFER_HOME", str(tmp_path))
    costs = costs_of()
    f = hot_freqs(np.random.default_rng(4), 3, 100)
    budget = everything(costs) // 2
    p = cached_plan("model-fp", costs, f, budget, group_size=10)
    files = list((tmp_path / "placements").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == p.key
    calls = []
    monkeypatch.setattr(pl, "plan_placement", lambda *a, **k: calls.append(1))
    assert cached_plan("model-fp", costs, f, budget, group_size=10) == p and not calls
    # another budget, model or pack is another problem
    monkeypatch.undo()
    monkeypatch.setenv("SPARSEINFER_HOME", str(tmp_path))
    cached_plan("model-fp", costs, f, budget + 1000, group_size=10)
    cached_plan("other-fp", costs, f, budget, group_size=10)
    cached_plan("model-fp", costs, [x[::-1].copy() for x in f], budget, group_size=10)
    assert len(list((tmp_path / "placements").glob("*.json"))) == 4
