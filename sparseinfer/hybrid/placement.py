"""Which tensors and which FFN neurons live on the accelerator, under a VRAM budget.

`plan_placement(costs, hot_freqs, budget)` fills the budget in a fixed priority order:

1. scratch for activations, dequantization and library workspaces (reserved first: the budget
   is a promise, so transient memory is part of it);
2. per layer, attention weights + their KV cache for the configured context + the block's norms
   (attention without its cache would ship the cache over PCIe each token, and norms are where
   the block runs, so they go together), layer 0 first;
3. predictors; 4. the output head (with the final norm);
5. hot FFN neurons: groups of `group_size` consecutive neurons in hotness order, chosen by an ILP
   (HiGHS via `scipy.optimize.milp`) that maximises the activation frequency mass on the device;
   each layer's device part is a prefix in hotness order.  Greedy is the fallback.

`plan_layer_offload` is the dense baseline (llama.cpp's `-ngl`): whole layers, then the head.
Everything here works on byte counts (`CostModel`), so it is tested without a model or a GPU.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .budget import format_bytes

log = logging.getLogger("sparseinfer.hybrid")

PLACEMENT_VERSION = 2
DEFAULT_GROUP = 64
ILP_TIME_LIMIT = 10.0


@dataclass(frozen=True)
class LayerCosts:
    """Device bytes of one transformer layer's parts, in the format they have on the device."""

    attn: int          # q/k/v/o weights and biases
    kv: int            # K and V for the configured context
    norms: int         # the block's norms
    predictor: int     # the layer's activation predictor (0: none)
    neuron: int        # one FFN neuron on the device: its gate/up rows, down column, biases
    n_neurons: int
    dense_ffn: int     # the whole dense FFN (layer-offload baseline)

    @property
    def core(self) -> int:
        return self.attn + self.kv + self.norms


@dataclass(frozen=True)
class CostModel:
    layers: tuple[LayerCosts, ...]
    head: int               # output head + final norm
    scratch: int            # transient device memory reserved before anything is placed
    ffn_overhead: int = 0   # per layer with FFN neurons on the device (allocator rounding)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Placement:
    """The solver's answer for one model, pack, device and budget."""

    device: str
    budget: int
    n_neurons: list[int]
    n_hot: list[int]                 # per layer: FFN neurons on the device, a prefix in hotness order
    attn_on_device: list[bool]       # attention weights + KV cache + norms of the layer
    predictor_on_device: list[bool]
    head_on_device: bool
    bytes: dict[str, int]            # device bytes by kind: scratch, attention, kv, norms, predictors, head, ffn
    expected_fraction: float         # activation mass (sum of frequencies) served by the device
    layer_fraction: list[float]
    read_bytes: dict[str, float] = field(default_factory=dict)  # expected weight bytes read per decoded
    #                                token by the GPU and by the CPU (KV cache not included)
    mode: str = "neurons"            # "neurons" (hybrid) | "layers" (dense layer offload) | "cpu"
    solver: str = "none"             # "ilp" | "greedy" | "layers" | "none"
    notes: list[str] = field(default_factory=list)
    key: str = ""

    @property
    def bytes_used(self) -> int:
        return sum(self.bytes.values())

    @property
    def n_layers(self) -> int:
        return len(self.n_hot)

    @property
    def on_device(self) -> bool:
        return self.mode != "cpu"

    def device_tensors(self) -> list[str]:
        """Names of the non-FFN parts on the device: layers.3.attn, layers.3.kv, head, ..."""
        out = []
        for i, on in enumerate(self.attn_on_device):
            if on:
                out += [f"layers.{i}.attn", f"layers.{i}.kv", f"layers.{i}.norms"]
        out += [f"layers.{i}.predictor" for i, on in enumerate(self.predictor_on_device) if on]
        return out + (["head"] if self.head_on_device else [])

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"version": PLACEMENT_VERSION}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        d = json.loads(text)
        if d.pop("version", None) != PLACEMENT_VERSION:
            raise ValueError("placement file from another version")
        return cls(**d)

    def describe(self) -> str:
        """A table: per layer hot neurons on the device, bytes, expected fraction served."""
        lines = [f"placement on {self.device}: mode {self.mode}, solver {self.solver}, budget "
                 f"{format_bytes(self.budget)}, used {format_bytes(self.bytes_used)}",
                 "  " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.bytes.items() if v),
                 f"  expected fraction of FFN activations served by the device: {self.expected_fraction:.1%}",
                 f"  expected weight bytes read per token: device {format_bytes(int(self.read_bytes.get('gpu', 0)))}, "
                 f"CPU {format_bytes(int(self.read_bytes.get('cpu', 0)))}",
                 f"  {'layer':>5} {'attn+kv':>7} {'pred':>4} {'hot neurons':>17} {'served':>7}"]
        for i in range(self.n_layers):
            lines.append(f"  {i:>5} {'gpu' if self.attn_on_device[i] else 'cpu':>7} "
                         f"{'gpu' if self.predictor_on_device[i] else 'cpu':>4} "
                         f"{self.n_hot[i]:>8} / {self.n_neurons[i]:<6} {self.layer_fraction[i]:>7.1%}")
        lines.append(f"  head: {'gpu' if self.head_on_device else 'cpu'}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------- FFN solver
@dataclass(frozen=True)
class Groups:
    """One layer's FFN neurons cut into groups in hotness order: value and bytes of each group."""

    value: np.ndarray   # (G,) sum of activation frequencies of the group's neurons
    cost: np.ndarray    # (G,) device bytes of the group
    size: np.ndarray    # (G,) neurons in the group (the last one may be short)


def make_groups(freq: np.ndarray, neuron_bytes: int, group_size: int) -> Groups:
    """`freq`: (n,) activation frequencies already in hotness order."""
    freq = np.asarray(freq, dtype=np.float64)
    n = len(freq)
    starts = np.arange(0, n, group_size)
    size = np.minimum(group_size, n - starts)
    value = np.add.reduceat(freq, starts) if n else np.zeros(0)
    return Groups(value, size * int(neuron_bytes), size)


def solve_ilp(groups: Sequence[Groups], budget: int, min_groups: int = 1,
              time_limit: float = ILP_TIME_LIMIT) -> list[int] | None:
    """Groups on the device per layer (a prefix), maximising value within `budget` bytes.

    Variables x[l,g] in {0,1}; x[l,g+1] <= x[l,g] keeps each layer's set a prefix in hotness
    order; with `min_groups` > 1 a layer holds 0 or at least `min_groups` groups (a layer with
    a few device neurons pays the device round trip for little).  None when HiGHS finds no
    usable answer in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    sizes = [len(g.value) for g in groups]
    n_x = sum(sizes)
    if n_x == 0:
        return [0] * len(groups)
    use_y = min_groups > 1
    n_var = n_x + (len(groups) if use_y else 0)
    off = np.concatenate([[0], np.cumsum(sizes)])
    # scale values so HiGHS's tolerances see numbers near 1
    vals = np.concatenate([g.value for g in groups])
    scale = vals.max() if vals.max() > 0 else 1.0
    c = np.zeros(n_var)
    c[:n_x] = -vals / scale
    rows, cols, data, lo, hi = [], [], [], [], []

    def add(row_terms: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for j, a in row_terms:
            rows.append(r), cols.append(j), data.append(a)
        lo.append(lb), hi.append(ub)

    add([(j, float(cst)) for j, cst in enumerate(np.concatenate([g.cost for g in groups]))], -np.inf, budget)
    for li, g in enumerate(groups):
        for k in range(len(g.value) - 1):
            add([(off[li] + k + 1, 1.0), (off[li] + k, -1.0)], -np.inf, 0.0)
        if use_y and len(g.value):
            y = n_x + li
            add([(off[li], 1.0), (y, -1.0)], -np.inf, 0.0)   # x[l,0] <= y[l]
            need = min(min_groups, len(g.value))
            add([(off[li] + k, -1.0) for k in range(len(g.value))] + [(y, float(need))], -np.inf, 0.0)
    a = coo_array((data, (rows, cols)), shape=(len(lo), n_var)).tocsr()
    try:
        res = milp(c, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(n_var),
                   bounds=Bounds(0, 1), options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "presolve": True})
    except Exception as e:  # noqa: BLE001 - any solver failure means: use greedy
        log.warning("ILP solver failed (%s); using the greedy placement", e)
        return None
    if res.x is None:
        log.warning("ILP solver gave no solution (%s); using the greedy placement", res.message)
        return None
    x = np.round(res.x[:n_x]).astype(int)
    counts = [int(x[off[i]: off[i + 1]].sum()) for i in range(len(groups))]
    if not _feasible(groups, counts, budget, min_groups):
        log.warning("ILP answer violates the constraints after rounding; using the greedy placement")
        return None
    if res.status != 0:
        log.warning("ILP stopped early (%s); keeping its best answer if greedy is not better", res.message)
    return counts


def _feasible(groups: Sequence[Groups], counts: Sequence[int], budget: int, min_groups: int) -> bool:
    if any(k < 0 or k > len(g.value) for g, k in zip(groups, counts)):
        return False
    if any(0 < k < min(min_groups, len(g.value)) for g, k in zip(groups, counts)):
        return False
    return sum(int(g.cost[:k].sum()) for g, k in zip(groups, counts)) <= budget


def total_value(groups: Sequence[Groups], counts: Sequence[int]) -> float:
    return float(sum(g.value[:k].sum() for g, k in zip(groups, counts)))


def solve_greedy(groups: Sequence[Groups], budget: int, min_groups: int = 1) -> list[int]:
    """Best value per byte first, each layer's set kept a prefix; layers that end up under
    `min_groups` are dropped and their bytes handed to the others."""
    banned: set[int] = set()
    while True:
        counts = _greedy_fill(groups, budget, banned)
        short = {i for i, (g, k) in enumerate(zip(groups, counts)) if 0 < k < min(min_groups, len(g.value))}
        if not short:
            return counts
        banned |= short


def _greedy_fill(groups: Sequence[Groups], budget: int, banned: set[int]) -> list[int]:
    counts = [0] * len(groups)
    left = budget
    heap = [(-_ratio(g, 0), i) for i, g in enumerate(groups) if len(g.value) and i not in banned]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        g, k = groups[i], counts[i]
        if g.cost[k] > left:
            continue  # this layer's prefix is blocked; the others may still fit
        left -= int(g.cost[k])
        counts[i] = k + 1
        if k + 1 < len(g.value):
            heapq.heappush(heap, (-_ratio(g, k + 1), i))
    return counts


def _ratio(g: Groups, k: int) -> float:
    return float(g.value[k]) / max(int(g.cost[k]), 1)


def solve_brute_force(groups: Sequence[Groups], budget: int, min_groups: int = 1) -> list[int]:
    """Every combination of prefixes (tests only: tiny instances)."""
    best, best_v = [0] * len(groups), -1.0
    for counts in itertools.product(*[range(len(g.value) + 1) for g in groups]):
        if _feasible(groups, counts, budget, min_groups):
            v = total_value(groups, counts)
            if v > best_v + 1e-12:
                best, best_v = list(counts), v
    return best


def choose_hot(groups: Sequence[Groups], budget: int, solver: str = "ilp", min_groups: int = 1,
               time_limit: float = ILP_TIME_LIMIT) -> tuple[list[int], str, list[str]]:
    """(groups per layer, solver used, notes). ILP unless it fails or greedy does better."""
    greedy = solve_greedy(groups, budget, min_groups)
    if solver == "greedy":
        return greedy, "greedy", []
    ilp = solve_ilp(groups, budget, min_groups, time_limit)
    if ilp is None:
        return greedy, "greedy", ["ILP solver failed or timed out; greedy placement used"]
    if total_value(groups, ilp) + 1e-12 < total_value(groups, greedy):
        return greedy, "greedy", ["ILP stopped before matching greedy; greedy placement used"]
    return ilp, "ilp", []


# ------------------------------------------------------------------------------- placement
def plan_placement(costs: CostModel, hot_freqs: Sequence[np.ndarray] | None, budget: int, device: str = "cuda",
                   group_size: int = DEFAULT_GROUP, min_groups: int = 1, solver: str = "ilp",
                   time_limit: float = ILP_TIME_LIMIT) -> Placement:
    """Hybrid placement. `hot_freqs[l]`: layer l's activation frequencies in hotness order.
    Without frequencies (no sparsity pack) hot neurons cannot be chosen: layer offload instead."""
    p = _plan_neurons(costs, hot_freqs, budget, device, group_size, min_groups, solver, time_limit)
    if p.mode != "layers":
        _reads(p, costs, hot_freqs)
    return p


def _plan_neurons(costs: CostModel, hot_freqs: Sequence[np.ndarray] | None, budget: int, device: str,
                  group_size: int, min_groups: int, solver: str, time_limit: float) -> Placement:
    if hot_freqs is None:
        p = plan_layer_offload(costs, budget, device)
        p.notes.insert(0, "no activation frequencies (no sparsity pack): dense layer offload instead")
        return p
    if len(hot_freqs) != len(costs.layers):
        raise ValueError(f"{len(hot_freqs)} frequency vectors for {len(costs.layers)} layers")
    p = _empty(costs, budget, device, "neurons")
    left = budget - costs.scratch
    if budget <= 0 or left < 0:
        return _cpu_only(p, f"VRAM budget {format_bytes(budget)} is below the {format_bytes(costs.scratch)} "
                            "of scratch the device needs; running on the CPU only")
    p.bytes["scratch"] = costs.scratch
    left = _place_fixed(costs, p, left, with_predictors=True)
    ffn_left = left - costs.ffn_overhead * len(costs.layers)
    groups = [make_groups(f, lc.neuron, group_size) for f, lc in zip(hot_freqs, costs.layers)]
    if ffn_left >= sum(int(g.cost.sum()) for g in groups):  # every neuron fits: no choice to make
        # (a solver may leave out neurons whose frequency is below its tolerance)
        counts, p.solver = [len(g.size) for g in groups], "all"
    elif ffn_left > 0:
        counts, p.solver, notes = choose_hot(groups, ffn_left, solver, min_groups, time_limit)
        p.notes += notes
    else:
        counts = [0] * len(groups)
    p.n_hot = [int(g.size[:k].sum()) for g, k in zip(groups, counts)]
    p.bytes["ffn"] = sum(int(g.cost[:k].sum()) for g, k in zip(groups, counts))
    p.bytes["ffn"] += costs.ffn_overhead * sum(1 for n in p.n_hot if n)
    _fractions(p, hot_freqs)
    return _finish(p, budget)


def plan_layer_offload(costs: CostModel, budget: int, device: str = "cuda") -> Placement:
    """Dense baseline: whole layers (attention, KV, norms, full FFN) from layer 0, then the head."""
    p = _plan_layers(costs, budget, device)
    _reads(p, costs, None)
    return p


def _plan_layers(costs: CostModel, budget: int, device: str) -> Placement:
    p = _empty(costs, budget, device, "layers")
    p.solver = "layers"
    left = budget - costs.scratch
    if budget <= 0 or left < 0:
        return _cpu_only(p, f"VRAM budget {format_bytes(budget)} is below the {format_bytes(costs.scratch)} "
                            "of scratch the device needs; running on the CPU only")
    p.bytes["scratch"] = costs.scratch
    for i, lc in enumerate(costs.layers):
        need = lc.core + lc.dense_ffn
        if need > left:
            break
        left -= need
        p.attn_on_device[i], p.n_hot[i] = True, lc.n_neurons
        for kind, b in (("attention", lc.attn), ("kv", lc.kv), ("norms", lc.norms), ("ffn", lc.dense_ffn)):
            p.bytes[kind] += b
    if all(p.attn_on_device) and costs.head <= left:
        p.head_on_device, p.bytes["head"] = True, costs.head
    _fractions(p, None)
    return _finish(p, budget)


def _empty(costs: CostModel, budget: int, device: str, mode: str) -> Placement:
    n = len(costs.layers)
    return Placement(device=device, budget=int(budget), n_neurons=[lc.n_neurons for lc in costs.layers],
                     n_hot=[0] * n, attn_on_device=[False] * n, predictor_on_device=[False] * n,
                     head_on_device=False, bytes=dict.fromkeys(("scratch", "attention", "kv", "norms", "predictors",
                                                                "head", "ffn"), 0),
                     expected_fraction=0.0, layer_fraction=[0.0] * n, mode=mode)


def _place_fixed(costs: CostModel, p: Placement, left: int, with_predictors: bool) -> int:
    """Attention+KV+norms per layer, then predictors, then the head, as far as they fit."""
    for i, lc in enumerate(costs.layers):
        if lc.core <= left:
            left -= lc.core
            p.attn_on_device[i] = True
            p.bytes["attention"] += lc.attn
            p.bytes["kv"] += lc.kv
            p.bytes["norms"] += lc.norms
    for i, lc in enumerate(costs.layers):
        if with_predictors and lc.predictor and lc.predictor <= left:
            left -= lc.predictor
            p.predictor_on_device[i] = True
            p.bytes["predictors"] += lc.predictor
    if costs.head <= left:
        left -= costs.head
        p.head_on_device, p.bytes["head"] = True, costs.head
    return left


def _fractions(p: Placement, hot_freqs: Sequence[np.ndarray] | None) -> None:
    """Expected share of FFN activations computed on the device (neuron share without frequencies)."""
    if hot_freqs is None or sum(float(np.sum(f)) for f in hot_freqs) <= 0:
        hot_freqs = [np.ones(n) for n in p.n_neurons]
    served = [float(np.sum(f[:k])) for f, k in zip(hot_freqs, p.n_hot)]
    total = [float(np.sum(f)) for f in hot_freqs]
    p.layer_fraction = [s / t if t > 0 else 0.0 for s, t in zip(served, total)]
    p.expected_fraction = sum(served) / sum(total) if sum(total) > 0 else 0.0


def _reads(p: Placement, costs: CostModel, hot_freqs: Sequence[np.ndarray] | None) -> None:
    """Expected weight bytes a decode step reads on each side: attention, norms, predictors and
    the head every token; an FFN neuron with its activation frequency (every token for the
    dense model of layer offload, which has no predictors)."""
    gpu = total = 0.0
    for i, lc in enumerate(costs.layers):
        if hot_freqs is None:
            ffn = np.full(lc.n_neurons, lc.dense_ffn / max(lc.n_neurons, 1))
            pred = 0
        else:
            ffn = np.asarray(hot_freqs[i], dtype=np.float64) * lc.neuron
            pred = lc.predictor
        total += lc.attn + lc.norms + pred + float(ffn.sum())
        gpu += (lc.attn + lc.norms if p.attn_on_device[i] else 0) + (pred if p.predictor_on_device[i] else 0)
        gpu += float(ffn[: p.n_hot[i]].sum())
    total += costs.head
    gpu += costs.head if p.head_on_device else 0
    p.read_bytes = {"gpu": gpu, "cpu": total - gpu}


def _finish(p: Placement, budget: int) -> Placement:
    useful = any(p.attn_on_device) or any(p.n_hot) or p.head_on_device or any(p.predictor_on_device)
    if not useful:
        return _cpu_only(p, f"VRAM budget {format_bytes(budget)} leaves no room for any layer, head or neuron "
                            "group after scratch; running on the CPU only")
    if p.bytes_used > budget:  # the planner's own invariant; never user-facing
        raise RuntimeError(f"placement uses {p.bytes_used} bytes of a {budget} byte budget")
    return p


def _cpu_only(p: Placement, note: str) -> Placement:
    n = p.n_layers
    p.mode, p.solver = "cpu", "none"
    p.n_hot, p.attn_on_device, p.predictor_on_device = [0] * n, [False] * n, [False] * n
    p.head_on_device = False
    p.bytes = dict.fromkeys(p.bytes, 0)
    p.expected_fraction, p.layer_fraction = 0.0, [0.0] * n
    if p.budget > 0:  # an explicit 0 budget asks for the CPU; say nothing
        p.notes.append(note)
    return p


# ------------------------------------------------------------------------------- cache on disk
def placement_dir() -> Path:
    home = os.environ.get("SPARSEINFER_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "sparseinfer"
    return base / "placements"


def placement_key(model_fingerprint: str, costs: CostModel, hot_freqs: Sequence[np.ndarray] | None,
                  budget: int, **params) -> str:
    """Identity of one planning problem: model, pack (its frequencies), costs, budget, options."""
    h = hashlib.sha256()
    h.update(json.dumps([model_fingerprint, costs.digest(), int(budget), PLACEMENT_VERSION,
                         sorted(params.items())], default=str).encode())
    for f in hot_freqs or ():
        h.update(np.ascontiguousarray(f, dtype=np.float32).tobytes())
    return h.hexdigest()[:24]


def cached_plan(model_fingerprint: str, costs: CostModel, hot_freqs: Sequence[np.ndarray] | None, budget: int,
                mode: str = "neurons", use_cache: bool = True, **params) -> Placement:
    """`plan_placement` / `plan_layer_offload`, memoised as small JSON files in the cache dir."""
    key = placement_key(model_fingerprint, costs, hot_freqs if mode == "neurons" else None, budget,
                        mode=mode, **params)
    path = placement_dir() / f"{key}.json"
    if use_cache and path.is_file():
        try:
            p = Placement.from_json(path.read_text())
            if p.key == key:
                return p
        except (ValueError, TypeError, KeyError):
            pass  # stale or foreign file: solve again
    if mode == "layers":
        p = plan_layer_offload(costs, budget, params.get("device", "cuda"))
    else:
        p = plan_placement(costs, hot_freqs, budget, **params)
    p.key = key
    if use_cache:
        _write_atomic(path, p.to_json())
    return p


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir costs a re-solve next time, nothing else
        log.warning("cannot cache the placement in %s: %s", path.parent, e)


__all__ = ["LayerCosts", "CostModel", "Placement", "Groups", "make_groups", "plan_placement", "plan_layer_offload",
           "solve_ilp", "solve_greedy", "solve_brute_force", "choose_hot", "total_value", "cached_plan",
           "placement_key", "placement_dir"]
