"""`sparseinfer prepare MODEL`: make the sparsity pack of a model (see `sparseinfer.sparse.prepare`)."""
from __future__ import annotations

import time

from .args import load_from_args, repo_data


def add_parser(subparsers):
    p = subparsers.add_parser("prepare", help="make the sparsity pack of a model (thresholds, profile, predictors)")
    p.add_argument("model", help="a .gguf file, a Hugging Face folder or a catalog name")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--data", default=None, help="calibration text: a file or folder (default: a mix of ../shared/data)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-sparsity", type=float, default=None, metavar="S", help="gated FFNs: zero this fraction of neurons")
    g.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                   help="gated FFNs: largest sparsity within (1+P) x dense perplexity on a held-out slice (default 0.03)")
    p.add_argument("--allocation", choices=("uniform", "error"), default="uniform",
                   help="per-layer sparsity: the same fraction everywhere (default) or an equal output-error share")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--recall", type=float, default=0.99, help="predictor recall target (default 0.99)")
    p.add_argument("--steps", type=int, default=400, help="training steps per predictor size")
    p.add_argument("--sizes", default=None, help="predictor hidden-size ladder, e.g. 64,128,256")
    p.add_argument("-o", "--output", default=None, help="pack path (default: MODEL.sparse / FOLDER/sparsity.sparse)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs (activation frequency, perplexity vs speed)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out perplexity check")
    p.add_argument("--no-speed-check", action="store_true",
                   help="skip decoding with and without the pack (a pack is then used wherever it is found)")
    p.add_argument("--no-head", action="store_true",
                   help="no preview of the output head (by default one is fitted and kept when its greedy tokens "
                        "agree with the exact head's on every held-out token and it decodes faster here)")
    p.add_argument("--verbose", action="store_true")
    return p


def run(a) -> int:
    from ..sparse.prepare import PrepareOptions, check_options, make_pack, print_report

    opts = PrepareOptions(data=a.data, target_sparsity=a.target_sparsity, max_ppl_increase=a.max_ppl_increase,
                          allocation=a.allocation, tokens=a.tokens, recall=a.recall, steps=a.steps, output=a.output,
                          plot=False if a.no_plot else True, evaluate=not a.no_eval, head=not a.no_head,
                          speed_check=not a.no_speed_check)
    if a.sizes:
        opts.sizes = tuple(int(s) for s in a.sizes.split(","))
    check_options(opts)  # the options first, then the data they need, then the load
    # default: the checkout's shared/data, whose files calibrate mixes
    if opts.data is None:
        opts.data = str(repo_data(flag="--data FILE"))
    t0 = time.perf_counter()
    llm = load_from_args(a, report=False, dense=True)
    pack = make_pack(llm.model, llm.source, llm.tokenizer, llm.info.path, opts, started=t0)
    print_report(pack)
    print(f"wrote {pack.path}")
    return 0
