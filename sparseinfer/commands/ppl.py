"""`sparseinfer ppl`: perplexity on a text file, llama.cpp's method (see `sparseinfer.perplexity`)."""
from __future__ import annotations

import json

from ..errors import SparseInferError
from .args import load_from_args, model_args, repo_data, sparse_args


def add_parser(subparsers):
    p = subparsers.add_parser("ppl", help="perplexity on a text file (default: WikiText-2 test), llama.cpp's method")
    model_args(p)
    p.add_argument("-f", "--file", default=None, help="text file (default: ../shared/data/wikitext-2-raw/wiki.test.raw)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--json", default=None, help="append the result as a JSON record to this file")
    sparse_args(p)
    return p


def run(a) -> int:
    from ..perplexity import perplexity
    from ..sparse.apply import perplexity_mode

    path = a.file or repo_data("wikitext-2-raw", "wiki.test.raw", flag="-f FILE")
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise SparseInferError(f"cannot read {path}: {e.strerror}; pass -f FILE") from None
    llm = load_from_args(a)
    mode = perplexity_mode(llm)
    r = perplexity(llm, text, ctx=a.ctx_size or 512, n_chunks=a.chunks)
    print(f"perplexity ({mode}): {r['ppl']:.4f} over {r['tokens_scored']} tokens ({r['chunks']} chunks of {r['ctx']}) "
          f"in {r['seconds']:.1f}s")
    if a.json:
        rec = {k: v for k, v in r.items() if k != "per_chunk"} | {"model": str(llm.info.path), "file": str(path),
                                                                   "mode": mode}
        with open(a.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0
