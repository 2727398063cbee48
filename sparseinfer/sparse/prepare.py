"""`sparseinfer prepare MODEL`: calibrate, profile, train predictors, write the sparsity pack.

1. thresholds (gated SiLU/GELU FFNs only): |act(gate x)| quantiles on calibration text, at a
   target sparsity or the largest one within a perplexity budget (searched on a held-out slice);
2. profile: run the sparsified model over the calibration text, count per-neuron activations,
   order neurons by hotness; record FFN inputs (f16) and active masks (bits) per layer;
3. predictors: per layer, the smallest-cost size from a ladder, tau tuned for the recall target;
4. evaluate dense / thresholds / sparse perplexity on the held-out slice; decode with and
   without the pack on this machine, alternated (`speed`: a pack measured slower than dense is
   not used automatically here);
5. save the pack (+ activation-frequency plot), print a per-layer table.
"""
from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SparseInferError
from ..quant import qweight_nbytes
from . import calibrate as cal
from .apply import default_pack_path, replace_ffns, restore, sparse_ffns, sparsify
from .ffn import SparseFFN
from .head import HiddenRecorder, choose as choose_head
from .pack import SparsityPack, LayerPack
from .predictor import LADDER, LayerData, TrainConfig, pack_bits, split_tokens, train_predictor, unpack_bits
from .profile import hotness_order, summarize

RELU_ACTS = ("relu", "drelu")


@dataclass
class PrepareOptions:
    data: str | None = None                 # calibration text: a file or folder (see calibrate._sources)
    target_sparsity: float | None = None    # gated models: fixed per-layer sparsity
    max_ppl_increase: float | None = None   # gated models: search the sparsity (default 0.03)
    allocation: str = "uniform"             # per-layer sparsity: "uniform" or "error" (equal output-error share)
    tokens: int = 8192
    seq_len: int = 256
    batch: int = 8
    eval_tokens: int = 2048
    recall: float = 0.99
    sizes: tuple[int, ...] = LADDER
    steps: int = 400
    output: str | None = None
    plot: str | bool = True                 # True: PNG next to the pack; a path; False: none
    evaluate: bool = True
    speed_check: bool = True                # decode with and without the pack here (`speed.measure`)
    head: bool = True                       # a preview of the output head (`sparse.head`) when it agrees
    head_agreement: float = 0.9999          # ... with the exact head's greedy token on this share of held-out tokens
                                            # (every one of 2048: generated text reads differently)
    progress: bool = True
    seed: int = 0
    torch_threads: int = 1                  # torch ops next to the C kernels (see `make_pack`)
    extra: dict = field(default_factory=dict)


def check_options(opts: PrepareOptions) -> None:
    """Refuse contradictory options, and a plot without matplotlib, before any slow work."""
    if opts.target_sparsity is not None and opts.max_ppl_increase is not None:
        raise SparseInferError("give --target-sparsity or --max-ppl-increase, not both")
    if opts.target_sparsity is not None and not 0.0 <= opts.target_sparsity < 1.0:
        raise SparseInferError(f"--target-sparsity must be in [0, 1), got {opts.target_sparsity}")
    if opts.steps < 1:
        raise SparseInferError(f"--steps must be at least 1, got {opts.steps}")
    if opts.tokens < 1:
        raise SparseInferError(f"--tokens must be at least 1, got {opts.tokens}")
    if not 0.0 < opts.recall <= 1.0:
        raise SparseInferError(f"--recall must be in (0, 1], got {opts.recall}")
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        raise SparseInferError("the activation plot needs matplotlib: pip install 'sparseinfer[plots]' (or --no-plot)")


def make_pack(model, source, tokenizer, model_path, opts: PrepareOptions | None = None,
              started: float | None = None) -> SparsityPack:
    """Make and save the sparsity pack of a dense model (as `sparseinfer.load(path, dense=True)`
    builds it: `llm.model, llm.source, llm.tokenizer, llm.info.path`); returns it (with `.path`
    set).  `started`: `time.perf_counter()` when the work began (the load), for the pack's
    "seconds"; default now."""
    opts = opts or PrepareOptions()
    check_options(opts)
    t_start = time.perf_counter() if started is None else started
    torch_threads = torch.get_num_threads()
    # torch's own thread team and the kernels' spinning pool fight over the cores; small torch
    # ops (norms, activations, training) run faster single-threaded next to the kernels.
    torch.set_num_threads(opts.torch_threads)
    try:
        return _prepare(model, source, tokenizer, Path(model_path), opts, t_start)
    finally:
        torch.set_num_threads(torch_threads)


def _prepare(model, source, tokenizer, model_path: Path, opts: PrepareOptions, t_start: float) -> SparsityPack:
    out = Path(opts.output) if opts.output else default_pack_path(model_path)
    cs = cal.calibration_set(tokenizer, opts.data, opts.tokens, opts.seq_len, opts.eval_tokens, opts.seq_len * 2,
                             opts.seed)
    pack = build_pack(model, source, cs, opts, model_path.name)
    if opts.speed_check:
        from .speed import measure, measure_head

        prompt = (cs.eval[0] if len(cs.eval) else cs.seqs[0])[:64]
        if opts.progress:
            print("measuring decode speed with and without the pack ...", flush=True)
        pack.info["speed"] = measure(model, pack, prompt)
        if pack.head is not None:
            pack.head.stats["speed"] = measure_head(model, pack.head, prompt)
            if pack.head.stats["speed"]["speedup"] < 1.0:  # kept out of the pack: slower than the exact head here
                pack.info["head_dropped"] = pack.head.stats
                pack.head = None
                pack.info["speed"] = measure(model, pack, prompt)
    if opts.plot:
        from .plots import plot_activation_frequency

        png = Path(opts.plot) if isinstance(opts.plot, (str, Path)) else out.with_name(out.name + ".png")
        plot_activation_frequency([lp.freq for lp in pack.layers], png,
                                  f"{pack.model['name']}: activation frequency ({pack.activation_source}, "
                                  f"{cs.description['tokens']} calibration tokens)")
        pack.info["plot"] = str(png)
        speed, search = pack.info.get("speed"), pack.info.get("search")
        if speed and search and any("speedup" in p for p in search):
            from .plots import plot_ppl_vs_speed

            png2 = out.with_name(out.name + ".speed.png")
            plot_ppl_vs_speed(search, pack.info.get("max_ppl_increase", 0.03), pack.info.get("eval"), speed, png2,
                              f"{pack.model['name']}: held-out perplexity vs decode speed ({speed['cpu']}, "
                              f"{speed['threads']} threads)", pack.head.stats.get("speed") if pack.head else None)
            pack.info["plot_speed"] = str(png2)
    pack.info["seconds"] = round(time.perf_counter() - t_start, 1)
    pack.save(out)
    return pack


def build_pack(model, src, cs: cal.CalibrationSet, opts: PrepareOptions, name: str = "") -> SparsityPack:
    """Thresholds, profile, predictors (and the held-out evaluation) of a dense model; the
    model is left dense.  `cs.seqs`/`cs.eval` are token tensors, so tiny test models work too."""
    mlps = replace_ffns(model, lambda i, m: SparseFFN(m, mode="threshold"))
    ffns = sparse_ffns(model)
    source = "relu" if all(f.act_name in RELU_ACTS for f in ffns) else "threshold"
    info = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "recall_target": opts.recall,
            "predictor_sizes": list(opts.sizes), "train_steps": opts.steps, **opts.extra}
    hrec = hidden = None
    try:
        thresholds = [0.0] * len(ffns)
        if source == "threshold":
            thresholds, sinfo = _calibrate_thresholds(model, ffns, mlps, cs, opts)
            info.update(sinfo)
        cal.set_thresholds(ffns, thresholds)
        rec = cal.Recorder(ffns, record=True)
        hrec = HiddenRecorder(model) if opts.head else None
        cal.forward_batches(model, cs.seqs, opts.batch, "profile + record", opts.progress)
        rec.detach(ffns)
        hidden = hrec.detach() if hrec is not None else None
        layers = _train_layers(ffns, rec, rec.frequencies(), thresholds, cs, opts)
        del rec
    finally:
        restore(model, mlps)
        if hrec is not None:
            hrec.detach()
    c = src.config
    pack = SparsityPack(
        fingerprint=src.fingerprint(),
        model={"name": name or Path(src.path).name, "family": c.family, "model_type": c.model_type,
               "hidden_act": ffns[0].act_name, "n_layers": len(ffns), "d_model": c.hidden_size,
               "n_neurons": ffns[0].n_neurons, "weight_bytes": qweight_nbytes(model)},
        activation_source=source, layers=layers, calibration=cs.description, info=info)
    if hidden is not None and hidden.shape[0]:
        pack.head, tried = choose_head(model, hidden, opts.head_agreement, progress=opts.progress,
                                      tokens=cs.seqs if hidden.shape[0] % cs.seqs.shape[1] == 0 else None)
        pack.info["head_search"] = tried
    if opts.evaluate:
        pack.info["eval"] = evaluate_pack(model, pack, cs.eval, opts.progress)
    return pack


def _threshold_speed(model, ffns, mlps, cs: cal.CalibrationSet):
    """`on_point` of the sparsity search: decode speed of the thresholds alone (no predictors:
    each layer's first projection dense, the threshold picking the rows of up and down) against
    the dense FFNs `mlps`, measured here (`speed.compare`)."""
    from .speed import compare

    prompt = (cs.eval[0] if len(cs.eval) else cs.seqs[0])[:64]

    def on_point(s: float) -> dict:
        for f in ffns:
            f.mode = "predict"
        try:
            rec = compare(model, mlps, ffns, prompt)
        finally:
            for f in ffns:
                f.mode = "threshold"
        return {"dense_tok_s": rec["dense_tok_s"], "sparse_tok_s": rec["sparse_tok_s"], "speedup": rec["speedup"]}

    return on_point


def _calibrate_thresholds(model, ffns, mlps, cs: cal.CalibrationSet, opts: PrepareOptions):
    n_seq = max(1, min(len(cs.seqs), 4096 // cs.seqs.shape[1]))
    rec = cal.Recorder(ffns, sample_per_call=max(1, 200_000 * opts.batch // max(n_seq, 1)), seed=opts.seed)
    for f in ffns:
        f.threshold = 0.0
    cal.forward_batches(model, cs.seqs[:n_seq], opts.batch, "threshold quantiles", opts.progress)
    rec.detach(ffns)
    samples = rec.sorted_samples()
    info = {"threshold_calibration_tokens": int(n_seq * cs.seqs.shape[1])}
    info["allocation"] = opts.allocation
    if opts.target_sparsity is not None:
        s = opts.target_sparsity
        info["target_sparsity"] = s
    else:
        budget = 0.03 if opts.max_ppl_increase is None else opts.max_ppl_increase
        on_point = _threshold_speed(model, ffns, mlps, cs) if opts.speed_check else None
        # the budget is relative to the dense FFNs, as the pack's evaluation reports it
        restore(model, mlps)
        try:
            dense = math.exp(cal.eval_nll(model, cs.eval, progress=opts.progress, desc="dense reference"))
        finally:
            restore(model, ffns)
        res = cal.search_sparsity(model, ffns, samples, cs.eval, budget, progress=opts.progress,
                                  allocation=opts.allocation, on_point=on_point, dense_ppl=dense)
        s = res.sparsity
        info.update({"max_ppl_increase": budget, "target_sparsity": s, "search": res.history, "search_dense_ppl": dense})
    return cal.thresholds_for(samples, s, opts.allocation), info


def _train_layers(ffns, rec: cal.Recorder, freqs, thresholds, cs: cal.CalibrationSet, opts: PrepareOptions):
    cfg = TrainConfig(sizes=tuple(opts.sizes), recall=opts.recall, steps=opts.steps, seed=opts.seed)
    n_tok = cs.seqs.numel()
    train, tune, report = split_tokens(n_tok, cs.seqs.shape[1])
    layers = []
    bar = tqdm(list(enumerate(ffns)), desc="predictors", unit="layer", disable=not opts.progress)
    for i, f in bar:
        order = hotness_order(freqs[i])
        x = torch.cat(rec.xs[i])
        y = _permute_bits(torch.cat(rec.ys[i]), order, f.n_neurons)
        rec.xs[i], rec.ys[i] = [], []
        res = train_predictor(LayerData(x, y, f.n_neurons, train, tune, report), cfg, f.first.row_bytes())
        stats = {"policy": res.policy, "hidden": res.hidden, "recall": res.recall, "precision": res.precision,
                 "density_predicted": res.density_predicted, "density_true": res.density_true,
                 "predictor_bytes": res.nbytes, "tried": res.tried, **summarize(freqs[i])}
        layers.append(LayerPack(thresholds[i], freqs[i], order, res.state, res.tau, stats, res.policy))
        bar.set_postfix(p=res.policy[0], r=res.hidden, recall=f"{res.recall:.3f}", dens=f"{res.density_predicted:.2f}")
    return layers


def _permute_bits(y: torch.Tensor, order: torch.Tensor, n: int, chunk: int = 4096) -> torch.Tensor:
    """Packed masks in original neuron order -> packed masks in hotness order."""
    return torch.cat([pack_bits(unpack_bits(y[s: s + chunk], n).index_select(1, order))
                      for s in range(0, len(y), chunk)])


def evaluate_pack(model, pack: SparsityPack, seqs: torch.Tensor, progress: bool = True) -> dict:
    """Held-out perplexity: dense, thresholds only (the sparsified model), thresholds +
    predictors (faithful per-token sparse decode).  `model` must be dense; it is left dense."""
    res = {"tokens_scored": int(seqs.shape[0] * (seqs.shape[1] - seqs.shape[1] // 2 - 1)),
           "sequences": int(seqs.shape[0]), "seq_len": int(seqs.shape[1])}
    res["ppl_dense"] = math.exp(cal.eval_nll(model, seqs, progress=progress, desc="eval dense"))
    mlps = replace_ffns(model, lambda i, m: m)  # the dense MLPs, to put back afterwards
    sparsify(model, pack, mode="threshold", build_decode=False)
    res["ppl_threshold"] = math.exp(cal.eval_nll(model, seqs, progress=progress, desc="eval thresholds"))
    for f in sparse_ffns(model):
        f.mode = "faithful"
    res["ppl_sparse"] = math.exp(cal.eval_nll(model, seqs, progress=progress, desc="eval sparse"))
    restore(model, mlps)
    return res


def print_report(pack: SparsityPack, console=None) -> None:
    """A rich table: per-layer threshold, density, skew, predictor size and held-out metrics."""
    from rich.console import Console
    from rich.table import Table

    import sys

    console = console or Console(width=None if sys.stdout.isatty() else 140)
    t = Table(title=f"sparsity pack {pack.path} ({pack.activation_source})", show_lines=False)
    for col in ("layer", "threshold", "density", "hot80", "decode", "hidden", "recall", "precision", "pred. density",
                "pred. KiB"):
        t.add_column(col, justify="right")
    for i, lp in enumerate(pack.layers):
        s = lp.stats
        t.add_row(str(i), f"{lp.threshold:.4f}", f"{s['density_true']:.3f}", f"{s['hot80']:.3f}", lp.policy, str(s["hidden"]),
                  f"{s['recall']:.4f}", f"{s['precision']:.3f}", f"{s['density_predicted']:.3f}",
                  f"{s['predictor_bytes'] / 1024:.0f}")
    pb, mb = pack.predictor_nbytes, pack.model.get("weight_bytes", 0)
    n_pred = sum(lp.policy == "predictor" for lp in pack.layers)
    t.add_row("all", "", f"{pack.mean_stat('density_true'):.3f}", f"{pack.mean_stat('hot80'):.3f}",
              f"{n_pred} pred.", "",
              f"{pack.mean_stat('recall'):.4f}", f"{pack.mean_stat('precision'):.3f}",
              f"{pack.mean_stat('density_predicted'):.3f}", f"{pb / 1024:.0f}", style="bold")
    console.print(t)
    trained = sum(lp.predictor_nbytes for lp in pack.layers)
    console.print(f"predictors used by decode: {pb / 2**20:.2f} MiB = {100 * pb / max(mb, 1):.2f}% of the model's "
                  f"{mb / 2**20:.1f} MiB (all trained, also ranking rows for forced density: {trained / 2**20:.2f} MiB); "
                  f"{n_pred}/{len(pack.layers)} layers decode with a predictor, the rest compute the first projection "
                  "densely and threshold it (exact)")
    ev = pack.info.get("eval")
    if ev:
        d = ev["ppl_dense"]
        console.print(f"held-out perplexity ({ev['sequences']} x {ev['seq_len']} tokens): dense {d:.3f} | "
                      f"thresholds {ev['ppl_threshold']:.3f} ({100 * (ev['ppl_threshold'] / d - 1):+.2f}%) | "
                      f"sparse (predictors) {ev['ppl_sparse']:.3f} ({100 * (ev['ppl_sparse'] / d - 1):+.2f}%)")
    sp = pack.info.get("speed")
    if sp:
        console.print(f"decode here ({sp['cpu']}, {sp['simd']}, {sp['threads']} threads): dense {sp['dense_tok_s']:.1f} "
                      f"tok/s, with the pack {sp['sparse_tok_s']:.1f} tok/s ({sp['speedup']:.2f}x)")
        from .speed import parts_here

        ffns, head, why = parts_here(pack)
        if why:
            console.print(f"`run`, `chat`, `serve`, `bench` and `ppl` on this CPU: {why.split(': ', 1)[1]}", style="bold")
    hd = pack.head
    if hd is not None:
        st, hs = hd.stats, hd.stats.get("speed")
        console.print(f"output head preview: rank {hd.rank} in {hd.fmt}, {hd.candidates} candidates and the context's tokens, "
                      f"{st.get('preview_bytes', 0) / 2**20:.1f} MiB instead of the head's {st.get('head_bytes', 0) / 2**20:.1f}; "
                      f"greedy tokens equal to the exact head's on {100 * st.get('agreement', 0):.2f}% of "
                      f"{st.get('tokens', 0)} held-out tokens (exact head for {100 * st.get('fallback', 0):.2f}%)"
                      + (f"; dense decode with it {hs['speedup']:.2f}x" if hs else ""))
    elif pack.info.get("head_dropped"):
        console.print(f"no output head preview: it decoded slower than the exact head here "
                      f"({pack.info['head_dropped']['speed']['speedup']:.2f}x)")
    elif pack.info.get("head_search"):
        best = max(pack.info["head_search"], key=lambda t: t["agreement"])
        console.print(f"no output head preview: the best rank tried ({best['rank']}) agreed with the exact head on "
                      f"{100 * best['agreement']:.2f}% of held-out tokens, below the target")
    if "target_sparsity" in pack.info:
        console.print(f"threshold sparsity: {pack.info['target_sparsity']:.3f}")
    if "plot" in pack.info:
        console.print(f"activation plot: {pack.info['plot']}")
    if "plot_speed" in pack.info:
        console.print(f"perplexity vs decode speed plot: {pack.info['plot_speed']}")
