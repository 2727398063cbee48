"""`sparseinfer bench`: prompt and decode throughput (see `sparseinfer.bench`)."""
from __future__ import annotations

import json

from .args import load_from_args, model_args, sparse_args


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="prompt and decode throughput")
    model_args(p)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--json", default=None, help="append results as JSON records to this file")
    sparse_args(p)
    return p


def run(a) -> int:
    from ..bench import bench_record, format_record

    llm = load_from_args(a)
    rec = bench_record(llm, a.n_prompt, a.n_gen, a.repetitions)
    print(format_record(rec, a.n_prompt, a.n_gen))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0
